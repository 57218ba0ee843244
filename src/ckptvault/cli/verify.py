"""``ckptvault verify``: read every chunk and check it against its hash."""

from __future__ import annotations

import logging
import time
from typing import Any

import click

from .._reports.verify import VerifyReport
from ..errors import VaultError
from ..manager import CheckpointManager
from .common import (
    EXIT_DAMAGED,
    emit_json,
    json_option,
    open_manager,
    progress_bar,
    progress_option,
    require_steps,
    step_argument,
    url_argument,
)
from .render import human_bytes

log = logging.getLogger("ckptvault.cli")

@click.command("verify", short_help="Read and check every chunk; exit 1 if damaged.")
@url_argument
@step_argument()
@json_option
@progress_option
def verify(url: str, step: int | None, as_json: bool, progress: bool | None) -> None:
    """Check every checkpoint of the vault at URL, or only STEP.

    Reads each manifest (checking its checksum) and every chunk it names
    (decoding it and checking its BLAKE3 hash; a chunk shared by several
    checkpoints is read once). Prints OK or DAMAGED per step, with the
    problems found.

    \b
    Exit status: 0 if everything is intact (or the vault has no checkpoints),
    1 if any checkpoint is damaged, 2 if there is no vault at URL or STEP is
    not committed.

    \b
    JSON: {"url", "ok", "checkpoints": [{"step", "ok", "problems"}],
    "chunks_checked", "bytes_checked"}
    """
    with open_manager(url) as mgr:
        steps = require_steps(mgr, [step]) if step is not None else mgr.steps()
        total = _bytes_to_check(mgr, steps)
        log.info("verify: %d checkpoints in %s, %s of distinct chunks to read", len(steps), mgr.url,
                 "an unknown amount (a manifest is unreadable)" if total is None else human_bytes(total))
        start = time.monotonic()
        with progress_bar(total, "verify", progress) as update:
            report = mgr.verify(step, progress=update)
        elapsed = time.monotonic() - start
        log.info("verify: read %d chunks, %s in %.2f s (%s/s); %d of %d checkpoints damaged", report.chunks_checked,
                 human_bytes(report.bytes_checked), elapsed, human_bytes(report.bytes_checked / max(elapsed, 1e-9)),
                 len(report.problems), len(report.checked))
        for checked in report.checked:
            log.debug("verify: step %d: %s", checked, "; ".join(report.problems.get(checked, [])) or "ok")
    if as_json:
        emit_json(_report_json(mgr.url, report))
    else:
        _print_report(mgr.url, report)
    if not report.ok:
        raise click.exceptions.Exit(EXIT_DAMAGED)


def _bytes_to_check(mgr: CheckpointManager, steps: list[int]) -> int | None:
    """Raw bytes of the distinct chunks of ``steps`` (the progress total); None if a manifest is unreadable."""
    sizes: dict[str, int] = {}
    try:
        for step in steps:
            sizes.update((c.id, c.raw) for c in mgr.vault.read_manifest(step).chunks)
    except VaultError:
        return None
    return sum(sizes.values())


def _report_json(url: str, report: VerifyReport) -> dict[str, Any]:
    return {
        "url": url, "ok": report.ok,
        "checkpoints": [{"step": s, "ok": s not in report.problems, "problems": report.problems.get(s, [])}
                        for s in report.checked],
        "chunks_checked": report.chunks_checked, "bytes_checked": report.bytes_checked,
    }


def _print_report(url: str, report: VerifyReport) -> None:
    if not report.checked:
        click.echo(f"no checkpoints in {url}: nothing to verify")
        return
    for step in report.checked:
        problems = report.problems.get(step, [])
        click.echo(f"step {step}: {'DAMAGED' if problems else 'OK'}")
        for problem in problems:
            click.echo(f"  {problem}")
    damaged = len(report.problems)
    verdict = f"{damaged} of {len(report.checked)} checkpoints DAMAGED" if damaged else "all intact"
    click.echo(f"checked {len(report.checked)} checkpoints, {report.chunks_checked} chunks, "
               f"{human_bytes(report.bytes_checked)}: {verdict}")
