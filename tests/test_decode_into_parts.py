"""Chunks decoded straight into the memory of the records they hold (``Vault.read_chunk_into_parts``): a chunk packed
with many small records is written across their tensors, verified there, with no buffer of the whole chunk."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

import ckptvault._restore.tensors as tensors_module
from ckptvault import CheckpointManager
from ckptvault._codecs import planes as planes_module
from ckptvault._codecs.planes import assemble, assemble_into_parts, split_planes
from ckptvault._format.chunk_object import chunk_key
from ckptvault.errors import CorruptChunkError


def _cut(total: int, rng: random.Random, small: bool) -> list[int]:
    """Lengths adding up to ``total``: mostly small and odd (``small``), else large and a few small."""
    lengths = []
    while total:
        n = min(total, rng.choice([1, 3, 4, 7, 64, 513, 5000]) if small else rng.choice([2, 4096, 70_001, 200_000]))
        lengths.append(n)
        total -= n
    return lengths


def _parts_at_odd_addresses(lengths: list[int]) -> tuple[list[bytearray], list[memoryview]]:
    """Parts in separate buffers, each starting 1 byte into its buffer (an unaligned address for any word)."""
    owners = [bytearray(b"\xaa" * (n + 1)) for n in lengths]
    return owners, [memoryview(o)[1:] for o in owners]


@pytest.fixture(params=["kernels", "numpy"])
def join_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "numpy":
        monkeypatch.setattr(planes_module, "_kernels", False)
    elif planes_module._plane_kernels() is None:
        pytest.skip("numba is not installed")
    return str(request.param)


@pytest.mark.parametrize("typesize", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("small", [True, False])
def test_planes_assembled_across_parts_are_the_bytes_assembled_whole(join_path: str, typesize: int, small: bool) -> None:
    rng = random.Random(typesize * 2 + small)
    size = (3 * planes_module.NUMPY_BLOCK + 5) * typesize + typesize - 1  # several blocks and a tail
    data = np.random.default_rng(typesize).integers(0, 256, size, dtype=np.uint8)
    stacked, tail = split_planes(data.data, typesize)
    planes = list(stacked)
    expected = assemble(planes, tail, np.empty(size, dtype=np.uint8))
    lengths = [0, *_cut(size, rng, small), 0]  # empty parts anywhere are allowed
    _owners, parts = _parts_at_odd_addresses(lengths)
    aligned = [np.empty(n, dtype=np.uint64).view(np.uint8)[:n] for n in lengths]  # the direct path
    for views in ([np.frombuffer(p, dtype=np.uint8) for p in parts], aligned):
        assemble_into_parts(planes, tail, views)
        assert b"".join(v.tobytes() for v in views) == expected.tobytes()


def _vault_with_deltas(path: Path, codec: str) -> CheckpointManager:
    torch.manual_seed(0)
    state = {"w": torch.randn(40_000), "b": torch.randn(300).double(), "raw": torch.randint(0, 255, (70_000,), dtype=torch.uint8)}
    mgr = CheckpointManager(path, async_save=False, codec=codec, chunk_size=64 << 10)
    mgr.save(1, state)
    state["w"][::7] += 1e-3  # most chunks of the next save are XOR deltas of these
    mgr.save(2, state)
    return mgr


@pytest.mark.parametrize("codec", ["zstd", "lz4", "none", "fast"])
def test_a_chunk_read_into_parts_is_the_chunk_there(tmp_path: Path, codec: str) -> None:
    """Every codec, and chunks stored as XOR deltas of the keyframe's (decoded, then copied in)."""
    rng = random.Random(codec)
    with _vault_with_deltas(tmp_path / "v", codec) as mgr:
        table = mgr.vault.read_manifest(2).chunks
        assert any(ref.base is not None for ref in table) == (codec in ("zstd", "lz4"))  # deltas for the default codecs
        for ref in table:
            owners, parts = _parts_at_odd_addresses(_cut(ref.raw, rng, small=len(table) % 2 == 0))
            mgr.vault.read_chunk_into_parts(ref.id, parts, expected_raw=ref.raw)
            assert b"".join(bytes(p) for p in parts) == bytes(mgr.vault.read_chunk(ref.id)), ref.id
            assert all(o[0] == 0xAA for o in owners)  # nothing written before a part


def test_parts_that_do_not_add_up_to_the_chunk_are_refused(tmp_path: Path) -> None:
    with _vault_with_deltas(tmp_path / "v", "zstd") as mgr:
        for ref in mgr.vault.read_manifest(2).chunks[:4]:
            for wrong in (ref.raw - 1, ref.raw + 1):
                with pytest.raises(ValueError, match=f"parts of {wrong} bytes cannot take chunk {ref.id}"):
                    mgr.vault.read_chunk_into_parts(ref.id, [memoryview(bytearray(wrong))])


@pytest.mark.parametrize(("where", "reason"), [(3, "BLAKE3 hash of the decoded bytes does not match"),
                                               (-10, "payload does not decode")])
def test_a_damaged_chunk_read_into_parts_is_refused_by_name(tmp_path: Path, where: int, reason: str) -> None:
    """A flipped byte in a plane stored raw decodes, to bytes whose hash differs; one in the compressed sign and
    exponent plane (last) does not decode."""
    torch.manual_seed(1)
    with CheckpointManager(tmp_path / "v", async_save=False) as mgr:
        mgr.save(1, {"w": torch.randn(100_000)})
        ref = mgr.vault.read_manifest(1).chunks[0]
        path = tmp_path / "v" / chunk_key(ref.id)
        data = bytearray(path.read_bytes())
        data[len(data) // where if where > 0 else where] ^= 0xFF
        path.chmod(0o644)
        path.write_bytes(bytes(data))
        with pytest.raises(CorruptChunkError, match=f"chunk {ref.id} is corrupt: {reason}"):
            mgr.vault.read_chunk_into_parts(ref.id, [memoryview(bytearray(ref.raw - 5)), memoryview(bytearray(5))])


def _records_per_chunk(manifest) -> list[int]:  # noqa: ANN001
    return [sum(p.chunk == c for t in manifest.tensors for p in t.pieces) for c in range(len(manifest.chunks))]


def _small_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(2)
    return {f"layer{i}.{kind}": torch.randn(n) for i, n in enumerate([3, 100, 4096, 77, 20_000, 1]) for kind in ("w", "b")}


@pytest.mark.parametrize("keys", [None, ["layer1.w", "layer3.b"]])
def test_a_restore_decodes_packed_chunks_into_the_tensors(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          keys: list[str] | None) -> None:
    """A whole restore writes each packed chunk across its records' tensors; a partial one, which needs only
    some of a chunk's records, decodes the chunk whole and copies them out. Both exact, whatever the path."""
    state = _small_state()
    calls: list[str] = []
    into_parts, whole = tensors_module.read_verified_into_parts, tensors_module.read_verified
    monkeypatch.setattr(tensors_module, "read_verified_into_parts", lambda *a, **k: calls.append("parts") or into_parts(*a, **k))
    monkeypatch.setattr(tensors_module, "read_verified",
                        lambda *a, **k: calls.append("copied" if k.get("into") is None else "in place") or whole(*a, **k))
    with CheckpointManager(tmp_path / "v", async_save=False, chunk_size=64 << 10) as mgr:
        mgr.save(1, state)
        assert max(_records_per_chunk(mgr.vault.read_manifest(1))) > 1  # the small records share chunks
        restored = mgr.restore(1, keys=keys)
    for name in keys or state:
        assert torch.equal(restored[name], state[name]), name
    assert ("parts" in calls) == (keys is None)
    assert ("copied" in calls) == (keys is not None)


def test_a_restore_from_a_damaged_packed_chunk_fails_naming_it(tmp_path: Path) -> None:
    state = _small_state()
    with CheckpointManager(tmp_path / "v", async_save=False, chunk_size=64 << 10) as mgr:
        mgr.save(1, state)
        manifest = mgr.vault.read_manifest(1)
        counts = _records_per_chunk(manifest)
        ref = manifest.chunks[counts.index(max(counts))]
        path = tmp_path / "v" / chunk_key(ref.id)
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x01
        path.chmod(0o644)
        path.write_bytes(bytes(data))
        with pytest.raises(CorruptChunkError, match=f"chunk {ref.id} is corrupt \\(needed by step 1, tensor 'layer"):
            mgr.restore(1)
