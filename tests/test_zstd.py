"""The vault's zstd stage: level 1 accelerated with Huffman-coded literals, or searching as a sample says
(_codecs/zstd.py); ordinary frames."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptvault._codecs.zstd as zstd_module
from ckptvault._codecs.planes import BytePlanes, plane_table, split_planes
from ckptvault._codecs.zstd import LEVEL1_ACCELERATION, LEVEL1_HASH_LOG, LITERALS_FROM, SPARSE_BELOW, Zstd


def _skewed_noise(n: int, seed: int = 0) -> bytes:
    """Bytes with no repeats worth a match but a skewed distribution (like an XORed high mantissa plane):
    only entropy coding of literals shrinks them."""
    return np.random.default_rng(seed).geometric(0.3, n).clip(0, 255).astype(np.uint8).tobytes()


def test_level_1_is_accelerated_where_the_package_is_installed_as_declared() -> None:
    # pyproject.toml asks for zstandard[cffi]: a test environment without it would measure the slower compressor
    assert zstd_module.ACCELERATED, "zstandard's CFFI backend is missing: pip install 'zstandard[cffi]'"
    assert type(zstd_module._compressor(1)).__name__ == "_AcceleratedLevel1"
    assert isinstance(zstd_module._compressor(3), zstandard.ZstdCompressor)


def test_accelerated_level_1_still_entropy_codes_literals() -> None:
    """zstd's plain acceleration (what negative levels do) stores literals raw; the vault's keeps Huffman coding."""
    data = _skewed_noise(1 << 20)
    plain_acceleration = zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters.from_level(
        1, hash_log=LEVEL1_HASH_LOG, target_length=LEVEL1_ACCELERATION))
    assert len(plain_acceleration.compress(data)) > 0.95 * len(data)
    stored = Zstd(1).encode(memoryview(data))
    assert len(stored) < 0.6 * len(data)
    assert zstandard.ZstdDecompressor().decompress(stored) == data


def test_accelerated_level_1_searches_less_than_the_unaccelerated_one() -> None:
    """Acceleration is on: it skips ahead where it finds no match, so it misses repeats that level 1 finds."""
    rng = np.random.default_rng(1)
    pieces = [rng.integers(0, 256, int(rng.integers(200, 2000)), dtype=np.uint8).tobytes() for _ in range(64)]
    data = b"".join(pieces[i % 16] if i % 2 else pieces[i] for i in range(64))  # repeats far apart, noise between
    unaccelerated = zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters.from_level(
        1, hash_log=LEVEL1_HASH_LOG, write_content_size=1))
    assert len(Zstd(1).encode(memoryview(data))) > len(unaccelerated.compress(data))


def _unaccelerated(data: bytes) -> bytes:
    params = zstandard.ZstdCompressionParameters.from_level(1, hash_log=LEVEL1_HASH_LOG, write_content_size=1)
    return zstandard.ZstdCompressor(compression_params=params).compress(data)


def test_data_sampled_as_sparse_is_compressed_without_acceleration() -> None:
    data = _skewed_noise(1 << 18)
    codec = Zstd(1)
    assert codec.encode_sampled(memoryview(data), SPARSE_BELOW / 2) == _unaccelerated(data)
    assert codec.encode_sampled(memoryview(data), SPARSE_BELOW) == codec.encode(memoryview(data)) != _unaccelerated(data)
    assert codec.encode_sampled(memoryview(data), None) == codec.encode(memoryview(data))


def _repeats_between_noise() -> bytes:
    rng = np.random.default_rng(2)
    block = rng.integers(0, 256, 3000, dtype=np.uint8).tobytes()
    return b"".join(block + rng.integers(0, 256, 500, dtype=np.uint8).tobytes() for _ in range(64))


def test_data_sampled_above_literals_from_is_written_as_literals_only() -> None:
    """No search: repeats that a search finds stay literals (the noise they are made of does not shrink), while a
    skewed distribution is still Huffman-coded, smaller than searched; below the bound level 1 searches."""
    assert zstd_module.LITERALS_ONLY, "zstd's ZSTD_compressSequences is missing from zstandard's CFFI backend"
    codec = Zstd(1)
    repeats = _repeats_between_noise()
    literals = codec.encode_sampled(memoryview(repeats), LITERALS_FROM)
    assert len(literals) > 0.99 * len(repeats) > 3 * len(_unaccelerated(repeats))
    assert codec.encode_sampled(memoryview(repeats), 0.99 * LITERALS_FROM) == codec.encode(memoryview(repeats))
    skewed = _skewed_noise(1 << 20)
    literals = codec.encode_sampled(memoryview(skewed), 0.5)
    assert len(literals) < min(0.45 * len(skewed), len(codec.encode(memoryview(skewed))))
    for data, frame in ((repeats, codec.encode_sampled(memoryview(repeats), 0.5)), (skewed, literals)):
        assert zstandard.get_frame_parameters(frame).content_size == len(data)
        assert zstandard.ZstdDecompressor().decompress(frame) == data
        assert bytes(codec.decode(memoryview(frame), len(data))) == data


def test_a_plane_of_one_repeated_byte_written_as_literals_is_stored_as_a_run() -> None:
    frame = Zstd(1).encode_sampled(memoryview(bytes(1 << 20)), 0.5)
    assert len(frame) < 100
    assert zstandard.ZstdDecompressor().decompress(frame) == bytes(1 << 20)


def test_other_levels_search_as_their_level_says_whatever_the_sample() -> None:
    data = _repeats_between_noise()
    level3 = zstandard.ZstdCompressor(compression_params=zstandard.ZstdCompressionParameters.from_level(
        3, write_content_size=1))
    for ratio in (None, SPARSE_BELOW / 2, LITERALS_FROM, 0.9):
        assert Zstd(3).encode_sampled(memoryview(data), ratio) == level3.compress(data)


def test_byte_planes_compress_a_sparse_plane_without_acceleration_and_a_dense_one_as_literals() -> None:
    """Floats whose sign-and-exponent plane is one value with rare exceptions (sparse, like an XOR delta's) and
    whose second plane is skewed noise: each plane is compressed as its sample says."""
    rng = np.random.default_rng(3)
    words = (rng.geometric(0.3, 1 << 20).clip(0, 255).astype(np.uint32) << 16) | rng.integers(0, 1 << 16, 1 << 20,
                                                                                              dtype=np.uint32)
    words[rng.integers(0, words.size, 2000)] |= np.uint32(0x3F000000)
    data = memoryview(words.view(np.uint8))
    stage = BytePlanes(4, Zstd(1))
    payload = memoryview(stage.encode(data))
    entries, _tail = plane_table(payload, 4)
    planes, _ = split_planes(data, 4)
    sparse, dense = bytes(planes[3]), bytes(planes[2])
    assert stage.sample_ratio(memoryview(planes[3])) < SPARSE_BELOW < LITERALS_FROM <= stage.sample_ratio(
        memoryview(planes[2]))
    stored = [bytes(payload[e.offset : e.offset + e.length]) for e in entries]
    assert entries[3].compressed and stored[3] == _unaccelerated(sparse)
    assert entries[2].compressed and stored[2] == zstd_module._LiteralsOnly().compress(dense)
    assert len(stored[2]) < len(Zstd(1).encode(memoryview(dense)))
    assert bytes(stage.decode(payload, len(data))) == bytes(data)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=1 << 16) | st.builds(_skewed_noise, st.integers(0, 1 << 17), st.integers(0, 9)))
def test_frames_are_ordinary_zstd_frames_that_round_trip(data: bytes) -> None:
    """Whichever way level 1 compresses (searched, unaccelerated for runs, literals only), empty input included."""
    for ratio in (None, SPARSE_BELOW / 2, LITERALS_FROM):
        stored = Zstd(1).encode_sampled(memoryview(data), ratio)
        assert zstandard.get_frame_parameters(stored).content_size == len(data)  # decoders size their output from it
        assert zstandard.ZstdDecompressor().decompress(stored) == data
        assert bytes(Zstd(1).decode(memoryview(stored), len(data))) == data


def test_each_thread_compresses_with_its_own_context() -> None:
    inputs = [_skewed_noise(300_000 + 1000 * i, seed=i) + bytes(5000 * i) for i in range(8)]
    results: dict[int, list[bytes]] = {}

    def work(i: int) -> None:
        results[i] = [Zstd(1).encode(memoryview(inputs[(i + k) % 8])) for k in range(8)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, frames in results.items():
        for k, frame in enumerate(frames):
            assert zstandard.ZstdDecompressor().decompress(frame) == inputs[(i + k) % 8]


def test_a_larger_input_after_a_smaller_one_grows_the_reused_buffer() -> None:
    """Also across a thread's contexts, which share one output buffer: each frame is copied out before the next."""
    small, large = _skewed_noise(1000), bytes(range(256)) * 40_000 + _skewed_noise(3 << 20, seed=5)
    codec = Zstd(1)
    for data in (small, large, small):
        frames = [codec.encode_sampled(memoryview(data), ratio) for ratio in (None, LITERALS_FROM, SPARSE_BELOW / 2)]
        for frame in frames:
            assert zstandard.ZstdDecompressor().decompress(frame) == data


def test_without_cffi_level_1_falls_back_to_the_plain_compressor(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(zstd_module, "ACCELERATED", False)
    monkeypatch.setattr(zstd_module, "_local", threading.local())  # no context cached by earlier tests
    data = _skewed_noise(1 << 18)
    assert isinstance(zstd_module._compressor(1), zstandard.ZstdCompressor)
    assert isinstance(zstd_module._compressor(1, "literals"), zstandard.ZstdCompressor)
    for stored in (Zstd(1).encode(memoryview(data)), Zstd(1).encode_sampled(memoryview(data), 0.5)):
        assert zstandard.ZstdDecompressor().decompress(stored) == data
