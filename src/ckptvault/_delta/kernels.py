"""Prediction kernels: what a checkpoint's arrays should be, given the one a step earlier (DESIGN §6, "Predicted deltas").

Each kernel is a fixed sequence of IEEE-754 operations on arrays of the record's dtype (float32 or float64), one
numpy ufunc per operation: every operation rounds to the dtype, none is fused with another (no multiply-add
contraction), and square roots and quotients are correctly rounded, as IEEE-754 requires. So a kernel gives the
same bits on every machine, at save and at restore. Constants that need library functions (powers, for bias
corrections) are computed once at save and stored in the manifest as values of the dtype. A kernel's name carries
its version: a new formula is a new name, and old names keep their formula.

Restores check the result against the digest the manifest holds, so a prediction that ever differed would be an
error, never a silent change. One condition would make it differ: flush-to-zero of subnormal numbers in the
thread that computes (``torch.set_flush_denormal(True)``); :func:`check_ieee` refuses to compute then.

Once a process has loaded numba for its byte-plane kernels (``_codecs/planes.py``), the same formulas run as one
pass per slice (``fused_kernels.py``: the same operations in the same order, so the same bits), loaded in the
background on first need; a slice whose prediction holds a NaN is computed here again, as a NaN's payload may
depend on a compiler's order of operands.

A record stores its residual against its prediction (:func:`residual_of`, undone by :func:`undo_residual`): the XOR
of the two bit patterns, or their difference as unsigned integers wrapping at the width, zigzag-coded so that
small differences of either sign have small codes (``"diff"``, what saves write: a first moment's new bits sit
above and below its prediction alike, and the difference's high bytes then hold fewer distinct values than the
XOR's). Both are integer operations, exact everywhere.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import blake3
import numpy as np

from .._codecs.planes import kernels_ready
from .._format.predicted import KERNEL_SIGNATURES, RESIDUALS
from .._parallel import map_all
from ..errors import PredictionError

#: a kernel writes its prediction into ``out`` (or returns an input itself, for ``same-1``), using ``tmp``
Kernel = Callable[[Mapping[str, np.ndarray], Mapping[str, float], np.ndarray, np.ndarray], np.ndarray]


def _same(x: Mapping[str, np.ndarray], s: Mapping[str, float], out: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    return x["x0"]


def _scale(x: Mapping[str, np.ndarray], s: Mapping[str, float], out: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    return np.multiply(x["x0"], out.dtype.type(s["c"]), out=out)


def _max(x: Mapping[str, np.ndarray], s: Mapping[str, float], out: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    return np.maximum(x["a0"], x["b1"], out=out)


def _adam_param(x: Mapping[str, np.ndarray], s: Mapping[str, float], out: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    """Adam's parameter update from the step's new moments: ``(m1 * neg_step_size) / (sqrt(v1) / bc2_sqrt + eps)
    + p0 * decay``, each operation rounded in turn (torch's order; ``decay`` is 1 - lr * weight_decay for AdamW's
    decoupled decay, else 1)."""
    t = out.dtype.type
    np.sqrt(x["v1"], out=tmp)
    np.divide(tmp, t(s["bc2_sqrt"]), out=tmp)
    np.add(tmp, t(s["eps"]), out=tmp)
    np.multiply(x["m1"], t(s["neg_step_size"]), out=out)
    np.divide(out, tmp, out=out)
    np.multiply(x["p0"], t(s["decay"]), out=tmp)
    return np.add(out, tmp, out=out)


def _adam_sq(x: Mapping[str, np.ndarray], s: Mapping[str, float], out: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    """Adam's second moment from the gradient recovered from the first: ``g = (m1 - m0 * b1) / (1 - b1)``, then
    ``v0 * b2 + (g * g) * (1 - b2)``. Rounding makes it approximate; the XOR stores what differs."""
    t = out.dtype.type
    np.multiply(x["m0"], t(s["b1"]), out=tmp)
    np.subtract(x["m1"], tmp, out=tmp)
    np.divide(tmp, t(s["one_minus_b1"]), out=tmp)
    np.multiply(tmp, tmp, out=tmp)
    np.multiply(tmp, t(s["one_minus_b2"]), out=tmp)
    np.multiply(x["v0"], t(s["b2"]), out=out)
    return np.add(out, tmp, out=out)


def _sgd_param(x: Mapping[str, np.ndarray], s: Mapping[str, float], out: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    """SGD with momentum: ``p0 + buf1 * neg_lr``."""
    np.multiply(x["buf1"], out.dtype.type(s["neg_lr"]), out=out)
    return np.add(x["p0"], out, out=out)


def _sgd_nesterov(x: Mapping[str, np.ndarray], s: Mapping[str, float], out: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    """Nesterov SGD: the gradient recovered from the two buffers, ``g = (buf1 - buf0 * momentum) /
    (1 - dampening)``, then ``p0 + (g + buf1 * momentum) * neg_lr``; approximate, like :func:`_adam_sq`."""
    t = out.dtype.type
    np.multiply(x["buf0"], t(s["momentum"]), out=tmp)
    np.subtract(x["buf1"], tmp, out=tmp)
    np.divide(tmp, t(s["one_minus_dampening"]), out=tmp)
    np.multiply(x["buf1"], t(s["momentum"]), out=out)
    np.add(tmp, out, out=tmp)
    np.multiply(tmp, t(s["neg_lr"]), out=tmp)
    return np.add(x["p0"], tmp, out=out)


KERNELS: dict[str, Kernel] = {
    "same-1": _same, "scale-1": _scale, "max-1": _max, "adam-param-1": _adam_param, "adam-sq-1": _adam_sq,
    "sgd-param-1": _sgd_param, "sgd-nesterov-1": _sgd_nesterov,
}
assert set(KERNELS) == set(KERNEL_SIGNATURES)
#: kernels whose residuals are almost all zero bits (the others predict first moments, which carry new gradient)
NEARLY_EXACT = frozenset({"max-1", "adam-param-1", "adam-sq-1", "sgd-param-1", "sgd-nesterov-1"})

#: elements of each slice a kernel runs on (every kernel is elementwise: slicing changes no bit); slices run in
#: parallel and reuse per-thread scratch arrays, as fresh memory for every temporary is slow to fault in
SLICE = 1 << 18
_scratch = threading.local()


def predict(op: str, inputs: Mapping[str, np.ndarray], scalars: Mapping[str, float]) -> np.ndarray:
    """The prediction of kernel ``op``, as a new array."""
    first = next(iter(inputs.values()))
    out = np.empty_like(first)
    with np.errstate(all="ignore"):  # 0/0 and overflow are IEEE results like any other, the same everywhere
        result = KERNELS[op](inputs, scalars, out, np.empty_like(first))
    return result if result is out else result.copy()


def residual_of(op: str, inputs: Mapping[str, np.ndarray], scalars: Mapping[str, float], target: np.ndarray,
                source: np.ndarray, residual: str, pool: ThreadPoolExecutor | None = None) -> None:
    """``target`` = the ``residual`` (``"xor"`` or ``"diff"``) of ``source``'s bits against the prediction of ``op``;
    in slices on ``pool`` when given (numpy and the fused kernels release the GIL). ``target`` may be one of the
    inputs: each slice's prediction is made before its slice is written. Not from one of ``pool``'s own threads."""
    _per_slice(op, inputs, scalars, target, source, _COMBINE[residual, False], (), 0, pool)


def undo_residual(op: str, inputs: Mapping[str, np.ndarray], scalars: Mapping[str, float], target: np.ndarray,
                  residual: str, skip: tuple[int, ...] = (), block: int = 0, pool: ThreadPoolExecutor | None = None,
                  source: np.ndarray | None = None) -> None:
    """The inverse of :func:`residual_of`: ``target`` = the bits ``source`` (``target`` itself by default) stores as
    its ``residual`` against the prediction of ``op``, except in the ``block``-byte blocks ``skip`` names (stored as
    they are), left as they are. Slices and ``pool`` as for :func:`residual_of`."""
    _per_slice(op, inputs, scalars, target, target if source is None else source, _COMBINE[residual, True], skip,
               block, pool)


#: combines a slice's stored or original bits with its prediction's: (source, prediction, target, scratch), arrays
#: of unsigned integers of the dtype's width, one length; ``target`` may be ``source``, never the scratch
Combine = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray], None]


def _per_slice(op: str, inputs: Mapping[str, np.ndarray], scalars: Mapping[str, float], target: np.ndarray,
               source: np.ndarray, combine: Combine, skip: tuple[int, ...], block: int,
               pool: ThreadPoolExecutor | None) -> None:
    per_block = block // target.itemsize if block else 0
    skipped = set(skip)
    parts = [(start, min(start + SLICE, len(target))) for start in range(0, len(target), SLICE)]
    if skipped:
        parts = [p for start, stop in _without(len(target), per_block, skipped) for p in _sliced(start, stop)]
    bits = np.dtype(f"u{target.itemsize}")

    def one(part: tuple[int, int]) -> None:
        lo, hi = part
        out, tmp = _buffers(target.dtype, hi - lo)
        prediction = _predicted(op, {role: a[lo:hi] for role, a in inputs.items()}, scalars, out, tmp)
        if prediction is not out and np.may_share_memory(prediction, target):  # an input (same-1) that is the target
            np.copyto(out, prediction)
            prediction = out
        combine(source[lo:hi].view(bits), prediction.view(bits), target[lo:hi].view(bits), tmp.view(bits))

    if pool is None or len(parts) <= 1:
        for part in parts:
            one(part)
    else:
        map_all(pool, one, parts)


def _xor(source: np.ndarray, prediction: np.ndarray, target: np.ndarray, tmp: np.ndarray) -> None:
    np.bitwise_xor(source, prediction, out=target)


def _diff(source: np.ndarray, prediction: np.ndarray, target: np.ndarray, tmp: np.ndarray) -> None:
    """``target = zigzag(source - prediction)``, the difference wrapping at the width: a value one unit in the
    last place above its prediction stores 2, one below stores 1 (XOR would set every bit that the carry flips)."""
    fused = _ready_fused()
    if fused is not None and target.itemsize == 4:
        fused.diff32(source, prediction, target)
        return
    signed = np.dtype(f"i{target.itemsize}")
    np.subtract(source, prediction, out=target)
    np.right_shift(target.view(signed), 8 * target.itemsize - 1, out=tmp.view(signed))  # all ones where negative
    np.left_shift(target, 1, out=target)
    np.bitwise_xor(target, tmp, out=target)


def _undiff(source: np.ndarray, prediction: np.ndarray, target: np.ndarray, tmp: np.ndarray) -> None:
    """The inverse of :func:`_diff`: ``target = prediction + unzigzag(source)``, wrapping at the width."""
    fused = _ready_fused()
    if fused is not None and target.itemsize == 4:
        fused.undiff32(source, prediction, target)
        return
    signed = np.dtype(f"i{target.itemsize}")
    np.bitwise_and(source, 1, out=tmp)
    np.negative(tmp.view(signed), out=tmp.view(signed))  # all ones where the difference is negative
    np.right_shift(source, 1, out=target)
    np.bitwise_xor(target, tmp, out=target)
    np.add(target, prediction, out=target)


#: (residual, undo) -> how a slice's bits combine with its prediction's
_COMBINE: dict[tuple[str, bool], Combine] = {("xor", False): _xor, ("xor", True): _xor,
                                             ("diff", False): _diff, ("diff", True): _undiff}
assert {r for r, _undo in _COMBINE} == set(RESIDUALS)


def _predicted(op: str, inputs: Mapping[str, np.ndarray], scalars: Mapping[str, float], out: np.ndarray,
               tmp: np.ndarray) -> np.ndarray:
    """Kernel ``op``'s prediction in ``out`` (or an input, for ``same-1``): in one pass where the fused kernels
    are loaded and the result holds no NaN, else by the numpy sequence."""
    fused = _ready_fused()
    if fused is not None and op in fused.KERNELS and not fused.predict_into(op, inputs, scalars, out):
        return out
    with np.errstate(all="ignore"):  # 0/0 and overflow are IEEE results like any other, the same everywhere
        return KERNELS[op](inputs, scalars, out, tmp)


_fused: Any = None  # the fused_kernels module once loaded, False where it could not be
_fused_loading: threading.Thread | None = None
_fused_lock = threading.Lock()
log = logging.getLogger(__name__)


def _ready_fused() -> Any:
    """``fused_kernels`` once loaded, else None; starts loading it, on a daemon thread, once the byte-plane
    kernels have loaded numba (small states never import numba for predictions)."""
    global _fused_loading
    if _fused is not None:
        return _fused or None
    if kernels_ready() and _fused_loading is None:
        with _fused_lock:
            if _fused_loading is None:
                _fused_loading = threading.Thread(target=_load_fused, name="ckptvault-load-fused", daemon=True)
                _fused_loading.start()
    return None


def _load_fused() -> None:
    global _fused
    try:
        from . import fused_kernels

        fused_kernels.load()
    except Exception as exc:  # noqa: BLE001 - a broken numba cache or compiler: the numpy sequences stay in use
        log.warning("could not load the fused prediction kernels (%s: %s); using numpy", type(exc).__name__, exc)
        _fused = False
        return
    _fused = fused_kernels


def wait_for_fused_loading() -> None:
    """Return once the thread loading the fused kernels (if any) has finished: none is left compiling while the
    interpreter exits."""
    thread = _fused_loading
    if thread is not None and thread is not threading.current_thread():
        thread.join()


def _without(n: int, per_block: int, skipped: set[int]) -> list[tuple[int, int]]:
    """Element ranges of ``[0, n)`` outside the blocks ``skipped``."""
    ranges, start = [], 0
    for b in sorted(skipped):
        lo, hi = b * per_block, min(n, (b + 1) * per_block)
        if lo > start:
            ranges.append((start, lo))
        start = max(start, hi)
    if start < n:
        ranges.append((start, n))
    return ranges


def _sliced(start: int, stop: int) -> list[tuple[int, int]]:
    return [(lo, min(lo + SLICE, stop)) for lo in range(start, stop, SLICE)]


def _buffers(dtype: np.dtype, n: int) -> tuple[np.ndarray, np.ndarray]:
    """This thread's two scratch arrays of ``dtype``, at least ``n`` long, as views of ``n`` elements."""
    held = getattr(_scratch, "arrays", None)
    if held is None:
        held = _scratch.arrays = {}
    pair = held.get(dtype)
    if pair is None or len(pair[0]) < n:
        pair = held[dtype] = (np.empty(max(n, SLICE), dtype=dtype), np.empty(max(n, SLICE), dtype=dtype))
    return pair[0][:n], pair[1][:n]


def check_ieee() -> None:
    """Raise PredictionError if this thread flushes subnormal numbers to zero: predictions would not be exact."""
    tiny = np.array([1e-38], dtype=np.float32) * np.float32(1e-3)
    if tiny[0] == 0:
        raise PredictionError("this thread flushes subnormal floats to zero (torch.set_flush_denormal(True)?), so "
                              "predicted checkpoints cannot be computed exactly here; call "
                              "torch.set_flush_denormal(False) before saving or restoring")


#: the numpy dtype of each record dtype predictions are computed in (``_format.predicted.PREDICTED_DTYPES``)
NUMPY_DTYPES: dict[str, np.dtype] = {"float32": np.dtype(np.float32), "float64": np.dtype(np.float64)}


def flat_array(buffer: memoryview, dtype: str) -> np.ndarray:
    """A record's bytes as a flat array of its ``dtype`` if predictions compute in it, else of bytes."""
    numeric = NUMPY_DTYPES.get(dtype)
    flat = np.frombuffer(buffer, dtype=np.uint8)
    return flat if numeric is None else flat.view(numeric)


def digest(array: np.ndarray) -> str:
    """BLAKE3 hex digest of an array's bytes (as a chunk is named), on several threads for a large one."""
    data = array.view(np.uint8).data
    threads = blake3.blake3.AUTO if len(data) > (8 << 20) else 1
    return blake3.blake3(data, max_threads=threads).hexdigest()

