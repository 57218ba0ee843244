"""Text rendering for the CLI: aligned tables, byte sizes, times, metrics and dtypes.

Pure functions from values to strings; nothing here prints or touches a vault.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: int | float) -> str:
    """``1536`` -> ``"1.5 KiB"``; binary units, three significant digits, exact below 1 KiB."""
    value = float(n)
    sign = "-" if value < 0 else ""
    value = abs(value)
    if value < 1024:
        return f"{sign}{int(value)} B"
    for unit in _UNITS[1:]:
        value /= 1024
        if value < 1024 or unit == _UNITS[-1]:
            break
    text = f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:.0f}"
    return f"{sign}{text} {unit}"


def percent(part: int | float, whole: int | float) -> str:
    """``part`` as a percentage of ``whole`` (``"-"`` when ``whole`` is 0)."""
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def local_time(ts: float) -> str:
    """Seconds since the epoch -> local ISO 8601 time to the second, without offset (``2024-05-01T12:00:00``)."""
    return datetime.fromtimestamp(ts).isoformat(timespec="seconds")


def iso_time(ts: float) -> str:
    """Seconds since the epoch -> local ISO 8601 time with UTC offset, for JSON output."""
    return datetime.fromtimestamp(ts).astimezone().isoformat(timespec="seconds")


def compact_value(value: Any) -> str:
    """A metric or metadata value in a few characters: floats to 4 significant digits."""
    if isinstance(value, bool) or value is None:
        return str(value).lower() if value is not None else "null"
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    if isinstance(value, (dict, list)):
        import json

        return json.dumps(value, separators=(",", ":"))
    return str(value)


def compact_mapping(values: Mapping[str, Any]) -> str:
    """``{"loss": 2.3141, "lr": 3e-4}`` -> ``"loss=2.314 lr=0.0003"``; empty -> ``""``."""
    return " ".join(f"{k}={compact_value(v)}" for k, v in values.items())


def dtype_label(kind: str, dtype: str) -> str:
    """Readable dtype of a manifest tensor entry: torch names as is, numpy ``<f4`` as ``np.float32``."""
    if kind == "torch":
        return dtype
    if kind == "pickle":
        return "pickle"
    try:
        import numpy as np

        return "np." + np.dtype(dtype).name
    except TypeError:
        return dtype


def shape_label(shape: Sequence[int]) -> str:
    """``[4, 16]`` -> ``"4x16"``; a 0-d scalar -> ``"()"``."""
    return "x".join(map(str, shape)) if shape else "()"


def table(headers: Sequence[str], rows: Iterable[Sequence[str]], align: str = "") -> str:
    """Align ``rows`` under ``headers``. ``align`` holds ``l`` or ``r`` per column (default ``l``).

    Columns are separated by two spaces; the last column is not padded, so no
    line ends in spaces.
    """
    body = [list(map(str, row)) for row in rows]
    widths = [len(h) for h in headers]
    for row in body:
        widths = [max(w, len(cell)) for w, cell in zip(widths, row)]
    aligns = align.ljust(len(headers), "l")

    def line(cells: Sequence[str]) -> str:
        parts = [c.rjust(w) if a == "r" else c.ljust(w) for c, w, a in zip(cells, widths, aligns)]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers), *(line(row) for row in body)])


def key_value_block(pairs: Iterable[tuple[str, str]]) -> str:
    """``name  value`` lines with the names padded to one width."""
    items = list(pairs)
    width = max((len(k) for k, _ in items), default=0)
    return "\n".join(f"{k.ljust(width)}  {v}".rstrip() for k, v in items)
