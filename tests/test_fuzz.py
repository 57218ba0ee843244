"""Property-based fuzzing of every reader of stored bytes, and of whole operations on mutated vaults.

What is fuzzed (seeds: the pristine corpus vault ``tests/hostile/base``, see tests/hostile/make_corpus.py):

(a) chunk objects: ``_format.chunk_object.parse_object`` + ``decode_payload`` on arbitrary bytes, on byte
    mutations of real chunk objects (flip, insert, delete, overwrite; coded with byte planes + zstd, lz4,
    shuffle, plain zstd, raw, and a whole-chunk XOR delta), and on edits of their JSON headers (any value
    replaced by another JSON value, keys deleted or added; the prefix keeps the right header length);
(b) manifests: ``_format.manifest.decode_manifest`` on arbitrary bytes, on arbitrary bodies wrapped with a
    valid checksum, and on structured mutations of the real manifest body (any JSON value at any path
    replaced by another: ints huge and negative, floats non-finite, strings with NUL or Unicode digits,
    lists, dicts, deep nesting, other values of the same manifest; keys and list items deleted or added),
    re-wrapped the way ``encode_manifest`` wraps a body;
(c) ``vault.json``: ``Vault(url).descriptor()`` and ``require()`` on arbitrary bytes and structured mutations;
(d) whole operations on a vault with one mutated object (manifest, chunk or vault.json): restore, verify,
    ls (steps + info), gc plan, in a worker process (tests/hostile/worker.py).

Properties:

* only ckptvault errors come out: the parsers raise exactly CorruptChunkError / CorruptManifestError /
  FormatVersionError, whole operations only VaultError subclasses; never KeyError, TypeError, IndexError,
  ValueError, RecursionError, MemoryError, OverflowError...;
* a FormatVersionError only where something newer is named: a version above 1, an unknown feature in
  ``requires``, an unknown codec stage, a dtype name this torch/numpy lacks;
* a chunk object that still decodes after a mutation decodes to its original bytes; a verify that passes
  after a chunk mutation means restore gives the original state;
* a restore that succeeds returns arrays holding exactly the bytes their records' pieces name in the chunks
  (so never memory that no chunk supplied: a mutated shape or piece list must be refused unless the manifest
  still describes real bytes), and a manifest or descriptor that a reader accepts satisfies the invariants
  of docs/DESIGN.md (types, ranges, ids, pieces inside their chunks, shape x itemsize = bytes);
* memory stays bounded: tracemalloc's peak for the in-process parsers, under an address-space cap; in the
  worker, its own cap and the growth of its peak RSS.

Runs under the suite's hypothesis profile (tests/conftest.py: 50 examples per test, well under a minute in all);
``HYPOTHESIS_PROFILE=thorough`` runs 1000 per test and the atheris harnesses for longer. The atheris harnesses
(tests/fuzz/) run for a bounded number of inputs at the end, skipped when atheris is not installed.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import copy
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import assume, given, note
from hypothesis import strategies as st

from ckptvault._codecs import BytePlanes, Shuffle
from ckptvault._codecs.lz4 import Lz4
from ckptvault._codecs.zstd import Zstd
from ckptvault._format.chunk_object import (
    ChunkHeader,
    chunk_id,
    decode_payload,
    decode_payload_into_parts,
    encode_object,
    parse_object,
)
from ckptvault._format.manifest import _pack as pack
from ckptvault._format.manifest import decode_manifest
from ckptvault._vault import Vault
from ckptvault.errors import CorruptChunkError, CorruptManifestError, FormatVersionError
from ckptvault.stores import open_store
from conftest import drop_memory_store, fresh_memory_url
from helpers.statedigest import state_digest
from hostile.make_corpus import (
    BASE_DIR,
    CHUNK_SIZE,
    DESCRIPTOR_KEY,
    MANIFEST_KEY,
    STEP,
    base_state,
    chunk_key,
    join_chunk,
    manifest_body_bytes,
    split_chunk,
    wrap_manifest,
)
from hostile.worker import Worker

FUZZ_DIR = Path(__file__).parent / "fuzz"
THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"

BASE_MANIFEST: dict[str, Any] = json.loads(manifest_body_bytes((BASE_DIR / MANIFEST_KEY).read_bytes()))
BASE_DESCRIPTOR: dict[str, Any] = json.loads((BASE_DIR / DESCRIPTOR_KEY).read_bytes())
CHUNK_IDS = [c["id"] for c in BASE_MANIFEST["chunks"]]
KNOWN_STAGES = {"planes", "xplanes", "zstd", "lz4", "shuffle"}
KNOWN_FEATURES = {"lossy", "xplanes", "sharded"}
#: most a chunk object of at most 64 KiB may make a decoder allocate (Python level)
CHUNK_PEAK = 32 << 20
#: most a manifest or vault.json of at most a few hundred KB may make a reader allocate (Python level)
MANIFEST_PEAK = 64 << 20
#: address space an in-process parser may add (beyond it an allocation fails instead of exhausting the machine)
ADDRESS_HEADROOM = 2 << 30
#: most one worker battery may raise the worker's peak RSS
MAX_GROWTH_MIB = 64


# -- memory bounds for in-process parsers -----------------------------------------------------------------------

def _vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def run_bounded(fn: Callable[[], Any]) -> tuple[Any, BaseException | None, int]:
    """``fn()`` with tracemalloc on and the address space capped; returns (result, exception, peak bytes)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = _vm_size() + ADDRESS_HEADROOM
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    tracemalloc.start()
    result, error = None, None
    try:
        result = fn()
    except BaseException as exc:  # noqa: BLE001 - the property tests judge what escaped
        error = exc
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    return result, error, peak


def escaped(error: BaseException, allowed: tuple[type[BaseException], ...]) -> str:
    """A failure message for an exception of a class the property does not allow."""
    where = ""
    tb = error.__traceback__
    while tb is not None:
        where = f" at {tb.tb_frame.f_code.co_filename.rsplit('/', 2)[-1]}:{tb.tb_lineno}"
        tb = tb.tb_next
    names = ", ".join(c.__name__ for c in allowed)
    return f"{type(error).__name__}{where}: {str(error)[:300]} (only {names} may escape)"


# -- JSON values and mutations ----------------------------------------------------------------------------------

class Deep:
    """A JSON list nested ``depth`` deep, written as text (json.dumps would itself recurse too deeply)."""

    def __init__(self, depth: int) -> None:
        self.depth = depth

    def __repr__(self) -> str:
        return f"Deep({self.depth})"


def dumps(value: Any, sort_keys: bool = False) -> str:
    """JSON text of ``value``: non-finite floats as 1e999 / -1e999 / NaN, :class:`Deep` as nested brackets."""
    if isinstance(value, Deep):
        return "[" * value.depth + "]" * value.depth
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else "1e999" if value > 0 else "-1e999"
    if isinstance(value, dict):
        items = sorted(value.items()) if sort_keys else value.items()
        return "{" + ",".join(json.dumps(str(k)) + ":" + dumps(v, sort_keys) for k, v in items) + "}"
    if isinstance(value, list):
        return "[" + ",".join(dumps(v, sort_keys) for v in value) + "]"
    return json.dumps(value, ensure_ascii=False)


INTERESTING_INTS = [0, 1, -1, 2, 3, 4, 16, 63, 64, 65, 99, 255, 256, 512, 600, 999, 4096, 16384, 65535, 65536, 65537,
                    2**28, 2**30, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30,
                    10**400]
INTERESTING_STRINGS = ["", "\x00", "a\x00b", "1", "١٢٣", "²³", "0x10", "abc", "../bait", "/etc/passwd", "zz" * 32,
                       CHUNK_IDS[0], CHUNK_IDS[0].upper(), CHUNK_IDS[1] + "\x00", "float32", "bfloat16", "bool", "<f4",
                       ">i4", "|u1", "float128", "evil", "torch", "numpy", "pickle", "part", "tensor", "ndarray",
                       "npscalar", "dict", "odict", "list", "tuple", "int", "float", "str", "bytes", "none", "lossy",
                       "xplanes", "planes", "zstd", "lz4", "shuffle", "blake3", "sha256", "ckptvault.manifest",
                       "ckptvault.vault", "0x1.0p-1", "nan", "inf", "x" * 5000]

json_scalars = st.one_of(
    st.none(), st.booleans(), st.sampled_from(INTERESTING_INTS), st.integers(),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(INTERESTING_STRINGS), st.text(max_size=12),
)
json_values = st.one_of(
    json_scalars,
    st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.text(max_size=6) | st.sampled_from(["id", "raw", "base", "codec", "typesize", "inner", "level", "tensor",
                                                "list", "dict", "shape", "pieces"]), inner, max_size=4), max_leaves=8),
    st.sampled_from([Deep(101), Deep(999), Deep(1000), Deep(5000), Deep(30000)]),
)

Path_ = tuple[Any, ...]


def value_paths(value: Any, prefix: Path_ = ()) -> list[Path_]:
    """The path of every JSON value inside ``value`` (dict keys and list indices), the root included."""
    out = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            out += value_paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            out += value_paths(item, (*prefix, index))
    return out


def at(doc: Any, path: Path_) -> Any:
    for step in path:
        doc = doc[step]
    return doc


@st.composite
def mutated(draw: st.DrawFn, original: Any, max_edits: int = 3) -> Any:
    """``original`` with 1..max_edits edits: replace a value (by a new JSON value, another value of the document,
    or an int nudged by +-1, x2, negation), delete a dict key or list item, or add one."""
    doc = copy.deepcopy(original)
    for _ in range(draw(st.integers(1, max_edits))):
        paths = value_paths(doc)
        path = draw(st.sampled_from(paths))
        current = at(doc, path)
        op = draw(st.sampled_from(["replace", "replace", "replace", "swap", "nudge", "delete", "add"]))
        if op == "nudge" and type(current) is int:
            new: Any = draw(st.sampled_from([current + 1, current - 1, current * 2, -current, current + 2**32]))
        elif op == "swap":
            new = copy.deepcopy(at(doc, draw(st.sampled_from(paths))))
        elif op == "delete" and path:
            parent = at(doc, path[:-1])
            del parent[path[-1]]
            note(f"delete {path}")
            continue
        elif op == "add" and isinstance(current, (dict, list)):
            item = draw(json_values)
            if isinstance(current, dict):
                key = draw(st.sampled_from(["requires", "lossy", "base", "attrs", "extra", "pickle", "x"]) | st.text(max_size=4))
                current[key] = item
            else:
                current.insert(draw(st.integers(0, len(current))), item)
            note(f"add {item!r} at {path}")
            continue
        else:
            new = draw(json_values)
        note(f"replace {path}: {current!r:.80} -> {new!r:.80}")
        if not path:
            doc = new
        else:
            at(doc, path[:-1])[path[-1]] = new
    return doc


@st.composite
def byte_mutations(draw: st.DrawFn, data: bytes) -> bytes:
    """``data`` with 1..8 byte-level edits: flip bits, overwrite, insert or delete bytes."""
    out = bytearray(data)
    for _ in range(draw(st.integers(1, 8))):
        pos = draw(st.integers(0, max(len(out) - 1, 0)))
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        if op == "flip" and out:
            out[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and out:
            out[pos] = draw(st.sampled_from([0, 0xFF, 0x7F, 0x80, ord("["), ord("{"), ord('"'), ord("9")]))
        elif op == "insert":
            out[pos:pos] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete" and out:
            del out[pos : pos + draw(st.integers(1, 16))]
        elif op == "truncate":
            del out[pos:]
    return bytes(out)


# -- (a) chunk objects ----------------------------------------------------------------------------------------------

def _stage_object(raw: bytes, stages: list[Any], base: bytes | None = None) -> bytes:
    """A chunk object of ``raw`` coded by ``stages``; with ``base``, a whole-chunk XOR delta against it."""
    data: Any = bytes(a ^ b for a, b in zip(raw, base)) if base is not None else raw
    for stage in stages:
        data = stage.encode(memoryview(data))
    header = ChunkHeader(codec=[s.spec() for s in stages], raw=len(raw), base=chunk_id(base) if base else None)
    return encode_object(header, bytes(data))


def _raw_chunks() -> dict[str, bytes]:
    vault = Vault(str(BASE_DIR))
    try:
        return {cid: bytes(vault.read_chunk(cid)) for cid in CHUNK_IDS}
    finally:
        vault.close()


RAWS = _raw_chunks()
PACK_RAW, BIG_RAW = RAWS[CHUNK_IDS[0]], RAWS[CHUNK_IDS[1]]
DELTA_BASE = bytes(b ^ 0x5A for b in PACK_RAW)
#: (name, chunk id, object bytes): every stored chunk of the base vault, and chunk 0 and 1 coded other ways
CHUNK_OBJECTS = [(f"base chunk {i}", cid, (BASE_DIR / chunk_key(cid)).read_bytes()) for i, cid in enumerate(CHUNK_IDS)]
CHUNK_OBJECTS += [
    ("planes+lz4", CHUNK_IDS[1], _stage_object(BIG_RAW, [BytePlanes(4, Lz4())])),
    ("shuffle+zstd", CHUNK_IDS[1], _stage_object(BIG_RAW, [Shuffle(4), Zstd(3)])),
    ("zstd", CHUNK_IDS[0], _stage_object(PACK_RAW, [Zstd(1)])),
    ("lz4", CHUNK_IDS[0], _stage_object(PACK_RAW, [Lz4()])),
    ("planes(2)+zstd", CHUNK_IDS[0], _stage_object(PACK_RAW, [BytePlanes(2, Zstd(1))])),
    ("xor delta, zstd", CHUNK_IDS[0], _stage_object(PACK_RAW, [Zstd(1)], base=DELTA_BASE)),
]
BASES = {chunk_id(DELTA_BASE): DELTA_BASE}
CHUNK_ERRORS = (CorruptChunkError, FormatVersionError)


def names_newer_chunk(data: bytes) -> bool:
    """Whether a chunk object declares something newer: a format version above 1, an unknown codec stage, or a
    header field that format 1 does not have (which a newer writer may add)."""
    if len(data) >= 5 and data[4] > 1:
        return True
    try:
        header = json.loads(split_chunk(data)[1])
    except Exception:  # noqa: BLE001 - a header that does not parse names nothing
        return False
    if isinstance(header, dict) and set(header) - {"base", "codec", "raw"}:
        return True
    stack = [header]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if "id" in item and item["id"] not in KNOWN_STAGES:
                return True
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def check_chunk_decode(cid: str, data: bytes, original: bytes | None) -> None:
    """parse_object + decode_payload of ``data`` as chunk ``cid``: only typed errors, bounded memory, and if it
    decodes, to the chunk's bytes (``original``); a full chunk decoded across parts the same way."""
    def decode() -> bytes:
        header, payload = parse_object(cid, data)
        base_raw = BASES.get(header.base) if isinstance(header.base, str) else None
        return bytes(decode_payload(cid, header, payload, base_raw))

    def decode_into_parts() -> bytes | None:  # a full chunk of a plausible size, across three parts
        header, payload = parse_object(cid, data)
        if header.base is not None or header.raw > CHUNK_PEAK // 4:
            return None
        cut = header.raw // 3
        parts = [memoryview(bytearray(n)) for n in (cut, min(1, header.raw - cut), max(0, header.raw - cut - 1))]
        decode_payload_into_parts(cid, header, payload, parts)
        return b"".join(bytes(p) for p in parts)

    result, error, peak = run_bounded(decode)
    assert peak <= CHUNK_PEAK, f"decoding a {len(data)}-byte chunk object allocated {peak / 2**20:.0f} MiB"
    in_parts, parts_error, _peak = run_bounded(decode_into_parts)
    if parts_error is not None or in_parts is not None:  # decoded both ways: the same outcome
        assert (parts_error is None) == (error is None), f"decoded one way only: {error!r} / {parts_error!r}"
        assert parts_error is None or isinstance(parts_error, CHUNK_ERRORS), escaped(parts_error, CHUNK_ERRORS)
        assert parts_error is None or cid in str(parts_error), f"the error does not name the chunk: {parts_error}"
        assert in_parts is None or in_parts == result
    if error is None:
        assert chunk_id(result) == cid
        if original is not None:
            assert result == original, "a mutated chunk object decoded to other bytes than its name says"
        return
    assert isinstance(error, CHUNK_ERRORS), escaped(error, CHUNK_ERRORS)
    assert cid in str(error), f"the error does not name the chunk: {type(error).__name__}: {error}"
    if isinstance(error, FormatVersionError):
        assert names_newer_chunk(data), f"FormatVersionError for a chunk that names nothing newer: {error}"


@given(data=st.binary(max_size=4096))
def test_chunk_arbitrary_bytes(data: bytes) -> None:
    check_chunk_decode(CHUNK_IDS[0], data, None)


@given(header=st.binary(max_size=512), payload=st.binary(max_size=512), version=st.sampled_from([0, 1, 1, 2, 255]))
def test_chunk_arbitrary_header_bytes(header: bytes, payload: bytes, version: int) -> None:
    """A valid fixed prefix in front of arbitrary header bytes, so the JSON parser sees them."""
    check_chunk_decode(CHUNK_IDS[0], join_chunk(header, payload, version=version), None)


@given(case=st.sampled_from(CHUNK_OBJECTS), data=st.data())
def test_chunk_byte_mutations(case: tuple[str, str, bytes], data: st.DataObject) -> None:
    name, cid, obj = case
    mutant = data.draw(byte_mutations(obj))
    note(f"{name}: {len(obj)} -> {len(mutant)} bytes")
    check_chunk_decode(cid, mutant, RAWS.get(cid, PACK_RAW))


@given(case=st.sampled_from(CHUNK_OBJECTS), data=st.data())
def test_chunk_header_edits(case: tuple[str, str, bytes], data: st.DataObject) -> None:
    name, cid, obj = case
    _prefix, head, payload = split_chunk(obj)
    header = data.draw(mutated(json.loads(head)))
    text = dumps(header, sort_keys=True).encode()
    assume(len(text) < 65536)
    note(f"{name}: header {text[:300]!r}")
    check_chunk_decode(cid, join_chunk(text, payload), RAWS.get(cid, PACK_RAW))


# -- (b) manifests ----------------------------------------------------------------------------------------------------

MANIFEST_ERRORS = (CorruptManifestError, FormatVersionError)


def _known_dtype(kind: Any, dtype: Any) -> bool:
    if not isinstance(dtype, str):
        return True
    if kind == "numpy":
        try:
            np.dtype(dtype)
            return True
        except (TypeError, ValueError):
            return False
    return isinstance(getattr(torch, dtype, None), torch.dtype)


def names_newer_manifest(body: Any) -> bool:
    """Whether a manifest body names something newer: version > 1, an unknown feature, an unknown dtype name."""
    if not isinstance(body, dict):
        return False
    version = body.get("version")
    if type(version) is int and version > 1:
        return True
    requires = body.get("requires")
    if isinstance(requires, list) and any(isinstance(r, str) and r not in KNOWN_FEATURES for r in requires):
        return True
    tensors = body.get("tensors")
    return isinstance(tensors, list) and any(
        isinstance(t, dict) and not _known_dtype(t.get("kind"), t.get("dtype")) for t in tensors)


def check_manifest_decode(data: bytes, body: Any = None) -> None:
    """decode_manifest of ``data``: only typed errors, bounded memory; accepted only with a version 0 or 1."""
    result, error, peak = run_bounded(lambda: decode_manifest(data, MANIFEST_KEY).to_json())
    assert peak <= MANIFEST_PEAK, f"decoding a {len(data)}-byte manifest allocated {peak / 2**20:.0f} MiB"
    if error is None:
        assert isinstance(result, dict) and result.get("format") == "ckptvault.manifest"
        version = result.get("version")
        assert type(version) is int and 0 <= version <= 1, f"accepted a manifest with version {version!r}"
        return
    assert isinstance(error, MANIFEST_ERRORS), escaped(error, MANIFEST_ERRORS)
    assert MANIFEST_KEY in str(error), f"the error does not name the manifest: {type(error).__name__}: {error}"
    if isinstance(error, FormatVersionError):
        assert names_newer_manifest(body), f"FormatVersionError for a manifest that names nothing newer: {error}"


@given(data=st.binary(max_size=4096))
def test_manifest_arbitrary_bytes(data: bytes) -> None:
    check_manifest_decode(data)


@given(body=st.binary(max_size=2048))
def test_manifest_arbitrary_body_with_valid_checksum(body: bytes) -> None:
    check_manifest_decode(wrap_manifest(body))


@given(body=json_values)
def test_manifest_arbitrary_json_body(body: Any) -> None:
    check_manifest_decode(wrap_manifest(dumps(body).encode()), body)


@given(body=mutated(BASE_MANIFEST))
def test_manifest_structured_mutations(body: Any) -> None:
    check_manifest_decode(wrap_manifest(dumps(body).encode()), body)


@given(body=mutated(BASE_MANIFEST))
def test_manifest_structured_mutations_packed(body: Any) -> None:
    """The same mutations inside a packed body (docs/DESIGN.md section 4), as a writer packs a large one."""
    check_manifest_decode(wrap_manifest(pack(dumps(body).encode())), body)


# -- (c) vault.json ----------------------------------------------------------------------------------------------------

def descriptor_violations(desc: Any) -> list[str]:
    """What an accepted vault.json breaks of docs/DESIGN.md section 2 (empty: nothing)."""
    from ckptvault._codecs import validate_codec_name

    if not isinstance(desc, dict):
        return [f"not an object: {type(desc).__name__}"]
    out = []
    if desc.get("format") != "ckptvault.vault":
        out.append(f"format {desc.get('format')!r}")
    version, size = desc.get("version"), desc.get("chunk_size")
    if not (type(version) is int and 0 <= version <= 1):
        out.append(f"version {version!r}")
    if not (type(size) is int and size % 64 == 0 and 64 << 10 <= size <= 256 << 20):
        out.append(f"chunk_size {size!r}")
    if desc.get("hash") != "blake3":
        out.append(f"hash {desc.get('hash')!r}")
    try:
        validate_codec_name(desc.get("codec"))  # type: ignore[arg-type]
    except Exception:  # noqa: BLE001 - any refusal means the codec is unusable
        out.append(f"codec {desc.get('codec')!r}")
    return out


def check_descriptor(data: bytes, desc: Any = None) -> None:
    url = fresh_memory_url("fuzz-desc")
    try:
        open_store(url).put(DESCRIPTOR_KEY, data)
        vault = Vault(url)
        result, error, peak = run_bounded(lambda: (vault.descriptor(), vault.require()))
        vault.close()
    finally:
        drop_memory_store(url)
    assert peak <= MANIFEST_PEAK, f"reading a {len(data)}-byte vault.json allocated {peak / 2**20:.0f} MiB"
    if error is None:
        violations = descriptor_violations(result[1].to_json())
        assert not violations, f"accepted a vault.json with {violations}"
        return
    assert isinstance(error, MANIFEST_ERRORS), escaped(error, MANIFEST_ERRORS)
    assert "vault.json" in str(error), f"the error does not name vault.json: {error}"
    if isinstance(error, FormatVersionError):
        version = desc.get("version") if isinstance(desc, dict) else None
        assert type(version) is int and version > 1, f"FormatVersionError for vault.json version {version!r}: {error}"


@given(data=st.binary(max_size=1024))
def test_descriptor_arbitrary_bytes(data: bytes) -> None:
    check_descriptor(data)


@given(desc=mutated(BASE_DESCRIPTOR))
def test_descriptor_structured_mutations(desc: Any) -> None:
    check_descriptor(dumps(desc).encode(), desc)


# -- (d) whole operations on a mutated vault ----------------------------------------------------------------------

BASE_DIGEST = state_digest(base_state())
OPERATIONS = [
    {"op": "restore", "step": STEP, "reference": str(BASE_DIR)},
    {"op": "verify", "step": STEP},
    {"op": "info"},
    {"op": "gc_plan"},
    {"op": "manifest", "step": STEP},
]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz-vaults")


@contextlib.contextmanager
def vault_with(scratch: Path, key: str, data: bytes) -> Iterator[Path]:
    """A copy of the base vault with the object at ``key`` replaced by ``data``; removed afterwards."""
    root = Path(tempfile.mkdtemp(dir=scratch))
    try:
        vault = Path(shutil.copytree(BASE_DIR, root / "vault"))
        (vault / key).write_bytes(data)
        yield vault
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_operations(worker: Worker, vault: Path) -> dict[str, dict[str, Any]]:
    """Every operation of OPERATIONS on ``vault``; asserts that each either worked or raised a VaultError."""
    reply = worker.call("battery", requests=[{**op, "vault": str(vault)} for op in OPERATIONS])
    assert reply["status"] == "ok", f"the worker {reply['status']}: {reply.get('detail')}"
    assert reply["maxrss_growth_mib"] < MAX_GROWTH_MIB, f"peak RSS grew by {reply['maxrss_growth_mib']:.0f} MiB"
    results = {}
    for op, result in zip(OPERATIONS, reply["value"]):
        if result["status"] == "raised":
            error = result["error"]
            assert "VaultError" in error["mro"], (
                f"{op['op']}: {error['type']} escaped: {error['message'][:300]}\n{error['traceback'][-2500:]}")
        results[op["op"]] = result
    return results


HEX64 = re.compile(r"[0-9a-f]{64}")
TREE_LEAVES = {"tensor": ("torch",), "ndarray": ("numpy",), "npscalar": ("numpy",), "pickle": ("pickle",)}


def _int(value: Any, low: int = 0) -> bool:
    return type(value) is int and value >= low


def _itemsize(kind: str, dtype: Any) -> int | None:
    if not isinstance(dtype, str):
        return None
    if kind == "pickle":
        return 1
    if kind == "numpy":
        try:
            return np.dtype(dtype).itemsize
        except (TypeError, ValueError):
            return None
    found = getattr(torch, dtype, None)
    return found.itemsize if isinstance(found, torch.dtype) else None


def manifest_violations(body: Any, step: int = STEP, chunk_size: int = CHUNK_SIZE) -> list[str]:
    """What an accepted manifest breaks of docs/DESIGN.md section 4 (empty: nothing)."""
    if not isinstance(body, dict):
        return [f"the body is a {type(body).__name__}"]
    out = []
    if body.get("format") != "ckptvault.manifest":
        out.append(f"format {body.get('format')!r}")
    if not (type(body.get("version")) is int and 0 <= body["version"] <= 1):
        out.append(f"version {body.get('version')!r}")
    if body.get("step") != step or type(body.get("step")) is not int:
        out.append(f"step {body.get('step')!r} in the manifest of step {step}")
    t = body.get("time")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t):
        out.append(f"time {t!r}")
    chunks, tensors = body.get("chunks"), body.get("tensors")
    if not isinstance(chunks, list) or not isinstance(tensors, list):
        return [*out, "chunks or tensors is not a list"]
    raws = []
    for i, c in enumerate(chunks):
        if not isinstance(c, dict) or not isinstance(c.get("id"), str) or not HEX64.fullmatch(c["id"]):
            out.append(f"chunks[{i}].id {c.get('id') if isinstance(c, dict) else c!r}")
        raw = c.get("raw") if isinstance(c, dict) else None
        if not (_int(raw) and raw <= chunk_size):
            out.append(f"chunks[{i}].raw {raw!r}")
        raws.append(raw if _int(raw) else 0)
    for i, r in enumerate(tensors):
        if not isinstance(r, dict):
            out.append(f"tensors[{i}] is a {type(r).__name__}")
            continue
        kind, shape, nbytes, pieces = r.get("kind"), r.get("shape"), r.get("nbytes"), r.get("pieces")
        if kind not in ("torch", "numpy", "pickle", "part"):
            out.append(f"tensors[{i}].kind {kind!r}")
        if not (isinstance(shape, list) and all(_int(d) for d in shape)):
            out.append(f"tensors[{i}].shape {shape!r}")
            continue
        if not _int(nbytes):
            out.append(f"tensors[{i}].nbytes {nbytes!r}")
            continue
        if not isinstance(pieces, list):
            out.append(f"tensors[{i}].pieces {pieces!r}")
            continue
        held = 0
        for j, p in enumerate(pieces):
            ok = (isinstance(p, list) and len(p) == 3 and all(_int(v) for v in p) and p[0] < len(chunks)
                  and p[1] + p[2] <= raws[p[0]])
            if not ok:
                out.append(f"tensors[{i}].pieces[{j}] {p!r}")
            else:
                held += p[2]
        if held != nbytes:
            out.append(f"tensors[{i}].pieces hold {held} bytes, nbytes is {nbytes}")
        itemsize = _itemsize(kind, r.get("dtype"))
        if itemsize is None:
            out.append(f"tensors[{i}].dtype {r.get('dtype')!r} is unknown")
        elif not r.get("lossy") and math.prod(shape) * itemsize != nbytes:
            out.append(f"tensors[{i}].shape {shape} x {itemsize} bytes != nbytes {nbytes}")
    out += tree_violations(body.get("tree"), tensors)
    return out


def tree_violations(tree: Any, tensors: list[Any]) -> list[str]:
    """What is wrong with a skeleton (docs/DESIGN.md section 4), walked without recursion."""
    out: list[str] = []
    stack: list[tuple[Any, bool]] = [(tree, False)]
    while stack and len(out) < 5:
        node, is_key = stack.pop()
        if not isinstance(node, dict) or not node:
            out.append(f"tree node {node!r:.60}")
            continue
        tag, body = next(iter(node.items()))
        extra = set(node) - {tag, "attrs"}
        if extra or ("attrs" in node and tag not in ("dict", "odict")):
            out.append(f"tree node with keys {sorted(node)}")
        if tag in ("dict", "odict") and not is_key:
            if not isinstance(body, list) or not all(isinstance(p, list) and len(p) == 2 for p in body):
                out.append(f"tree {tag} body {body!r:.60}")
                continue
            stack += [(k, True) for k, _ in body] + [(v, False) for _, v in body]
        elif tag in ("list", "tuple") and not is_key:
            if not isinstance(body, list):
                out.append(f"tree {tag} body {body!r:.60}")
                continue
            stack += [(v, False) for v in body]
        elif tag in TREE_LEAVES and not is_key:
            if not (_int(body) and body < len(tensors) and isinstance(tensors[body], dict)
                    and tensors[body].get("kind") in TREE_LEAVES[tag]):
                out.append(f"tree leaf {node!r:.60}")
        elif not scalar_ok(tag, body):
            out.append(f"tree scalar {node!r:.60}")
    return out


def scalar_ok(tag: str, body: Any) -> bool:
    if tag == "int":
        return type(body) is int
    if tag == "bool":
        return isinstance(body, bool)
    if tag == "str":
        return isinstance(body, str)
    if tag == "none":
        return body is None
    try:
        if tag == "float":
            float.fromhex(body)
            return True
        if tag == "bytes":
            base64.b64decode(body, validate=True)
            return True
    except (TypeError, ValueError, binascii.Error):
        return False
    return False


def test_manifest_oracle_accepts_the_base() -> None:
    """The invariants used below hold for the real manifest (else they would prove nothing)."""
    assert manifest_violations(BASE_MANIFEST) == []
    assert descriptor_violations(BASE_DESCRIPTOR) == []


@given(body=mutated(BASE_MANIFEST))
def test_operations_on_mutated_manifest(body: Any, worker: Worker, scratch: Path) -> None:
    with vault_with(scratch, MANIFEST_KEY, wrap_manifest(dumps(body).encode())) as vault:
        results = run_operations(worker, vault)
    restore, manifest = results["restore"], results["manifest"]
    if restore["status"] == "ok":
        assert restore["value"]["unread"] is None, f"restore returned bytes no piece names: {restore['value']['unread']}"
    if manifest["status"] == "ok":
        violations = manifest_violations(manifest["value"]["manifest"])
        assert not violations, f"read_manifest accepted a manifest with {violations[:5]}"


CHUNK_TARGETS = [(i, cid, (BASE_DIR / chunk_key(cid)).read_bytes()) for i, cid in enumerate(CHUNK_IDS)]


@st.composite
def chunk_mutations(draw: st.DrawFn) -> tuple[str, bytes]:
    index, cid, obj = draw(st.sampled_from(CHUNK_TARGETS))
    if draw(st.booleans()):
        return cid, draw(byte_mutations(obj))
    _prefix, head, payload = split_chunk(obj)
    text = dumps(draw(mutated(json.loads(head))), sort_keys=True).encode()
    assume(len(text) < 65536)
    return cid, join_chunk(text, payload)


@given(mutation=chunk_mutations())
def test_operations_on_mutated_chunk(mutation: tuple[str, bytes], worker: Worker, scratch: Path) -> None:
    cid, data = mutation
    with vault_with(scratch, chunk_key(cid), data) as vault:
        results = run_operations(worker, vault)
    restore, verify = results["restore"], results["verify"]
    if restore["status"] == "ok":
        assert restore["value"]["digest"] == BASE_DIGEST, "restore returned other values than the chunks' names promise"
    if verify["status"] == "ok" and verify["value"]["ok"]:
        assert restore["status"] == "ok", f"verify passed, but restore failed: {restore['error']['message'][:300]}"


@given(desc=mutated(BASE_DESCRIPTOR))
def test_operations_on_mutated_descriptor(desc: Any, worker: Worker, scratch: Path) -> None:
    with vault_with(scratch, DESCRIPTOR_KEY, dumps(desc).encode()) as vault:
        results = run_operations(worker, vault)
    restore = results["restore"]
    if restore["status"] == "ok":
        assert restore["value"]["digest"] == BASE_DIGEST


# -- coverage-guided fuzzing (atheris) ---------------------------------------------------------------------------

ATHERIS_RUNS = 200_000 if THOROUGH else 3000
ATHERIS_SECONDS = 300 if THOROUGH else 20


@pytest.mark.parametrize("harness", ["fuzz_chunk_header.py", "fuzz_manifest.py"])
def test_atheris_harness(harness: str, tmp_path: Path) -> None:
    """Each atheris harness of tests/fuzz/ for a bounded number of inputs, seeded from the corpus: no finding."""
    pytest.importorskip("atheris")
    proc = subprocess.run(
        [sys.executable, str(FUZZ_DIR / harness), f"-atheris_runs={ATHERIS_RUNS}", f"-max_total_time={ATHERIS_SECONDS}",
         f"-artifact_prefix={tmp_path}/", "-rss_limit_mb=4096", "-print_final_stats=1"],
        capture_output=True, text=True, timeout=ATHERIS_SECONDS + 240, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{harness} found an input that escapes (exit {proc.returncode}):\n{output[-6000:]}"
    assert not list(tmp_path.glob("crash-*")) and not list(tmp_path.glob("oom-*")), output[-3000:]
