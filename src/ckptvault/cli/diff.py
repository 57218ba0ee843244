"""``ckptvault diff``: compare two checkpoints tensor by tensor."""

from __future__ import annotations

import click

from .._reports.diff import CheckpointDiff, TensorDiff, diff_steps
from .common import emit_json, json_option, open_manager, progress_bar, progress_option, require_steps, url_argument
from .render import dtype_label, human_bytes, key_value_block, percent, shape_label, table


@click.command("diff", short_help="Compare two checkpoints tensor by tensor: what changed, what it cost.")
@url_argument
@click.argument("step_a", metavar="A", type=click.IntRange(min=0))
@click.argument("step_b", metavar="B", type=click.IntRange(min=0))
@click.option("--keys", "-k", "patterns", multiple=True, metavar="PATTERN",
              help="Only key paths matching PATTERN (shell-style, e.g. 'model.*'; a bare prefix matches its "
                   "subtree). Repeatable.")
@click.option("--changed-only", is_flag=True, help="List only the tensors that differ.")
@json_option
@progress_option
def diff(url: str, step_a: int, step_b: int, patterns: tuple[str, ...], changed_only: bool, as_json: bool,
         progress: bool | None) -> None:
    """Compare checkpoint A with checkpoint B of the vault at URL.

    One row per array present in both: CHANGED, the fraction of its elements
    whose bits differ; MAX |DIFF|, the largest absolute difference of the
    values (complex: modulus of the difference; bool and integers as numbers;
    nan if a NaN is involved; '-' for non-numeric data); ADDED, the bytes
    checkpoint B added to the vault for it (its share of the chunk objects B's
    save created: a delta against its keyframe, a full chunk, or nothing when
    the data was already stored). Then the arrays only in A or only in B, the
    Python scalars that differ, and totals. Arrays stored as the same chunks
    in both checkpoints are equal by construction and not read.

    An array of a DCP checkpoint (ckptvault.distributed.VaultWriter), stored
    as the shards its ranks held, is one row of its whole SHAPE, compared
    whole: two steps saved at different world sizes, or one by DCP and one
    by CheckpointManager.save, compare by value.

    \b
    Exit status: 0 whatever the differences; 1 if a chunk or manifest is
    damaged; 2 if there is no vault at URL or A or B is not committed.

    \b
    JSON: {"url", "step_a", "step_b", "keyframe_step_b", "totals": {"tensors",
    "tensors_changed", "only_a", "only_b", "scalars_changed", "elements",
    "elements_changed", "changed_fraction", "added_bytes", "stored_bytes",
    "logical_bytes"}, "tensors": [{"path", "dtype", "shape", "numel", "nbytes",
    "kind", "status", "changed", "changed_fraction", "max_abs_diff",
    "added_bytes"}], "only_a"/"only_b": [{"path", "kind", "dtype", "shape",
    "nbytes", "added_bytes"}],
    "scalars": [{"path", "status", "a", "b"}]}; status is same, changed or
    retyped (dtype or shape differs); a non-finite max_abs_diff is "nan"/"inf".
    """
    with open_manager(url) as mgr:
        require_steps(mgr, [step_a, step_b])
        with progress_bar(None, "diff", progress) as update:
            result = diff_steps(mgr.vault, step_a, step_b, patterns or None, update)
    if as_json:
        emit_json({"url": mgr.url} | result.to_json())
    else:
        _print_diff(mgr.url, result, changed_only)


def _print_diff(url: str, d: CheckpointDiff, changed_only: bool) -> None:
    kind = "a keyframe" if d.keyframe_step_b in (None, d.step_b) else f"deltas against keyframe {d.keyframe_step_b}"
    click.echo(f"diff of step {d.step_a} -> step {d.step_b} in {url} (step {d.step_b}: {kind})")
    rows = [t for t in d.tensors if not changed_only or t.status != "same"]
    if rows:
        click.echo()
        click.echo(table(("KEY PATH", "DTYPE", "SHAPE", "CHANGED", "MAX |DIFF|", "ADDED"),
                         [_row(t) for t in rows], "lllrrr"))
    for step, only, later in ((d.step_a, d.only_a, False), (d.step_b, d.only_b, True)):
        if only:
            click.echo()
            click.echo(f"only in step {step}:")
            click.echo(table(("KEY PATH", "DTYPE", "SHAPE", "LOGICAL", "ADDED"), [
                (o.path, dtype_label(o.kind, o.dtype), shape_label(o.shape), human_bytes(o.nbytes),
                 human_bytes(o.added_bytes) if later else "-") for o in only], "lllrr"))
    if d.scalars:
        click.echo()
        click.echo("scalars that differ:")
        for s in d.scalars:
            click.echo(f"  {s['path']}: {_scalar(s, 'a')} -> {_scalar(s, 'b')}")
    t = d.totals
    click.echo()
    click.echo(key_value_block([
        ("tensors", f"{t['tensors_changed']} of {t['tensors']} differ; {t['only_a']} only in {d.step_a}, "
                    f"{t['only_b']} only in {d.step_b}"),
        ("elements", f"{t['elements_changed']} of {t['elements']} differ ({percent(t['elements_changed'], t['elements'])})"),
        ("added", f"{human_bytes(t['added_bytes'])} added to the vault by step {d.step_b} "
                  f"({percent(t['added_bytes'], t['logical_bytes'])} of its {human_bytes(t['logical_bytes'])} logical; "
                  f"it references {human_bytes(t['stored_bytes'])} stored)"),
    ]))


def _row(t: TensorDiff) -> tuple[str, ...]:
    if t.status == "retyped":
        changed = "retyped"
    elif t.changed == 0:
        changed = "0"
    else:
        changed = f"{100 * t.changed_fraction:.3g}%"
    return (t.path, dtype_label(t.kind, t.dtype), shape_label(t.shape), changed,
            _number(t.max_abs_diff), human_bytes(t.added_bytes))


def _number(value: float | int | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.4g}"


def _scalar(change: dict[str, object], side: str) -> str:
    if change["status"] == f"only_{'b' if side == 'a' else 'a'}":
        return "(absent)"
    return repr(change[side])
