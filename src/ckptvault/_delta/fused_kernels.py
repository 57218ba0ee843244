"""Prediction kernels in one pass (numba): each computes what ``kernels.py``'s numpy sequence computes, element by
element in the same order of operations, with every operation rounded to the array's dtype and none fused with
another (numba compiles without fast-math, so no multiply-add contraction; square roots and quotients are
correctly rounded; numpy's error model: a division by zero is IEEE's infinity or NaN, not an exception). So for
every element whose prediction is a number, the bits are those of the numpy kernels. A NaN's payload, though, may
depend on the order in which a compiler passes the operands of a commutative operation: each kernel counts the
NaNs it made, and its caller then computes that slice with numpy.

Contract: ``KERNELS[op][0](inputs..., out, scalars...)`` writes the prediction into ``out`` and returns how many
of its elements are NaN. Arrays are 1-D, of one float dtype and length; scalars are of the arrays' dtype.
:func:`diff32` and :func:`undiff32` make and undo a ``"diff"`` residual of uint32 words. The kernels release the
GIL, compile on first use and are cached on disk by numba.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numba import njit

_OPTIONS: dict[str, Any] = {"nogil": True, "cache": True, "boundscheck": False, "error_model": "numpy"}


@njit(**_OPTIONS)
def _scale(x0, out, c):  # type: ignore[no-untyped-def]
    nan = 0
    for i in range(out.size):
        y = x0[i] * c
        nan += y != y  # a count, not a flag: the loop stays vectorised
        out[i] = y
    return nan


@njit(**_OPTIONS)
def _adam_param(p0, m1, v1, out, decay, neg_step_size, bc2_sqrt, eps):  # type: ignore[no-untyped-def]
    nan = 0
    for i in range(out.size):
        denominator = np.sqrt(v1[i]) / bc2_sqrt + eps
        y = (m1[i] * neg_step_size) / denominator + p0[i] * decay
        nan += y != y  # a count, not a flag: the loop stays vectorised
        out[i] = y
    return nan


@njit(**_OPTIONS)
def _adam_sq(v0, m0, m1, out, b1, one_minus_b1, b2, one_minus_b2):  # type: ignore[no-untyped-def]
    nan = 0
    for i in range(out.size):
        g = (m1[i] - m0[i] * b1) / one_minus_b1
        y = v0[i] * b2 + (g * g) * one_minus_b2
        nan += y != y  # a count, not a flag: the loop stays vectorised
        out[i] = y
    return nan


@njit(**_OPTIONS)
def _sgd_param(p0, buf1, out, neg_lr):  # type: ignore[no-untyped-def]
    nan = 0
    for i in range(out.size):
        y = p0[i] + buf1[i] * neg_lr
        nan += y != y  # a count, not a flag: the loop stays vectorised
        out[i] = y
    return nan


@njit(**_OPTIONS)
def _sgd_nesterov(p0, buf0, buf1, out, neg_lr, momentum, one_minus_dampening):  # type: ignore[no-untyped-def]
    nan = 0
    for i in range(out.size):
        g = (buf1[i] - buf0[i] * momentum) / one_minus_dampening
        y = p0[i] + (g + buf1[i] * momentum) * neg_lr
        nan += y != y  # a count, not a flag: the loop stays vectorised
        out[i] = y
    return nan


@njit(**_OPTIONS)
def diff32(source, prediction, out):  # type: ignore[no-untyped-def]
    """``out = zigzag(source - prediction)`` on uint32 bit patterns, the difference wrapping at 32 bits
    (``kernels._diff``'s numpy sequence in one pass)."""
    for i in range(out.size):
        d = np.int32(np.int64(source[i]) - np.int64(prediction[i]))  # wraps to 32 bits
        out[i] = np.uint32((np.int64(d) << 1) ^ (np.int64(d) >> 31))


@njit(**_OPTIONS)
def undiff32(source, prediction, out):  # type: ignore[no-untyped-def]
    """The inverse of :func:`diff32`: ``out = prediction + unzigzag(source)``, wrapping at 32 bits."""
    for i in range(out.size):
        z = np.int64(source[i])
        out[i] = np.uint32(((z >> 1) ^ -(z & 1)) + np.int64(prediction[i]))


#: per kernel name: the compiled loop, the input roles and the scalar names in the order it takes them. ``max-1``
#: stays with numpy: one operation gains nothing from fusing, and the sign of a maximum of two zeros is numpy's own
KERNELS: dict[str, tuple[Callable[..., int], tuple[str, ...], tuple[str, ...]]] = {
    "scale-1": (_scale, ("x0",), ("c",)),
    "adam-param-1": (_adam_param, ("p0", "m1", "v1"), ("decay", "neg_step_size", "bc2_sqrt", "eps")),
    "adam-sq-1": (_adam_sq, ("v0", "m0", "m1"), ("b1", "one_minus_b1", "b2", "one_minus_b2")),
    "sgd-param-1": (_sgd_param, ("p0", "buf1"), ("neg_lr",)),
    "sgd-nesterov-1": (_sgd_nesterov, ("p0", "buf0", "buf1"), ("neg_lr", "momentum", "one_minus_dampening")),
}


def predict_into(op: str, inputs: dict[str, np.ndarray], scalars: dict[str, float], out: np.ndarray) -> bool:
    """Kernel ``op``'s prediction into ``out``; True if it holds a NaN (then compute it with numpy instead)."""
    kernel, roles, names = KERNELS[op]
    t = out.dtype.type
    return kernel(*(inputs[role] for role in roles), out, *(t(scalars[name]) for name in names)) > 0


def load() -> None:
    """Call every kernel once per dtype, which loads its compiled code (from numba's cache after the first time)."""
    for dtype in (np.float32, np.float64):
        for op, (_kernel, roles, names) in KERNELS.items():
            one = np.ones(1, dtype=dtype)
            predict_into(op, dict.fromkeys(roles, one), dict.fromkeys(names, 1.0), np.empty(1, dtype=dtype))
    words = np.ones(1, dtype=np.uint32)
    diff32(words, words, np.empty(1, dtype=np.uint32))
    undiff32(words, words, np.empty(1, dtype=np.uint32))
