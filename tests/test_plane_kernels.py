"""The numba byte-plane kernels write exactly what the numpy loops they replace write."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptvault._codecs import planes as planes_module
from ckptvault._codecs.planes import assemble, split_planes


def numpy_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(planes_module, "_kernels", False)  # as where numba is missing


@pytest.mark.parametrize("typesize", [2, 4, 8])
def test_kernels_are_in_use(typesize: int) -> None:
    split_planes(bytes(64), typesize)
    assert planes_module._plane_kernels() is not None


@settings(max_examples=60, deadline=None)
@given(data=st.binary(min_size=0, max_size=3000), typesize=st.sampled_from([1, 2, 3, 4, 8]),
       readonly=st.booleans())
def test_kernels_match_numpy_and_round_trip(data: bytes, typesize: int, readonly: bool) -> None:
    source: bytes | memoryview = data if readonly else memoryview(bytearray(data))
    planes, tail = split_planes(source, typesize)
    planes, tail = planes.copy(), bytes(tail)
    with pytest.MonkeyPatch.context() as mp:
        numpy_only(mp)
        reference, reference_tail = split_planes(source, typesize)
        np.testing.assert_array_equal(planes, reference)
        assert tail == bytes(reference_tail)
        back_numpy = assemble(list(reference), reference_tail, np.empty(len(data), np.uint8)).tobytes()
    back = assemble(list(planes), tail, np.empty(len(data), np.uint8)).tobytes()
    assert back == data and back_numpy == data


def test_kernels_on_a_chunk_of_floats() -> None:
    """A 4 MiB chunk of float32, split into caller memory and joined from planes of mixed origin (read-only
    views of bytes, writable arrays), as a save and a restore do."""
    values = np.random.default_rng(3).standard_normal(1 << 20, dtype=np.float32)
    raw = values.tobytes()
    out = np.empty(len(raw), np.uint8)
    planes, _ = split_planes(raw, 4, out)
    assert planes.base is out or planes.base is out.base
    words = values.view(np.uint32)
    for k in range(4):
        np.testing.assert_array_equal(planes[k], ((words >> (8 * k)) & 0xFF).astype(np.uint8))
    readonly = [np.frombuffer(planes[k].tobytes(), np.uint8) for k in (0, 3)]
    mixed = [readonly[0], planes[1].copy(), planes[2], readonly[1]]
    assert assemble(mixed, b"", np.empty(len(raw), np.uint8)).tobytes() == raw


@pytest.mark.parametrize("typesize", [2, 4, 8])
def test_kernels_on_unaligned_memory(typesize: int) -> None:
    """Chunks of a packed buffer can start at any byte: the kernels read and write unaligned words too."""
    raw = np.random.default_rng(typesize).integers(0, 256, typesize * 1000 + 3, dtype=np.uint8).tobytes()
    source = memoryview(bytearray(b"x" + raw))[1:]
    planes, tail = split_planes(source, typesize)
    whole = len(raw) // typesize * typesize
    np.testing.assert_array_equal(planes, np.frombuffer(raw, np.uint8)[:whole].reshape(-1, typesize).T)
    out = np.empty(len(raw) + 1, np.uint8)[1:]
    assert assemble(list(planes), tail, out).tobytes() == raw


def test_background_loading_loads_the_kernels_that_saves_and_restores_use(tmp_path: Path) -> None:
    """In a fresh interpreter, load_kernels_in_background loads every split and join kernel on a background
    thread; a save and a restore of 2-, 4- and 8-byte elements then load nothing more."""
    script = f"""
import torch
from ckptvault import CheckpointManager
from ckptvault._codecs import plane_kernels as k, planes

with CheckpointManager({str(tmp_path / "vault")!r}, async_save=False) as mgr:
    planes.load_kernels_in_background().join()
    names = [f"_{{kind}}{{size}}" for kind in ("split", "join") for size in (2, 4, 8)]
    loaded = {{name: len(getattr(k, name).signatures) for name in names}}
    assert all(n == 1 for n in loaded.values()), loaded
    assert planes.load_kernels_in_background() is None  # loaded: nothing to start
    state = {{"h": torch.randn(50_000).bfloat16(), "f": torch.randn(50_000), "d": torch.randn(50_000).double()}}
    mgr.save(1, state)
    back = mgr.restore(1)
    assert all(torch.equal(back[key], value) for key, value in state.items())
    after = {{name: len(getattr(k, name).signatures) for name in loaded}}
    assert after == loaded, (loaded, after)
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]
