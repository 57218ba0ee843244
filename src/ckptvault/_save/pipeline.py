"""The save pipeline shared by synchronous and asynchronous saves.

Order of calls for one save: ``Saver.submit`` (caller's thread: raise any
unreported error of an earlier save, wait for or skip a save in flight,
take the snapshot) -> ``_complete`` (background thread when asynchronous:
choose the delta base, write chunks, commit the manifest, report the commit on
the handle, fill the keyframe cache, run the after-commit hook such as
retention). At most one save is in flight per Saver, so staging
memory is bounded by one copy of the state; the keyframe cache (by default for
asynchronous saves) holds the high half of the latest keyframe's bytes on top.

Errors of a background save are set on its handle and also kept until the
next ``submit``, ``wait`` or ``close``, which raise them: a failure is never
lost, and a failed save never commits. They are ckptvault's typed errors: an
exception that is not one (a third-party store's, a codec bug, MemoryError)
arrives as a ``SaveError`` naming it, with the original as its ``__cause__``.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .._argcheck import check_kind
from .._codecs.lossy import LossySafety
from .._delta.policy import ALL_PLANES_UP_TO, DeltaPolicy, KeyframeCache, ManifestCache, delta_context
from .._delta.predict import Predictor
from .._parallel import pause_collector, resume_collector
from .._vault import Vault
from ..handle import SaveHandle
from ..info import info_from_manifest
from ..options import AsyncOptions
from ..rules import CodecRules
from .chain_level import level_writer
from .chunks import write_chunks
from .commit import build_manifest, commit
from .inflight import InFlight, typed_error
from .lossy import LossyBuffers, apply_lossy
from .snapshot import Snapshot, take_snapshot
from .staging import StagingBuffer

log = logging.getLogger(__name__)

Progress = Callable[[int], None]


@dataclass
class SaveRequest:
    step: int
    metrics: dict[str, Any]  # as json_fields returned them
    metadata: dict[str, Any]
    overwrite: bool
    progress: Progress | None
    lossless: str = "zstd"  # the lossless codec that "lossless" and bare lossy rules use


class Saver(InFlight):
    """Runs saves into one vault, in the background when ``async_save``."""

    def __init__(self, vault: Vault, delta_policy: DeltaPolicy, *, async_save: bool = True,
                 async_options: AsyncOptions | None = None, after_commit: Callable[[int], None] | None = None,
                 safety: LossySafety | None = None, cache_keyframe: bool | None = None,
                 predictor: Predictor | None = None) -> None:
        check_kind("async_save", async_save, bool)
        check_kind("cache_keyframe", cache_keyframe, bool, type(None))
        super().__init__("ckptvault-save", after_commit)
        async_options = async_options or AsyncOptions()
        self.vault, self.delta_policy = vault, delta_policy
        self.async_save, self.on_busy = async_save, async_options.on_busy
        self.max_staging_bytes = async_options.max_staging_bytes
        self.safety = safety or LossySafety()
        self._staging = StagingBuffer()
        self._lossy_buffers = LossyBuffers()  # with the staging buffer: asynchronous saves reuse their memory
        # None: keep the keyframes an asynchronous save stages (the staging buffer holds a copy of the state already)
        # and, for synchronous saves, the chunks of keyframes of at most ALL_PLANES_UP_TO bytes that their deltas
        # read back (:meth:`_caches`, :meth:`_keeps_reads`)
        self.cache_keyframe = cache_keyframe
        wanted = cache_keyframe is not False
        deltas = delta_policy.enabled and delta_policy.every > 1  # every=1: every checkpoint is a keyframe
        self._keyframe_cache = KeyframeCache() if wanted and deltas else None
        self._predictor = predictor if deltas else None
        self._manifests = ManifestCache() if deltas else None  # the next save's base manifests, without a re-read
        register_live(self)

    @property
    def predictor(self) -> Predictor | None:
        """The predictor of this saver's predicted deltas (``DeltaOptions.predict``), or None."""
        return self._predictor

    def submit(self, request: SaveRequest, state: Any, rules: CodecRules, allow_pickle: bool) -> SaveHandle:
        """Stage ``state`` and start (or, when synchronous, run) its save."""
        self.raise_pending()
        if self.inflight_step is not None and self.on_busy == "skip":
            warnings.warn(f"skipping the save of step {request.step}: step {self.inflight_step} is still being saved",
                          RuntimeWarning, stacklevel=3)
            return SaveHandle.skipped_save(request.step)
        self.wait_inflight()  # not paused: the save in flight ends its pause, and a collection due runs then
        self.raise_pending()
        staging = self._staging if self.async_save else None
        pause_collector()  # the snapshot and the records live until the save ends: no collection meanwhile
        staged = False
        try:
            snapshot = take_snapshot(state, rules, allow_pickle, staging, self.max_staging_bytes)
            staged = snapshot.staged
            if self.async_save and not staged:
                log.warning("step %d needs more staging memory than max_staging_bytes=%s; saving synchronously",
                            request.step, self.max_staging_bytes)
            handle = SaveHandle(request.step)
            handle.staged.set_result(None)
            if staged:
                self.start(handle, self._complete, handle, request, snapshot)
            else:
                self._run(handle, request, snapshot)  # inside this pause
        finally:
            resume_collector(run_due=not staged)
        if not staged:
            self.raise_pending()
        return handle

    def _complete(self, handle: SaveHandle, request: SaveRequest, snapshot: Snapshot) -> None:
        """A staged save's steps after the snapshot, on the background thread, with the cycle collector paused."""
        pause_collector()
        try:
            self._run(handle, request, snapshot)
        finally:
            resume_collector(run_due=True)

    def _run(self, handle: SaveHandle, request: SaveRequest, snapshot: Snapshot) -> None:
        """Steps after the snapshot. Never raises: the outcome goes to the handle (and errors to pending)."""
        try:
            delta = delta_context(self.vault, self.delta_policy, request.step, self._manifests)
            delta.cache = self._keyframe_cache
            if delta.cache is not None:
                if delta.keyframe is not None:
                    delta.keep_reads = self._keeps_reads(sum(chunk.raw for chunk in delta.keyframe.chunks))
                elif self._caches(snapshot):
                    delta.cache.begin(request.step)
                elif not self._keeps_reads(sum(len(view) for view in snapshot.views)):
                    delta.cache.clear()
                # else the previous keyframe's planes stay until this one's deltas read it: they reuse the memory
            buffers = self._lossy_buffers if snapshot.staged else None
            snapshot = apply_lossy(snapshot, self.safety, request.lossless, self.vault, delta.keyframe, buffers)
            if self._predictor is not None:  # keyframes are never predicted: each one ends the restore chains
                latest = delta.latest if delta.keyframe is not None else None
                snapshot = self._predictor.apply(snapshot, latest, request.step, self.vault.chunk_size(), self.vault.pool,
                                                 self.vault)
            batch = self.vault.store.write_batch()  # finished by commit(), after it staged the manifest
            try:
                chunks, pieces = write_chunks(self.vault, snapshot, request.progress, delta, batch)
                manifest = build_manifest(request.step, snapshot, chunks, pieces, request.metrics,
                                          request.metadata, delta.keyframe_step, delta.since_keyframe, delta.latest,
                                          level_writer(self.vault, batch, delta.guard))
            except BaseException:
                batch.abandon()
                raise
            commit(self.vault, request.step, manifest, request.overwrite, delta.guard, batch)
        except BaseException as caught:  # noqa: BLE001 - handed to the caller, not swallowed
            if self._predictor is not None:
                self._predictor.forget()
            if self._keyframe_cache is not None:
                self._keyframe_cache.abort()
            what = f"the save of step {request.step} failed, nothing committed"
            exc = typed_error(caught, what)
            log.error("%s", exc if exc is not caught else f"{what}: {caught}")  # a wrapped one says it already
            self.keep_error(exc, handle)
            handle.committed.set_exception(exc)
            return
        handle.committed.set_result(info_from_manifest(manifest))
        self._commit_keyframe_cache(request.step)
        self._keep_for_next_save(manifest)
        self.run_after_commit(request.step)

    def _caches(self, snapshot: Snapshot) -> bool:
        """Whether the keyframe save of ``snapshot`` fills the keyframe cache: always or never where
        ``cache_keyframe`` says so; by default for an asynchronous save if it is staged (a state too large to stage,
        ``max_staging_bytes``, says memory is short), never for a synchronous one, whose caller would wait for the
        copy (:meth:`_keeps_reads` fills it later)."""
        if self.cache_keyframe is not None:
            return self.cache_keyframe
        return self.async_save and snapshot.staged

    def _keeps_reads(self, keyframe_bytes: int) -> bool:
        """Whether delta saves against a keyframe of ``keyframe_bytes`` (raw) keep the keyframe chunks they read back
        in the cache: by default for synchronous saves of a keyframe of at most ``ALL_PLANES_UP_TO`` bytes (one more
        copy of a small state costs little; each delta save would read it back otherwise). ``ckptvault.save()``,
        which saves once, passes ``cache_keyframe=False``: it copies nothing."""
        if self.cache_keyframe is not None or self.async_save:
            return False
        return keyframe_bytes <= ALL_PLANES_UP_TO

    def _commit_keyframe_cache(self, step: int) -> None:
        """Fill the keyframe cache from committed keyframe ``step``'s chunks (if it was filling), on the vault's
        threads. This runs after the save's handle reports the commit, so it adds nothing to the wait for it, and
        before the next save may stage (that waits for this whole task). A failure costs later deltas their
        cache, never this save."""
        if self._keyframe_cache is None:
            return
        try:
            self._keyframe_cache.commit(step, self.vault.pool)
        except Exception as exc:  # noqa: BLE001 - the save is committed; deltas read the keyframe from the store
            log.warning("could not keep keyframe %d in the keyframe cache (%s: %s); its deltas will read it back",
                        step, type(exc).__name__, exc)

    def _keep_for_next_save(self, manifest: Any) -> None:
        """Keep committed ``manifest`` parsed for the next save's delta context and copy its arrays for the next
        save's predictions (after the commit is reported, before the next save may stage, as for the keyframe
        cache). A failure costs the next save a manifest read, or its predictions, only."""
        try:
            if self._manifests is not None:
                self._manifests.note(self.vault, manifest)
            if self._predictor is not None:
                self._predictor.keep(manifest)
        except Exception as exc:  # noqa: BLE001 - the save is committed; the next one just reads, or is not predicted
            if self._predictor is not None:
                self._predictor.forget()
            log.warning("could not keep step %d for the next save (%s: %s); that save reads it again and is not "
                        "predicted", manifest.step, type(exc).__name__, exc)

    def close(self) -> None:
        """Flush: wait for the save in flight, stop the background thread, raise any unreported error."""
        try:
            self.wait()
        finally:
            self.stop_thread()
            forget_live(self)


class _Closable(Protocol):
    def close(self) -> None: ...


_LIVE: weakref.WeakSet[_Closable] = weakref.WeakSet()


def register_live(saver: _Closable) -> None:
    """Have ``saver.close()`` called at interpreter exit (unless closed before; never in a forked child)."""
    _LIVE.add(saver)


def forget_live(saver: _Closable) -> None:
    """Undo :func:`register_live` (at ``close``)."""
    _LIVE.discard(saver)


def _flush_at_exit() -> None:
    """At interpreter exit, finish saves in flight; report failures in the log."""
    for saver in list(_LIVE):
        try:
            saver.close()
        except BaseException as exc:  # noqa: BLE001 - nobody is left to raise to
            log.error("a checkpoint save failed before exit: %s", exc)


def _register_exit_flush() -> None:
    """Flush before concurrent.futures stops accepting work at exit.

    ``atexit`` handlers run too late: ``threading._shutdown`` first runs the
    hooks of ``threading._register_atexit``, where concurrent.futures marks
    every executor shut down, so a save still in flight could no longer submit
    its chunk writes. Hooks of that list run last-registered first, and this
    module imports concurrent.futures (registering its hook) before this runs.
    """
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # not CPython >= 3.9: the best left is atexit
        atexit.register(_flush_at_exit)
    else:
        register(_flush_at_exit)


def _forget_parent_saves() -> None:
    """In a forked child (e.g. a DataLoader worker): the parent's saves are not ours to flush.

    Their background threads did not fork, so waiting for them at the child's
    exit (multiprocessing children run the threading exit hooks) would hang.
    """
    _LIVE.clear()


_register_exit_flush()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parent_saves)
