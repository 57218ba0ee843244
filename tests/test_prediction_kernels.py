"""The fused prediction kernels (numba) give the numpy sequences' bits for every prediction that is a number, say
when they made a NaN, and predictions through them stay exactly those of the numpy kernels, NaNs included."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ckptvault._delta import fused_kernels
from ckptvault._delta import kernels as kernels_module
from ckptvault._delta.kernels import KERNELS, residual_of, undo_residual
from ckptvault._format.predicted import KERNEL_SIGNATURES

FUSED = sorted(fused_kernels.KERNELS)
DTYPES = {np.float32: np.uint32, np.float64: np.uint64}


def special_values(dtype: type) -> np.ndarray:
    info = np.finfo(dtype)
    tiny = float(info.smallest_subnormal)
    values = [0.0, -0.0, tiny, -tiny, float(info.tiny), 1.0, -1.0, 0.1, 3.0, float(info.max), -float(info.max),
              np.inf, -np.inf, np.nan]
    return np.array(values, dtype=dtype)


def inputs_for(op: str, dtype: type, seed: int) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Every combination of special values across the kernel's inputs, then random numbers of every magnitude."""
    roles, names = KERNEL_SIGNATURES[op]
    grid = np.array(list(itertools.product(special_values(dtype), repeat=len(roles))), dtype=dtype).T
    rng = np.random.default_rng(seed)
    random = (rng.standard_normal((len(roles), 50_000)) * 10.0 ** rng.integers(-30, 30, (len(roles), 50_000)))
    columns = np.concatenate([grid, random.astype(dtype)], axis=1)
    scalars = {name: float(dtype(rng.standard_normal())) for name in names}
    return dict(zip(roles, columns, strict=True)), scalars


def numpy_prediction(op: str, inputs: dict[str, np.ndarray], scalars: dict[str, float]) -> np.ndarray:
    first = next(iter(inputs.values()))
    with np.errstate(all="ignore"):
        return KERNELS[op](inputs, scalars, np.empty_like(first), np.empty_like(first)).copy()


@pytest.mark.parametrize("dtype", list(DTYPES), ids=["float32", "float64"])
@pytest.mark.parametrize("op", FUSED)
def test_fused_kernels_give_the_numpy_bits_of_every_number_and_count_nans(op: str, dtype: type) -> None:
    inputs, scalars = inputs_for(op, dtype, seed=len(op))
    expected = numpy_prediction(op, inputs, scalars)
    got = np.empty_like(expected)
    made_nan = fused_kernels.predict_into(op, inputs, scalars, got)
    numbers = ~np.isnan(expected)
    bits = DTYPES[dtype]
    np.testing.assert_array_equal(got.view(bits)[numbers], expected.view(bits)[numbers])
    np.testing.assert_array_equal(np.isnan(got), ~numbers)
    assert made_nan == bool((~numbers).any())


@pytest.mark.parametrize("residual", ["xor", "diff"])
@pytest.mark.parametrize("op", FUSED)
def test_predictions_through_the_fused_kernels_are_those_of_numpy_nans_included(op: str, residual: str,
                                                                                monkeypatch) -> None:
    """Slices whose prediction holds a NaN (whose payload a compiler's operand order may change) are computed by
    numpy again: the residual is the same either way."""
    inputs, scalars = inputs_for(op, np.float32, seed=7)
    payloads = np.array([0x7FC00001, 0xFFC00002, 0x7F800003], dtype=np.uint32).view(np.float32)
    for k, array in enumerate(inputs.values()):  # NaNs of different payloads meeting in one operation
        array[-3:] = np.roll(payloads, k)
    source = np.random.default_rng(1).standard_normal(len(next(iter(inputs.values())))).astype(np.float32)
    fused_kernels.load()
    monkeypatch.setattr(kernels_module, "_fused", fused_kernels)
    through_fused = np.empty_like(source)
    residual_of(op, inputs, scalars, through_fused, source, residual)
    monkeypatch.setattr(kernels_module, "_fused", False)  # as where numba is missing
    through_numpy = np.empty_like(source)
    residual_of(op, inputs, scalars, through_numpy, source, residual)
    np.testing.assert_array_equal(through_fused.view(np.uint32), through_numpy.view(np.uint32))


def words(dtype: type, seed: int) -> np.ndarray:
    """Bit patterns of every kind: random words, the extremes of the width, and words one apart across a carry."""
    bits = DTYPES[dtype]
    top = np.iinfo(bits).max
    edges = np.array([0, 1, 2, top, top - 1, top >> 1, (top >> 1) + 1, 0xFF, 0x100, 0xFFFF, 0x10000], dtype=bits)
    random = np.random.default_rng(seed).integers(0, top, 100_000, dtype=bits, endpoint=True)
    return np.concatenate([edges, random])


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "numpy"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=["float32", "float64"])
@pytest.mark.parametrize("residual", ["xor", "diff"])
def test_every_residual_is_undone_bit_for_bit_for_any_bits(residual: str, dtype: type, fused: bool,
                                                           monkeypatch) -> None:
    """Residuals are integer operations on the bit patterns: any original and any prediction (NaN payloads, infinities,
    negative zero, words at the ends of the width) round trip, in place and into another array, through the fused
    kernels and through numpy; the two make the same residual."""
    fused_kernels.load()
    monkeypatch.setattr(kernels_module, "_fused", fused_kernels if fused else False)
    bits = DTYPES[dtype]
    original, predicted = words(dtype, 1), words(dtype, 2)
    pairs = np.array([[a, b] for a in words(dtype, 3)[:11] for b in words(dtype, 4)[:11]], dtype=bits)
    original, predicted = np.concatenate([original, pairs[:, 0]]), np.concatenate([predicted, pairs[:, 1]])
    inputs = {"x0": predicted.view(dtype)}
    stored = np.empty_like(original).view(dtype)
    residual_of("same-1", inputs, {}, stored, original.view(dtype), residual)
    monkeypatch.setattr(kernels_module, "_fused", False)
    by_numpy = np.empty_like(stored)
    residual_of("same-1", inputs, {}, by_numpy, original.view(dtype), residual)
    np.testing.assert_array_equal(stored.view(bits), by_numpy.view(bits))
    monkeypatch.setattr(kernels_module, "_fused", fused_kernels if fused else False)
    apart = np.empty_like(stored)
    undo_residual("same-1", inputs, {}, apart, residual, source=stored)
    np.testing.assert_array_equal(apart.view(bits), original)
    undo_residual("same-1", inputs, {}, stored, residual)  # in place
    np.testing.assert_array_equal(stored.view(bits), original)
    made = predicted.copy().view(dtype)
    residual_of("same-1", {"x0": made}, {}, made, original.view(dtype), residual)  # the target is the input
    np.testing.assert_array_equal(made.view(bits), by_numpy.view(bits))
    undone = predicted.copy().view(dtype)
    undo_residual("same-1", {"x0": undone}, {}, undone, residual, source=by_numpy)
    np.testing.assert_array_equal(undone.view(bits), original)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=["float32", "float64"])
def test_a_diff_residual_codes_small_differences_of_either_sign_small(dtype: type) -> None:
    """One unit in the last place above the prediction stores 2, one below stores 1, equal stores 0, across a carry
    and around zero too (where the XOR of two words one apart sets every bit the carry flips)."""
    bits = DTYPES[dtype]
    predicted = np.array([0x7FFF, 0x8000, 1, 0, 0x3F800000, np.iinfo(bits).max], dtype=bits)
    for step, code in ((1, 2), (-1, 1), (0, 0), (2, 4), (-2, 3)):
        original = predicted + bits(step) if step >= 0 else predicted - bits(-step)
        stored = np.empty_like(original).view(dtype)
        residual_of("same-1", {"x0": predicted.view(dtype)}, {}, stored, original.view(dtype), "diff")
        np.testing.assert_array_equal(stored.view(bits), np.full(len(predicted), code, dtype=bits))


def test_fused_kernels_load_only_once_numba_is_loaded_for_the_byte_planes(monkeypatch) -> None:
    monkeypatch.setattr(kernels_module, "_fused", None)
    monkeypatch.setattr(kernels_module, "_fused_loading", None)
    monkeypatch.setattr(kernels_module, "kernels_ready", lambda: False)
    assert kernels_module._ready_fused() is None and kernels_module._fused_loading is None
    monkeypatch.setattr(kernels_module, "kernels_ready", lambda: True)
    assert kernels_module._ready_fused() is None  # loading starts in the background; numpy meanwhile
    kernels_module.wait_for_fused_loading()
    assert kernels_module._ready_fused() is fused_kernels
