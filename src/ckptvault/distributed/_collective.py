"""A CheckpointManager in a torch.distributed job: collective saves and restores, on DCP with the vault's plugin.

Every rank makes its CheckpointManager (a collective call: it creates two gloo groups with the configured timeout)
and calls ``save``, ``wait``, ``restore`` and ``close`` in the same order. One save, in this order:

1. (caller's thread, every rank) agree whether a save is in flight anywhere (``on_busy="skip"`` skips on all ranks
   or none); once per manager, check that every rank sees the same vault (:meth:`Collective.check_shared`: rank 0
   writes a probe object, every rank must read it back; UnsharedVaultError otherwise, before anything is written);
   find the per-rank values (``_per_rank.py``: one ``all_gather`` of digests) and give each rank's its own key.
2. (caller's thread) an asynchronous save copies this rank's tensors into host buffers kept across saves (DCP's
   AsyncStager protocol, ``_staging.py``); training may go on once ``save`` returns.
3. (background thread, or the caller's when synchronous) ``dcp.save`` with :class:`~.dcp.VaultWriter`: the
   coordinator decides keyframe or delta once and refuses a committed step, every rank writes its chunks (durable
   on return), the coordinator commits ONE manifest after every rank's write returned, then applies retention once.

Failure: any rank's error reaches every rank as DCP's CheckpointException, raised here as
:class:`~ckptvault.errors.RankFailedError` naming each failed rank and its error (a StepExistsError stays itself). A
rank that dies makes the survivors' collective fail (at once where gloo sees the closed connection, else at the
timeout); they raise RankFailedError naming the ranks whose heartbeat stopped (``_board.py``). Nothing is committed
either way: the manifest is written only after every rank's chunks are durable, and chunks already written are
left to gc. The process groups of a failed job are not reusable: restart the job and save again.
"""

from __future__ import annotations

import logging
import secrets
import socket
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .._delta.policy import KeyframeCache
from .._feedback import reissue_deferred
from .._format.records import Manifest
from .._restore.tensors import restore_tree
from .._save.inflight import InFlight
from .._save.lossy import LossyBuffers
from .._save.pipeline import SaveRequest
from .._vault import Vault
from ..errors import (
    InvalidArgumentError,
    KeyMismatchError,
    ObjectNotFoundError,
    RankFailedError,
    StepExistsError,
    UnsharedVaultError,
    VaultError,
)
from ..handle import SaveHandle
from ..info import info_from_manifest
from ..options import DeltaOptions, DistributedOptions, LossySafety
from ._board import HeartbeatBoard, join
from ._per_rank import digest, own_values, per_rank_paths, saved_ranks, units, unwrap_targets, wrap, wrap_targets
from ._staging import HostStaging
from .dcp import VaultReader, VaultWriter, checked_rules
from .planners import VaultLoadPlanner, VaultSavePlanner

log = logging.getLogger(__name__)
T = TypeVar("T")


def wanted(options: DistributedOptions) -> bool:
    """Whether a manager made now takes part in a distributed job."""
    if options.enabled is False:
        return False
    running = dist.is_available() and dist.is_initialized()
    if options.enabled and not running:
        raise InvalidArgumentError("DistributedOptions(enabled=True), but torch.distributed is not initialised: call "
                                   "torch.distributed.init_process_group() (torchrun does) before making the manager")
    return running


@dataclass(frozen=True)
class SaveSettings:
    """How the job's saves store data (the manager's keywords)."""

    codec: str | None
    codec_rules: Mapping[str, str] | Iterable[tuple[str, str]] | None
    chunk_size: int | None
    incremental: bool
    delta: DeltaOptions
    async_save: bool
    on_busy: str
    lossy_safety: LossySafety


class Collective(InFlight):
    """The collective part of one CheckpointManager; see the module docstring for the order of calls."""

    def __init__(self, vault: Vault, options: DistributedOptions, settings: SaveSettings,
                 after_commit: Callable[[int], None] | None) -> None:
        super().__init__("ckptvault-dsave", after_commit)
        self.vault, self.options, self.settings = vault, options, settings
        self.codec_rules = checked_rules(settings.codec_rules, settings.codec)
        join(dist.get_rank(), dist.get_world_size(), options.timeout)  # a manager on one rank only: an error, no hang
        timeout = timedelta(seconds=options.timeout)
        self.saves = dist.new_group(backend="gloo", timeout=timeout)  # the (background) saves' DCP collectives
        self.control = dist.new_group(backend="gloo", timeout=timeout)  # the caller's thread: agreement, loads
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.board = HeartbeatBoard(f"ckptvault/{self.control.group_name}/", self.rank, self.world)
        self.board.start()
        self._shared_checked = False
        self._staging = HostStaging()
        self._lossy_buffers = LossyBuffers()  # reused: a save starts only once the previous one is committed
        keep = settings.async_save if settings.delta.cache_keyframe is None else settings.delta.cache_keyframe
        deltas = settings.incremental and settings.delta.keyframe_every > 1
        self._keyframe_cache = KeyframeCache() if keep and deltas else None
        self._manifests: dict[Any, Manifest] = {}  # the writers' manifests read for deltas, kept across saves

    # -- agreement ---------------------------------------------------------
    def on_coordinator(self, fn: Callable[[], T]) -> T:
        """``fn()`` run on rank 0, its result (or its exception, raised) on every rank."""
        box: list[Any] = [None]
        if self.rank == 0:
            try:
                box[0] = (True, fn())
            except Exception as exc:  # noqa: BLE001 - raised on every rank below
                box[0] = (False, exc if isinstance(exc, VaultError) else
                          RankFailedError("a step rank 0 runs for all", {0: f"{type(exc).__name__}: {exc}"}))
        self._collective("agreeing with rank 0", dist.broadcast_object_list, box, src=0, group=self.control)
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def everywhere(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` on every rank, then raised on every rank if it raised on any (its own error where it failed, a
        RankFailedError naming the failed ranks elsewhere), so no rank goes on into a collective the others left."""
        error: BaseException | None = None
        result: Any = None
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - raised below, after every rank knows
            error = exc
        flags: list[Any] = [None] * self.world
        mine = None if error is None else f"{type(error).__name__}: {error}"
        self._collective(what, dist.all_gather_object, flags, mine, group=self.control)
        if error is not None:
            raise error
        failed = {rank: text for rank, text in enumerate(flags) if text is not None}
        if failed:
            raise RankFailedError(what, failed)
        return result

    def _any(self, flag: bool) -> bool:
        flags: list[Any] = [None] * self.world
        self._collective("agreeing on the saves in flight", dist.all_gather_object, flags, flag, group=self.control)
        return any(flags)

    def _collective(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A collective of the caller's thread; a failure (a rank died or timed out) is a RankFailedError."""
        try:
            return fn(*args, **kwargs)
        except Exception as exc:
            raise self._stopped(what, exc) from exc

    def _stopped(self, what: str, exc: BaseException) -> RankFailedError:
        silent = self.board.silent()
        detail = f"the collective failed ({type(exc).__name__}: {exc})"
        if not silent:
            return RankFailedError(what, {}, f"{detail}; every rank still beats: one is stuck elsewhere, or took "
                                             f"longer than the timeout ({self.options.timeout:g} s)")
        return RankFailedError(what, silent, detail)

    def check_shared(self) -> None:
        """Once per manager, before its first save writes anything: every rank reads back an object rank 0 wrote into
        the vault (``probes/<token>``, deleted after), else UnsharedVaultError naming the ranks and hosts that could
        not."""
        if self._shared_checked:
            return
        token = secrets.token_hex(16)
        key = f"probes/{token}"

        def write_probe() -> str:
            self.vault.store.put(key, token.encode())
            return token

        token = self.on_coordinator(write_probe)
        try:
            seen = bytes(self.vault.store.get(f"probes/{token}", max_size=64)) == token.encode()
        except ObjectNotFoundError:
            seen = False
        gathered: list[Any] = [None] * self.world
        self._collective("checking the vault is shared", dist.all_gather_object, gathered,
                         (seen, socket.gethostname()), group=self.control)
        if self.rank == 0:
            try:
                self.vault.store.delete(f"probes/{token}")
            except VaultError as exc:  # harmless: nothing lists probes/
                log.warning("could not delete the vault probe %s: %s", key, exc)
        missing = {rank: host for rank, (ok, host) in enumerate(gathered) if not ok}
        if missing:
            raise UnsharedVaultError(self.vault.url, missing)
        self._shared_checked = True

    # -- saving ------------------------------------------------------------
    def save(self, request: SaveRequest, state: Any, allow_pickle: bool) -> SaveHandle:
        """Start (or, when synchronous, run) the collective save of ``state``; every rank calls it."""
        self.raise_pending()
        busy = self._any(self.inflight_step is not None) if self.settings.on_busy == "skip" else False
        if busy:
            warnings.warn(f"skipping the save of step {request.step}: a save is still in flight on some rank",
                          RuntimeWarning, stacklevel=3)
            return SaveHandle.skipped_save(request.step)
        self.wait_inflight()
        self.raise_pending()
        self.check_shared()
        what = f"the save of step {request.step}"
        plain, mine = self.everywhere(what, lambda: _digested(state, self.options.per_rank))
        gathered: list[Any] = [None] * self.world
        self._collective("comparing values across ranks", dist.all_gather_object, gathered, mine, group=self.control)
        wrapped = wrap(plain, per_rank_paths(gathered), self.rank)
        writer = self._writer(request, allow_pickle)
        handle = SaveHandle(request.step)
        if self.settings.async_save:
            staged = self.everywhere(what, lambda: writer.stage(wrapped))  # a rank out of memory: all stop here
            handle.staged.set_result(None)
            self.start(handle, self._complete, handle, writer, staged, request.step)
        else:
            handle.staged.set_result(None)
            self._complete(handle, writer, wrapped, request.step)
            self.raise_pending()
        return handle

    def _writer(self, request: SaveRequest, allow_pickle: bool) -> VaultWriter:
        s = self.settings
        writer = VaultWriter(self.vault.url, request.step, overwrite=request.overwrite, allow_pickle=allow_pickle,
                             codec=s.codec, codec_rules=self.codec_rules, chunk_size=s.chunk_size,
                             metrics=request.metrics, metadata=request.metadata, incremental=s.incremental,
                             delta=s.delta)
        writer._lent, writer._staging, writer._manifests = self.vault, self._staging, self._manifests
        writer.progress, writer.keyframe_cache = request.progress, self._keyframe_cache
        writer.lossy_safety, writer.lossy_buffers = s.lossy_safety, self._lossy_buffers
        writer.agree_group = self.saves  # the ranks agree on each lossy array's stored form, inside DCP's save
        return writer

    def _complete(self, handle: SaveHandle, writer: VaultWriter, state: dict[str, Any], step: int) -> None:
        """DCP's save, then (rank 0) retention. Never raises: the outcome goes to the handle and to pending."""
        what = f"the save of step {step}"
        try:
            try:
                dcp.save(state, storage_writer=writer, planner=VaultSavePlanner(), process_group=self.saves)
            except CheckpointException as exc:
                raise _failed(what, exc) from None
            except VaultError:
                raise
            except Exception as exc:  # a collective failed: a rank died, or the timeout passed
                raise self._stopped(what, exc) from exc
            manifest = writer.manifest if writer.manifest is not None else self.vault.read_manifest(step)
        except BaseException as caught:  # noqa: BLE001 - handed to the caller, not swallowed
            if self._keyframe_cache is not None:
                self._keyframe_cache.abort()
            log.error("%s", caught)
            self.keep_error(caught, handle)
            handle.committed.set_exception(caught)
            return
        handle.committed.set_result(info_from_manifest(manifest))
        self._keep_keyframe(step)
        if self.rank == 0:  # one rank prunes for all
            self.run_after_commit(step)

    def _keep_keyframe(self, step: int) -> None:
        """Keep committed keyframe ``step``'s chunks in the cache (the bytes noted are this save's staging buffers, or
        a synchronous save's state, which the caller may change only once this returns)."""
        if self._keyframe_cache is None:
            return
        try:
            self._keyframe_cache.commit(step, self.vault.pool)
        except Exception as exc:  # noqa: BLE001 - the save is committed; deltas read the keyframe from the store
            log.warning("could not keep keyframe %d in the keyframe cache (%s); its deltas will read it back", step, exc)

    def close(self) -> None:
        """Wait for the save in flight, then release the threads and the groups (raises a failed save's error)."""
        try:
            self.wait()
        finally:
            self.stop_thread()
            self.board.stop()
            for group in (self.saves, self.control):
                try:
                    dist.destroy_process_group(group)
                except Exception as exc:  # noqa: BLE001 - the job's default group is gone already
                    log.debug("could not destroy a process group: %s", exc)
            reissue_deferred()

    # -- restoring ---------------------------------------------------------
    def restore(self, manifest: Manifest, into: Any, keys: Iterable[str] | str | None, strict: bool,
                allow_pickle: bool) -> Any:
        """Every rank: ``into`` loaded in place at this world size (DTensors resharded, each rank's per-rank values
        its own), or without ``into`` the whole state, each per-rank value this rank's. A per-rank value of which
        the checkpoint holds none for this rank (saved at fewer ranks) is a KeyMismatchError if ``strict``, else
        left as it is (``into``) or out (without)."""
        if into is None:
            return own_values(restore_tree(self.vault, manifest, keys, allow_pickle), self.rank, strict)
        if not isinstance(into, dict):
            raise InvalidArgumentError(f"into= of a restore in a distributed job is a dict (as for dcp.load), got "
                                       f"{type(into).__name__}")
        if keys is not None:
            raise InvalidArgumentError("keys= and into= together: into= names what is read")
        live = {key: value for key, value in into.items() if _is_live(value)}
        for key, obj in live.items():
            into[key] = obj.state_dict()
        undo: list[Any] = []
        try:  # a rank the save lacked (strict) fails here, and every rank with it
            self.everywhere(f"the restore of step {manifest.step}", lambda: undo.extend(
                wrap_targets(into, saved_ranks(manifest.tree), self.rank, self.world, strict)))
        except BaseException:
            unwrap_targets(into, undo)
            into.update(live)
            raise
        try:
            reader = VaultReader(self.vault.url, manifest.step, allow_pickle=allow_pickle)
            reader._lent = self.vault
            try:
                dcp.load(into, storage_reader=reader, planner=VaultLoadPlanner(allow_partial_load=not strict),
                         process_group=self.control)
            except CheckpointException as exc:
                raise _failed(f"the restore of step {manifest.step}", exc) from None
            except VaultError:
                raise
            except Exception as exc:
                raise self._stopped(f"the restore of step {manifest.step}", exc) from exc
        finally:
            unwrap_targets(into, undo)
            loaded = {key: into[key] for key in live}
            into.update(live)
        for key, obj in live.items():
            obj.load_state_dict(loaded[key])
        return into


def _failed(what: str, exc: CheckpointException) -> BaseException:
    """DCP's CheckpointException as ckptvault's error: the typed error itself where every failure is the same
    refusal (a committed step, a key the checkpoint lacks), else RankFailedError naming each rank's error."""
    errors = {rank: err for rank, (err, _traceback) in exc.failures.items()}
    if errors and all(isinstance(e, StepExistsError) for e in errors.values()):
        return next(iter(errors.values()))
    missing = [str(e) for e in errors.values() if "Missing key in checkpoint" in str(e)]
    if missing and len(missing) == len(errors):
        return KeyMismatchError(f"{missing[0]} (on {len(missing)} ranks); pass strict=False to leave the tensors "
                                "the checkpoint lacks as they are")
    return RankFailedError(what, {rank: f"{type(e).__name__}: {e}" for rank, e in errors.items()})


def _is_live(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def _plain(state: Any) -> Any:
    """``state`` with every object that has ``state_dict``/``load_state_dict`` replaced by its state dict."""
    if _is_live(state) and not isinstance(state, dict):
        return _plain(state.state_dict())
    if isinstance(state, dict):
        if not all(isinstance(key, str) for key in state):
            return state
        return {key: _plain(value) for key, value in state.items()}
    return state


def _digested(state: Any, patterns: tuple[str, ...]) -> tuple[dict[str, Any], dict[Any, tuple[str, bool]]]:
    """The state with live objects as their state dicts, and {path: (digest, forced)} of its units."""
    plain = _plain(state)
    if not isinstance(plain, dict):
        raise InvalidArgumentError(f"a save in a distributed job takes a dict state (as dcp.save does), got "
                                   f"{type(state).__name__}")
    return plain, {path: (digest(value), forced) for path, value, forced in units(plain, patterns)}
