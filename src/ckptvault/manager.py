"""CheckpointManager: the user-facing API of a vault."""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ._argcheck import check_kind, check_progress
from ._codecs import DEFAULT_CODEC
from ._codecs.planes import load_if_worth_it, wait_for_kernel_loading
from ._delta.kernels import wait_for_fused_loading
from ._delta.policy import DeltaPolicy
from ._delta.predict import predictor_for
from ._feedback import reissue_deferred
from ._format.manifest import check_step, manifest_key
from ._format.records import Manifest
from ._format.schema import MAX_STEP
from ._maintenance.mixin import MaintenanceMixin, apply_retention
from ._maintenance.prune import GcPacer
from ._maintenance.retention import Policy, Retention
from ._parallel import pause_collector, resume_collector
from ._reports.verify import VerifyReport, verify_steps
from ._restore.live import has_live_objects, restore_live
from ._restore.tensors import RESTORED, restore_into, restore_tree
from ._save.commit import json_fields
from ._save.pipeline import Saver, SaveRequest
from ._save.preemption import Preempted, PreemptionHandler, critical, signal_numbers
from ._save.process_child import ChildConfig
from ._save.process_saver import ProcessSaver, pickled_retention
from ._vault import Vault
from .errors import InvalidArgumentError, ManagerClosedError, StepExistsError, VaultError, VaultNotFoundError
from .handle import SaveHandle
from .info import CheckpointInfo, info_from_manifest
from .options import AsyncOptions, DeltaOptions, DistributedOptions, LossySafety, grouped
from .rules import CodecRules, preset_rules
from .stores import StorageOptions, Store

log = logging.getLogger(__name__)

Progress = Callable[[int], None]


def _distributed_running() -> bool:
    """Whether torch.distributed is initialised in this process, asked without importing anything: a job
    initialises it (``init_process_group``) through ``torch.distributed``, so that module is loaded by then."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


class CheckpointManager(MaintenanceMixin):
    """Save, list, inspect and restore checkpoints in one vault.

    ``url`` is a local path, ``file://``, ``memory://`` or ``s3://`` URL, any URL fsspec knows, or a Store.
    The vault is created on the first save; reading an absent vault finds no steps.

    How data is stored: ``codec`` is the default lossless codec of a new vault (``zstd``, ``lz4``,
    ``none``/``fast``, ``zstd-N``); ``codec_rules`` override it per key path, first match wins, and may name
    lossy codecs (``bf16``, ``fp16``, ``int8-block[:B]``, ``residual-int8[:B]``) or be a preset name
    (``"moments-compact"``; ``ckptvault presets`` lists them). ``chunk_size`` is for a new vault (default
    4 MiB; 16 MiB on S3, where fewer objects save time). ``storage_options``: the store's
    :class:`~ckptvault.LocalOptions` or :class:`~ckptvault.S3Options`, or a dict of the same keys (fsspec: its
    filesystem's arguments). ``workers``: threads for chunk I/O (default: from the CPU count and the store).

    How saves run: ``async_save=True`` (the default) stages the state into host memory and writes in the
    background, tuned by ``async_options`` (:class:`~ckptvault.AsyncOptions`). ``incremental=True`` (the
    default) writes chunks identical to stored ones never again and stores changed chunks as deltas against
    the latest keyframe, tuned by ``delta`` (:class:`~ckptvault.DeltaOptions`). ``lossy_safety``
    (:class:`~ckptvault.LossySafety`) says what happens to a lossy result that flushes, overflows or makes NaNs.
    ``retention`` (a :class:`~ckptvault.Retention`, a policy or a list of policies) prunes after each commit
    (manifests only; it always keeps the latest and pinned steps and the keyframes kept deltas need), then gc
    deletes the chunks only pruned checkpoints used once they are older than ``Retention.gc_grace`` (one hour):
    right after a prune the disk holds as much as before. ``exclusive=True`` promises that this manager is the
    vault's only writer: its retention then deletes at once the chunks its own prune released (docs/DESIGN.md
    G6), never other unreferenced objects. Not while another process saves into, copies into or restores a
    pruned step from the vault.
    A termination signal ends the process without waiting for an asynchronous save in flight unless
    :meth:`handle_preemption` is called.

    The flat spellings of earlier versions (``keyframe_every=5``, ``on_busy="skip"``, ``max_flushed=0.1``, ...,
    every field of those option objects) still work; each folds into its object. Use as a context manager or call
    :meth:`close`.
    """

    def __init__(
        self,
        url: str | os.PathLike[str] | Store,
        *,
        codec: str | None = None,
        codec_rules: str | Mapping[str, str] | Iterable[tuple[str, str]] | None = None,
        chunk_size: int | None = None,
        storage_options: StorageOptions | None = None,
        workers: int | None = None,
        async_save: bool = True,
        incremental: bool = True,
        delta: DeltaOptions | None = None,
        async_options: AsyncOptions | None = None,
        lossy_safety: LossySafety | None = None,
        retention: Retention | Policy | Iterable[Policy] | None = None,
        exclusive: bool = False,
        distributed: DistributedOptions | None = None,
        **flat: Any,
    ) -> None:
        options = grouped({"delta": delta, "async_options": async_options, "lossy_safety": lossy_safety}, flat)
        delta, async_options, lossy_safety = options["delta"], options["async_options"], options["lossy_safety"]
        self.vault = Vault(url, storage_options, workers)
        self.url = self.vault.url
        self._codec = codec
        self._chunk_size = chunk_size
        self._codec_rules = preset_rules(codec_rules) if isinstance(codec_rules, str) else codec_rules
        CodecRules(self._codec_rules, DEFAULT_CODEC if codec is None else codec)  # validate early
        self.delta_policy = DeltaPolicy(incremental, delta.keyframe_every, delta.keyframe_growth,
                                        None if delta.predict is False else delta.max_chain)
        self.retention = Retention.coerce(retention)
        check_kind("exclusive", exclusive, bool)
        self.exclusive = exclusive
        self._gc_pacer = GcPacer()
        self._preemption: PreemptionHandler | None = None
        self._collective = self._join_job(distributed, async_save, incremental, delta, async_options, lossy_safety)
        self._saver = self._make_saver(url, storage_options, async_save, delta, async_options, lossy_safety)
        self._closed = False
        self._rules_checked = False  # the first save warns about codec_rules patterns that match no tensor

    def _join_job(self, options: DistributedOptions | None, async_save: bool, incremental: bool, delta: DeltaOptions,
                  async_options: AsyncOptions, lossy_safety: LossySafety) -> Any:
        """The collective part of this manager in a torch.distributed job (``distributed/_collective.py``), or None."""
        check_kind("distributed", options, DistributedOptions, type(None))
        options = options or DistributedOptions()
        if options.enabled is False or (options.enabled is None and not _distributed_running()):
            return None  # before importing the collective part: it imports torch.distributed.checkpoint (~1 s)
        from .distributed._collective import Collective, SaveSettings, wanted

        if not wanted(options):
            return None
        if async_options.saver != "thread":
            raise InvalidArgumentError(f"AsyncOptions(saver={async_options.saver!r}) is for single-process saves; in "
                                       "a torch.distributed job each rank saves on its own threads (saver='thread'), "
                                       "or pass distributed=DistributedOptions(enabled=False) to save each process "
                                       "alone")
        if delta.predict is not False:
            raise InvalidArgumentError("DeltaOptions(predict=...) is for single-process saves; in a torch.distributed "
                                       "job pass distributed=DistributedOptions(enabled=False) to save each process "
                                       "alone, or drop predict")
        settings = SaveSettings(self._codec, self._codec_rules, self._chunk_size, incremental, delta, async_save,
                                async_options.on_busy, lossy_safety)
        return Collective(self.vault, options, settings, self._after_commit)

    def _make_saver(self, url: str | os.PathLike[str] | Store, storage_options: StorageOptions | None,
                    async_save: bool, delta: DeltaOptions, async_options: AsyncOptions,
                    lossy_safety: LossySafety) -> Saver | ProcessSaver:
        """The thread saver, or for ``AsyncOptions(saver="process" | "idle-process")`` the saver process."""
        if async_options.saver == "thread":
            return Saver(self.vault, self.delta_policy, async_save=async_save, async_options=async_options,
                         after_commit=self._after_commit, safety=lossy_safety, cache_keyframe=delta.cache_keyframe,
                         predictor=predictor_for(delta.predict))
        saver = async_options.saver
        if not async_save:
            raise InvalidArgumentError(f"AsyncOptions(saver={saver!r}) runs asynchronous saves; it needs "
                                       "async_save=True")
        if isinstance(url, Store):
            raise InvalidArgumentError(f"AsyncOptions(saver={saver!r}) needs the vault's URL, which the saver process "
                                       f"opens itself, not a Store object: pass {self.url!r}")
        config = ChildConfig(self.url, storage_options, self.vault.workers, self.delta_policy, delta.predict,
                             lossy_safety or LossySafety(), True if delta.cache_keyframe is None else delta.cache_keyframe,
                             logging.getLogger("ckptvault").getEffectiveLevel(), pickled_retention(self.retention),
                             self.exclusive)
        return ProcessSaver(config, async_options, after_commit=self._after_commit,
                            exclusive_retention=self.exclusive and self.retention is not None)

    @property
    def distributed(self) -> bool:
        """Whether this manager takes part in a torch.distributed job (its saves and restores are collective)."""
        return self._collective is not None

    def _check_open(self, what: str) -> None:
        """ManagerClosedError after :meth:`close`: the vault's store and pool are released, so nothing may run."""
        if self._closed:
            raise ManagerClosedError(what, self.url)

    # -- saving ------------------------------------------------------------
    def save(
        self,
        step: int,
        state: Any,
        *,
        metrics: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
        overwrite: bool = False,
        allow_pickle: bool = False,
        progress: Progress | None = None,
    ) -> SaveHandle:
        """Save ``state`` as checkpoint ``step``; returns a :class:`SaveHandle`.

        With ``async_save=True`` (the default) this returns as soon as the state
        is copied into host staging memory (``handle.staged``); chunking,
        encoding, writing and the commit run in the background
        (``handle.committed``, ``handle.wait()``). If a save is still in
        flight, this first waits for it (``on_busy="wait"``) or returns a
        skipped handle with a warning (``on_busy="skip"``). An earlier
        background save's error is raised here, by :meth:`wait` or by
        :meth:`close`. With ``async_save=False`` this returns once committed.

        The checkpoint becomes visible atomically when its manifest is written,
        last. Raises StepExistsError if ``step`` is committed and not ``overwrite``,
        UnsupportedObjectError (naming the key path) for values that need pickle.

        ``progress``: called with the size in bytes of each chunk as it is written or found already stored
        (from worker threads); a callable that takes a keyword ``total`` also gets ``total=``, the same on
        every call and the sum of all increments: the bytes of the state as chunked (``info(step).logical_bytes``
        when nothing is stored lossy).
        """
        self._check_open("save()")
        check_step(step)
        check_kind("overwrite", overwrite, bool)
        check_kind("allow_pickle", allow_pickle, bool)  # "no" would allow it
        check_progress(progress)
        if self._collective is not None:  # the coordinator creates the vault and refuses a committed step
            request = SaveRequest(step, json_fields(metrics, "metrics"), json_fields(metadata, "metadata"), overwrite,
                                  progress)
            with critical(self._preemption):
                return self._collective.save(request, state, allow_pickle)
        codec = DEFAULT_CODEC if self._codec is None else self._codec
        desc = self.vault.descriptor() or self.vault.create(self._chunk_size, codec)
        if not overwrite and (self.vault.store.exists(manifest_key(step)) or self._saver.in_flight(step)):
            raise StepExistsError(step, self.url)
        rules = CodecRules(self._codec_rules, desc.codec if self._codec is None else self._codec,
                           check_unmatched=not self._rules_checked)
        metrics, metadata = json_fields(metrics, "metrics"), json_fields(metadata, "metadata")  # here, once: fail before any work
        request = SaveRequest(step, metrics, metadata, overwrite, progress, rules.default)
        with critical(self._preemption):  # a handled signal arriving inside acts once this returns
            handle = self._saver.submit(request, state, rules, allow_pickle)
        self._rules_checked = self._rules_checked or not handle.skipped
        reissue_deferred()  # warnings of the previous background save, at this line
        return handle

    def _after_commit(self, step: int) -> None:
        load_if_worth_it()  # numba's byte-plane kernels, once this process has split enough bytes (planes.LOAD_AFTER)
        if self.retention is not None:  # only now that the checkpoint is durable; exclusive: DESIGN G6
            apply_retention(self.vault, self.retention, step, exclusive=self.exclusive, pacer=self._gc_pacer)

    def wait(self) -> None:
        """Wait until every save in flight is committed; raise the error of any failed save."""
        try:
            with critical(self._preemption):
                self._saver.wait()
                if self._collective is not None:
                    self._collective.wait()
        finally:
            reissue_deferred()

    # -- listing -----------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        self._check_open("steps()")
        return self.vault.steps()

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def info(self, step: int | str | None = None) -> CheckpointInfo:
        """Statistics, metrics and metadata of ``step`` (a step or a pin tag; default: latest)."""
        return info_from_manifest(self.vault.read_manifest(self._resolve(step)))

    def manifest(self, step: int | str | None = None) -> dict[str, Any]:
        """The verified manifest body of ``step`` (a step or a pin tag; default: latest), as the JSON object
        docs/DESIGN.md section 4 describes (for tools; ``info`` gives the same as typed values)."""
        return self.vault.read_manifest(self._resolve(step)).to_json()

    # -- restoring ---------------------------------------------------------
    def restore(
        self,
        step: int | str | None = None,
        *,
        into: Any = None,
        keys: Iterable[str] | str | None = None,
        strict: bool = True,
        allow_pickle: bool = False,
        progress: Progress | None = None,
    ) -> Any:
        """Restore ``step``: a step, a pin tag (``restore("best")`` after ``pin(200, "best")``: the newest step
        pinned so), or None for the latest.

        Without ``into``: a new state with the saved structure and types
        (``keys`` limits it to matching key paths; only those are read).
        With ``into``: copies into the tensors of ``into`` in place (matched by
        key path at the root or under one saved subtree, e.g. ``model``) and
        returns ``into``; no second copy of the state is made. As in
        torch.distributed.checkpoint, the target decides what is read: only
        the tensors ``into`` names are read (and only their chunks fetched), so
        ``into={"model": model.state_dict()}`` restores the model from a
        checkpoint that also holds an optimizer. Saved entries ``into`` does
        not name, whether another subtree or a sibling inside a subtree it
        names, are neither read nor an error.
        ``strict=True``: every tensor of ``into`` must be in the checkpoint,
        else :class:`~ckptvault.errors.KeyMismatchError` names the missing
        key paths. ``strict=False``: those are skipped and left unchanged. A
        dtype or shape mismatch is a ``KeyMismatchError`` either way. Leaves
        of ``into`` that are not tensors or arrays (ints, floats, ...) are
        left as they are.

        Live objects: where ``into`` holds objects with ``state_dict()`` and
        ``load_state_dict()`` (``into={"model": model, "optimizer": opt,
        "scheduler": sched, "scaler": scaler, "step": 0}``), each is restored
        completely from the saved subtree at its key path: the tensors its
        state dict holds in place as above (a module's parameters and
        buffers, an optimizer's existing state), then, for anything but a
        module whose state dict holds only tensors, ``load_state_dict()``
        with the saved subtree (a fresh optimizer's state as new tensors).
        The same mounting and ``strict`` rules apply; ``strict`` also
        requires each object's subtree to be saved. Plain values of ``into``
        (``"step": 0``) cannot be updated in place, so this form returns a
        :class:`~ckptvault.RestoreReport` instead of ``into``: the saved
        values at their key paths (``report["step"]``), and per object what
        was restored and its missing and unexpected keys.

        ``progress``: called with the size in bytes of each chunk read (from worker threads); a callable
        that takes a keyword ``total`` also gets ``total=``, the same on every call and the sum of all
        increments: the bytes of the chunks this restore reads (``info(step).logical_bytes`` for a whole
        checkpoint; less when ``keys`` or ``into`` name part of it, a packed chunk counted whole).
        """
        pause_collector()  # before anything allocates
        try:
            check_kind("strict", strict, bool)
            check_kind("allow_pickle", allow_pickle, bool)  # "no" would allow unpickling
            check_progress(progress)
            return self._restore(step, into, keys, strict, allow_pickle, progress)
        finally:
            resume_collector()

    def _restore(self, step: int | str | None, into: Any, keys: Iterable[str] | str | None, strict: bool,
                 allow_pickle: bool, progress: Progress | None) -> Any:
        if self._collective is not None:
            resolved = self._collective.on_coordinator(lambda: self._resolve(step))  # every rank the same step
            manifest = self.vault.read_manifest(resolved)
            return self._collective.restore(manifest, into, keys, strict, allow_pickle)
        manifest = self.vault.read_manifest(self._resolve(step))
        noted = RESTORED.set(self._keeps_restored(manifest, latest=step is None))
        try:
            if into is not None:
                if has_live_objects(into):
                    return restore_live(self.vault, manifest, into, strict, allow_pickle, progress)
                return restore_into(self.vault, manifest, into, strict, progress)
            return restore_tree(self.vault, manifest, keys, allow_pickle, progress)
        finally:
            RESTORED.reset(noted)
            load_if_worth_it()  # as after a commit: once this process has joined enough bytes (planes.LOAD_AFTER)

    def _keeps_restored(self, manifest: Manifest, latest: bool) -> Callable[[Manifest, int, memoryview], None] | None:
        """With predicted deltas saved by this process, for a restore of the vault's latest checkpoint before any
        save: what keeps the arrays the restore reads, so that a save one step later predicts from them rather than
        reading them back (``Predictor.restoring``). ``latest``: ``manifest`` is the latest (the restore asked for
        it), else the vault is asked."""
        predictor = self._saver.predictor if isinstance(self._saver, Saver) else None
        if predictor is None or predictor.keeps_arrays:
            return None
        try:
            latest = latest or manifest.step == self.latest_step()
        except VaultError as exc:  # the restore itself does not need the listing: it goes on, keeping nothing
            log.debug("restore of step %d keeps no copies for the next save: %s", manifest.step, exc)
            return None
        return predictor.restoring(manifest) if latest else None

    # -- maintenance -------------------------------------------------------
    def delete(self, step: int) -> None:
        """Remove checkpoint ``step`` (its manifest). Chunks it alone used are reclaimed by gc."""
        self._check_open("delete()")
        if not self.vault.store.exists(manifest_key(check_step(step))):  # a damaged manifest can still be deleted
            self.vault.read_manifest(step)  # raises VaultNotFoundError / StepNotFoundError naming the steps
        self.vault.store.delete(manifest_key(step))

    def verify(self, step: int | None = None, progress: Progress | None = None) -> VerifyReport:
        """Read and check every chunk of ``step`` (default: every step).

        ``progress``: called with the size in bytes of each chunk checked; a callable that takes a keyword
        ``total`` also gets ``total=``, the same on every call and the sum of all increments: the bytes of
        the distinct chunks of the steps checked.
        """
        self._check_open("verify()")
        check_progress(progress)
        steps = [check_step(step)] if step is not None else self.steps()
        return verify_steps(self.vault, steps, progress)

    def _resolve(self, step: int | str | None) -> int:
        """The step to read: a step, a pin tag (its step: :meth:`step_of`), or None (the latest committed); waits
        if it is the save in flight."""
        self._check_open("restore(), info() or manifest()")
        if isinstance(step, str) and step.isdigit():  # a step number as text, more likely than a tag of digits
            raise InvalidArgumentError(f"step must be an int from 0 to {MAX_STEP} (20 digits), got {step!r}: pass "
                                       f"int({step!r}) for that step, or mgr.step_of({step!r}) for a pin tag of digits")
        if isinstance(step, str):
            step = self.step_of(step)
        if step is not None and self._saver.in_flight(step):
            self._saver.wait()
        if self._collective is not None and step is not None and step == self._collective.inflight_step:
            self._collective.wait()
        if step is not None:
            return check_step(step)
        latest = self.latest_step()
        if latest is None:
            self.vault.require()
            raise VaultNotFoundError(f"the vault at {self.url} has no committed checkpoint")
        return latest

    def close(self) -> None:
        """Finish the save in flight, then release the vault. Raises the error of a failed save. Closing twice is
        harmless; any other use afterwards raises :class:`~ckptvault.errors.ManagerClosedError`."""
        if self._closed:
            return
        self._closed = True
        try:
            with critical(self._preemption):
                try:
                    self._saver.close()
                finally:
                    if self._collective is not None:
                        self._collective.close()
        finally:
            wait_for_kernel_loading()  # not left importing numba while the interpreter exits (planes.LOAD_AFTER)
            wait_for_fused_loading()
            self.vault.close()
            reissue_deferred()
            self._end_preemption()

    # -- preemption --------------------------------------------------------
    def handle_preemption(self, signals: int | Iterable[int] = signal.SIGTERM, *, poll: bool = False) -> None:
        """Make a termination signal finish the save in flight before the process exits (opt-in; main thread only).

        Without this, SIGTERM (preemption, ``scancel``, a Kubernetes eviction) ends the process at once with
        status 143 and an asynchronous save that ``save()`` had already returned from is lost: the vault keeps
        the previous checkpoint. (Normal exits, exceptions and ``sys.exit`` always wait for it.)

        With it, the handler only records the signal, calls the handler that was installed before (if it is a
        Python function), and then:

        * ``poll=False`` (default): raises :class:`~ckptvault.Preempted`, a ``SystemExit`` with code 128 + signum,
          in the main thread (deferred to the end of this manager's ``save``, ``wait`` or ``close`` if it is
          inside one). ``finally`` and ``with`` blocks run, ``close()`` or the exit flush commits the save in
          flight, and the process exits with status 128 + signum (143 for SIGTERM). No final checkpoint: the
          state may be mid-step.
        * ``poll=True``: only sets :attr:`preempted`. The training loop checks it at a step boundary, saves a
          final checkpoint and leaves the ``with`` block (or calls :meth:`close`), which commits every save and
          then raises :class:`~ckptvault.Preempted` (exit status 128 + signum). A loop that never checks
          keeps running until the scheduler kills it.

        ``signals``: one signal or several (default SIGTERM; SIGUSR1 for ``sbatch --signal=USR1@120``). If the
        handler installed before was ``SIG_IGN``, the signal stays ignored (only :attr:`preempted` is set).
        :meth:`close` puts the previous handlers back. Raises InvalidArgumentError outside the main thread, if this
        manager already handles preemption, or for a signal that cannot be caught.
        """
        self._check_open("handle_preemption()")
        check_kind("poll", poll, bool)
        numbers = signal_numbers(signals)
        if self._preemption is not None and self._preemption.installed:
            raise InvalidArgumentError("handle_preemption() was already called on this manager; close() it first")
        self._preemption = PreemptionHandler(numbers, poll)

    @property
    def preempted(self) -> bool:
        """True once a signal :meth:`handle_preemption` handles has arrived: save a final checkpoint and stop."""
        return self._preemption is not None and self._preemption.signum is not None

    def _end_preemption(self) -> None:
        """At close: restore the previous signal handlers; exit (raise Preempted) if a polled signal arrived."""
        handler = self._preemption
        if handler is None:
            return
        signum = handler.exit_status_due()
        handler.uninstall()
        if signum is not None:
            raise Preempted(signum)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({self.url!r})"

