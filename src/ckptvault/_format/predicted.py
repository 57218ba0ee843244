"""Checks of predicted records and of the restore chain a predicted checkpoint carries (DESIGN §6, "Predicted deltas").

A record with ``"predict"`` is stored as its residual against a prediction computed from other records: of
its own checkpoint (level 0) or of the checkpoints before it, whose records the manifest's ``"chain"`` lists with
pieces in the manifest's own chunk table. A level is stored in chunks of that table (``{"step", "pieces"}``, the
pieces holding the level's JSON ``{"step", "tensors"}``: :func:`check_level`, when a restore reads it) or inline
(``{"step", "tensors"}``). Every input must resolve to a record of the same dtype and shape, and the chain must
end: no record may need a level the manifest does not hold.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from ..errors import PredictionError
from . import HEX_DIGEST
from .records import ChainLevel, ChunkRef, Manifest, Piece, PredictInfo, PredictInput, TensorRecord

#: the kernels this version can compute, by versioned name, with the input roles and scalars each takes
KERNEL_SIGNATURES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "same-1": (("x0",), ()),
    "scale-1": (("x0",), ("c",)),
    "max-1": (("a0", "b1"), ()),
    "adam-param-1": (("p0", "m1", "v1"), ("decay", "neg_step_size", "bc2_sqrt", "eps")),
    "adam-sq-1": (("v0", "m0", "m1"), ("b1", "one_minus_b1", "b2", "one_minus_b2")),
    "sgd-param-1": (("p0", "buf1"), ("neg_lr",)),
    "sgd-nesterov-1": (("p0", "buf0", "buf1"), ("neg_lr", "momentum", "one_minus_dampening")),
}
#: the dtypes predictions are computed in
PREDICTED_DTYPES = ("float32", "float64")
#: how a record's stored bits combine with its prediction's: XOR, or the zigzag-coded difference (the manifest then
#: names the ``requires`` feature given here, which readers from before it existed refuse)
RESIDUALS: dict[str, str | None] = {"xor": None, "diff": "residual-diff"}


def check_predict(f: Any, body: Any, at: str, record_dtype: str) -> PredictInfo:
    """The :class:`PredictInfo` of a record's ``"predict"`` entry (``f``: the schema's field checker)."""
    body = f.dict(body, at)
    op = f.str(f.required(body, "op", at), f"{at}.op")
    if op not in KERNEL_SIGNATURES:
        # damage, not a newer format: a writer with ops beyond these names a feature in requires, refused before
        f.fail(f"{at}.op", f"is {op[:60]!r}, not one of the predictions format version 1 defines "
                           f"({', '.join(KERNEL_SIGNATURES)})")
    if record_dtype not in PREDICTED_DTYPES:
        f.fail(f"{at}", f"is on a record of dtype {record_dtype}; predictions are only of {', '.join(PREDICTED_DTYPES)}")
    roles, scalar_names = KERNEL_SIGNATURES[op]
    inputs = tuple(_input(f, item, f"{at}.inputs[{k}]") for k, item in enumerate(f.list(f.required(body, "inputs", at),
                                                                                        f"{at}.inputs")))
    if sorted(i.role for i in inputs) != sorted(roles):
        f.fail(f"{at}.inputs", f"name roles {sorted(i.role for i in inputs)}; {op} takes {sorted(roles)}")
    scalars = f.dict(f.required(body, "scalars", at), f"{at}.scalars")
    if sorted(scalars) != sorted(scalar_names):
        f.fail(f"{at}.scalars", f"name {sorted(scalars)}; {op} takes {sorted(scalar_names)}")
    digest = f.str(f.required(body, "digest", at), f"{at}.digest")
    if not HEX_DIGEST.fullmatch(digest):
        f.fail(f"{at}.digest", "is not a BLAKE3 hex digest")
    block = f.int(f.required(body, "block", at), f"{at}.block", 1)
    raw = tuple(f.int(b, f"{at}.raw_blocks[{k}]") for k, b in enumerate(f.list(body.get("raw_blocks", []),
                                                                                  f"{at}.raw_blocks")))
    residual = f.str(body.get("residual", "xor"), f"{at}.residual")
    if residual not in RESIDUALS:
        f.fail(f"{at}.residual", f"is {residual[:60]!r}, not one of the residuals format version 1 defines "
                                 f"({', '.join(RESIDUALS)})")
    return PredictInfo(op, inputs, {name: f.number(scalars[name], f"{at}.scalars.{name}") for name in scalar_names},
                       digest, block, f.int(f.required(body, "from_step", at), f"{at}.from_step"), raw, residual)


def _input(f: Any, item: Any, at: str) -> PredictInput:
    item = f.list(item, at)
    if len(item) != 3:
        f.fail(at, "is not [role, level, path]")
    return PredictInput(f.str(item[0], f"{at}[0]"), f.int(item[1], f"{at}[1]", 0, 1), f.str(item[2], f"{at}[2]"))


#: the most bytes of JSON one level stored in chunks may hold (the largest chunk of any vault)
MAX_LEVEL_BYTES = 256 << 20


def check_chain(f: Any, body: Any, check_record: Callable[[Any, str], TensorRecord],
                check_pieces: Callable[[Any, str], tuple[Piece, ...]], requires: tuple[str, ...]
                ) -> tuple[ChainLevel, ...]:
    """The manifest's ``"chain"`` levels (``check_record`` checks one record, as for ``"tensors"``;
    ``check_pieces`` a record's pieces): levels stored inline with their records, and levels stored in chunks with
    the pieces of their JSON (a manifest with those names ``"chain-chunks"`` in ``requires``)."""
    levels = []
    for n, level in enumerate(f.list(body, "chain")):
        at = f"chain[{n}]"
        level = f.dict(level, at)
        step = f.int(f.required(level, "step", at), f"{at}.step")
        if "pieces" in level:
            if "chain-chunks" not in requires:
                f.fail("requires", f"does not name 'chain-chunks', but {at} is stored in chunks")
            pieces = check_pieces(level["pieces"], f"{at}.pieces")
            if not pieces or sum(p.length for p in pieces) > MAX_LEVEL_BYTES:
                f.fail(f"{at}.pieces", f"must hold 1 to {MAX_LEVEL_BYTES} bytes")
            levels.append(ChainLevel(step, None, pieces))
            continue
        records = f.list(f.required(level, "tensors", at), f"{at}.tensors")
        levels.append(ChainLevel(step, tuple(check_record(r, f"{at}.tensors[{k}]") for k, r in enumerate(records))))
    return tuple(levels)


def check_level(f: Any, body: Any, level: ChainLevel, at: str, check_record: Callable[[Any, str], TensorRecord]
                ) -> ChainLevel:
    """``level`` (stored in chunks) with the records of ``body``, the parsed JSON its pieces hold."""
    body = f.dict(body, at)
    step = f.int(f.required(body, "step", at), f"{at}.step")
    if step != level.step:
        f.fail(f"{at}.step", f"is {step}, but the manifest lists the level as step {level.step}")
    records = f.list(f.required(body, "tensors", at), f"{at}.tensors")
    return replace(level, tensors=tuple(check_record(r, f"{at}.tensors[{k}]") for k, r in enumerate(records)))


def check_inputs(f: Any, tensors: tuple[TensorRecord, ...], chain: tuple[ChainLevel, ...], requires: tuple[str, ...]
                 ) -> None:
    """Every prediction's inputs resolve to a record of its dtype and shape, at a level the manifest holds; a
    manifest with predictions declares ``"predicted"`` in ``requires``. Records of levels stored in chunks and not
    read yet, and inputs in them, are checked once a restore reads them (:func:`check_level`, then this again)."""
    levels = [tensors] + [level.tensors for level in chain]
    by_path = [None if records is None else {t.path: t for t in records} for records in levels]
    found = False
    for n, records in enumerate(levels):
        where = "tensors" if n == 0 else f"chain[{n - 1}].tensors"
        for k, record in enumerate(records or ()):
            if record.predict is None:
                continue
            found = True
            if record.is_lossy:
                f.fail(f"{where}[{k}].predict", "is on a lossy record")
            feature = RESIDUALS[record.predict.residual]
            if feature is not None and feature not in requires:
                f.fail("requires", f"does not name {feature!r}, but {where}[{k}] is stored as a "
                                   f"{record.predict.residual!r} residual")
            for item in record.predict.inputs:
                held = by_path[n + item.level] if n + item.level < len(levels) else {}
                if held is None:
                    continue  # a level not read yet
                source = held.get(item.path)
                if source is None or source.dtype != record.dtype or source.shape != record.shape:
                    f.fail(f"{where}[{k}].predict.inputs", f"name {item.path!r} {item.level} level(s) back, which the "
                                                           "manifest does not hold with the record's dtype and shape")
    if found and "predicted" not in requires:
        f.fail("requires", "does not name 'predicted', but records are predicted")


def build_chain(tensors: tuple[TensorRecord, ...], latest: Manifest | None) -> tuple[ChainLevel, ...]:
    """The restore chain of a checkpoint whose records are ``tensors``, predicted from ``latest``: the records of
    ``latest`` its predictions read (with those they read in turn at the same level), then ``latest``'s own chain
    as it is. The pieces keep ``latest``'s chunk indices: the new manifest's chunk table starts with ``latest``'s
    (:func:`chain_table_prefix`), so levels pass from manifest to manifest unchanged."""
    if latest is None or not any(t.predict is not None for t in tensors):
        return ()
    by_path = {t.path: t for t in latest.tensors}
    needed: set[str] = set()
    todo = [i.path for t in tensors if t.predict is not None for i in t.predict.inputs if i.level == 1]
    while todo:
        path = todo.pop()
        if path in needed:
            continue
        record = by_path.get(path)
        if record is None:
            raise PredictionError(f"step {latest.step} lacks {path!r}, which a prediction reads")
        needed.add(path)
        if record.predict is not None:
            todo.extend(i.path for i in record.predict.inputs if i.level == 0)
    level = ChainLevel(latest.step, tuple(t for t in latest.tensors if t.path in needed))
    return (level, *latest.chain)


def chain_table_prefix(latest: Manifest) -> list[ChunkRef]:
    """The chunks a manifest predicted from ``latest`` lists first, in ``latest``'s order (none of them new)."""
    return [replace(c, new=False) if c.new else c for c in latest.chunks]
