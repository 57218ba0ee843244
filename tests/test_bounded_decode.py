"""Reading chunk objects from a damaged or hostile vault: bounded memory and typed errors only.

What is checked: a header's every field is validated before anything is decoded (``raw`` bounded by the vault's
chunk size and equal to the manifest's chunk table, ``base``, ``codec`` and each stage's settings, nesting, length),
each violation a CorruptChunkError naming the field (an unknown stage id or header field: FormatVersionError);
decompression bombs (a small payload whose header or zstd frame claims gigabytes) are refused without the memory
they claim, measured as the peak RSS of a fresh process that restores and verifies them; zstd, LZ4, byte-planes
and shuffle decoders never decode more than they were asked for; delta reads check plane tables before reading
by range; a header-only read (``Vault.chunk_base``) reads only the header.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import lz4.block
import numpy as np
import pytest
import torch
import zstandard

from ckptvault import CheckpointManager
from ckptvault import _vault as vault_module
from ckptvault._codecs import BytePlanes, Lz4, Shuffle
from ckptvault._codecs.zstd import Zstd
from ckptvault._format import chunk_object
from ckptvault._format.chunk_object import MAX_RAW, ChunkHeader, chunk_id, chunk_key, encode_object, parse_object
from ckptvault._format.manifest import encode_manifest
from ckptvault._vault import MAX_CHUNK_SIZE
from ckptvault.errors import CorruptChunkError, FormatVersionError
from conftest import assert_same_state
from helpers.counting_store import CountingStore

HELPERS = Path(__file__).parent / "helpers"
CHUNK = 64 << 10
#: what a hostile header or frame claims: far more than any chunk
BOMB = 2 << 30
#: how much a reader's peak memory may grow while it refuses the bombs: a small multiple of chunk size x workers
#: (64 KiB x 8; refusing them measured 0 here), an eighth of the smallest bomb decoded (500 MiB)
GROWTH_LIMIT = 64 << 20
#: a name for objects parsed on their own (not a hash of their bytes: parsing never looks)
CID = chunk_id(b"a chunk parsed on its own")
PLANES_ZSTD = {"id": "planes", "inner": {"id": "zstd", "level": 1}, "typesize": 4}
_ZSTD_BLOCK = 128 << 10


# -- building hostile bytes -------------------------------------------------------------------------

def rle_frame(size: int, declare: bool = True) -> bytes:
    """A zstd frame of ``size`` zero bytes in RLE blocks (4 bytes per 128 KiB: 2 GiB in 64 KiB), declaring its
    content size (single segment) or not (a 2 MiB window instead)."""
    magic = struct.pack("<I", 0xFD2FB528)
    head = bytes([0xE0]) + struct.pack("<Q", size) if declare else bytes([0x00, 0x58])
    sizes = [_ZSTD_BLOCK] * (size // _ZSTD_BLOCK) + ([size % _ZSTD_BLOCK] if size % _ZSTD_BLOCK else [])
    blocks = ((int(i == len(sizes) - 1) | 1 << 1 | n << 3).to_bytes(3, "little") + b"\0" for i, n in enumerate(sizes))
    return magic + head + b"".join(blocks)


def planes_payload(planes: list[bytes], compressed: list[bool], tail: bytes = b"") -> bytes:
    """A byte-planes payload: the plane table, the stored planes, the tail."""
    sizes = [len(p) | (1 << 31 if c else 0) for p, c in zip(planes, compressed, strict=True)]
    return struct.pack(f"<B{len(planes)}I", len(planes), *sizes) + b"".join(planes) + tail


def raw_object(head: bytes | str, payload: bytes = b"", version: int = 1) -> bytes:
    """A chunk object with the exact header bytes ``head`` (which need not be valid JSON)."""
    head = head.encode() if isinstance(head, str) else head
    return struct.pack("<4sBBH", b"CKVC", version, 0, len(head)) + head + payload


def header_json(**fields: Any) -> str:
    """A header with ``fields`` over a valid default (None: leave the field out)."""
    body = {"base": None, "codec": [], "raw": CHUNK, **fields}
    return json.dumps({k: v for k, v in body.items() if v is not _ABSENT}, separators=(",", ":"))


_ABSENT = object()


def write_object(root: Path, cid: str, data: bytes) -> None:
    """Store ``data`` as chunk object ``cid`` of the local vault at ``root`` (chunk files are read-only)."""
    path = root / chunk_key(cid)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.chmod(0o644)
    path.write_bytes(data)


def repoint(root: Path, step: int, index: int, cid: str) -> None:
    """Make entry ``index`` of step ``step``'s chunk table name ``cid``, re-encoding the manifest's checksum."""
    path = root / "manifests" / f"{step:020d}.json"
    body = json.loads(path.read_bytes())["manifest"]
    body["chunks"][index]["id"] = cid
    path.chmod(0o644)
    path.write_bytes(encode_manifest(body))


def chunk_index(manifest: dict[str, Any], key: str) -> int:
    """The chunk table index of the one chunk holding tensor ``key``."""
    (record,) = [t for t in manifest["tensors"] if t["path"] == key]
    ((index, _offset, _length),) = record["pieces"]
    return int(index)


def _state(seed: int, keys: str) -> dict[str, torch.Tensor]:
    """One 64 KiB float32 tensor per key: each fills exactly one chunk."""
    gen = torch.Generator().manual_seed(seed)
    return {key: torch.randn(CHUNK // 4, generator=gen) for key in keys}


@pytest.fixture
def vault(tmp_path: Path) -> tuple[Path, dict[str, Any], dict[str, torch.Tensor]]:
    """A 64 KiB-chunk vault with steps 0 and 1 of tensors a..e (no shared chunks, no deltas); returns
    (root, manifest of step 1, state of step 1)."""
    root = tmp_path / "vault"
    states = {step: _state(step, "abcde") for step in (0, 1)}
    with CheckpointManager(root, chunk_size=CHUNK, incremental=False, async_save=False) as mgr:
        for step, state in states.items():
            mgr.save(step, state)
        manifest = mgr.manifest(1)
    assert len({chunk_index(manifest, key) for key in "abcde"}) == 5
    return root, manifest, states[1]


def cid_of(manifest: dict[str, Any], key: str) -> str:
    return str(manifest["chunks"][chunk_index(manifest, key)]["id"])


# -- bombs, in a fresh process that measures its memory --------------------------------------------

RAW_BOMB = f"header field 'raw' is {BOMB}, above the vault's chunk size {CHUNK}"
BOMBS: dict[str, tuple[ChunkHeader, bytes, str]] = {
    "a": (ChunkHeader(codec=[{"id": "zstd", "level": 1}], raw=BOMB), rle_frame(BOMB), RAW_BOMB),
    "b": (ChunkHeader(codec=[{"id": "lz4"}], raw=BOMB), lz4.block.compress(bytes(8 << 20), store_size=False), RAW_BOMB),
    "c": (ChunkHeader(codec=[PLANES_ZSTD], raw=BOMB), planes_payload([rle_frame(BOMB // 4)] * 4, [True] * 4), RAW_BOMB),
    # within a small raw, a zstd frame that declares (and holds) gigabytes
    "d": (ChunkHeader(codec=[{"id": "zstd", "level": 1}], raw=CHUNK), rle_frame(BOMB),
          f"zstd frame declares {BOMB} bytes, {CHUNK} expected"),
    # a plane whose 16 KB frame declares (and holds) 500 MiB
    "e": (ChunkHeader(codec=[PLANES_ZSTD], raw=CHUNK),
          planes_payload([rle_frame(500 << 20)] + [bytes(CHUNK // 4)] * 3, [True, False, False, False]),
          f"zstd frame declares {500 << 20} bytes, {CHUNK // 4} expected"),
}


def test_bombs_are_refused_by_restore_and_verify_in_bounded_memory(vault: tuple[Path, dict[str, Any], Any]) -> None:
    root, manifest, _state1 = vault
    for key, (header, payload, _reason) in BOMBS.items():
        assert len(payload) < 2 * CHUNK  # every bomb is a small object
        write_object(root, cid_of(manifest, key), encode_object(header, payload))
    done = subprocess.run([sys.executable, str(HELPERS / "hostile_reader.py"), str(root), str(GROWTH_LIMIT), *BOMBS],
                          capture_output=True, text=True, timeout=300, check=True)
    result = json.loads(done.stdout)
    assert result["grown"] < GROWTH_LIMIT, f"peak RSS grew by {result['grown'] >> 20} MiB refusing the bombs"
    for key, (_header, _payload, reason) in BOMBS.items():
        cid = cid_of(manifest, key)
        kind, message = result["errors"][key]
        assert kind == "CorruptChunkError"
        assert f"chunk {cid} is corrupt (needed by step 1, tensor '{key}')" in message and reason in message
        assert any(cid in problem and reason in problem for problem in result["verify"]), result["verify"]


# -- a chunk that holds more than the vault's chunk size, or other than its manifest says ------------

def test_a_valid_chunk_larger_than_the_chunk_size_is_refused_before_it_is_decoded(
        vault: tuple[Path, dict[str, Any], Any], monkeypatch: pytest.MonkeyPatch) -> None:
    root, manifest, _state1 = vault
    data = np.arange(1 << 18, dtype=np.float32).tobytes()  # 1 MiB, sixteen times the chunk size
    cid = chunk_id(data)
    stage = BytePlanes(4, Zstd(1))
    write_object(root, cid, encode_object(ChunkHeader(codec=[stage.spec()], raw=len(data)), stage.encode(memoryview(data))))
    assert chunk_object.decode_object(cid, (root / chunk_key(cid)).read_bytes()) == data  # valid and hash-correct
    repoint(root, 1, chunk_index(manifest, "a"), cid)
    decoded: list[str] = []  # the chunks read_chunk decodes
    real = vault_module.decode_payload
    monkeypatch.setattr(vault_module, "decode_payload", lambda *args, **kw: decoded.append(args[0]) or real(*args, **kw))
    reason = f"header field 'raw' is {len(data)}, above the vault's chunk size {CHUNK}"
    with CheckpointManager(root) as mgr:
        with pytest.raises(CorruptChunkError, match=f"chunk {cid} is corrupt .*tensor 'a'.*{reason}"):
            mgr.restore(1, keys=["a"])
        with pytest.raises(CorruptChunkError, match=reason):
            mgr.vault.read_chunk(cid)
        assert any(reason in problem for problem in mgr.verify(1).problems[1])
    assert cid not in decoded and decoded  # the others were decoded


def test_a_valid_chunk_shorter_than_its_chunk_table_entry_is_refused(vault: tuple[Path, dict[str, Any], Any]) -> None:
    root, manifest, state1 = vault
    data = state1["a"].numpy().tobytes()[: CHUNK // 2]  # hash-correct, but half of what the manifest lists
    cid = chunk_id(data)
    write_object(root, cid, encode_object(ChunkHeader(codec=[], raw=len(data)), data))
    repoint(root, 1, chunk_index(manifest, "a"), cid)
    reason = f"header field 'raw' is {CHUNK // 2}, but the chunk is listed with {CHUNK} bytes"
    with CheckpointManager(root) as mgr:
        with pytest.raises(CorruptChunkError, match=f"chunk {cid} is corrupt .*tensor 'a'.*{reason}"):
            mgr.restore(1)
        assert any(reason in problem for problem in mgr.verify(1).problems[1])
        assert bytes(mgr.vault.read_chunk(cid)) == data  # nothing wrong with the chunk on its own
        assert_same_state({"b": state1["b"]}, mgr.restore(1, keys=["b"]))


def test_a_header_raw_other_than_the_manifest_is_refused_before_decoding(vault: tuple[Path, dict[str, Any], Any]) -> None:
    root, manifest, _state1 = vault
    cid = cid_of(manifest, "a")
    write_object(root, cid, encode_object(ChunkHeader(codec=[{"id": "zstd", "level": 1}], raw=1000), rle_frame(1000)))
    with CheckpointManager(root) as mgr, pytest.raises(
            CorruptChunkError, match=f"header field 'raw' is 1000, but the chunk is listed with {CHUNK} bytes"):
        mgr.restore(1, keys=["a"])


def test_the_default_bound_is_the_largest_chunk_size() -> None:
    assert MAX_RAW == MAX_CHUNK_SIZE
    header, _ = parse_object(CID, raw_object(header_json(raw=MAX_RAW)))
    assert header.raw == MAX_RAW
    with pytest.raises(CorruptChunkError, match=f"'raw' is {MAX_RAW + 1}, above the largest chunk size {MAX_RAW}"):
        parse_object(CID, raw_object(header_json(raw=MAX_RAW + 1)))


# -- malformed headers: one typed error naming the field -------------------------------------------

def _planes(**settings: Any) -> dict[str, Any]:
    return {**PLANES_ZSTD, **settings}


CORRUPT_HEADERS = {
    "deep-list": ("[" * 60_000, r"header holds 60000 '\[' and '\{', more than a chunk header can \(10\)"),
    "deep-codec": ('{"base":null,"codec":' + "[" * 30_000 + "]" * 30_000 + ',"raw":1}', "header holds 30001 '"),
    "not-json": ('{"base":null,', r"unreadable chunk header \(Expecting"),
    "not-utf8": (b'{"base":null,"codec":[],"raw":1,"\xff":0}', "unreadable chunk header .*utf-8"),
    "not-object": ("[1,2]", "header is a JSON list, not an object"),
    "no-raw": (header_json(raw=_ABSENT), "header lacks field 'raw'"),
    "no-base": (header_json(base=_ABSENT), "header lacks field 'base'"),
    "raw-negative": (header_json(raw=-1), "header field 'raw' is -1, below 0"),
    "raw-bool": (header_json(raw=True), r"header field 'raw' is True \(bool\), not an integer"),
    "raw-string": (header_json(raw="65536"), r"header field 'raw' is '65536' \(str\), not an integer"),
    "raw-float": (header_json(raw=65536.0), r"header field 'raw' is 65536.0 \(float\), not an integer"),
    "raw-huge": (header_json(raw=BOMB), f"header field 'raw' is {BOMB}, above the vault's chunk size {CHUNK}"),
    "base-not-hex": (header_json(base="xyz"), r"header field 'base' is 'xyz' \(str\), not null or a chunk id"),
    "base-upper": (header_json(base=CID.upper()), "header field 'base' is '.*, not null or a chunk id"),
    "base-int": (header_json(base=7), r"header field 'base' is 7 \(int\), not null or a chunk id"),
    "base-own-id": (header_json(base=CID), "header field 'base' names the chunk itself"),
    "codec-object": (header_json(codec={"id": "zstd"}), "header field 'codec' must be a list of stage specs, got dict"),
    "stages": (header_json(codec=[{"id": "lz4"}] * 5), "header field 'codec' holds 5 stages, more than 4"),
    "stage-string": (header_json(codec=["zstd"]), r"'codec' stage 0: a stage spec must be a JSON object, got 'zstd'"),
    "stage-id-int": (header_json(codec=[{"id": 5}]), r"'codec' stage 0: a stage spec's 'id' must be a string, got 5"),
    "typesize-0": (header_json(codec=[_planes(typesize=0)]),
                   "'codec' stage 0: setting 'typesize' of stage 'planes' is 0, outside 1..255"),
    "typesize-1000": (header_json(codec=[_planes(typesize=1000)]), "setting 'typesize' of stage 'planes' is 1000, outside"),
    "typesize-bool": (header_json(codec=[_planes(typesize=True)]),
                      r"setting 'typesize' of stage 'planes' must be an integer, got True \(bool\)"),
    "typesize-absent": (header_json(codec=[{"id": "planes", "inner": {"id": "lz4"}}]),
                        "stage 'planes' lacks its setting 'typesize'"),
    "xplanes-typesize": (header_json(codec=[_planes(id="xplanes", typesize=-4)]),
                         "setting 'typesize' of stage 'xplanes' is -4"),
    "shuffle-typesize": (header_json(codec=[{"id": "shuffle", "typesize": 0}]), "setting 'typesize' of stage 'shuffle' is 0"),
    "level-high": (header_json(codec=[{"id": "zstd", "level": 23}]), "setting 'level' of stage 'zstd' is 23, outside -131072..2"),
    "level-float": (header_json(codec=[{"id": "zstd", "level": 1.5}]), "setting 'level' of stage 'zstd' must be an integer"),
    "inner-level": (header_json(codec=[_planes(inner={"id": "zstd", "level": "max"})]),
                    "stage 0: setting 'level' of stage 'zstd' must be an integer"),
    "no-inner": (header_json(codec=[{"id": "planes", "typesize": 4}]), "stage 'planes' lacks its setting 'inner'"),
    "inner-on-zstd": (header_json(codec=[{"id": "zstd", "inner": {"id": "lz4"}}]),
                      r"stage 'zstd' has settings it does not take: \['inner'\]"),
    "nested-inner": (header_json(codec=[_planes(inner=_planes())]),
                     "stage 'planes' wraps a stage of its own, so it cannot be another stage's inner stage"),
}


@pytest.mark.parametrize("case", list(CORRUPT_HEADERS))
def test_a_malformed_header_is_a_corrupt_chunk_naming_the_field(case: str) -> None:
    head, reason = CORRUPT_HEADERS[case]
    with pytest.raises(CorruptChunkError, match=reason) as caught:
        parse_object(CID, raw_object(head), max_raw=CHUNK)
    assert caught.value.chunk == CID


NEWER_HEADERS = {
    "stage": (header_json(codec=[{"id": "brotli"}]), "unknown codec stage 'brotli'; this chunk was written by a newer"),
    "inner-stage": (header_json(codec=[_planes(inner={"id": "brotli"})]), "unknown codec stage 'brotli'"),
    "field": (header_json(future=1), rf"chunk {CID} has header fields \['future'\] this ckptvault does not know"),
    "version": (header_json(), f"chunk {CID} uses chunk format version 2"),
}


@pytest.mark.parametrize("case", list(NEWER_HEADERS))
def test_a_newer_stage_field_or_version_is_a_format_version_error(case: str) -> None:
    head, reason = NEWER_HEADERS[case]
    with pytest.raises(FormatVersionError, match=reason):
        parse_object(CID, raw_object(head, version=2 if case == "version" else 1), max_raw=CHUNK)


@pytest.mark.parametrize(("data", "reason"), [
    (b"CKVC\x01", "object is 5 bytes, shorter than its fixed header"),
    (raw_object(header_json())[:20], f"its {len(header_json())}-byte header runs past the end of the 20-byte object"),
    (raw_object(header_json(), version=0), r"format version 0 \(versions start at 1\)"),
])
def test_a_truncated_object_or_version_0_is_corrupt(data: bytes, reason: str) -> None:
    with pytest.raises(CorruptChunkError, match=reason):
        parse_object(CID, data, max_raw=CHUNK)


def test_a_deeply_nested_header_fails_restore_and_verify_with_a_typed_error(vault: tuple[Path, dict[str, Any], Any]) -> None:
    root, manifest, _state1 = vault
    cid = cid_of(manifest, "b")
    write_object(root, cid, raw_object("[" * 60_000))
    with CheckpointManager(root) as mgr:
        with pytest.raises(CorruptChunkError, match=f"chunk {cid} is corrupt .*tensor 'b'.*header holds 60000"):
            mgr.restore(1)
        assert any("header holds 60000" in problem for problem in mgr.verify(1).problems[1])


def test_header_only_reads_check_the_header_and_read_nothing_more(vault: tuple[Path, dict[str, Any], Any]) -> None:
    root, manifest, state1 = vault
    good, bomb = cid_of(manifest, "a"), cid_of(manifest, "b")
    write_object(root, bomb, encode_object(ChunkHeader(codec=[{"id": "lz4"}], raw=BOMB), bytes(1 << 20)))
    long_cid = cid_of(manifest, "c")
    padded = raw_object(header_json().encode() + b" " * 2000, state1["c"].numpy().tobytes())  # JSON allows the spaces
    assert chunk_id(state1["c"].numpy().tobytes()) == long_cid
    write_object(root, long_cid, padded)
    store = CountingStore(root)
    with CheckpointManager(store) as mgr:
        assert mgr.vault.chunk_base(good) is None
        with pytest.raises(CorruptChunkError, match=f"chunk {bomb} is corrupt: header field 'raw' is {BOMB}, above"):
            mgr.vault.chunk_base(bomb)
        assert mgr.vault.chunk_base(long_cid) is None
    assert store.read[chunk_key(bomb)] == 1024  # one first read, not the 1 MiB payload
    assert store.read[chunk_key(long_cid)] == 1024 + len(padded) - CHUNK  # then just the rest of the header


# -- decoders never produce or allocate more than asked ------------------------------------------

def test_zstd_refuses_a_frame_declaring_other_than_the_expected_size() -> None:
    for declared in (BOMB, 1000):
        with pytest.raises(ValueError, match=f"zstd frame declares {declared} bytes, {CHUNK} expected"):
            Zstd().decode(memoryview(rle_frame(declared)), CHUNK)
    assert Zstd().decode(memoryview(rle_frame(CHUNK)), CHUNK) == bytes(CHUNK)


def test_zstd_decodes_a_frame_without_a_content_size_into_at_most_the_expected_size() -> None:
    assert Zstd().decode(memoryview(rle_frame(CHUNK, declare=False)), CHUNK) == bytes(CHUNK)
    with pytest.raises(zstandard.ZstdError, match="did not decompress full frame"):
        Zstd().decode(memoryview(rle_frame(256 << 20, declare=False)), CHUNK)


def test_zstd_refuses_data_after_its_frame() -> None:
    half = zstandard.ZstdCompressor().compress(bytes(CHUNK // 2))
    with pytest.raises(zstandard.ZstdError, match="unused data"):
        Zstd().decode(memoryview(half + half), CHUNK // 2)
    with pytest.raises(ValueError, match=f"declares {CHUNK // 2} bytes, {CHUNK} expected"):
        Zstd().decode(memoryview(half + half), CHUNK)


def test_lz4_refuses_a_size_its_block_cannot_hold() -> None:
    block = lz4.block.compress(bytes(CHUNK), store_size=False)
    assert Lz4().decode(memoryview(block), CHUNK) == bytes(CHUNK)
    with pytest.raises(ValueError, match=f"an LZ4 block of {len(block)} bytes cannot hold {1 << 30} bytes"):
        Lz4().decode(memoryview(block), 1 << 30)


def test_byte_planes_check_their_table_against_the_payload_and_the_size() -> None:
    stage, plane = BytePlanes(4, Zstd(1)), CHUNK // 4
    frame = rle_frame(plane)
    good = planes_payload([frame] * 4, [True] * 4)
    assert bytes(stage.decode(memoryview(good), CHUNK)) == bytes(CHUNK)
    cases = {
        "raw plane too long": (planes_payload([bytes(plane + 4)] * 4, [False] * 4),
                               f"plane 0 is stored as {plane + 4} raw bytes, but the chunk's planes hold {plane}"),
        "raw plane short": (planes_payload([bytes(plane - 4)] * 4, [False] * 4), f"plane 0 is stored as {plane - 4} raw"),
        "compressed too long": (planes_payload([bytes(2 * plane)] + [frame] * 3, [True] * 4),
                                f"plane 0 is stored as {2 * plane} compressed bytes"),
        "table past payload": (good[:-10], f"plane table describes {len(good)} bytes, the payload holds {len(good) - 10}"),
        "plane count": (planes_payload([frame] * 2, [True] * 2), "payload has 2 planes, spec says 4"),
    }
    for payload, reason in cases.values():
        with pytest.raises(ValueError, match=reason):
            stage.decode(memoryview(payload), CHUNK)
        with pytest.raises(CorruptChunkError, match=reason):
            chunk_object.decode_object(CID, encode_object(ChunkHeader(codec=[stage.spec()], raw=CHUNK), payload),
                                       max_raw=CHUNK)


def test_shuffle_refuses_a_payload_of_another_length() -> None:
    data = np.arange(CHUNK // 4, dtype=np.float32).tobytes()
    shuffled = Shuffle(4).encode(memoryview(data))
    assert bytes(Shuffle(4).decode(memoryview(shuffled), CHUNK)) == data
    with pytest.raises(ValueError, match=f"shuffled payload of {CHUNK} bytes, {1 << 30} expected"):
        Shuffle(4).decode(memoryview(shuffled), 1 << 30)


# -- plane deltas: the delta's table and its base's are checked before any ranged read -----------

def _delta_vault(root: Path) -> tuple[str, str]:
    """Steps 0 and 1 of one 64 KiB tensor a small step apart: step 1 is a plane delta; returns (delta, base)."""
    rng = np.random.default_rng(0)
    before = rng.standard_normal(CHUNK // 4).astype(np.float32)
    after = (before - np.float32(1e-4) * rng.standard_normal(CHUNK // 4).astype(np.float32)).astype(np.float32)
    with CheckpointManager(root, chunk_size=CHUNK, async_save=False) as mgr:
        mgr.save(0, {"w": torch.from_numpy(before)})
        mgr.save(1, {"w": torch.from_numpy(after)})
        (entry,) = mgr.manifest(1)["chunks"]
    assert entry.get("base"), "step 1 should be a plane delta"
    return entry["id"], entry["base"]


def _xor_payload(length: int) -> bytes:
    """A plane-delta payload whose plane 3 claims ``length`` compressed, XORed bytes (the others raw)."""
    sizes = [CHUNK // 4] * 3 + [length | 1 << 31 | 1 << 30]
    return struct.pack("<B4I", 4, *sizes) + bytes(3 * (CHUNK // 4)) + bytes(64)


def test_a_plane_delta_whose_table_claims_more_than_the_chunk_is_refused(tmp_path: Path) -> None:
    cid, base = _delta_vault(tmp_path / "v")
    spec = {**PLANES_ZSTD, "id": "xplanes"}
    write_object(tmp_path / "v", cid, encode_object(ChunkHeader(codec=[spec], raw=CHUNK, base=base), _xor_payload((1 << 30) - 1)))
    reason = f"plane 3 is stored as {(1 << 30) - 1} compressed bytes, but the chunk's planes hold {CHUNK // 4}"
    with CheckpointManager(tmp_path / "v") as mgr, pytest.raises(CorruptChunkError, match=f"chunk {cid} is corrupt.*{reason}"):
        mgr.restore(1)


def test_a_base_whose_table_claims_more_than_the_chunk_is_refused_before_its_ranged_read(tmp_path: Path) -> None:
    cid, base = _delta_vault(tmp_path / "v")
    huge = (1 << 30) - 1
    table = struct.pack("<B4I", 4, *([huge | 1 << 31] * 4))  # four planes of a GiB each
    write_object(tmp_path / "v", base, encode_object(ChunkHeader(codec=[PLANES_ZSTD], raw=CHUNK), table + bytes(64)))
    store = CountingStore(tmp_path / "v")
    reason = f"its delta base {base} is corrupt: plane 0 is stored as {huge} compressed bytes"
    with CheckpointManager(store) as mgr, pytest.raises(CorruptChunkError, match=f"chunk {cid} is corrupt.*{reason}"):
        mgr.restore(1)
    assert store.read[chunk_key(base)] <= 4096  # its header and table, no range of planes


# -- an object larger than any chunk object can be ------------------------------------------------------

OVERSIZED = 256 << 20


def _oversize(root: Path, cid: str) -> None:
    """Replace chunk object ``cid`` by a sparse file of OVERSIZED bytes (cheap on disk, costly to read)."""
    path = root / chunk_key(cid)
    path.chmod(0o644)
    with open(path, "r+b") as f:
        f.truncate(OVERSIZED)


def test_an_oversized_object_is_refused_before_it_is_read(vault: tuple[Path, dict[str, Any], Any]) -> None:
    root, manifest, _state1 = vault
    _oversize(root, cid_of(manifest, "a"))
    done = subprocess.run([sys.executable, str(HELPERS / "hostile_reader.py"), str(root), str(GROWTH_LIMIT), "a"],
                          capture_output=True, text=True, timeout=300, check=True)
    result = json.loads(done.stdout)
    assert result["grown"] < GROWTH_LIMIT, f"peak RSS grew by {result['grown'] >> 20} MiB refusing the object"
    kind, message = result["errors"]["a"]
    limit = chunk_object.max_object_size(CHUNK)
    assert kind == "CorruptChunkError"
    assert f"the object is {OVERSIZED} bytes, more than a chunk object of this vault can be ({limit})" in message
    assert any(f"the object is {OVERSIZED} bytes" in problem for problem in result["verify"]), result["verify"]


def test_copy_refuses_an_oversized_object_before_writing_anything(vault: tuple[Path, dict[str, Any], Any],
                                                                   tmp_path: Path) -> None:
    from ckptvault._maintenance.copy import copy_checkpoints

    root, manifest, _state1 = vault
    _oversize(root, cid_of(manifest, "a"))
    with pytest.raises(CorruptChunkError, match=f"the object is {OVERSIZED} bytes, more than a chunk object of"):
        copy_checkpoints(root, tmp_path / "copy")
    assert not (tmp_path / "copy").exists()


def test_copy_refuses_a_destination_with_smaller_chunks(vault: tuple[Path, dict[str, Any], Any], tmp_path: Path) -> None:
    """Chunks are copied byte for byte: into a vault of smaller chunks they would be refused by its readers."""
    from ckptvault._maintenance.copy import copy_checkpoints
    from ckptvault.errors import InvalidArgumentError

    root, _manifest, state = vault
    small, large = tmp_path / "small", tmp_path / "large"
    with CheckpointManager(large, chunk_size=4 * CHUNK) as mgr:
        mgr.save(7, {"x": torch.ones(3)}).wait()
    copy_checkpoints(root, large, [1])  # larger chunks: fine
    with CheckpointManager(large) as mgr:
        assert_same_state(mgr.restore(1), state)
    with CheckpointManager(small, chunk_size=CHUNK) as mgr:
        mgr.save(7, {"x": torch.ones(3)}).wait()
    with pytest.raises(InvalidArgumentError, match=f"has chunk size {CHUNK}, smaller than the source's {4 * CHUNK}"):
        copy_checkpoints(large, small)
