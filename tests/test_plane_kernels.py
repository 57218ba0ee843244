"""The numba byte-plane kernels write exactly what the numpy loops they replace write."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptvault.codecs import planes as planes_module
from ckptvault.codecs.planes import assemble, split_planes


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
