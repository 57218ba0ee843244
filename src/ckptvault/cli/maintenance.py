"""Maintenance commands: ``prune``, ``gc``, ``pin``, ``unpin`` and ``pins``.

All four are safe to run from a scheduled job (cron, a Kubernetes CronJob)
while a training job saves into the same vault: prune never deletes the
latest or a pinned checkpoint, and gc only deletes unreferenced chunks older
than its grace period (see ckptvault._maintenance.gc).
"""

from __future__ import annotations

from typing import Any

import click

from .._maintenance.gc import GCPlan, GCResult
from .._maintenance.prune import PrunePlan, PruneResult
from .._maintenance.retention import DEFAULT_GRACE, Retention
from .common import emit_json, json_option, open_manager, url_argument
from .render import human_bytes, table


def _steps_text(steps: list[int], limit: int = 20) -> str:
    shown = ", ".join(map(str, steps[:limit]))
    return shown + (f", ... ({len(steps) - limit} more)" if len(steps) > limit else "")


# -- prune --------------------------------------------------------------------------
@click.command("prune")
@url_argument
@click.option("--keep-last", type=click.IntRange(min=1), help="Keep the N newest checkpoints.", metavar="N")
@click.option("--keep-every", type=click.IntRange(min=1), help="Keep every checkpoint whose step is a multiple of K.",
              metavar="K")
@click.option("--keep-best", type=click.IntRange(min=1), help="Keep the N best checkpoints by --metric.", metavar="N")
@click.option("--metric", help="Metric for --keep-best (as given to save(metrics=...)).", metavar="NAME")
@click.option("--mode", type=click.Choice(["min", "max"]), default="min", show_default=True,
              help="Whether lower or higher --metric is better.")
@click.option("--keep-daily", type=click.IntRange(min=1), help="Keep the newest checkpoint of each of the last D UTC days.",
              metavar="D")
@click.option("--keep-weekly", type=click.IntRange(min=1), help="Keep the newest checkpoint of each of the last W weeks.",
              metavar="W")
@click.option("--dry-run", "-n", is_flag=True, help="Only say what would be removed.")
@json_option
def prune(url: str, keep_last: int | None, keep_every: int | None, keep_best: int | None, metric: str | None, mode: str,
          keep_daily: int | None, keep_weekly: int | None, dry_run: bool, as_json: bool) -> None:
    """Remove the checkpoints of the vault at URL that no --keep-* option keeps.

    A checkpoint is kept if ANY option keeps it; the latest checkpoint, pinned
    checkpoints (`ckptvault pin`) and the keyframes kept checkpoints delta
    against are always kept. Only manifests are removed: run `ckptvault gc`
    afterwards to free the chunks. Safe next to a running training job.

    \b
    Example (hourly cron job next to training):
      ckptvault prune /ckpts --keep-last 5 --keep-every 10000 --keep-daily 7 && ckptvault gc /ckpts

    \b
    JSON: {"url", "dry_run", "keep", "removed", "skipped", "manifest_bytes_freed",
    "released_bytes", "decisions": [{"step", "keep", "reasons"}]}
    """
    if keep_best is not None and not metric:
        raise click.UsageError("--keep-best needs --metric NAME")
    retention = Retention(keep_last=keep_last, keep_every=keep_every, keep_best=keep_best, metric=metric, mode=mode,
                          keep_daily=keep_daily, keep_weekly=keep_weekly)
    with open_manager(url) as mgr:
        plan, result = mgr.prune(retention, dry_run=dry_run)
    if as_json:
        emit_json(_prune_json(mgr.url, plan, result))
    else:
        _prune_text(plan, result)


def _prune_json(url: str, plan: PrunePlan, result: PruneResult | None) -> dict[str, Any]:
    out = {"url": url, "dry_run": result is None} | plan.to_dict()
    out["removed"] = plan.drop if result is None else result.deleted
    out["skipped"] = {} if result is None else {str(k): v for k, v in result.skipped.items()}
    out["manifest_bytes_freed"] = plan.bytes if result is None else result.bytes_freed
    return out


def _prune_text(plan: PrunePlan, result: PruneResult | None) -> None:
    kept = [d for d in plan.decisions if d.keep]
    click.echo(f"keeping {len(kept)} checkpoints:")
    for d in kept:
        click.echo(f"  {d.step:>10}  {', '.join(d.reasons)}")
    removed = plan.drop if result is None else result.deleted
    verb = "would remove" if result is None else "removed"
    freed = plan.bytes if result is None else result.bytes_freed
    if not removed:
        click.echo(f"{verb} nothing")
    else:
        click.echo(f"{verb} {len(removed)} checkpoints: {_steps_text(removed)} ({human_bytes(freed)} of manifests)")
        click.echo(f"{human_bytes(plan.released_bytes)} of chunks only they used become garbage: "
                   "run `ckptvault gc` to free it")
    for step, why in (result.skipped.items() if result else []):
        click.echo(f"skipped step {step}: {why} since the plan was made")


# -- gc -----------------------------------------------------------------------------
@click.command("gc")
@url_argument
@click.option("--grace", type=click.FloatRange(min=0), default=DEFAULT_GRACE, show_default=True, metavar="SECONDS",
              help="Only delete unreferenced objects at least this old (on the store's clock). It must exceed the "
                   "longest a save may take, in any process.")
@click.option("--dry-run", "-n", is_flag=True, help="Only say what would be deleted.")
@json_option
def gc(url: str, grace: float, dry_run: bool, as_json: bool) -> None:
    """Delete the chunks of the vault at URL that no checkpoint references.

    Delta bases of referenced chunks stay. Only objects older than --grace are
    deleted, so a save in progress in another process is never harmed; it is
    safe to run from a cron job next to training, and to interrupt (the next
    run finishes the job). If any manifest is unreadable, nothing is deleted.

    \b
    JSON: {"url", "dry_run", "grace", "clock", "checkpoints", "chunks_total", "chunks_live",
    "live_bytes", "fresh_unreferenced", "removed": [{"key", "size", "mtime", "kind"}],
    "bytes_freed", "skipped_live", "skipped_fresh", "skipped_gone"}
    """
    with open_manager(url) as mgr:
        plan, result = mgr.gc(grace, dry_run=dry_run)
    if as_json:
        emit_json(_gc_json(mgr.url, plan, result))
    else:
        _gc_text(plan, result)


def _gc_json(url: str, plan: GCPlan, result: GCResult | None) -> dict[str, Any]:
    out: dict[str, Any] = {"url": url, "dry_run": result is None} | plan.to_dict()
    removed = plan.candidates if result is None else result.deleted
    out.pop("candidates")
    out.pop("bytes")
    out["removed"] = [vars(g) for g in removed]
    out["bytes_freed"] = sum(g.size for g in removed)
    for name in ("skipped_live", "skipped_fresh", "skipped_gone"):
        out[name] = 0 if result is None else getattr(result, name)
    return out


def _gc_text(plan: GCPlan, result: GCResult | None) -> None:
    removed = plan.candidates if result is None else result.deleted
    verb = "would remove" if result is None else "removed"
    by_kind: dict[str, list[int]] = {}
    for g in removed:
        by_kind.setdefault(g.kind, []).append(g.size)
    parts = [f"{len(sizes)} {kind}{'s' if len(sizes) != 1 else ''} ({human_bytes(sum(sizes))})"
             for kind, sizes in sorted(by_kind.items())]
    total = sum(g.size for g in removed)
    click.echo(f"{verb} {', '.join(parts) if parts else 'nothing'}; {human_bytes(total)} freed")
    click.echo(f"{len(plan.live)} chunks ({human_bytes(plan.live_bytes)}) are used by {len(plan.manifests)} checkpoints")
    if plan.fresh_unreferenced:
        click.echo(f"{plan.fresh_unreferenced} unreferenced chunks are younger than the grace period "
                   f"({plan.grace:g} s) and were kept")
    if result is not None and (result.skipped_live or result.skipped_fresh):
        click.echo(f"{result.skipped_live + result.skipped_fresh} chunks became used by a new save meanwhile and were kept")


# -- pin / unpin ----------------------------------------------------------------------
@click.command("pin")
@url_argument
@click.argument("step", type=click.IntRange(min=0), metavar="STEP")
@click.argument("tag", metavar="TAG")
@json_option
def pin(url: str, step: int, tag: str, as_json: bool) -> None:
    """Pin checkpoint STEP under TAG: no prune (and no retention policy) removes it until unpinned."""
    with open_manager(url) as mgr:
        mgr.pin(step, tag)
        tags = sorted(mgr.pins().get(step, ()))
    if as_json:
        emit_json({"url": mgr.url, "step": step, "tag": tag, "pinned": True, "tags": tags})
    else:
        click.echo(f"pinned step {step} as {tag!r} (tags: {', '.join(tags)})")


@click.command("unpin")
@url_argument
@click.argument("step", type=click.IntRange(min=0), metavar="STEP")
@click.argument("tag", metavar="TAG")
@json_option
def unpin(url: str, step: int, tag: str, as_json: bool) -> None:
    """Remove pin TAG from checkpoint STEP (the checkpoint stays until a prune drops it). Idempotent."""
    with open_manager(url) as mgr:
        removed = mgr.unpin(step, tag)
        tags = sorted(mgr.pins().get(step, ()))
    if as_json:
        emit_json({"url": mgr.url, "step": step, "tag": tag, "removed": removed, "tags": tags})
    elif removed:
        click.echo(f"unpinned {tag!r} from step {step}" + (f" (still pinned as {', '.join(tags)})" if tags else ""))
    else:
        click.echo(f"step {step} had no pin {tag!r}; nothing removed")


@click.command("pins")
@url_argument
@json_option
def pins(url: str, as_json: bool) -> None:
    """List the pins of the vault at URL: one row per tag, with the step it protects.

    A pin whose checkpoint is no longer committed (deleted with `ckptvault rm`)
    is listed as such; `ckptvault unpin URL STEP TAG` removes it.

    \b
    JSON: {"url", "pins": [{"tag", "step", "committed"}]}
    """
    with open_manager(url) as mgr:
        pinned = mgr.pins()
        committed = set(mgr.steps())
    rows = sorted(((tag, step) for step, tags in pinned.items() for tag in tags), key=lambda r: (r[0], r[1]))
    if as_json:
        emit_json({"url": mgr.url, "pins": [{"tag": t, "step": s, "committed": s in committed} for t, s in rows]})
    elif not rows:
        click.echo(f"no pins in {mgr.url} (`ckptvault pin URL STEP TAG` adds one)")
    else:
        click.echo(table(("TAG", "STEP", "CHECKPOINT"), [
            (t, str(s), "committed" if s in committed else "gone (unpin it)") for t, s in rows], "lrl"))


COMMANDS = (prune, gc, pin, unpin, pins)
