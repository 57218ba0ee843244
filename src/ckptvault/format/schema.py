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
import math
import re
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np
import torch

from ..errors import CorruptManifestError, FormatVersionError
from . import FORMAT_VERSION

MANIFEST_FORMAT = "ckptvault.manifest"
VAULT_FORMAT = "ckptvault.vault"
#: optional features a manifest may declare in "requires"; a reader refuses any it does not know
KNOWN_FEATURES = frozenset({"lossy", "xplanes"})
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

_HEX_ID = re.compile(r"[0-9a-f]{64}", re.ASCII)
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

    def bool(self, value: Any, field: str) -> bool:
        if not isinstance(value, bool):
            self.fail(field, f"must be true or false, not {_kind(value)}")
        return value

    def number(self, value: Any, field: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            self.fail(field, f"must be a finite number, not {_short(value)}")
        return float(value)

    def chunk_id(self, value: Any, field: str) -> str:
        if not isinstance(value, str) or not _HEX_ID.fullmatch(value):
            self.fail(field, f"must be a chunk id (64 lowercase hex digits), not {_short(value)}")
        return value

    def required(self, body: dict[str, Any], name: str, field: str = "") -> Any:
        if name not in body:
            self.fail(field + name if not field else f"{field}.{name}", "is missing")
        return body[name]


# -- vault.json ---------------------------------------------------------------

def check_descriptor(desc: Any, what: str) -> dict[str, Any]:
    """``desc`` (the parsed ``vault.json``) if it describes a vault this reader can use; ``what`` names the file
    in messages. Raises CorruptManifestError, or FormatVersionError for a newer format."""
    f = _Fields(what)
    desc = f.dict(desc, "")
    if desc.get("format") != VAULT_FORMAT:
        f.fail("format", f"is {_short(desc.get('format'))}, not {VAULT_FORMAT!r}: this is not a ckptvault vault")
    _check_version(f, f.required(desc, "version"), "vault")
    size = f.int(f.required(desc, "chunk_size"), "chunk_size", MIN_CHUNK_SIZE, MAX_CHUNK_SIZE)
    if size % 64:
        f.fail("chunk_size", f"is {size}, not a multiple of 64")
    if f.required(desc, "hash") != HASH_NAME:
        f.fail("hash", f"is {_short(desc['hash'])}; format version 1 names chunks by {HASH_NAME!r} only")
    codec = f.str(f.required(desc, "codec"), "codec")
    from ..codecs import validate_codec_name  # codecs import nothing of format's schema

    try:
        validate_codec_name(codec)
    except ValueError as exc:
        f.fail("codec", f"{codec!r} is not a codec ({exc})")
    if "created" in desc:
        f.number(desc["created"], "created")
    return desc


def _check_version(f: _Fields, version: Any, what: str) -> None:
    f.int(version, "version")
    if version > FORMAT_VERSION:
        f.fail("version", f"is {version}: this {what} uses a newer format than this ckptvault reads "
                          f"(up to {FORMAT_VERSION}); upgrade ckptvault", FormatVersionError)


# -- manifests ----------------------------------------------------------------

def check_manifest(body: Any, what: str, step: int | None = None, chunk_size: int = MAX_CHUNK_SIZE) -> dict[str, Any]:
    """``body`` (a parsed manifest body) if it is a well-formed manifest of ``step`` (None: any) in a vault of
    ``chunk_size``; ``what`` names the file in messages. Raises CorruptManifestError, or FormatVersionError
    for a newer version or an unknown required feature."""
    f = _Fields(what)
    body = f.dict(body, "")
    if body.get("format") != MANIFEST_FORMAT:
        f.fail("format", f"is {_short(body.get('format'))}, not {MANIFEST_FORMAT!r}")
    _check_version(f, f.required(body, "version"), "manifest")
    _check_requires(f, body.get("requires", []))
    _check_header(f, body, step)
    chunks = _check_chunks(f, f.list(f.required(body, "chunks"), "chunks"), chunk_size)
    tensors = f.list(f.required(body, "tensors"), "tensors")
    for i, record in enumerate(tensors):
        _check_record(f, record, f"tensors[{i}]", tensors, chunks)
    _check_tree(f, f.required(body, "tree"), tensors)
    return body


def _check_requires(f: _Fields, requires: Any) -> None:
    names = [f.str(name, f"requires[{i}]") for i, name in enumerate(f.list(requires, "requires"))]
    unknown = sorted(set(names) - KNOWN_FEATURES)
    if unknown:
        f.fail("requires", f"names features {unknown} this ckptvault does not know: upgrade ckptvault",
               FormatVersionError)


def _check_header(f: _Fields, body: dict[str, Any], step: int | None) -> None:
    """The scalar fields: step, time, sizes, keyframe, user metrics and metadata."""
    found = f.int(f.required(body, "step"), "step", 0, MAX_STEP)
    if step is not None and found != step:
        f.fail("step", f"is {found}, but the file is the manifest of step {step}")
    f.number(f.required(body, "time"), "time")
    if "writer" in body:
        f.str(body["writer"], "writer")
    if body.get("hash", HASH_NAME) != HASH_NAME:
        f.fail("hash", f"is {_short(body['hash'])}; format version 1 names chunks by {HASH_NAME!r} only")
    f.bool(body.get("pickle", False), "pickle")
    for name in ("logical_bytes", "stored_bytes", "added_bytes"):
        f.int(f.required(body, name), name)
    f.int(body.get("keyframe_step", found), "keyframe_step", 0, MAX_STEP)
    f.int(body.get("since_keyframe", 0), "since_keyframe")
    for name in ("metrics", "metadata"):
        _check_json_depth(f, f.dict(body.get(name, {}), name), name)


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


def _check_chunks(f: _Fields, chunks: list[Any], chunk_size: int) -> list[int]:
    """Check the chunk table; returns each chunk's raw length, for the pieces that point into it."""
    raws = []
    for i, entry in enumerate(chunks):
        at = f"chunks[{i}]"
        entry = f.dict(entry, at)
        f.chunk_id(f.required(entry, "id", at), f"{at}.id")
        raws.append(f.int(f.required(entry, "raw", at), f"{at}.raw", 1, chunk_size))
        f.int(f.required(entry, "stored", at), f"{at}.stored")
        f.bool(entry.get("new", False), f"{at}.new")
        if entry.get("base") is not None:
            base = f.chunk_id(entry["base"], f"{at}.base")
            if base == entry["id"]:
                f.fail(f"{at}.base", "names the chunk itself")
    return raws


def _check_record(f: _Fields, record: Any, at: str, tensors: list[Any], chunks: list[int]) -> None:
    """One tensor record: its kind, dtype and shape, and pieces that hold exactly its stored bytes."""
    record = f.dict(record, at)
    f.str(f.required(record, "path", at), f"{at}.path")
    kind = f.required(record, "kind", at)
    if kind not in ("torch", "numpy", "pickle", "part"):
        f.fail(f"{at}.kind", f"is {_short(kind)}; one of 'torch', 'numpy', 'pickle', 'part'")
    itemsize = _itemsize(f, kind, f.required(record, "dtype", at), f"{at}.dtype")
    shape = _shape(f, f.required(record, "shape", at), f"{at}.shape")
    for name in ("global_shape", "offsets"):
        if name in record:
            _shape(f, record[name], f"{at}.{name}")
    f.str(f.required(record, "codec", at), f"{at}.codec")
    for name, check in (("requires_grad", f.bool), ("device", f.str)):
        if name in record:
            check(record[name], f"{at}.{name}")
    nbytes = f.int(f.required(record, "nbytes", at), f"{at}.nbytes")
    held = _pieces(f, f.required(record, "pieces", at), f"{at}.pieces", chunks)
    if held != nbytes:
        f.fail(f"{at}.pieces", f"hold {held} bytes, but the record's nbytes is {nbytes}")
    lossy = record.get("lossy")
    if lossy is not None and lossy.get("codec") != "lossless":
        _check_lossy(f, f.dict(lossy, f"{at}.lossy"), f"{at}.lossy", shape, itemsize, nbytes, tensors, chunks)
    elif math.prod(shape) * itemsize != nbytes:
        f.fail(f"{at}.shape", f"{shape} of {record['dtype']} is {math.prod(shape) * itemsize} bytes, "
                              f"but the pieces hold {nbytes}")
    elif lossy is not None:
        _check_lossless_fallback(f, f.dict(lossy, f"{at}.lossy"), f"{at}.lossy")


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
    itemsize = _torch_itemsizes().get(dtype)
    if itemsize is None:
        f.fail(field, f"{_short(dtype)} is not a torch dtype this torch {torch.__version__} can hold",
               FormatVersionError)
    return itemsize


#: torch dtypes by name with their element sizes; quantized dtypes are never stored natively (tree.py pickles them)
_TORCH_ITEMSIZES: dict[str, int] = {
    str(d).removeprefix("torch."): d.itemsize for d in vars(torch).values()
    if isinstance(d, torch.dtype) and not str(d).startswith(("torch.qint", "torch.quint"))
}


def _torch_itemsizes() -> dict[str, int]:
    return _TORCH_ITEMSIZES


def _shape(f: _Fields, shape: Any, field: str) -> list[int]:
    dims = f.list(shape, field)
    if len(dims) > MAX_DIMS:
        f.fail(field, f"has {len(dims)} dimensions, more than {MAX_DIMS}")
    for i, dim in enumerate(dims):
        if type(dim) is not int or not 0 <= dim < 1 << 62:
            f.fail(field, f"dimension {i} is {_short(dim)}: dimensions are integers from 0 to 2**62")
    return dims


def _pieces(f: _Fields, pieces: Any, field: str, chunks: list[int]) -> int:
    """Check ``[chunk index, offset, length]`` pieces against the chunk table; returns the bytes they hold."""
    total = 0
    for i, piece in enumerate(f.list(pieces, field)):
        at = f"{field}[{i}]"
        if not isinstance(piece, list) or len(piece) != 3 or any(type(v) is not int for v in piece):
            f.fail(at, f"must be [chunk index, offset, length] integers, not {_short(piece)}")
        chunk, offset, length = piece
        if not 0 <= chunk < len(chunks):
            f.fail(at, f"names chunk {chunk}, but the chunk table has {len(chunks)} entries")
        if offset < 0 or length < 1 or offset + length > chunks[chunk]:
            f.fail(at, f"bytes {offset}..{offset + length} lie outside chunk {chunk} of {chunks[chunk]} bytes")
        total += length
    return total


def _check_lossy(f: _Fields, lossy: dict[str, Any], at: str, shape: list[int], itemsize: int, nbytes: int,
                 tensors: list[Any], chunks: list[int]) -> None:
    """A lossy record's stored form: the primary part's dtype and shape match its bytes, its scale part holds
    one float32 per block, a residual's keyframe copy holds the original tensor's bytes."""
    codec = f.required(lossy, "codec", at)
    if codec not in _LOSSY_CODECS:
        f.fail(f"{at}.codec", f"is {_short(codec)}; one of {', '.join(_LOSSY_CODECS)}", FormatVersionError)
    stored_size = _itemsize(f, "torch", f.required(lossy, "stored_dtype", at), f"{at}.stored_dtype")
    stored_shape = _shape(f, f.required(lossy, "stored_shape", at), f"{at}.stored_shape")
    if math.prod(stored_shape) * stored_size != nbytes:
        f.fail(f"{at}.stored_shape", f"{stored_shape} of {lossy['stored_dtype']} is not the {nbytes} bytes stored")
    numel = math.prod(shape)
    if f.int(f.required(lossy, "original_nbytes", at), f"{at}.original_nbytes") != numel * itemsize:
        f.fail(f"{at}.original_nbytes", f"is {lossy['original_nbytes']}, but the shape {shape} holds {numel * itemsize}")
    if math.prod(stored_shape) != numel:
        f.fail(f"{at}.stored_shape", f"holds {math.prod(stored_shape)} values, the tensor {numel}")
    parts = f.dict(lossy.get("parts", {}), f"{at}.parts")
    if codec in _BLOCK_CODECS:
        block = f.int(f.required(lossy, "block", at), f"{at}.block", 1, 1 << 30)
        _check_scale_part(f, parts, f"{at}.parts", tensors, -(-numel // block))
    elif parts:
        f.fail(f"{at}.parts", f"a {codec} record has no parts, this one names {sorted(parts)}")
    if codec == "residual-int8":
        f.int(f.required(lossy, "base_step", at), f"{at}.base_step", 0, MAX_STEP)
        held = _pieces(f, f.required(lossy, "base_pieces", at), f"{at}.base_pieces", chunks)
        if held != numel * itemsize:
            f.fail(f"{at}.base_pieces", f"hold {held} bytes, the keyframe copy needs {numel * itemsize}")
    for i, note in enumerate(f.list(lossy.get("notes", []), f"{at}.notes")):
        f.str(note, f"{at}.notes[{i}]")
    for name, value in f.dict(lossy.get("error", {}), f"{at}.error").items():
        if value not in ("inf", "-inf", "nan") and (isinstance(value, (bool, str)) or not isinstance(value, (int, float))):
            f.fail(f"{at}.error.{name}", f"must be a number (or 'inf', '-inf', 'nan'), not {_short(value)}")


def _check_scale_part(f: _Fields, parts: dict[str, Any], at: str, tensors: list[Any], blocks: int) -> None:
    index = f.int(f.required(parts, "scale", at), f"{at}.scale", 0, len(tensors) - 1)
    part = tensors[index]
    if not isinstance(part, dict) or part.get("kind") != "part" or part.get("dtype") != "float32":
        f.fail(f"{at}.scale", f"names tensors[{index}], which is not a float32 part record")
    if math.prod(part.get("shape") or [0]) != blocks:
        f.fail(f"{at}.scale", f"names tensors[{index}] of shape {_short(part.get('shape'))}; {blocks} scales are needed")


def _check_lossless_fallback(f: _Fields, lossy: dict[str, Any], at: str) -> None:
    if "requested" in lossy:
        f.str(lossy["requested"], f"{at}.requested")
    for i, note in enumerate(f.list(lossy.get("notes", []), f"{at}.notes")):
        f.str(note, f"{at}.notes[{i}]")


# -- the tree -----------------------------------------------------------------

def _check_tree(f: _Fields, tree: Any, tensors: list[Any]) -> None:
    """Every node of the state's skeleton (docs/DESIGN.md section 4), at most MAX_DEPTH containers deep, walked
    without recursion; leaf indices name records of the matching kind."""
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
        elif tag in _LEAF_KINDS:
            _check_leaf(f, tag, body, at, tensors)
        else:
            _check_scalar(f, tag, body, at)


def _node(f: _Fields, node: Any, at: str) -> tuple[str, Any]:
    """(tag, body) of a skeleton node: one known tag, plus ``attrs`` on a dict."""
    node = f.dict(node, at)
    tags = [key for key in node if key != "attrs"]
    if len(tags) != 1 or ("attrs" in node and tags[0] not in ("dict", "odict")):
        f.fail(at, f"must be a node with one tag, not {_short(sorted(node))}")
    tag = tags[0]
    if tag not in _LEAF_KINDS and tag not in _SCALAR_TAGS and tag not in ("dict", "odict", "list", "tuple"):
        f.fail(at, f"has unknown node tag {_short(tag)}", FormatVersionError)
    return tag, node[tag]


def _check_leaf(f: _Fields, tag: str, index: Any, at: str, tensors: list[Any]) -> None:
    f.int(index, f"{at}.{tag}", 0, len(tensors) - 1)
    record = tensors[index]
    if record["kind"] != _LEAF_KINDS[tag]:
        f.fail(f"{at}.{tag}", f"names tensors[{index}] of kind {record['kind']!r}; a {tag} node needs {_LEAF_KINDS[tag]!r}")
    if tag == "npscalar" and record["shape"] != []:
        f.fail(f"{at}.{tag}", f"names tensors[{index}] of shape {record['shape']}; a numpy scalar has shape []")


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
