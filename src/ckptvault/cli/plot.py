"""``ckptvault plot``: storage and metrics over steps, as a PNG (matplotlib) or a chart in the terminal."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import click

from .._reports.plot_data import StepRow, StorageSeries, storage_series
from ..errors import InvalidArgumentError
from .common import EXIT_DAMAGED, emit_json, json_option, open_manager, url_argument
from .plot_draw import comparison, counted, load_matplotlib, write_png
from .render import compact_value, human_bytes, table

BAR_WIDTH = 32  # cells of the VAULT vs TORCH.SAVE bar
SPARK_WIDTH = 64  # most cells of a metric's sparkline; longer series are averaged into buckets
_EIGHTHS = " ▏▎▍▌▋▊▉█"
_SPARKS = "▁▂▃▄▅▆▇█"


def _png_path(_ctx: click.Context, _param: click.Parameter, value: Path | None) -> Path | None:
    if value is not None and value.suffix.lower() != ".png":
        raise click.BadParameter(f"{str(value)!r} does not end in .png: the chart is written as a PNG")
    return value


@click.command("plot", short_help="Storage over steps (vault vs torch.save) and metrics: a PNG or a terminal chart.")
@url_argument
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE.png", callback=_png_path,
              help="Write the chart as a PNG (needs matplotlib: pip install 'ckptvault[plot]'). Without it, the "
                   "chart is printed in the terminal.")
@click.option("--metric", "-m", "metrics", multiple=True, metavar="NAME",
              help="Plot this numeric metric (repeatable) [default: every numeric metric the checkpoints recorded].")
@json_option
def plot(url: str, output: Path | None, metrics: tuple[str, ...], as_json: bool) -> None:
    """Chart the storage of the vault at URL over its steps, and the metrics saved with each checkpoint.

    Per checkpoint: LOGICAL bytes (its arrays uncompressed), STORED bytes
    (the chunks it references, as stored) and ADDED bytes (chunks new to the
    vault with it); and over the run, VAULT, the running sum of added bytes
    (what the vault held after each save), against TORCH, the running sum of
    logical bytes (an estimate of one torch.save file per checkpoint).
    Keyframes, checkpoints with lossy tensors and pinned checkpoints are
    marked. Only committed checkpoints are listed: chunks that deleted
    checkpoints added are in no sum (`ckptvault du` measures the store).
    Reads manifests only, never chunk data.

    With -o FILE.png: a PNG of two storage panels and one panel per metric.
    Without: the same series as a table with bars and sparklines on stdout.

    \b
    Exit status: 0 done; 1 if a manifest is damaged (reported on stderr, left
    out of the chart); 2 if there is no vault or no checkpoint at URL, an
    unknown --metric, FILE is not a .png or cannot be written, or -o without
    matplotlib installed.

    \b
    JSON (instead of the terminal chart; with -o the PNG is written too):
    {"url", "png" (FILE or null), "metrics": [NAME], "checkpoints": [{"step",
    "time", "logical_bytes", "stored_bytes", "added_bytes",
    "cumulative_stored_bytes", "cumulative_torch_bytes", "keyframe",
    "keyframe_step", "lossy": [CODEC], "pins": [TAG], "metrics"}],
    "damaged": [{"step", "error"}]}; "png" is null when nothing was written;
    non-finite metrics are "nan", "inf", "-inf".
    """
    if output is not None:  # before the vault is read: these are reported at once
        load_matplotlib()
        if not output.parent.is_dir():
            raise InvalidArgumentError(f"cannot write the chart to {output}: {output.parent} is not a directory")
    with open_manager(url) as mgr:
        series = storage_series(mgr.vault).require_checkpoints()
    names = series.select_metrics(metrics)
    written = output if output is not None and series.rows else None  # nothing to draw when every manifest is damaged
    if written is not None:
        _write(series, names, written)
    _report(series, names, output, written, as_json)
    if series.damaged:
        raise click.exceptions.Exit(EXIT_DAMAGED)


def _write(series: StorageSeries, names: Sequence[str], output: Path) -> None:
    try:
        write_png(series, names, output)
    except OSError as exc:
        raise InvalidArgumentError(f"cannot write the chart to {output}: {exc.strerror or exc}") from None


def _report(series: StorageSeries, names: Sequence[str], output: Path | None, written: Path | None, as_json: bool) -> None:
    """stdout: the JSON, the terminal chart (no -o) or what was written; stderr: the steps left out."""
    if as_json:
        emit_json({"url": series.url, "png": None if written is None else str(written)} | series.to_json(names))
    elif output is None:
        click.echo(text_chart(series, names))
    elif written is not None:
        click.echo(f"wrote {written}: {counted(len(series.rows), 'checkpoint')}, {counted(len(names), 'metric panel')}")
    for step, error in sorted(series.damaged.items()):
        click.echo(f"warning: step {step} left out: {error}", err=True)


# -- the terminal chart ----------------------------------------------------------------
def text_chart(series: StorageSeries, metrics: Sequence[str]) -> str:
    """The chart as text: a header, one row per checkpoint with a VAULT vs TORCH.SAVE bar, tags and the chosen
    metrics, a sparkline per metric and a legend."""
    rows = series.rows
    if not rows:
        return f"no readable checkpoints in {series.url}"
    last = rows[-1]
    lines = [f"{series.url}: {counted(len(rows), 'checkpoint')}, steps {rows[0].step}..{last.step}",
             comparison(last.cumulative_stored, last.cumulative_torch), ""]
    scale = max(last.cumulative_torch, last.cumulative_stored, 1)
    headers = ("STEP", "LOGICAL", "STORED", "ADDED", "VAULT", "TORCH", "VAULT █ vs TORCH.SAVE ░".ljust(BAR_WIDTH), "TAGS",
               *metrics)
    cells = [(str(r.step), human_bytes(r.logical), human_bytes(r.stored), human_bytes(r.added),
              human_bytes(r.cumulative_stored), human_bytes(r.cumulative_torch),
              bar(r.cumulative_stored, r.cumulative_torch, scale), tags(r) or "-",
              *(compact_value(r.metrics[m]) if m in r.metrics else "-" for m in metrics)) for r in rows]
    lines.append(table(headers, cells, "rrrrrrll" + "r" * len(metrics)))
    if metrics:
        lines.append("")
        width = max(len(m) for m in metrics)
        lines += [f"{m.ljust(width)}  {metric_line(rows, m)}" for m in metrics]
    lines += ["", "VAULT: running sum of added bytes (deleted checkpoints not counted); TORCH: running sum of logical "
                  "bytes (one torch.save file per checkpoint, estimated)",
              "TAGS: keyframe (stored whole; later deltas are against it), lossy CODECS (tensors stored lossily), "
              "pinned TAGS (kept by every prune)"]
    return "\n".join(lines)


def bar(vault: int, torch: int, scale: int, width: int = BAR_WIDTH) -> str:
    """``vault`` bytes in full and partial blocks, then light shade up to ``torch`` bytes, ``scale`` bytes being
    ``width`` cells."""
    eighths = round(8 * width * vault / scale)
    solid = "█" * (eighths // 8) + (_EIGHTHS[eighths % 8] if eighths % 8 else "")
    shade = max(round(width * torch / scale) - len(solid), 0)
    return (solid + "░" * shade).ljust(width)


def tags(row: StepRow) -> str:
    """``keyframe, lossy bf16,int8-block, pinned best``: what marks the checkpoint."""
    out = ["keyframe"] if row.keyframe else []
    out += [f"lossy {','.join(row.lossy)}"] if row.lossy else []
    out += [f"pinned {','.join(row.pins)}"] if row.pins else []
    return ", ".join(out)


def metric_line(rows: Sequence[StepRow], name: str) -> str:
    """``▇▆▄▃▂▁ first 5.51, last 1.92, min 1.9 at step 550`` for the checkpoints that recorded ``name``."""
    points = [(r.step, r.metrics[name]) for r in rows if name in r.metrics]
    finite = [(s, v) for s, v in points if math.isfinite(v)]
    summary = f"first {compact_value(points[0][1])}, last {compact_value(points[-1][1])}"
    if finite:
        low = min(finite, key=lambda p: p[1])
        summary += f", min {compact_value(low[1])} at step {low[0]}"
    return f"{sparkline([v for _, v in points])}  {summary}"


def sparkline(values: Sequence[float], width: int = SPARK_WIDTH) -> str:
    """One block per value, its height from the smallest to the largest finite one (a space where none is
    finite); more than ``width`` values are averaged into ``width`` buckets first."""
    if len(values) > width:
        buckets = [values[i * len(values) // width:(i + 1) * len(values) // width] for i in range(width)]
        values = [_mean(b) for b in buckets]
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return " " * len(values)
    low, high = min(finite), max(finite)
    top = len(_SPARKS) - 1

    def cell(v: float) -> str:
        if not math.isfinite(v):
            return " "
        return _SPARKS[round(top * (v - low) / (high - low))] if high > low else _SPARKS[0]

    return "".join(cell(v) for v in values)


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan

