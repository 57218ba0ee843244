"""The schema of manifests and ``vault.json``: every field checked once, where the bytes are parsed.

:func:`check_manifest` and :func:`check_descriptor` take the parsed JSON of a
file and either return it unchanged or raise. Everything that reads a manifest
goes through them (``decode_manifest``, ``Vault.descriptor``), so the rest of
the package may index the body without checking again: types and ranges, ASCII
hex chunk ids, leaf indices in range, pieces inside their chunks, ``shape`` x
itemsize equal to the bytes the pieces hold, the nesting depth of the tree and
of user metadata. A violation is a :class:`CorruptManifestError` naming the
file and the field (``tensors[3].pieces[0]``); a version or feature newer than
this reader is a :class:`FormatVersionError`.
"""

from __future__ import annotations

import base64
import binascii
import builtins
import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any, NoReturn

import numpy as np
import torch

from ..errors import CorruptManifestError, FormatVersionError
from . import FORMAT_VERSION, HEX_DIGEST
from .predicted import RESIDUALS, check_chain, check_inputs, check_level, check_predict
from .records import ChunkRef, Descriptor, LossyInfo, Manifest, Piece, TensorRecord
from .shards import check_boxes, check_sharding, check_shards_node

MANIFEST_FORMAT = "ckptvault.manifest"
VAULT_FORMAT = "ckptvault.vault"
#: optional features a manifest may declare in "requires"; a reader refuses any it does not know
KNOWN_FEATURES = frozenset({"lossy", "xplanes", "sharded", "predicted", "chain-chunks",
                            *(feature for feature in RESIDUALS.values() if feature is not None)})
#: the only chunk hash of format version 1
HASH_NAME = "blake3"
#: chunk sizes a vault may declare: a multiple of 64 (every dtype's elements end on a chunk boundary) in this range
MIN_CHUNK_SIZE = 64 << 10
MAX_CHUNK_SIZE = 256 << 20
#: deepest nesting of containers in a state's tree and of JSON values in metrics and metadata
MAX_DEPTH = 100
#: most dimensions of one array (numpy's own limit is 64)
MAX_DIMS = 64
#: steps are written as 20 decimal digits in manifest keys
MAX_STEP = 10**20 - 1

_NUMPY_KINDS = "biufc"
_LOSSY_CODECS = ("bf16", "fp16", "int8-block", "residual-int8", "lossless")
_BLOCK_CODECS = ("int8-block", "residual-int8")
_LEAF_KINDS = {"tensor": "torch", "ndarray": "numpy", "npscalar": "numpy", "pickle": "pickle"}
_SCALAR_TAGS = ("none", "bool", "int", "float", "str", "bytes")


class _Fields:
    """Where a check is: the file's name, for messages that name the file and the field."""

    def __init__(self, what: str) -> None:
        self.what = what

    def fail(self, field: str, problem: str, error: Callable[[str], Exception] = CorruptManifestError) -> NoReturn:
        at = f" field {field}" if field else ""
        raise error(f"{self.what}:{at} {problem}")

    def dict(self, value: Any, field: str) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(field, f"must be a JSON object, not {_kind(value)}")
        return value

    def list(self, value: Any, field: str) -> list[Any]:
        if not isinstance(value, list):
            self.fail(field, f"must be a JSON list, not {_kind(value)}")
        return value

    def int(self, value: Any, field: str, low: int = 0, high: int | None = None) -> int:
        if type(value) is not int:
            self.fail(field, f"must be an integer, not {_kind(value)}")
        if value < low or (high is not None and value > high):
            bound = f"{low}..{high}" if high is not None else f">= {low}"
            self.fail(field, f"is {_short(value)}, outside {bound}")
        return value

    def str(self, value: Any, field: str) -> str:
        if not isinstance(value, str):
            self.fail(field, f"must be a string, not {_kind(value)}")
        return value

    # builtins.str and builtins.dict from here on: in the class body ``str`` and ``dict`` are the methods above
    def bool(self, value: Any, field: builtins.str) -> bool:
        if not isinstance(value, bool):
            self.fail(field, f"must be true or false, not {_kind(value)}")
        return value

    def number(self, value: Any, field: builtins.str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(field, f"must be a finite number, not {_short(value)}")
        return float(value)

    def chunk_id(self, value: Any, field: builtins.str) -> builtins.str:
        if not isinstance(value, str) or not HEX_DIGEST.fullmatch(value):
            self.fail(field, f"must be a chunk id (64 lowercase hex digits), not {_short(value)}")
        return value

    def required(self, body: builtins.dict[builtins.str, Any], name: builtins.str, field: builtins.str = "") -> Any:
        if name not in body:
            self.fail(field + name if not field else f"{field}.{name}", "is missing")
        return body[name]


# -- vault.json ---------------------------------------------------------------

def check_descriptor(desc: Any, what: str) -> Descriptor:
    """The :class:`Descriptor` that ``desc`` (the parsed ``vault.json``) gives, if it describes a vault this
    reader can use; ``what`` names the file in messages. Raises CorruptManifestError, or FormatVersionError for a
    newer format."""
    f = _Fields(what)
    desc = f.dict(desc, "")
    if desc.get("format") != VAULT_FORMAT:
        f.fail("format", f"is {_short(desc.get('format'))}, not {VAULT_FORMAT!r}: this is not a ckptvault vault")
    version = _check_version(f, f.required(desc, "version"), "vault")
    size = f.int(f.required(desc, "chunk_size"), "chunk_size", MIN_CHUNK_SIZE, MAX_CHUNK_SIZE)
    if size % 64:
        f.fail("chunk_size", f"is {size}, not a multiple of 64")
    if f.required(desc, "hash") != HASH_NAME:
        f.fail("hash", f"is {_short(desc['hash'])}; format version 1 names chunks by {HASH_NAME!r} only")
    codec = f.str(f.required(desc, "codec"), "codec")
    from .._codecs import validate_codec_name  # codecs import nothing of format's schema

    try:
        validate_codec_name(codec)
    except ValueError as exc:
        f.fail("codec", f"{codec!r} is not a codec ({exc})")
    created = f.number(desc["created"], "created") if "created" in desc else None
    return Descriptor(size, codec, created, version)


def _check_version(f: _Fields, version: Any, what: str) -> int:
    f.int(version, "version")
    if version > FORMAT_VERSION:
        f.fail("version", f"is {version}: this {what} uses a newer format than this ckptvault reads "
                          f"(up to {FORMAT_VERSION}); upgrade ckptvault", FormatVersionError)
    return version


# -- manifests ----------------------------------------------------------------

#: the feature a packed manifest body requires: its one other field, ``packed``, holds the whole body
PACKED = "packed"
_PACKED_FIELDS = frozenset({"format", "version", "requires", PACKED})


def packed_text(body: Any, what: str) -> str | None:
    """The base64 text of a packed manifest body (``{"format", "version", "requires": ["packed"], "packed"}``:
    docs/DESIGN.md section 4), or None for a body that is not packed. Raises CorruptManifestError for a body that
    requires ``packed`` in another form, FormatVersionError for a newer version."""
    requires = body.get("requires") if isinstance(body, dict) else None
    if not (isinstance(requires, list) and PACKED in requires):
        return None
    f = _Fields(what)
    _check_format_and_version(f, body)
    if set(body) != _PACKED_FIELDS or requires != [PACKED]:
        f.fail("requires", f"names {PACKED!r}, but the body is not a packed one: it must hold exactly the fields "
                           f"{sorted(_PACKED_FIELDS)}, and requires only {PACKED!r}")
    return f.str(body[PACKED], PACKED)


def check_manifest(body: Any, what: str, step: int | None = None, chunk_size: int = MAX_CHUNK_SIZE) -> Manifest:
    """The :class:`Manifest` that ``body`` (a parsed manifest body) describes, if it is a well-formed manifest of
    ``step`` (None: any) in a vault of ``chunk_size``; ``what`` names the file in messages. Raises
    CorruptManifestError, or FormatVersionError for a newer version or an unknown required feature."""
    f = _Fields(what)
    body = f.dict(body, "")
    version = _check_format_and_version(f, body)
    requires = _check_requires(f, body.get("requires", []))
    header = _check_header(f, body, step)
    chunks = _check_chunks(f, f.list(f.required(body, "chunks"), "chunks"), chunk_size)
    raws = [chunk.raw for chunk in chunks]
    tensors = tuple(_check_record(f, record, f"tensors[{i}]", raws)
                    for i, record in enumerate(f.list(f.required(body, "tensors"), "tensors")))
    for i, record in enumerate(tensors):
        if record.is_lossy:
            _check_parts(f, record, f"tensors[{i}].lossy.parts", tensors)
    check_boxes(f, tensors)
    chain = check_chain(f, body.get("chain", []), lambda record, at: _check_record(f, record, at, raws),
                        lambda pieces, at: _pieces(f, pieces, at, raws)[0], requires)
    check_inputs(f, tensors, chain, requires)
    tree = f.required(body, "tree")
    check_sharding(f, tensors, _check_tree(f, tree, tensors), requires)
    return Manifest(tree=tree, tensors=tensors, chunks=chunks, requires=requires, version=version, chain=chain,
                    **header)


def check_chain_level(manifest: Manifest, n: int, data: bytes, what: str) -> Manifest:
    """``manifest`` with chain level ``n`` (stored in chunks) holding the records of ``data``, the bytes its pieces
    hold; ``what`` names the manifest in messages. The level's own records are checked; the inputs of the
    predictions that read them are not yet: :func:`check_chain_inputs` once the levels wanted are in place.
    Raises CorruptManifestError."""
    from .manifest import parse_json  # the manifest module imports this one

    f = _Fields(what)
    at = f"chain[{n}]"
    raws = [chunk.raw for chunk in manifest.chunks]
    body = parse_json(data, f"{what} {at}", CorruptManifestError)
    level = check_level(f, body, manifest.chain[n], at, lambda record, field: _check_record(f, record, field, raws))
    return replace(manifest, chain=(*manifest.chain[:n], level, *manifest.chain[n + 1:]))


def check_chain_inputs(manifest: Manifest, what: str) -> None:
    """Every prediction's inputs, in ``manifest``'s records and the chain levels it holds, resolve to a record of
    its dtype and shape (after :func:`check_chain_level` put levels in place: once for all of them, where a check
    after each would check the records of every level again for each). Raises CorruptManifestError."""
    check_inputs(_Fields(what), manifest.tensors, manifest.chain, manifest.requires)


def _check_format_and_version(f: _Fields, body: dict[str, Any]) -> int:
    """A manifest body's version, once its ``format`` names a manifest and the version is one this reader reads."""
    if body.get("format") != MANIFEST_FORMAT:
        f.fail("format", f"is {_short(body.get('format'))}, not {MANIFEST_FORMAT!r}")
    return _check_version(f, f.required(body, "version"), "manifest")


def _check_requires(f: _Fields, requires: Any) -> tuple[str, ...]:
    names = tuple(f.str(name, f"requires[{i}]") for i, name in enumerate(f.list(requires, "requires")))
    unknown = sorted(set(names) - KNOWN_FEATURES)
    if unknown:
        f.fail("requires", f"names features {unknown} this ckptvault does not know: upgrade ckptvault",
               FormatVersionError)
    return names


def _check_header(f: _Fields, body: dict[str, Any], step: int | None) -> dict[str, Any]:
    """The scalar fields (step, time, sizes, keyframe, user metrics and metadata), as Manifest keywords: every
    field version 1 writes is required (only ``requires`` is optional)."""
    found = f.int(f.required(body, "step"), "step", 0, MAX_STEP)
    if step is not None and found != step:
        f.fail("step", f"is {found}, but the file is the manifest of step {step}")
    if f.required(body, "hash") != HASH_NAME:
        f.fail("hash", f"is {_short(body['hash'])}; format version 1 names chunks by {HASH_NAME!r} only")
    out: dict[str, Any] = {"step": found, "time": f.number(f.required(body, "time"), "time"),
                           "writer": f.str(f.required(body, "writer"), "writer"),
                           "pickle": f.bool(f.required(body, "pickle"), "pickle"),
                           "keyframe_step": f.int(f.required(body, "keyframe_step"), "keyframe_step", 0, MAX_STEP),
                           "since_keyframe": f.int(f.required(body, "since_keyframe"), "since_keyframe")}
    for name in ("logical_bytes", "stored_bytes", "added_bytes"):
        out[name] = f.int(f.required(body, name), name)
    for name in ("metrics", "metadata"):
        out[name] = f.dict(f.required(body, name), name)
        _check_json_depth(f, out[name], name)
    if type(body["time"]) is int:  # keep the number as written, so encoding gives the same bytes
        out["time"] = body["time"]
    return out


def _check_json_depth(f: _Fields, value: Any, field: str) -> None:
    if too_deep(value):
        f.fail(field, f"is nested more than {MAX_DEPTH} levels deep")


def too_deep(value: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether dicts, lists and tuples in ``value`` nest more than ``limit`` levels (walked without recursion,
    so any depth is safe to ask about)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend((v, depth + 1) for v in item)
    return False


def _check_chunks(f: _Fields, chunks: list[Any], chunk_size: int) -> tuple[ChunkRef, ...]:
    out = []
    for i, entry in enumerate(chunks):
        at = f"chunks[{i}]"
        entry = f.dict(entry, at)
        cid = f.chunk_id(f.required(entry, "id", at), f"{at}.id")
        base = None
        if entry.get("base") is not None:
            base = f.chunk_id(entry["base"], f"{at}.base")
            if base == cid:
                f.fail(f"{at}.base", "names the chunk itself")
        out.append(ChunkRef(cid, f.int(f.required(entry, "raw", at), f"{at}.raw", 1, chunk_size),
                            f.int(f.required(entry, "stored", at), f"{at}.stored"),
                            f.bool(entry.get("new", False), f"{at}.new"), base))
    return tuple(out)


def _check_record(f: _Fields, record: Any, at: str, chunks: list[int]) -> TensorRecord:
    """One tensor record: its kind, dtype and shape, and pieces that hold exactly its stored bytes."""
    record = f.dict(record, at)
    kind = f.required(record, "kind", at)
    if kind not in ("torch", "numpy", "pickle", "part"):
        f.fail(f"{at}.kind", f"is {_short(kind)}; one of 'torch', 'numpy', 'pickle', 'part'")
    dtype = f.required(record, "dtype", at)
    itemsize = _itemsize(f, kind, dtype, f"{at}.dtype")
    shape = _shape(f, f.required(record, "shape", at), f"{at}.shape")
    nbytes = f.int(f.required(record, "nbytes", at), f"{at}.nbytes")
    pieces, held = _pieces(f, f.required(record, "pieces", at), f"{at}.pieces", chunks)
    if held != nbytes:
        f.fail(f"{at}.pieces", f"hold {held} bytes, but the record's nbytes is {nbytes}")
    lossy = _check_lossy(f, f.dict(record["lossy"], f"{at}.lossy"), f"{at}.lossy", shape, itemsize, nbytes, chunks
                         ) if record.get("lossy") is not None else None
    if (lossy is None or not lossy.is_lossy) and math.prod(shape) * itemsize != nbytes:
        f.fail(f"{at}.shape", f"{list(shape)} of {dtype} is {math.prod(shape) * itemsize} bytes, "
                              f"but the pieces hold {nbytes}")
    optional = {name: _shape(f, record[name], f"{at}.{name}") for name in ("global_shape", "offsets") if name in record}
    return TensorRecord(
        path=f.str(f.required(record, "path", at), f"{at}.path"), kind=kind, dtype=dtype, shape=shape, nbytes=nbytes,
        codec=f.str(f.required(record, "codec", at), f"{at}.codec"), pieces=pieces,
        requires_grad=f.bool(record.get("requires_grad", False), f"{at}.requires_grad"),
        device=f.str(record["device"], f"{at}.device") if "device" in record else None, lossy=lossy,
        predict=check_predict(f, record["predict"], f"{at}.predict", dtype) if "predict" in record else None,
        **optional)


def _itemsize(f: _Fields, kind: str, dtype: Any, field: str) -> int:
    """Bytes per element of ``dtype`` for a record of ``kind``; refuses dtypes no save writes (object arrays)."""
    dtype = f.str(dtype, field)
    if kind == "numpy":
        try:
            parsed = np.dtype(dtype)
        except (TypeError, ValueError, SyntaxError):
            f.fail(field, f"{_short(dtype)} is not a numpy dtype")
        if parsed.kind not in _NUMPY_KINDS or parsed.str != dtype or parsed.itemsize < 1:
            f.fail(field, f"{_short(dtype)} is not a numeric numpy dtype in its canonical form ('<f4')")
        return parsed.itemsize
    if kind == "pickle":
        if dtype not in ("|u1", "uint8"):
            f.fail(field, f"is {_short(dtype)}; pickled bytes are stored as uint8")
        return 1
    itemsize = _TORCH_ITEMSIZES.get(dtype)
    if itemsize is None:
        f.fail(field, f"{_short(dtype)} is not a torch dtype this torch {torch.__version__} can hold",
               FormatVersionError)
    return itemsize


#: torch dtypes by name with their element sizes; quantized dtypes are never stored natively (_tree.py pickles them)
_TORCH_ITEMSIZES: dict[str, int] = {
    str(d).removeprefix("torch."): d.itemsize for d in vars(torch).values()
    if isinstance(d, torch.dtype) and not str(d).startswith(("torch.qint", "torch.quint"))
}


def _shape(f: _Fields, shape: Any, field: str) -> tuple[int, ...]:
    dims = f.list(shape, field)
    if len(dims) > MAX_DIMS:
        f.fail(field, f"has {len(dims)} dimensions, more than {MAX_DIMS}")
    for i, dim in enumerate(dims):
        if type(dim) is not int or not 0 <= dim < 1 << 62:
            f.fail(field, f"dimension {i} is {_short(dim)}: dimensions are integers from 0 to 2**62")
    return tuple(dims)


def _pieces(f: _Fields, pieces: Any, field: str, chunks: list[int]) -> tuple[tuple[Piece, ...], int]:
    """Check ``[chunk index, offset, length]`` pieces against the chunk table; returns them and the bytes they
    hold."""
    out, total = [], 0
    for i, piece in enumerate(f.list(pieces, field)):
        at = f"{field}[{i}]"
        if not isinstance(piece, list) or len(piece) != 3 or any(type(v) is not int for v in piece):
            f.fail(at, f"must be [chunk index, offset, length] integers, not {_short(piece)}")
        chunk, offset, length = piece
        if not 0 <= chunk < len(chunks):
            f.fail(at, f"names chunk {chunk}, but the chunk table has {len(chunks)} entries")
        if offset < 0 or length < 1 or offset + length > chunks[chunk]:
            f.fail(at, f"bytes {offset}..{offset + length} lie outside chunk {chunk} of {chunks[chunk]} bytes")
        out.append(Piece(chunk, offset, length))
        total += length
    return tuple(out), total


def _check_lossy(f: _Fields, lossy: dict[str, Any], at: str, shape: tuple[int, ...], itemsize: int, nbytes: int,
                 chunks: list[int]) -> LossyInfo:
    """A lossy record's stored form: the primary part's dtype and shape match its bytes, a residual's keyframe
    copy holds the original tensor's bytes (the parts are checked once every record is: :func:`_check_parts`)."""
    codec = f.required(lossy, "codec", at)
    if codec not in _LOSSY_CODECS:
        f.fail(f"{at}.codec", f"is {_short(codec)}; one of {', '.join(_LOSSY_CODECS)}")  # a new one comes with `requires`
    notes = tuple(f.str(note, f"{at}.notes[{i}]") for i, note in enumerate(f.list(lossy.get("notes", []), f"{at}.notes")))
    if codec == "lossless":
        requested = f.str(lossy["requested"], f"{at}.requested") if "requested" in lossy else None
        return LossyInfo(codec, notes=notes, requested=requested)
    stored_dtype = f.required(lossy, "stored_dtype", at)
    stored_size = _itemsize(f, "torch", stored_dtype, f"{at}.stored_dtype")
    stored_shape = _shape(f, f.required(lossy, "stored_shape", at), f"{at}.stored_shape")
    if math.prod(stored_shape) * stored_size != nbytes:
        f.fail(f"{at}.stored_shape", f"{list(stored_shape)} of {stored_dtype} is not the {nbytes} bytes stored")
    numel = math.prod(shape)
    original = f.int(f.required(lossy, "original_nbytes", at), f"{at}.original_nbytes")
    if original != numel * itemsize:
        f.fail(f"{at}.original_nbytes", f"is {original}, but the shape {list(shape)} holds {numel * itemsize}")
    if math.prod(stored_shape) != numel:
        f.fail(f"{at}.stored_shape", f"holds {math.prod(stored_shape)} values, the tensor {numel}")
    parts = f.dict(lossy.get("parts", {}), f"{at}.parts")
    block = f.int(f.required(lossy, "block", at), f"{at}.block", 1, 1 << 30) if codec in _BLOCK_CODECS else None
    if codec not in _BLOCK_CODECS and parts:
        f.fail(f"{at}.parts", f"a {codec} record has no parts, this one names {sorted(parts)}")
    base_step = base_pieces = None
    if codec == "residual-int8":
        base_step = f.int(f.required(lossy, "base_step", at), f"{at}.base_step", 0, MAX_STEP)
        base_pieces, held = _pieces(f, f.required(lossy, "base_pieces", at), f"{at}.base_pieces", chunks)
        if held != numel * itemsize:
            f.fail(f"{at}.base_pieces", f"hold {held} bytes, the keyframe copy needs {numel * itemsize}")
    return LossyInfo(codec, block, stored_dtype, stored_shape, original, _check_error(f, lossy, at), notes,
                     {name: f.int(index, f"{at}.parts.{name}") for name, index in parts.items()}, base_step, base_pieces)


def _check_error(f: _Fields, lossy: dict[str, Any], at: str) -> dict[str, Any]:
    error = f.dict(lossy.get("error", {}), f"{at}.error")
    for name, value in error.items():
        if value not in ("inf", "-inf", "nan") and (isinstance(value, (bool, str)) or not isinstance(value, (int, float))):
            f.fail(f"{at}.error.{name}", f"must be a number (or 'inf', '-inf', 'nan'), not {_short(value)}")
    return error


def _check_parts(f: _Fields, record: TensorRecord, at: str, tensors: tuple[TensorRecord, ...]) -> None:
    """A block codec's scale part: a float32 part record holding one value per block."""
    assert record.lossy is not None
    if record.lossy.block is None:
        return
    index = f.int(f.required(record.lossy.parts, "scale", at), f"{at}.scale", 0, len(tensors) - 1)
    part = tensors[index]
    if part.kind != "part" or part.dtype != "float32":
        f.fail(f"{at}.scale", f"names tensors[{index}], which is not a float32 part record")
    blocks = -(-record.numel // record.lossy.block)
    if part.numel != blocks:
        f.fail(f"{at}.scale", f"names tensors[{index}] of shape {list(part.shape)}; {blocks} scales are needed")


# -- the tree -----------------------------------------------------------------

def _check_tree(f: _Fields, tree: Any, tensors: tuple[TensorRecord, ...]) -> set[int]:
    """Every node of the state's skeleton (docs/DESIGN.md section 4), at most MAX_DEPTH containers deep, walked
    without recursion; leaf indices name records of the matching kind. Returns the records shards nodes name."""
    sharded: set[int] = set()
    stack: list[tuple[Any, str, int]] = [(tree, "tree", 0)]
    while stack:
        node, at, depth = stack.pop()
        if depth > MAX_DEPTH:
            f.fail("tree", f"is nested more than {MAX_DEPTH} containers deep")
        tag, body = _node(f, node, at)
        if tag in ("dict", "odict"):
            for i, item in enumerate(f.list(body, f"{at}.{tag}")):
                if not isinstance(item, list) or len(item) != 2:
                    f.fail(f"{at}.{tag}[{i}]", "must be a [key node, value node] pair")
                key_tag, key_body = _node(f, item[0], f"{at}.{tag}[{i}][0]")
                if key_tag not in _SCALAR_TAGS or key_tag == "bytes":
                    f.fail(f"{at}.{tag}[{i}][0]", f"a dict key must be a str, int, float, bool or None node, not {key_tag!r}")
                _check_scalar(f, key_tag, key_body, f"{at}.{tag}[{i}][0]")
                stack.append((item[1], f"{at}.{tag}[{i}][1]", depth + 1))
            if "attrs" in node:
                stack.append((f.dict(node["attrs"], f"{at}.attrs").get("_metadata", {"none": None}),
                              f"{at}.attrs._metadata", depth + 1))
        elif tag in ("list", "tuple"):
            stack.extend((child, f"{at}.{tag}[{i}]", depth + 1) for i, child in enumerate(f.list(body, f"{at}.{tag}")))
        elif tag == "shards":
            check_shards_node(f, body, f"{at}.shards", tensors, sharded)
        elif tag in _LEAF_KINDS:
            _check_leaf(f, tag, body, at, tensors)
        else:
            _check_scalar(f, tag, body, at)
    return sharded


def _node(f: _Fields, node: Any, at: str) -> tuple[str, Any]:
    """(tag, body) of a skeleton node: one known tag, plus ``attrs`` on a dict."""
    node = f.dict(node, at)
    tags = [key for key in node if key != "attrs"]
    if len(tags) != 1 or ("attrs" in node and tags[0] not in ("dict", "odict")):
        f.fail(at, f"must be a node with one tag, not {_short(sorted(node))}")
    tag = tags[0]
    if tag not in _LEAF_KINDS and tag not in _SCALAR_TAGS and tag not in ("dict", "odict", "list", "tuple", "shards"):
        f.fail(at, f"has unknown node tag {_short(tag)}")  # version 1's tags are all known; new ones need `requires`
    return tag, node[tag]


def _check_leaf(f: _Fields, tag: str, index: Any, at: str, tensors: tuple[TensorRecord, ...]) -> None:
    f.int(index, f"{at}.{tag}", 0, len(tensors) - 1)
    record = tensors[index]
    if record.kind != _LEAF_KINDS[tag]:
        f.fail(f"{at}.{tag}", f"names tensors[{index}] of kind {record.kind!r}; a {tag} node needs {_LEAF_KINDS[tag]!r}")
    if tag == "npscalar" and record.shape != ():
        f.fail(f"{at}.{tag}", f"names tensors[{index}] of shape {list(record.shape)}; a numpy scalar has shape []")


def _check_scalar(f: _Fields, tag: str, body: Any, at: str) -> None:
    field = f"{at}.{tag}"
    if tag == "none":
        if body is not None:
            f.fail(field, "must be null")
    elif tag == "bool":
        f.bool(body, field)
    elif tag == "int":
        if type(body) is not int:
            f.fail(field, f"must be an integer, not {_kind(body)}")
    elif tag == "float":
        try:
            float.fromhex(f.str(body, field))
        except (ValueError, OverflowError):
            f.fail(field, f"{_short(body)} is not a hexadecimal float")
    elif tag == "str":
        f.str(body, field)
    else:
        try:
            base64.b64decode(f.str(body, field), validate=True)
        except (binascii.Error, ValueError):
            f.fail(field, "is not base64")


def _kind(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def _short(value: Any, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters (hostile values may be long; huge ints are not converted)."""
    if type(value) is int and value.bit_length() > 200:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
