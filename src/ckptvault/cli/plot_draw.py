"""The PNG of ``ckptvault plot``, drawn with matplotlib (the optional extra ``[plot]``).

matplotlib is imported by :func:`load_matplotlib` only, never when the package or the CLI is imported. Drawing
uses the Agg canvas on a bare ``Figure``, without pyplot, so no display and no global backend state are involved.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from .._reports.plot_data import StepRow, StorageSeries
from ..errors import InvalidArgumentError
from .render import human_bytes

if TYPE_CHECKING:
    from matplotlib.axes import Axes

DPI = 100
WIDTH_IN = 11.0
STORAGE_HEIGHT_IN = 6.6  # the two storage panels
METRIC_HEIGHT_IN = 1.9  # each metric panel
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")
MARKERS: dict[str, dict[str, Any]] = {  # how a checkpoint's role shows on the per-checkpoint panel (on its STORED point)
    "keyframe": {"marker": "^", "color": "#d62728", "s": 70, "zorder": 4},
    "lossy": {"marker": "o", "facecolors": "none", "edgecolors": "#9467bd", "s": 190, "linewidths": 1.8, "zorder": 5},
    "pinned": {"marker": "*", "color": "#e6a700", "edgecolors": "black", "linewidths": 0.6, "s": 260, "zorder": 6},
}


def figure_size_px(num_metrics: int) -> tuple[int, int]:
    """(width, height) in pixels of the PNG for ``num_metrics`` metric panels."""
    return round(WIDTH_IN * DPI), round((STORAGE_HEIGHT_IN + METRIC_HEIGHT_IN * num_metrics) * DPI)


def load_matplotlib() -> ModuleType:
    """matplotlib, or InvalidArgumentError saying how to install it or do without it."""
    try:
        import matplotlib
    except ImportError:
        raise InvalidArgumentError("plot -o needs matplotlib, which is not installed: pip install 'ckptvault[plot]', "
                                   "or leave out -o to print the chart in the terminal") from None
    return matplotlib


def comparison(vault: int, torch: int) -> str:
    """``vault 12 MiB vs 115 MiB as torch.save files, 9.6x smaller`` (or ``larger``, for a vault that does not pay)."""
    text = f"vault {human_bytes(vault)} vs {human_bytes(torch)} as torch.save files"
    if not vault or not torch:
        return text
    return f"{text}, {torch / vault:.1f}x smaller" if torch >= vault else f"{text}, {vault / torch:.1f}x larger"


def counted(count: int, noun: str) -> str:
    """``1 checkpoint``, ``2 checkpoints``."""
    return f"{count} {noun}{'' if count == 1 else 's'}"


def byte_unit(largest: float) -> tuple[str, float]:
    """The binary unit an axis whose values reach ``largest`` bytes is labelled in, and its size in bytes."""
    power = 0 if largest < 1024 else min(int(math.log(largest, 1024)), len(_UNITS) - 1)
    return _UNITS[power], float(1024**power)


def write_png(series: StorageSeries, metrics: Sequence[str], path: Path) -> None:
    """Draw ``series`` (the storage panels, then one panel per name in ``metrics``) into the PNG at ``path``.
    Raises OSError if ``path`` cannot be written."""
    load_matplotlib()
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    width, height = figure_size_px(len(metrics))
    fig = Figure(figsize=(width / DPI, height / DPI), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    ratios = [1.35, 1.0] + [METRIC_HEIGHT_IN / (STORAGE_HEIGHT_IN / 2.35)] * len(metrics)
    axes = fig.subplots(2 + len(metrics), 1, sharex=True, gridspec_kw={"height_ratios": ratios})
    rows = series.rows
    fig.suptitle(f"ckptvault vault {series.url}: {counted(len(rows), 'checkpoint')}, steps {rows[0].step}..{rows[-1].step}",
                 fontsize=13)
    _draw_totals(axes[0], rows)
    _draw_per_checkpoint(axes[1], rows)
    for ax, name in zip(axes[2:], metrics):
        _draw_metric(ax, rows, name)
    if metrics:
        axes[2].set_title("metrics saved with each checkpoint", fontsize=11)
    axes[-1].set_xlabel("step")
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))  # whole steps, round ticks
    if rows[0].step == rows[-1].step:  # one checkpoint: room for integer ticks around it
        axes[-1].set_xlim(rows[0].step - 1, rows[0].step + 1)
    fig.savefig(path, format="png", dpi=DPI)


def _legend(ax: Axes) -> None:
    """The legend right of the panel, where it cannot hide data."""
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=9, frameon=False, borderaxespad=0.0)


def _draw_totals(ax: Axes, rows: Sequence[StepRow]) -> None:
    steps = [r.step for r in rows]
    vault, torch = rows[-1].cumulative_stored, rows[-1].cumulative_torch
    unit, size = byte_unit(max(vault, torch))
    ax.plot(steps, [r.cumulative_torch / size for r in rows], "--", color="#7f7f7f", lw=2, marker=".",
            label="torch.save of every checkpoint\n(estimate: running sum of logical bytes)")
    ax.plot(steps, [r.cumulative_stored / size for r in rows], "-", color="#1f77b4", lw=2.4, marker=".",
            label="vault size\n(running sum of added bytes)")
    ax.fill_between(steps, [r.cumulative_stored / size for r in rows], color="#1f77b4", alpha=0.15)
    ax.set_title(f"total: {comparison(vault, torch)}", fontsize=11)
    ax.set_ylabel(f"cumulative ({unit})")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    _legend(ax)


def _draw_per_checkpoint(ax: Axes, rows: Sequence[StepRow]) -> None:
    steps = [r.step for r in rows]
    unit, size = byte_unit(max(max(r.logical, r.stored, r.added) for r in rows))
    # stems of a fixed width in points, not in steps: they stay visible and apart however the steps are spaced
    ax.vlines(steps, 0, [r.added / size for r in rows], color="#2ca02c", alpha=0.55, lw=_stem_width(len(rows)),
              label="added (new to the vault)")
    ax.plot(steps, [r.logical / size for r in rows], "-", marker=".", color="#7f7f7f", lw=1.6,
            label="logical (arrays uncompressed)")
    ax.plot(steps, [r.stored / size for r in rows], "-", marker=".", color="#ff7f0e", lw=1.6,
            label="stored (chunks it references)")
    for role, style in MARKERS.items():
        chosen = [r for r in rows if _has_role(r, role)]
        ax.scatter([r.step for r in chosen], [r.stored / size for r in chosen], label=_role_label(role, chosen), **style)
    for r in rows:
        if r.pins:
            ax.annotate(",".join(r.pins), (r.step, r.stored / size), textcoords="offset points", xytext=(0, 10),
                        ha="center", fontsize=8)
    ax.set_title("each checkpoint", fontsize=11)
    ax.set_ylabel(f"bytes ({unit})")
    ax.set_ylim(bottom=0, top=1.25 * max(max(r.logical, r.stored, r.added) for r in rows) / size)
    ax.grid(alpha=0.3)
    _legend(ax)


def _stem_width(count: int) -> float:
    """Points per stem: wide for a few checkpoints, a hairline for thousands."""
    return max(0.6, min(8.0, 400.0 / max(count, 1)))


def _has_role(row: StepRow, role: str) -> bool:
    return {"keyframe": row.keyframe, "lossy": bool(row.lossy), "pinned": bool(row.pins)}[role]


def _role_label(role: str, chosen: Sequence[StepRow]) -> str:
    """The legend entry of a marker, with how many checkpoints carry it."""
    what = {"keyframe": "keyframe (stored whole)", "lossy": "with lossy tensors", "pinned": "pinned (tag above)"}[role]
    return f"{what}: {len(chosen)}"


def _draw_metric(ax: Axes, rows: Sequence[StepRow], name: str) -> None:
    points = [(r.step, r.metrics[name]) for r in rows if name in r.metrics]
    ax.plot([s for s, _ in points], [v for _, v in points], "-", marker=".", color="#17becf", lw=1.6, label=name)
    ax.set_ylabel(name)
    ax.grid(alpha=0.3)
    _legend(ax)

