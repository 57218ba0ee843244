"""The data of ``ckptvault plot``: storage and metrics per checkpoint, over steps.

Pure reads: the vault's manifests and pins, never chunk payloads (as ``ls`` and ``du``). The figures are the ones
every manifest records (``CheckpointInfo.logical_bytes``, ``stored_bytes``, ``added_bytes``), summed in step order:

* ``cumulative_stored``: the running sum of ``added_bytes``, what the vault held after each save (every chunk is
  added once, by the first checkpoint that needs it). Only committed, readable checkpoints are listed: chunks
  that deleted (pruned) checkpoints added are in no sum, so where a later checkpoint still shares them, or until
  gc frees them, the store holds more (``ckptvault du`` measures the store itself).
* ``cumulative_torch``: the running sum of ``logical_bytes``, an estimate of a ``torch.save`` file per checkpoint
  (a torch file holds the same array bytes plus a small pickle of the structure).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .._maintenance.pins import list_pins
from .._save.commit import metrics_from_manifest, non_finite_as_str
from .._vault import Vault
from ..errors import InvalidArgumentError, VaultError, VaultNotFoundError


@dataclass(frozen=True)
class StepRow:
    """One committed checkpoint. ``lossy``: the lossy codecs its tensors are stored with (empty: stored exactly);
    ``pins``: its pin tags; ``metrics``: its numeric metrics (bools and non-numbers left out; NaN and infinities
    as floats)."""

    step: int
    time: float
    logical: int
    stored: int
    added: int
    cumulative_stored: int
    cumulative_torch: int
    keyframe: bool
    keyframe_step: int
    lossy: tuple[str, ...] = ()
    pins: tuple[str, ...] = ()
    metrics: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The row as strict JSON (non-finite metrics as ``"nan"``, ``"inf"``, ``"-inf"``)."""
        return {"step": self.step, "time": self.time, "logical_bytes": self.logical, "stored_bytes": self.stored,
                "added_bytes": self.added, "cumulative_stored_bytes": self.cumulative_stored,
                "cumulative_torch_bytes": self.cumulative_torch, "keyframe": self.keyframe,
                "keyframe_step": self.keyframe_step, "lossy": list(self.lossy), "pins": list(self.pins),
                "metrics": non_finite_as_str(self.metrics)}


@dataclass(frozen=True)
class StorageSeries:
    """Every readable committed checkpoint of a vault, oldest first; ``damaged``: steps whose manifest cannot be
    read -> why (left out of every row and sum)."""

    url: str
    rows: tuple[StepRow, ...]
    damaged: dict[int, str] = field(default_factory=dict)

    def require_checkpoints(self) -> StorageSeries:
        """``self``, or VaultNotFoundError when the vault has no committed checkpoint (nothing to plot)."""
        if not self.rows and not self.damaged:
            raise VaultNotFoundError(f"the vault at {self.url} has no committed checkpoint to plot")
        return self

    @property
    def metric_names(self) -> list[str]:
        """The numeric metrics any checkpoint recorded, in the order they first appear."""
        return list(dict.fromkeys(name for row in self.rows for name in row.metrics))

    def select_metrics(self, names: Sequence[str]) -> list[str]:
        """``names`` (default: every numeric metric), checked: InvalidArgumentError names one no checkpoint
        recorded, and the ones there are."""
        known = self.metric_names
        for name in names:
            if name not in known:
                there = ", ".join(known) if known else "none"
                raise InvalidArgumentError(f"no checkpoint in {self.url} recorded a numeric metric {name!r}; "
                                           f"numeric metrics: {there}")
        return list(dict.fromkeys(names)) if names else known

    def to_json(self, metrics: Sequence[str]) -> dict[str, Any]:
        """``{"url", "metrics", "checkpoints", "damaged"}``; each row keeps only ``metrics``."""
        rows = []
        for row in self.rows:
            out = row.to_json()
            out["metrics"] = {k: v for k, v in out["metrics"].items() if k in metrics}
            rows.append(out)
        return {"url": self.url, "metrics": list(metrics), "checkpoints": rows,
                "damaged": [{"step": s, "error": e} for s, e in sorted(self.damaged.items())]}


def numeric_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The top-level metrics that are numbers (int or float, not bool), as floats."""
    values = metrics_from_manifest(metrics)
    return {k: float(v) for k, v in values.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def storage_series(vault: Vault) -> StorageSeries:
    """Read every manifest and the pins of ``vault`` into a :class:`StorageSeries`. An empty or absent vault gives
    no rows; the caller decides whether that is an error."""
    pins = list_pins(vault)
    rows: list[StepRow] = []
    damaged: dict[int, str] = {}
    stored_sum = torch_sum = 0
    for step in vault.steps():
        try:
            m = vault.read_manifest(step)
        except VaultError as exc:
            damaged[step] = str(exc)
            continue
        stored_sum += m.added_bytes
        torch_sum += m.logical_bytes
        lossy = sorted({t.lossy.codec for t in m.tensors if t.is_lossy and t.lossy is not None})
        rows.append(StepRow(step, m.time, m.logical_bytes, m.stored_bytes, m.added_bytes, stored_sum, torch_sum,
                            m.keyframe == step, m.keyframe, tuple(lossy), tuple(sorted(pins.get(step, ()))),
                            numeric_metrics(m.metrics)))
    return StorageSeries(vault.url, tuple(rows), damaged)

