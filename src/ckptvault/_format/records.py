"""The typed model of a manifest: what ``_format.schema`` parses a manifest body into, and what a save builds.

Every class is a frozen dataclass whose fields mirror the JSON fields of docs/DESIGN.md section 4;
``to_json`` gives the body back with its keys in the order the format has always written them, so encoding a
parsed manifest reproduces its bytes. Code above ``_format/`` reads manifests only through these types.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass, field
from typing import Any

from . import jsontext

#: a state's JSON skeleton (_tree.py); checked node by node by the schema, kept as JSON
Node = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Piece:
    """``length`` bytes at ``offset`` in chunk ``chunk`` (an index into the manifest's chunk table)."""

    chunk: int
    offset: int
    length: int

    def to_json(self) -> list[int]:
        return [self.chunk, self.offset, self.length]


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """One entry of the chunk table: a chunk object, its raw and stored sizes, whether this save created it, and
    (for a delta) the full chunk it is a delta against."""

    id: str
    raw: int
    stored: int
    new: bool = False
    base: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "raw": self.raw, "stored": self.stored, "new": self.new}
        if self.base is not None:
            out["base"] = self.base
        return out


@dataclass(frozen=True)
class LossyInfo:
    """How a tensor is stored lossily (docs/DESIGN.md section 12); ``codec`` "lossless" when it fell back."""

    codec: str
    block: int | None = None
    stored_dtype: str | None = None
    stored_shape: tuple[int, ...] | None = None
    original_nbytes: int | None = None
    error: dict[str, Any] | None = None
    notes: tuple[str, ...] = ()
    parts: dict[str, int] = field(default_factory=dict)
    base_step: int | None = None
    base_pieces: tuple[Piece, ...] | None = None
    requested: str | None = None

    @property
    def is_lossy(self) -> bool:
        return self.codec != "lossless"

    def to_json(self) -> dict[str, Any]:
        if not self.is_lossy:
            out: dict[str, Any] = {"codec": self.codec}
            if self.requested is not None:
                out["requested"] = self.requested
            out["notes"] = list(self.notes)
            return out
        out = {"codec": self.codec}
        if self.block is not None:
            out["block"] = self.block
        out.update({"stored_dtype": self.stored_dtype, "stored_shape": list(self.stored_shape or ()),
                    "original_nbytes": self.original_nbytes,
                    "error": dict(self.error) if self.error is not None else None, "parts": dict(self.parts)})
        if self.notes:
            out["notes"] = list(self.notes)
        if self.base_pieces is not None:
            out["base_step"] = self.base_step
            out["base_pieces"] = [p.to_json() for p in self.base_pieces]
        return out


@dataclass(frozen=True, slots=True)
class PredictInput:
    """An array a prediction reads: the record at key path ``path`` of the checkpoint ``level`` steps back in the
    manifest's chain (0: the same checkpoint as the predicted record, 1: the one a step earlier)."""

    role: str
    level: int
    path: str

    def to_json(self) -> list[Any]:
        return [self.role, self.level, self.path]


@dataclass(frozen=True)
class PredictInfo:
    """A record stored as its residual against a prediction (docs/DESIGN.md section 6, "Predicted deltas").

    ``op``: the kernel, by versioned name (``_delta/kernels.py``); ``inputs``: the arrays it reads; ``scalars``:
    its constants, in the record's dtype, computed once at save; ``digest``: BLAKE3 of the restored bytes, checked
    once the residual is undone; ``raw_blocks``: the ``block``-byte blocks stored as they are (the prediction did
    not pay); ``from_step``: the checkpoint one step earlier that level-1 inputs come from; ``residual``: how the
    stored bits combine with the prediction's, ``"xor"`` or ``"diff"`` (the zigzag-coded difference of the bit
    patterns as unsigned integers; written without a key when ``"xor"``, as before it existed).
    """

    op: str
    inputs: tuple[PredictInput, ...]
    scalars: dict[str, float]
    digest: str
    block: int
    from_step: int
    raw_blocks: tuple[int, ...] = ()
    residual: str = "xor"

    def to_json(self) -> dict[str, Any]:
        if not all(math.isfinite(c) for c in self.scalars.values()):  # strict JSON (jsontext.py writes no NaN)
            raise ValueError(f"prediction scalars must be finite, got {self.scalars}")
        out = {"op": self.op, "inputs": [i.to_json() for i in self.inputs], "scalars": dict(self.scalars),
               "digest": self.digest, "block": self.block, "from_step": self.from_step,
               "raw_blocks": list(self.raw_blocks)}
        if self.residual != "xor":
            out["residual"] = self.residual
        return out


@dataclass(frozen=True)
class TensorRecord:
    """One stored array: its key path, kind (``torch``, ``numpy``, ``pickle``, or ``part`` for a lossy tensor's
    scales), dtype and shape as restored, and the pieces holding its stored bytes (``nbytes`` of them)."""

    path: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    codec: str
    pieces: tuple[Piece, ...]
    global_shape: tuple[int, ...] | None = None
    offsets: tuple[int, ...] | None = None
    requires_grad: bool = False
    device: str | None = None
    lossy: LossyInfo | None = None
    predict: PredictInfo | None = None

    @property
    def is_lossy(self) -> bool:
        """Stored in a lossy form (restore decodes it to ``dtype``)."""
        return self.lossy is not None and self.lossy.is_lossy

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def restored_nbytes(self) -> int:
        """Bytes of the array as restored (``nbytes`` is its stored form's, smaller for a lossy record)."""
        if self.is_lossy and self.lossy is not None and self.lossy.original_nbytes is not None:
            return self.lossy.original_nbytes
        return self.nbytes

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "kind": self.kind, "dtype": self.dtype, "shape": list(self.shape),
                               "global_shape": list(self.global_shape if self.global_shape is not None else self.shape),
                               "offsets": list(self.offsets if self.offsets is not None else [0] * len(self.shape)),
                               "nbytes": self.nbytes, "codec": self.codec, "pieces": [p.to_json() for p in self.pieces]}
        if self.requires_grad:
            out["requires_grad"] = True
        if self.device is not None:
            out["device"] = self.device
        if self.lossy is not None:
            out["lossy"] = self.lossy.to_json()
        if self.predict is not None:
            out["predict"] = self.predict.to_json()
        return out


@dataclass(frozen=True)
class ChainLevel:
    """The records of checkpoint ``step`` that a predicted checkpoint's restore needs, with pieces in the
    predicted checkpoint's own chunk table: ``chain[0]`` is one step back, ``chain[1]`` two, ...

    A level is stored in chunk objects of that table (``pieces``: the bytes of its JSON, :attr:`body_text`), or
    inline in the manifest (no ``pieces``), as manifests written before chunked levels hold it. ``tensors`` is None
    for a level read from a manifest until a restore reads its chunks (``_restore/chain.py``)."""

    step: int
    tensors: tuple[TensorRecord, ...] | None
    pieces: tuple[Piece, ...] | None = None

    @property
    def records(self) -> tuple[TensorRecord, ...]:
        """The level's records; only for a level whose records are known (read, or made by this process)."""
        assert self.tensors is not None, "a level stored in chunks is read before its records are used"
        return self.tensors

    def to_json(self) -> dict[str, Any]:
        """The level as the manifest holds it, a copy for the caller: the level's own JSON is made once and passes
        unchanged into every later manifest of its chain (the writer splices in :attr:`json_text`)."""
        return copy.deepcopy(self._json)

    @functools.cached_property
    def _json(self) -> dict[str, Any]:
        if self.pieces is not None:
            return {"step": self.step, "pieces": [p.to_json() for p in self.pieces]}
        return self._body

    @functools.cached_property
    def _body(self) -> dict[str, Any]:
        return {"step": self.step, "tensors": [t.to_json() for t in self.records]}

    @functools.cached_property
    def residual_forms(self) -> frozenset[str]:
        """The residual forms (``PredictInfo.residual``) its records are stored as, found once: a level passes
        unchanged from manifest to manifest. Only for a level whose records are known."""
        return frozenset(t.predict.residual for t in self.records if t.predict is not None)

    @functools.cached_property
    def json_text(self) -> bytes:
        """The level as the manifest writes it (``_format/manifest.py``), made once."""
        return jsontext.dumps(self._json)

    @functools.cached_property
    def body_text(self) -> bytes:
        """The level with its records, as its chunks hold it (and as a manifest holds an inline level)."""
        return jsontext.dumps(self._body)


@dataclass(frozen=True)
class Manifest:
    """A checkpoint's manifest (docs/DESIGN.md section 4): its step, sizes, user metrics and metadata, the keyframe
    its deltas are against, the state's skeleton, its tensor records and the chunks they use."""

    step: int
    time: float
    tree: Node
    tensors: tuple[TensorRecord, ...]
    chunks: tuple[ChunkRef, ...]
    logical_bytes: int = 0
    stored_bytes: int = 0
    added_bytes: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    keyframe_step: int | None = None
    since_keyframe: int = 0
    pickle: bool = False
    writer: str | None = None
    requires: tuple[str, ...] = ()
    version: int = 1
    chain: tuple[ChainLevel, ...] = ()

    @property
    def keyframe(self) -> int:
        """The keyframe whose chunks this checkpoint's deltas are against (its own step for a keyframe)."""
        return self.step if self.keyframe_step is None else self.keyframe_step

    def chunk_bases(self) -> dict[str, str | None]:
        """Each chunk id this checkpoint names -> the full chunk it is a delta against (None for a full chunk)."""
        return {c.id: c.base for c in self.chunks}

    def to_json(self, chain: bool = True) -> dict[str, Any]:
        """The manifest body, keys in the order the format writes them (without ``"chain"`` when not ``chain``).
        Apart from ``tree``, ``metrics`` and ``metadata`` (this manifest's own), nothing in it is shared with the
        records, which decoding the same manifest bytes again may return (``manifest.decode_manifest``)."""
        from .schema import MANIFEST_FORMAT  # the schema imports this module

        out: dict[str, Any] = {"format": MANIFEST_FORMAT, "version": self.version, "step": self.step, "time": self.time}
        if self.writer is not None:
            out["writer"] = self.writer
        out.update({"hash": "blake3", "pickle": self.pickle, "logical_bytes": self.logical_bytes,
                    "stored_bytes": self.stored_bytes, "added_bytes": self.added_bytes, "metrics": self.metrics,
                    "metadata": self.metadata, "keyframe_step": self.keyframe, "since_keyframe": self.since_keyframe,
                    "tree": self.tree, "tensors": [t.to_json() for t in self.tensors],
                    "chunks": [c.to_json() for c in self.chunks]})
        if self.requires:
            out["requires"] = list(self.requires)
        if self.chain and chain:
            out["chain"] = [level.to_json() for level in self.chain]
        return out


@dataclass(frozen=True)
class Descriptor:
    """``vault.json``: the vault's chunk size and default codec, fixed when the vault is created."""

    chunk_size: int
    codec: str
    created: float | None = None
    version: int = 1

    def to_json(self) -> dict[str, Any]:
        from .schema import HASH_NAME, VAULT_FORMAT  # the schema imports this module

        out: dict[str, Any] = {"format": VAULT_FORMAT, "version": self.version, "chunk_size": self.chunk_size,
                               "codec": self.codec, "hash": HASH_NAME}
        if self.created is not None:
            out["created"] = self.created
        return out
