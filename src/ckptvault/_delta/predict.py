"""Predicted deltas: a checkpoint one optimizer step after the previous one stores its weights and moments as their
residual against their prediction from that checkpoint (DESIGN §6, "Predicted deltas").

Call order, one save at a time (the saver's): :meth:`Predictor.apply` after the snapshot (and lossy step), which
replaces the views of predicted records with their residuals; then the chunks are written and the manifest,
with the restore chain :func:`build_chain` makes, committed; then :meth:`Predictor.keep` copies the arrays the
next save's predictions read (this save's original bytes), or :meth:`Predictor.forget` after a failure. Only a
committed checkpoint's arrays are ever predicted from, and only when it is the vault's latest, of the same
manifest (``time``) the predictor kept, exactly one optimizer step back. A predictor that kept none of it (the
first save of a resumed run, the save after a failed one) takes the arrays, where the latest checkpoint's step is
the one just before the save's, from the copies its manager's restore of that checkpoint kept
(:meth:`Predictor.restoring`), or reads them back from the vault.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import zstandard

from .._codecs import DEFAULT_CODEC
from .._format.records import Manifest, PredictInfo, PredictInput
from .._restore.tensors import copied_record, manifest_leaves, restore_paths, tree_of
from .._save.snapshot import ArrayRecord, Snapshot, take_snapshot
from .._vault import Vault
from ..errors import PredictionError, VaultError
from ..rules import CodecRules
from .kernels import check_ieee, digest, flat_array, predict, residual_of
from .optimizers import ParamSlot, SlotKey, find_slots

log = logging.getLogger(__name__)

#: bytes of a block sampled to judge whether its prediction pays (a zstd-1 estimate of each form)
SAMPLE = 1 << 14
#: blocks smaller than this are judged by their count of non-zero bytes (too little for zstd to say)
SMALL = 4096
_ESTIMATOR = zstandard.ZstdCompressor(level=1)
#: steps a block's raw estimate is reused for (predicted saves are one step apart), unless its residual's
#: estimate comes close to it (a record's raw bytes compress alike from one step to the next, and a prediction
#: rarely comes near them: one estimate per block and save, the residual's, is what decides)
RAW_REUSE = 16
#: a residual estimate at least this fraction of the block's remembered raw estimate has the raw bytes estimated again
CLOSE = 0.75
#: the residual saves write (``kernels.residual_of``): the zigzag-coded difference, whose high byte planes store
#: smaller than the XOR's for first moments, and no larger for the nearly exact kinds
RESIDUAL = "diff"
#: records of at most this many bytes are predicted together with the others of their kernel and constants, in one
#: call (``Predictor._batched``): a call costs more than a small record's elements (biases, norms)
BATCH_UP_TO = 4096


@dataclass
class _Kept:
    """The arrays of the latest committed save that the next save's predictions may read."""

    step: int
    time: float
    arrays: dict[str, np.ndarray]
    slots: dict[SlotKey, dict[str, Any]]  # (optimizer, pid) -> kind, group, step, moment paths


@dataclass
class _Plan:
    index: int
    op: str
    inputs: tuple[PredictInput, ...]
    scalars: dict[str, float]
    slot: SlotKey | None = None  # a parameter's prediction: its optimizer slot, whose pairing it uses


@dataclass
class Predictor:
    """Predicts a save's arrays from the previous save's (``DeltaOptions.predict``); one per saver."""

    pairs: Mapping[str, str] | None = None
    _kept: _Kept | None = None
    _pending: tuple[int, list[memoryview], dict[SlotKey, ParamSlot], list[ArrayRecord]] | None = None
    _buffers: dict[str, np.ndarray] = field(default_factory=dict)
    #: the model array each optimizer parameter was paired with by a trial that matched (:data:`LIKELY`), taken
    #: again without one until its prediction stops paying
    _pairings: dict[SlotKey, str] = field(default_factory=dict)
    #: per record path and block: its raw bytes' estimate (compressed fraction of the sample, step it was made at)
    _raw_estimates: dict[str, dict[int, tuple[float, int]]] = field(default_factory=dict)
    #: copies of the arrays a restore of a committed checkpoint read (its step and time; record index -> array), for
    #: the first save's predictions in place of reading them back (:meth:`restoring`)
    _restored: tuple[int, float, dict[int, Any]] | None = None
    _restored_lock: threading.Lock = field(default_factory=threading.Lock)

    def apply(self, snapshot: Snapshot, latest: Manifest | None, step: int, block: int,
              pool: ThreadPoolExecutor | None = None, vault: Vault | None = None) -> Snapshot:
        """``snapshot`` with each record that a prediction from ``latest`` stores smaller replaced by its residual
        (the kernels run in slices on ``pool``, if given). ``vault``: where ``latest`` is committed, to read its
        arrays back from if this predictor kept none of them and ``latest`` is step ``step - 1``."""
        slots = find_slots(snapshot.tree, snapshot.records, snapshot.views, self.pairs)
        self._pending = (step, list(snapshot.views), slots, list(snapshot.records))
        if latest is None:
            return snapshot
        kept = self._kept
        fresh = kept is not None and latest.step == kept.step and latest.time == kept.time
        if not fresh and (vault is None or latest.step != step - 1 or not slots):
            return snapshot
        try:
            check_ieee()
        except PredictionError as exc:
            log.warning("step %d is saved without predictions: %s", step, exc)
            return snapshot
        if kept is None or not fresh:
            assert vault is not None  # not fresh: checked above
            kept = self._kept = self._read_back(vault, latest, slots, snapshot.records, step)
            if kept is None:
                return snapshot
        current = {r.path: flat_array(snapshot.views[i], r.dtype) for i, r in enumerate(snapshot.records)}
        plans = _plans(snapshot, slots, kept, latest, current, self._pairings)
        return self._residuals(snapshot, plans, kept, current, latest.step, block, pool) if plans else snapshot

    def _residuals(self, snapshot: Snapshot, plans: list[_Plan], kept: _Kept, current: dict[str, np.ndarray],
                   from_step: int, block: int, pool: ThreadPoolExecutor | None) -> Snapshot:
        records, views = list(snapshot.records), list(snapshot.views)
        last_read = {i.path: n for n, plan in enumerate(plans) for i in plan.inputs if i.level == 1}
        batched = self._batched(plans, records, current, kept)  # before any residual overwrites a kept array
        for n, plan in enumerate(plans):
            record = records[plan.index]
            actual = current[record.path]
            residual = batched.get(n)
            if residual is None:
                residual = self._residual_buffer(record.path, actual, kept, last_read.get(record.path, -1) <= n)
                residual_of(plan.op, _inputs(plan, current, kept), plan.scalars, residual, actual, RESIDUAL, pool)
            raw_blocks = _raw_blocks(actual, residual, block, self._raw_estimates.setdefault(record.path, {}),
                                     from_step + 1)
            if len(raw_blocks) * block >= record.nbytes:
                if plan.slot is not None:  # the pairing may be wrong now: the next save tries the lookalikes again
                    self._pairings.pop(plan.slot, None)
                continue
            _restore_blocks(residual, actual, raw_blocks, block)
            info = PredictInfo(plan.op, plan.inputs, plan.scalars, digest(actual), block, from_step,
                               tuple(raw_blocks), RESIDUAL)
            records[plan.index] = record.with_predict(info)
            views[plan.index] = residual.view(np.uint8).data
        return replace(snapshot, records=records, views=views)

    def _batched(self, plans: list[_Plan], records: list[ArrayRecord], current: dict[str, np.ndarray],
                 kept: _Kept) -> dict[int, np.ndarray]:
        """The residuals of plans whose records hold at most :data:`BATCH_UP_TO` bytes, by plan number, each in a
        buffer of its record's own: one kernel call per group of such plans with the same kernel, constants, dtype
        and inputs (the kernels work element by element, so each residual is what a call of its own makes)."""
        groups: dict[tuple[Any, ...], list[tuple[int, np.ndarray, dict[str, np.ndarray]]]] = {}
        for n, plan in enumerate(plans):
            actual = current[records[plan.index].path]
            if actual.nbytes > BATCH_UP_TO:
                continue
            inputs = _inputs(plan, current, kept)
            if all(len(a) == len(actual) for a in inputs.values()):
                key = (plan.op, actual.dtype, tuple(plan.scalars.items()), tuple(inputs))
                groups.setdefault(key, []).append((n, actual, inputs))
        out: dict[int, np.ndarray] = {}
        for members in groups.values():
            if len(members) < 2:
                continue
            first = plans[members[0][0]]
            inputs = {role: np.concatenate([each[role] for _n, _a, each in members]) for role in members[0][2]}
            actuals = np.concatenate([actual for _n, actual, _i in members])
            residuals = np.empty_like(actuals)
            residual_of(first.op, inputs, first.scalars, residuals, actuals, RESIDUAL)
            start = 0
            for n, actual, _inputs_of_n in members:
                out[n] = self._own_buffer(records[plans[n].index].path, actual)
                out[n][:] = residuals[start:start + len(actual)]
                start += len(actual)
        return out

    def _residual_buffer(self, path: str, like: np.ndarray, kept: _Kept, free: bool) -> np.ndarray:
        """Where record ``path``'s residual goes: its own kept array from the previous save when no later prediction
        of this save reads it (``free``; :meth:`keep` refills it after the commit), else a buffer of its own."""
        own = kept.arrays.get(path)
        if free and own is not None and own.dtype == like.dtype and own.shape == like.shape:
            return own
        return self._own_buffer(path, like)

    def _own_buffer(self, path: str, like: np.ndarray) -> np.ndarray:
        """Record ``path``'s residual buffer, kept from save to save."""
        buffer = self._buffers.get(path)
        if buffer is None or buffer.dtype != like.dtype or buffer.shape != like.shape:
            buffer = self._buffers[path] = np.empty_like(like)
        return buffer

    def keep(self, manifest: Manifest) -> None:
        """After ``manifest`` (this save's) is committed: keep its arrays for the next save's predictions."""
        with self._restored_lock:
            self._restored = None  # this predictor keeps its own saves' arrays from now on
        if self._pending is None or self._pending[0] != manifest.step:
            self.forget()
            return
        _step, views, slots, records = self._pending
        self._pending = None
        old = self._kept.arrays if self._kept is not None else {}
        self._kept = _kept_of(manifest, views, slots, records, old)

    @property
    def keeps_arrays(self) -> bool:
        """Whether this predictor holds the arrays of a save it made (then it needs no restore's)."""
        return self._kept is not None

    def restoring(self, manifest: Manifest) -> Callable[[Manifest, int, memoryview], None] | None:
        """While committed ``manifest`` is restored in this process, before this predictor kept any arrays (a resumed
        run): the function for ``_restore.tensors.RESTORED``, which keeps a copy of each array record the restore
        reads, so that a first save one step later predicts from them instead of reading them back. Restores of the
        same checkpoint add to the copies (a model, then its optimizer); one of another replaces them. None once
        this predictor keeps arrays of its own saves."""
        if self._kept is not None:
            return None
        with self._restored_lock:
            if self._restored is None or self._restored[:2] != (manifest.step, manifest.time):
                self._restored = (manifest.step, manifest.time, {})
            copies = self._restored[2]

        def noted(read: Manifest, index: int, view: memoryview) -> None:
            record = read.tensors[index]
            if (read.step, read.time) != (manifest.step, manifest.time) or record is not manifest.tensors[index]:
                return  # another manifest's read (none is expected): not this checkpoint's record
            if record.kind not in ("torch", "numpy") or record.is_lossy or len(view) != record.nbytes:
                return  # a lossy record's view holds its stored form, not its values
            try:
                copy = copied_record(record, view)
            except Exception as exc:  # noqa: BLE001 - a copy for a later save must never fail the restore
                log.warning("could not keep a copy of %r as step %d was restored (%s: %s); the next save reads it "
                            "back", record.path, manifest.step, type(exc).__name__, exc)
                return
            with self._restored_lock:
                copies[index] = copy

        return noted

    def _read_back(self, vault: Vault, latest: Manifest, slots: dict[SlotKey, ParamSlot], records: list[ArrayRecord],
                   step: int) -> _Kept | None:
        """What :meth:`keep` would have kept of committed checkpoint ``latest``: its optimizers' subtrees (moments,
        step counts, groups) and the model arrays that ``slots`` (this save's) may pair with, from the copies a
        restore of it kept (:meth:`restoring`) if they hold them all, else read back from ``vault``. None where they
        cannot be read (logged; the save goes on without predictions)."""
        optimizers = {path for path, _pid in slots}
        candidates = {records[i].path for slot in slots.values() for i in slot.candidates}
        leaves = manifest_leaves(latest)
        wanted = {path for path, node in leaves.items()
                  if "pickle" not in node and (path in candidates or any(not o or path.startswith(o + ".")
                                                                         for o in optimizers))}
        arrays = {path: node[tag] for path in wanted if (tag := next(iter(node := leaves[path]))) in ("tensor", "ndarray")}
        with self._restored_lock:
            restored, self._restored = self._restored, None
        if (restored is not None and restored[:2] == (latest.step, latest.time) and set(arrays.values()) <= restored[2].keys()
                and not any("shards" in leaves[path] for path in wanted)):
            log.debug("kept %d arrays of step %d from its restore to predict step %d from", len(arrays), latest.step, step)
            state = tree_of(latest, {i: restored[2][i] for i in arrays.values()}, wanted)
        else:
            try:
                state = restore_paths(vault, latest, wanted)
            except VaultError as exc:
                log.warning("step %d is saved without predictions: step %d's arrays could not be read back (%s: %s)",
                            step, latest.step, type(exc).__name__, exc)
                return None
            log.debug("read back %d arrays of step %d to predict step %d from", len(arrays), latest.step, step)
        before = take_snapshot(state, CodecRules(None, DEFAULT_CODEC))
        records_before = list(before.records)
        return _kept_of(latest, list(before.views), find_slots(before.tree, records_before, before.views, self.pairs),
                        records_before, None)

    def forget(self) -> None:
        self._kept, self._pending = None, None


def _kept_of(manifest: Manifest, views: list[memoryview], slots: dict[SlotKey, ParamSlot], records: list[ArrayRecord],
             reuse: dict[str, np.ndarray] | None) -> _Kept:
    """The arrays of committed ``manifest`` (its snapshot's ``views``, ``records`` and ``slots``) that the next save's
    predictions read: each slot's moments and the model arrays it may pair with, copied into the arrays of ``reuse``
    where they fit, or into new ones; ``reuse=None``: the views' own memory, which nothing else holds, is kept."""
    index = {r.path: i for i, r in enumerate(records)}
    wanted: set[str] = set()
    described = {}
    for key, slot in slots.items():
        paths = {name: records[i].path for name, i in slot.moments.items()}
        described[key] = {"kind": slot.kind, "group": slot.group, "step": slot.step, "moments": paths}
        wanted.update(paths.values())
        wanted.update(records[i].path for i in slot.candidates)
    arrays = {}
    for path in wanted:
        source = flat_array(views[index[path]], records[index[path]].dtype)
        if reuse is None and source.flags.writeable:
            arrays[path] = source
            continue
        target = None if reuse is None else reuse.get(path)
        if target is None or target.shape != source.shape or target.dtype != source.dtype:
            target = np.empty_like(source)
        np.copyto(target, source)
        arrays[path] = target
    return _Kept(manifest.step, manifest.time, arrays, described)


def _inputs(plan: _Plan, current: dict[str, np.ndarray], kept: _Kept) -> dict[str, np.ndarray]:
    """The arrays ``plan``'s kernel reads, by role: this save's (level 0) or the kept ones of the save before."""
    return {i.role: (current if i.level == 0 else kept.arrays)[i.path] for i in plan.inputs}


def _plans(snapshot: Snapshot, slots: dict[SlotKey, ParamSlot], kept: _Kept, latest: Manifest,
           current: dict[str, np.ndarray], pairings: dict[SlotKey, str]) -> list[_Plan]:
    """The predictions to try, per parameter: second moments, first moments, AMSGrad maxima, then the parameter
    (which reads its step's moments; :meth:`Predictor._residuals` relies on this order to reuse kept arrays).
    ``pairings``: each parameter's model array as a convincing trial found it, taken without a new trial; a
    trial's pairing is added where it matched :data:`LIKELY` of its elements."""
    records = snapshot.records
    previous = {t.path: t for t in latest.tensors}

    def predictable(record: ArrayRecord) -> bool:
        """Stored exactly now and at the previous save, with the same dtype and shape, and kept from it."""
        old = previous.get(record.path)
        return ((record.lossy is None or not record.lossy.is_lossy) and record.path in kept.arrays and old is not None
                and not old.is_lossy and old.dtype == record.dtype and list(old.shape) == list(record.shape))

    ready = {r.path for r in records if predictable(r)}  # judged once per record, not once per candidate
    by_path = {r.path: r for r in records}
    index = {r.path: i for i, r in enumerate(records)}
    plans: list[_Plan] = []
    chosen: set[str] = set()
    for key, slot in slots.items():
        before = kept.slots.get(key)
        if before is None or before["kind"] != slot.kind:
            continue
        paths = {name: records[i].path for name, i in slot.moments.items()}
        if before["moments"] != paths or not all(p in ready for p in paths.values()):
            continue
        make = _adam_plans if slot.kind == "adam" else _sgd_plans
        dtype = np.dtype(np.float32) if by_path[next(iter(paths.values()))].dtype == "float32" else np.dtype(np.float64)
        candidates = [records[i].path for i in slot.candidates if records[i].path in ready and records[i].path not in chosen]
        found = make(slot, before, paths, candidates[0] if candidates else None, dtype)
        if found and found[-1][1] in PARAMETER_OPS:
            if pairings.get(key) in candidates:  # paired by a convincing trial at an earlier save
                found[-1] = _paired(found[-1], pairings[key])
            elif len(candidates) > 1:
                found[-1], convincing = _best_pairing(found[-1], candidates, current, kept)
                if convincing:
                    pairings[key] = found[-1][0]
            chosen.add(found[-1][0])
        plans.extend(_Plan(index[path], op, inputs, scalars, key if op in PARAMETER_OPS else None)
                     for path, op, inputs, scalars in found)
    return plans


PARAMETER_OPS = ("adam-param-1", "sgd-param-1", "sgd-nesterov-1")
#: elements of each candidate a parameter's prediction is tried on, where several model arrays could be it
TRIAL = 256
#: a candidate whose prediction matches this many of the TRIAL elements is taken without trying the others: only
#: an array equal to it on those elements could match as well (the rest differ in a few last bits, from sqrt)
CONVINCING = TRIAL - TRIAL // 32
#: a trial's pairing is kept for later saves, untried, if its prediction matched this fraction of the trial
#: elements: another array matches only where it equals that one (a parameter's pairing does not change between
#: steps; small arrays, such as biases, match fewer than CONVINCING in their last bits)
LIKELY = 0.75

Planned = tuple[str, str, tuple[PredictInput, ...], dict[str, float]]


def _best_pairing(plan: Planned, candidates: list[str], current: dict[str, np.ndarray], kept: _Kept
                  ) -> tuple[Planned, bool]:
    """The parameter plan for whichever candidate array its prediction matches best on the first elements, and
    whether it matched :data:`LIKELY` of them. A pairing only decides how well the parameter compresses: restore
    recomputes the prediction the manifest names, whichever array that is."""
    _path, op, inputs, scalars = plan
    moments = {i.path for i in inputs if i.role != "p0"}
    trial = {i.role: (current if i.level == 0 else kept.arrays)[i.path][:TRIAL] for i in inputs if i.role != "p0"}
    scores = []
    for candidate in candidates:
        if candidate in moments:
            scores.append(-1)
            continue
        trial["p0"] = kept.arrays[candidate][:TRIAL]
        scores.append(int(np.count_nonzero(predict(op, trial, scalars) == current[candidate][:TRIAL])))
        if scores[-1] >= min(CONVINCING, len(trial["p0"])):
            break
    best = max(scores)
    chosen = candidates[scores.index(best)]
    return _paired(plan, chosen), best >= LIKELY * min(TRIAL, len(current[chosen]))


def _paired(plan: Planned, param: str) -> Planned:
    """``plan``, a parameter's, predicting model array ``param``."""
    _path, op, inputs, scalars = plan
    return param, op, tuple(PredictInput(i.role, i.level, param) if i.role == "p0" else i for i in inputs), scalars


Found = list[Planned]


def _adam_plans(slot: ParamSlot, before: dict[str, Any], paths: dict[str, str], param: str | None,
                dtype: np.dtype) -> Found:
    if slot.step is None or before["step"] is None or slot.step != before["step"] + 1:
        return []
    group = before["group"]  # the hyperparameters in force during the step: the previous checkpoint's
    b1, b2 = (float(b) for b in group["betas"])
    lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
    m, v = paths.get("exp_avg"), paths.get("exp_avg_sq")
    if m is None or v is None:
        return []
    c = _caster(dtype)
    # the second moment first: it reads the old first moment, whose kept copy then takes the first's residual
    out: Found = [(v, "adam-sq-1", (PredictInput("v0", 1, v), PredictInput("m0", 1, m), PredictInput("m1", 0, m)),
                   {"b1": c(b1), "one_minus_b1": c(1 - b1), "b2": c(b2), "one_minus_b2": c(1 - b2)}),
                  (m, "scale-1", (PredictInput("x0", 1, m),), {"c": c(b1)})]
    second = v
    if group.get("amsgrad") and "max_exp_avg_sq" in paths:
        second = paths["max_exp_avg_sq"]
        out.append((second, "max-1", (PredictInput("a0", 1, second), PredictInput("b1", 0, v)), {}))
    if param is not None:
        t = slot.step
        bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t  # Python floats, as torch computes them; stored, never recomputed
        decay = 1 - lr * wd if group.get("decoupled_weight_decay") and wd != 0 else 1.0
        out.append((param, "adam-param-1",
                    (PredictInput("p0", 1, param), PredictInput("m1", 0, m), PredictInput("v1", 0, second)),
                    {"decay": c(decay), "neg_step_size": c(-(lr / bc1)), "bc2_sqrt": c(bc2 ** 0.5), "eps": c(eps)}))
    return out


def _sgd_plans(slot: ParamSlot, before: dict[str, Any], paths: dict[str, str], param: str | None,
               dtype: np.dtype) -> Found:
    buf = paths.get("momentum_buffer")
    group = before["group"]
    if buf is None:
        return []
    c = _caster(dtype)
    momentum, lr = float(group["momentum"]), float(group["lr"])
    out: Found = [(buf, "scale-1", (PredictInput("x0", 1, buf),), {"c": c(momentum)})]
    if param is None:
        return out
    if group.get("nesterov"):  # the parameter last, as every caller expects (it reads the old buffer too)
        out.append((param, "sgd-nesterov-1",
                    (PredictInput("p0", 1, param), PredictInput("buf0", 1, buf), PredictInput("buf1", 0, buf)),
                    {"neg_lr": c(-lr), "momentum": c(momentum), "one_minus_dampening": c(1 - float(group["dampening"]))}))
    else:
        out.append((param, "sgd-param-1", (PredictInput("p0", 1, param), PredictInput("buf1", 0, buf)),
                    {"neg_lr": c(-lr)}))
    return out


def _caster(dtype: np.dtype) -> Callable[[float], float]:
    """Rounds a Python float to ``dtype`` (the value a kernel computes with), as a float JSON keeps exactly."""
    return lambda value: float(dtype.type(value))


def _raw_blocks(actual: np.ndarray, residual: np.ndarray, block: int,
                known: dict[int, tuple[float, int]] | None = None, step: int = 0) -> list[int]:
    """Blocks (of ``block`` bytes) whose residual a zstd-1 estimate on a sample of each form says stores larger
    than the block itself. A residual that stores in a 64th of its sample is kept without estimating the block:
    the most the block could store smaller is that 64th; one of almost only zero bytes is kept without an estimate
    at all. ``known``: the record's raw estimates by block from earlier saves (updated here), reused up to
    :data:`RAW_REUSE` steps after they were made (``step``: this save's) unless the residual's estimate comes
    :data:`CLOSE` to one."""
    raw_bytes, res_bytes = actual.view(np.uint8), residual.view(np.uint8)
    if len(raw_bytes) < SMALL and len(raw_bytes) <= block:  # one block, judged as a whole (nothing to remember)
        nonzero = int(np.count_nonzero(res_bytes))
        return [0] if nonzero * 64 > len(res_bytes) and nonzero > np.count_nonzero(raw_bytes) else []
    out = []
    for k, start in enumerate(range(0, len(raw_bytes), block)):
        end = min(start + block, len(raw_bytes))
        mid = start + max(0, (end - start - SAMPLE) // 2)
        mid -= mid % actual.itemsize
        stop = min(end, mid + SAMPLE)
        sample = res_bytes[mid:stop]
        if len(sample) >= SMALL and np.count_nonzero(sample) * 64 <= len(sample):
            continue
        estimate = _estimate(sample, actual.itemsize)
        if estimate * 64 > len(sample) and estimate > _raw_estimate(raw_bytes[mid:stop], actual.itemsize, estimate,
                                                                    k, known, step):
            out.append(k)
    return out


def _raw_estimate(sample: np.ndarray, itemsize: int, residual: int, k: int, known: dict[int, tuple[float, int]] | None,
                  step: int) -> float:
    """Block ``k``'s raw estimate: remembered in ``known`` if made fewer than :data:`RAW_REUSE` steps ago and
    ``residual`` (its residual's) is not :data:`CLOSE` to it, else made now (and remembered)."""
    if known is not None and k in known:
        fraction, made = known[k]
        if step - made < RAW_REUSE and residual < CLOSE * fraction * len(sample):
            return fraction * len(sample)
    estimate = _estimate(sample, itemsize)
    if known is not None:
        known[k] = (estimate / len(sample), step)
    return estimate


def _estimate(sample: np.ndarray, itemsize: int) -> int:
    """Compressed size of ``sample`` byte-shuffled (planes of equal significance together), as the codecs store it;
    for a sample too small for zstd to judge, its count of non-zero bytes."""
    if len(sample) < SMALL:
        return int(np.count_nonzero(sample))
    usable = len(sample) - len(sample) % itemsize
    planes = np.ascontiguousarray(sample[:usable].reshape(-1, itemsize).T)
    return len(_ESTIMATOR.compress(planes.data))


def _restore_blocks(residual: np.ndarray, actual: np.ndarray, blocks: list[int], block: int) -> None:
    res_bytes, raw_bytes = residual.view(np.uint8), actual.view(np.uint8)
    for k in blocks:
        res_bytes[k * block:(k + 1) * block] = raw_bytes[k * block:(k + 1) * block]


def predictor_for(predict: bool | Mapping[str, str]) -> Predictor | None:
    """The saver's predictor for ``DeltaOptions.predict``: None for False, else one (with the pairing it names)."""
    if predict is False:
        return None
    return Predictor(None if predict is True else dict(predict))  # the chain cap: the saver's DeltaPolicy
