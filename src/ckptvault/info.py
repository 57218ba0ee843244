"""Read-only views of manifests for users: CheckpointInfo and TensorInfo."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TensorInfo:
    """One stored array. ``stored_bytes`` counts its share of the chunks it lives in."""

    path: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    stored_bytes: int
    codec: str


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint.

    ``logical_bytes``: bytes of its arrays uncompressed. ``stored_bytes``: stored
    size of every chunk it references. ``added_bytes``: what this checkpoint
    added to the vault (chunks no earlier checkpoint had).
    """

    step: int
    time: float
    logical_bytes: int
    stored_bytes: int
    added_bytes: int
    metrics: dict[str, Any]
    metadata: dict[str, Any]
    tensors: list[TensorInfo] = field(repr=False)
    num_chunks: int = 0

    @property
    def ratio(self) -> float:
        """Stored / logical bytes (lower is better)."""
        return self.stored_bytes / self.logical_bytes if self.logical_bytes else 1.0

    def to_dict(self, with_tensors: bool = False) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("step", "time", "logical_bytes", "stored_bytes", "added_bytes",
                                             "metrics", "metadata", "num_chunks")}
        out["ratio"] = self.ratio
        if with_tensors:
            out["tensors"] = [vars(t) | {"shape": list(t.shape)} for t in self.tensors]
        return out


def info_from_manifest(manifest: dict[str, Any]) -> CheckpointInfo:
    chunks = manifest["chunks"]
    tensors = []
    for t in manifest["tensors"]:
        share = sum(chunks[c]["stored"] * length / max(chunks[c]["raw"], 1) for c, _off, length in t["pieces"])
        tensors.append(TensorInfo(t["path"], t["kind"], t["dtype"], tuple(t["shape"]), t["nbytes"], round(share),
                                  t["codec"]))
    return CheckpointInfo(
        step=manifest["step"], time=manifest["time"], logical_bytes=manifest["logical_bytes"],
        stored_bytes=manifest["stored_bytes"], added_bytes=manifest["added_bytes"], metrics=manifest["metrics"],
        metadata=manifest["metadata"], tensors=tensors, num_chunks=len(chunks),
    )
