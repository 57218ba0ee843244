"""Plane deltas (``xplanes``): per byte plane, XOR with the base's plane only where that compresses better.

What is checked: exact round trips of the stage; which planes it XORs on nearby float states; that a restore
reads only the XORed planes of the base (bytes counted on a real local store); that damage to a base plane the
delta does not use leaves the delta restorable while damage to one it uses is reported against the base; deltas
against a base stored raw; the manifest's ``requires`` feature; and errors for a stage used without its base.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ckptvault import CheckpointManager
from ckptvault._codecs import BytePlanes, PlaneDelta
from ckptvault._codecs.planes import plane_table, split_planes
from ckptvault._codecs.zstd import Zstd
from ckptvault._format.chunk_object import chunk_key, header_length, parse_object
from ckptvault.errors import CorruptChunkError
from conftest import assert_same_state
from helpers.counting_store import CountingStore

CHUNK = 256 << 10


def nearby_floats(n: int, seed: int, step: float = 1e-4) -> tuple[np.ndarray, np.ndarray]:
    """Two float32 arrays one small optimizer-like step apart."""
    rng = np.random.default_rng(seed)
    before = rng.standard_normal(n).astype(np.float32)
    after = (before - step * rng.standard_normal(n).astype(np.float32)).astype(np.float32)
    return before, after


def stage() -> PlaneDelta:
    return PlaneDelta(4, Zstd(1))


def encode_against(data: bytes, base_planes: list[np.ndarray]) -> tuple[bytes, bool]:
    """The stage's payload joined into bytes, and whether it XORs any plane."""
    parts, uses_base = stage().encode_against(memoryview(data), base_planes)
    return b"".join(parts), uses_base


def test_nearby_floats_xor_the_high_planes_and_store_the_noise_planes_alone() -> None:
    before, after = nearby_floats(1 << 18, seed=0)
    base_planes = list(split_planes(memoryview(before.tobytes()), 4)[0])
    payload, uses_base = encode_against(after.tobytes(), base_planes)
    entries, _ = plane_table(payload, 4)
    assert uses_base
    assert entries[3].xor and entries[2].xor  # sign/exponent and high mantissa change rarely
    assert not entries[0].xor  # the lowest mantissa byte is noise either way
    assert not entries[0].compressed  # the lowest mantissa byte is noise: stored raw, on its own
    decoded = stage().decode_against(memoryview(payload), after.nbytes, dict(enumerate(base_planes)))
    assert bytes(decoded) == after.tobytes()
    plain = BytePlanes(4, Zstd(1)).encode(memoryview(after.tobytes()))
    assert len(payload) < 0.8 * len(plain)


def test_unrelated_data_uses_no_base_plane_and_reads_as_a_plain_planes_payload() -> None:
    rng = np.random.default_rng(1)
    base = rng.standard_normal(1 << 16).astype(np.float32)
    data = rng.standard_normal(1 << 16).astype(np.float32)
    payload, uses_base = encode_against(data.tobytes(), list(split_planes(base.tobytes(), 4)[0]))
    assert not uses_base
    assert bytes(BytePlanes(4, Zstd(1)).decode(memoryview(payload), data.nbytes)) == data.tobytes()


def high_planes_only(base: np.ndarray) -> list[np.ndarray | None]:
    """What the keyframe cache keeps of a float32 base: its two high planes."""
    planes = list(split_planes(base.tobytes(), 4)[0])
    return [None, None, planes[2], planes[3]]


def test_without_the_low_base_planes_a_dense_change_stores_them_alone_and_fetches_nothing() -> None:
    before, after = nearby_floats(1 << 18, seed=3, step=1e-2)  # the high mantissa plane changes almost everywhere
    fetched = []
    parts, uses_base = stage().encode_against(memoryview(after.tobytes()), high_planes_only(before),
                                              lambda: fetched.append(1) or list(split_planes(before.tobytes(), 4)[0]))
    payload = b"".join(parts)
    entries, _ = plane_table(payload, 4)
    assert uses_base and not fetched
    assert entries[3].xor and not entries[1].xor and not entries[0].xor
    high = {k: p for k, p in enumerate(high_planes_only(before)) if p is not None}
    decoded = stage().decode_against(memoryview(payload), after.nbytes, high)
    assert bytes(decoded) == after.tobytes()


def test_without_the_low_base_planes_a_sparse_change_fetches_the_whole_base_and_xors_them() -> None:
    rng = np.random.default_rng(5)
    before = rng.standard_normal(1 << 18).astype(np.float32)
    after = before.copy()
    rows = rng.choice(before.size // 32, size=before.size // 32 // 50, replace=False)  # 2% of 32-value rows
    for r in rows:
        after[r * 32 : (r + 1) * 32] += np.float32(1e-3) * rng.standard_normal(32).astype(np.float32)
    whole = list(split_planes(before.tobytes(), 4)[0])
    fetched = []
    parts, uses_base = stage().encode_against(memoryview(after.tobytes()), high_planes_only(before),
                                              lambda: fetched.append(1) or whole)
    payload = b"".join(parts)
    entries, _ = plane_table(payload, 4)
    assert fetched == [1] and uses_base
    assert all(e.xor for e in entries)  # unchanged rows XOR to zeros in every plane
    assert len(payload) < 0.1 * after.nbytes
    assert bytes(stage().decode_against(memoryview(payload), after.nbytes, dict(enumerate(whole)))) == after.tobytes()
    # without a way to fetch it, the low planes are stored on their own: bigger, still exact
    parts, _ = stage().encode_against(memoryview(after.tobytes()), high_planes_only(before))
    alone = b"".join(parts)
    assert len(alone) > 3 * len(payload)
    assert bytes(stage().decode_against(memoryview(alone), after.nbytes, dict(enumerate(whole)))) == after.tobytes()


@given(st.binary(min_size=0, max_size=5000), st.data())
def test_round_trip_of_any_bytes_against_any_base(data: bytes, draw: st.DataObject) -> None:
    flips = draw.draw(st.lists(st.integers(0, max(len(data) - 1, 0)), max_size=20))
    base = bytearray(data)
    for i in flips:
        if base:
            base[i] ^= 0x5A
    whole = len(data) - len(data) % 4
    base_planes = list(split_planes(bytes(base), 4)[0])
    payload, _ = encode_against(data, base_planes)
    assert bytes(stage().decode_against(memoryview(payload), len(data), dict(enumerate(base_planes)))) == data
    assert len(payload) <= len(data) + 1 + 16 + (len(data) - whole)


def test_the_stage_refuses_to_run_without_its_base() -> None:
    with pytest.raises(ValueError, match="encode_against"):
        stage().encode(memoryview(b"\0" * 16))
    with pytest.raises(ValueError, match="Vault.read_chunk"):
        stage().decode(memoryview(b"\0" * 16), 16)
    before, after = nearby_floats(4096, seed=2)
    payload, uses_base = encode_against(after.tobytes(), list(split_planes(before.tobytes(), 4)[0]))
    assert uses_base
    with pytest.raises(ValueError, match=r"base's plane \d is missing"):
        stage().decode_against(memoryview(payload), after.nbytes, {})
    with pytest.raises(ValueError, match="XORed with a delta base"):
        BytePlanes(4, Zstd(1)).decode(memoryview(payload), after.nbytes)


# -- through the vault ---------------------------------------------------------------------------------


def two_steps(root: Path) -> dict[int, dict[str, Any]]:
    before, after = nearby_floats(1 << 16, seed=3)  # exactly one 256 KiB chunk
    states = {0: {"w": torch.from_numpy(before)}, 1: {"w": torch.from_numpy(after)}}
    with CheckpointManager(root, chunk_size=CHUNK) as mgr:
        for step, state in states.items():
            mgr.save(step, state)
        mgr.wait()
    return states


def the_delta(root: Path) -> tuple[str, str]:
    with CheckpointManager(root) as mgr:
        (entry,) = mgr.manifest(1)["chunks"]
    assert entry.get("base"), "step 1 should be a plane delta against step 0"
    return entry["id"], entry["base"]


def test_a_delta_restore_reads_only_the_base_planes_it_xors(tmp_path: Path) -> None:
    states = two_steps(tmp_path / "v")
    cid, base = the_delta(tmp_path / "v")
    store = CountingStore(tmp_path / "v")
    with CheckpointManager(store) as mgr:
        assert mgr.manifest(1)["requires"] == ["xplanes"]
        assert_same_state(states[1], mgr.restore(1))
    base_object = (tmp_path / "v" / chunk_key(base)).read_bytes()
    header, payload = parse_object(base, base_object)
    entries, _ = plane_table(payload, 4)
    delta_entries, _ = plane_table(parse_object(cid, (tmp_path / "v" / chunk_key(cid)).read_bytes())[1], 4)
    xored = [k for k, e in enumerate(delta_entries) if e.xor]
    assert 0 not in xored and 3 in xored
    used = entries[xored[-1]].offset + entries[xored[-1]].length - entries[xored[0]].offset
    assert store.read[chunk_key(cid)] == (tmp_path / "v" / chunk_key(cid)).stat().st_size
    assert store.read[chunk_key(base)] <= 4096 + used
    assert store.read[chunk_key(base)] <= len(base_object) - entries[0].length + 4096  # plane 0 never read


def damage(root: Path, cid: str, plane: int) -> None:
    """Flip a byte in the middle of stored plane ``plane`` of chunk ``cid``."""
    path = root / chunk_key(cid)
    data = bytearray(path.read_bytes())
    entries, _ = plane_table(parse_object(cid, bytes(data))[1], 4)
    where = header_length(bytes(data[:8])) + entries[plane].offset + entries[plane].length // 2
    data[where] ^= 0xFF
    path.chmod(0o644)
    path.write_bytes(bytes(data))


def test_damage_to_a_base_plane_the_delta_does_not_use_leaves_it_restorable(tmp_path: Path) -> None:
    states = two_steps(tmp_path / "v")
    _, base = the_delta(tmp_path / "v")
    damage(tmp_path / "v", base, plane=0)
    with CheckpointManager(tmp_path / "v") as mgr:
        assert_same_state(states[1], mgr.restore(1))  # verified against its own hash
        with pytest.raises(CorruptChunkError, match="does not match"):
            mgr.restore(0)
        report = mgr.verify()
        assert not report.ok and list(report.problems) == [0]


def test_damage_to_a_base_plane_the_delta_xors_is_reported_against_the_base(tmp_path: Path) -> None:
    """A damaged base plane fails the delta's own hash check, and the error names the base (DESIGN C3)."""
    two_steps(tmp_path / "v")
    cid, base = the_delta(tmp_path / "v")
    damage(tmp_path / "v", base, plane=3)
    with CheckpointManager(tmp_path / "v") as mgr, pytest.raises(CorruptChunkError) as caught:
        mgr.restore(1)
    message = str(caught.value)
    assert cid in message and f"its delta base {base} is corrupt" in message and "step 1" in message


def test_a_missing_base_is_reported_as_missing(tmp_path: Path) -> None:
    two_steps(tmp_path / "v")
    cid, base = the_delta(tmp_path / "v")
    path = tmp_path / "v" / chunk_key(base)
    path.chmod(0o644)
    path.unlink()
    with CheckpointManager(tmp_path / "v") as mgr, pytest.raises(CorruptChunkError, match=f"delta base {base} is missing"):
        mgr.restore(1)


def test_a_delta_against_a_base_stored_raw(tmp_path: Path) -> None:
    """A keyframe of incompressible floats is stored raw; a later step that changes only low mantissa bits
    is still a plane delta (the high planes XOR to zero), read against the whole raw base."""
    rng = np.random.default_rng(4)
    bits = rng.integers(0, 2**32, size=1 << 16, dtype=np.uint32)
    bits &= ~np.uint32(0x7F800000)  # keep exponents finite...
    bits |= rng.integers(1, 254, size=bits.size, dtype=np.uint32) << np.uint32(23)  # ...and random, so nothing compresses
    later = bits ^ rng.integers(0, 256, size=bits.size, dtype=np.uint32)  # only the lowest byte changes
    states = {0: {"w": torch.from_numpy(bits.view(np.float32))}, 1: {"w": torch.from_numpy(later.view(np.float32))}}
    with CheckpointManager(tmp_path / "v", chunk_size=CHUNK) as mgr:
        for step, state in states.items():
            mgr.save(step, state)
        mgr.wait()
        (key_entry,) = mgr.manifest(0)["chunks"]
        assert key_entry["stored"] > CHUNK  # stored raw: header + the bytes
        (entry,) = mgr.manifest(1)["chunks"]
        assert entry.get("base") == key_entry["id"] and entry["stored"] < 0.3 * CHUNK
    with CheckpointManager(tmp_path / "v") as mgr:
        for step, state in states.items():
            assert_same_state(state, mgr.restore(step))
        assert mgr.verify().ok
