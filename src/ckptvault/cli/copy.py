"""``ckptvault cp``: copy checkpoints between vaults, sending only the chunks the destination lacks."""

from __future__ import annotations

import click

from .._maintenance.copy import CopyPlan, CopyResult, execute_copy, plan_copy
from .._vault import Vault
from ..errors import InvalidArgumentError
from .common import emit_json, group_storage_options, json_option, parse_options, progress_bar, progress_option
from .render import human_bytes


def parse_steps(values: tuple[str, ...]) -> tuple[list[int], list[tuple[int, int]]] | None:
    """``("100", "200,300", "400-600")`` -> ([100, 200, 300], [(400, 600)]); None when no --steps was given."""
    if not values:
        return None
    singles: list[int] = []
    ranges: list[tuple[int, int]] = []
    for value in values:
        for part in filter(None, (p.strip() for p in value.split(","))):
            try:
                if "-" in part:
                    low, high = (int(x) for x in part.split("-", 1))
                    ranges.append((low, high))
                else:
                    singles.append(int(part))
            except ValueError:
                raise click.BadParameter(f"{part!r} is not a step, a list (100,200) or a range (100-500)",
                                         param_hint="--steps") from None
    for low, high in ranges:
        if low > high:  # a reversed range would name no step and copy nothing
            raise click.BadParameter(f"range {low}-{high} is empty: write the lower step first ({high}-{low})",
                                     param_hint="--steps")
    return singles, ranges


def select_steps(spec: tuple[list[int], list[tuple[int, int]]], committed: list[int]) -> list[int]:
    """The steps a parsed ``--steps`` names: single steps as given (copying one that is not committed is an error),
    plus the committed steps inside each range."""
    singles, ranges = spec
    chosen = set(singles)
    chosen.update(s for s in committed for low, high in ranges if low <= s <= high)
    return sorted(chosen)


@click.command("cp", short_help="Copy checkpoints to another vault, sending only missing chunks.")
@click.argument("src", metavar="SRC")
@click.argument("dst", metavar="DST")
@click.option("--steps", "steps", multiple=True, metavar="STEPS",
              help="Steps to copy: 100, 100,200 or 100-500 (committed steps in that range); repeatable. Default: all.")
@click.option("--overwrite", is_flag=True, help="Replace steps the destination holds with different content.")
@click.option("--verify", is_flag=True, help="Read back and check every chunk of the copied steps in DST.")
@click.option("--dry-run", "-n", is_flag=True, help="Only say what would be copied.")
@click.option("--src-option", "src_options", multiple=True, metavar="KEY=VALUE",
              help="A storage option for SRC (for s3://: endpoint_url, profile, region_name, ...); repeatable.")
@click.option("--dst-option", "dst_options", multiple=True, metavar="KEY=VALUE", help="A storage option for DST; repeatable.")
@json_option
@progress_option
def cp(src: str, dst: str, steps: tuple[str, ...], overwrite: bool, verify: bool, dry_run: bool,
       src_options: tuple[str, ...], dst_options: tuple[str, ...], as_json: bool, progress: bool | None) -> None:
    """Copy the checkpoints of the vault at SRC into the vault at DST (created if absent).

    Only the chunk objects DST lacks are sent; chunks it already holds are
    reused, so copying again sends nothing, and tiering a vault from local
    NVMe to object storage costs only what changed. Each step appears in DST
    atomically, after all its chunks; an interrupted copy can simply be run
    again. Pins are not copied. Credentials and endpoints of s3:// URLs come
    from the environment (AWS_ACCESS_KEY_ID, AWS_ENDPOINT_URL, AWS_PROFILE,
    ...) or --src-option/--dst-option.

    \b
    Examples:
      ckptvault cp /nvme/ckpts s3://bucket/run1                 everything
      ckptvault cp /nvme/ckpts s3://bucket/run1 --steps 1000-5000,9000

    \b
    JSON: {"src", "dst", "dry_run", "steps", "skipped", "chunks_to_send", "bytes_to_send",
    "chunks_reused", "copied", "chunks_sent", "bytes_sent", "verified"}
    """
    if group_storage_options():
        raise click.UsageError("cp opens two vaults: give their options with --src-option and --dst-option, not "
                               "--storage-option before the command")
    spec = parse_steps(steps)
    source = Vault(src, parse_options(src_options, "--src-option"))
    dest = Vault(dst, parse_options(dst_options, "--dst-option"))
    try:
        if source.url == dest.url:
            raise InvalidArgumentError(f"source and destination are the same vault: {source.url}")
        plan = plan_copy(source, dest, None if spec is None else select_steps(spec, source.steps()),
                         overwrite=overwrite)
        result = None
        if not dry_run:
            with progress_bar(plan.bytes, f"sending to {dest.url}", progress) as update:
                result = execute_copy(source, dest, plan, overwrite=overwrite, verify=verify, progress=update)
    finally:
        source.close()
        dest.close()
    if as_json:
        emit_json({"dry_run": dry_run} | plan.to_dict() | (result.to_dict() if result else
                                                           {"copied": [], "chunks_sent": 0, "bytes_sent": 0,
                                                            "verified": False}))
    else:
        click.echo(_text(plan, result))


def _text(plan: CopyPlan, result: CopyResult | None) -> str:
    steps = [s.step for s in plan.steps]
    if result is None:
        head = (f"would copy {len(steps)} checkpoint{'s' if len(steps) != 1 else ''} {_list(steps)} from {plan.src} to "
                f"{plan.dst}: {len(plan.send)} chunks to send ({human_bytes(plan.bytes)}), {plan.reuse} already there")
    else:
        head = (f"copied {len(result.copied)} checkpoint{'s' if len(result.copied) != 1 else ''} {_list(result.copied)} "
                f"from {plan.src} to {plan.dst}: {result.chunks_sent} chunks sent ({human_bytes(result.bytes_sent)}), "
                f"{plan.reuse} already there" + ("; verified" if result.verified else ""))
    if plan.skipped:
        head += f"\n{len(plan.skipped)} already in the destination: {_list(plan.skipped)}"
    return head


def _list(steps: list[int], limit: int = 10) -> str:
    if not steps:
        return "(none)"
    shown = ", ".join(map(str, steps[:limit]))
    return f"({shown}{', ...' if len(steps) > limit else ''})"
