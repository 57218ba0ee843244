"""PyTorch Lightning's CheckpointIO over a vault: ``Trainer(plugins=[VaultCheckpointIO(url)])``.

Lightning names checkpoints by file path (``dirpath/epoch=0-step=10.ckpt``); a vault by step. The plugin stores
each checkpoint dict as the vault's step ``global_step`` (its tensors as tensors, so chunks are shared and stored
as deltas across checkpoints) and keeps the mapping in the vault: one pin per path (tag :func:`path_tag`), so
several paths of one global step (a top-k file and ``last.ckpt``) share one stored checkpoint, and a step is
deleted when its last pin goes. At each path it writes a small JSON pointer file, for what ModelCheckpoint and
the Trainer check on the file system (a file exists, ``ckpt_path="last"`` finds the newest ``last*.ckpt``).

Order of one save (``save_checkpoint``): the pointer file is written at once (so Lightning's file checks see the
checkpoint as it would see a torch.save file); the pins move after the commit, when the next call of the plugin
finds the save done, or waits for it (the next save of another step, a load of that path, ``teardown``). A load
reads the step pinned for the path, so after a crash it finds the last committed checkpoint for that path, never
a partial one. The contract in full: docs/INTEGRATIONS.md, "Lightning".
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from fsspec.core import url_to_fs

try:  # the unified package; the standalone pytorch_lightning's own base class is registered below
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
except ImportError:
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO  # type: ignore[assignment]

from ..errors import (
    CheckpointPathNotFoundError,
    InvalidArgumentError,
    PinNotFoundError,
    StepExistsError,
    StepNotFoundError,
)
from ..handle import SaveHandle
from ..manager import CheckpointManager
from ..options import DistributedOptions

log = logging.getLogger(__name__)

#: the ``format`` field of a pointer file
POINTER_FORMAT = "ckptvault.lightning-pointer"
#: the prefix of the pin tags that map paths to steps
TAG_PREFIX = "lightning."
_POINTER_MAX_BYTES = 64 * 1024


def path_key(path: str | os.PathLike[str]) -> str:
    """The form a path is compared in: an absolute local path (``file://`` dropped), or a remote URL as given."""
    text = os.fspath(path)
    if not isinstance(text, str):
        raise InvalidArgumentError(f"a checkpoint path must be a str or os.PathLike of str, got {text!r}")
    if "://" in text and not text.startswith("file://"):
        return text
    return os.path.abspath(text.removeprefix("file://"))


def path_tag(key: str) -> str:
    """The pin tag of a path key: ``lightning.<file name, tag characters only>.<16 hex digits of its SHA-256>``."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", key.rstrip("/").rsplit("/", 1)[-1])[:80]
    return f"{TAG_PREFIX}{name}.{hashlib.sha256(key.encode()).hexdigest()[:16]}"


@dataclass
class _Pending:
    """The save in flight: its step and handle, and the paths to pin once it is committed."""

    step: int
    handle: SaveHandle
    paths: list[str] = field(default_factory=list)


class VaultCheckpointIO(CheckpointIO):
    """Lightning's checkpoint plugin storing into the vault at ``url`` (a local path or any URL a
    :class:`~ckptvault.CheckpointManager` takes, not a Store object: the plugin reopens the vault after each
    ``teardown``).

    ``allow_pickle=True`` stores values that need pickle (objects in ``hyper_parameters``, a callback's custom
    state) and loads them back (unless Lightning asks for ``weights_only=True``); without it such a value fails
    the save at once with :class:`~ckptvault.errors.UnsupportedObjectError` naming its key path, nothing stored.
    Every other keyword goes to the CheckpointManager (``codec``, ``codec_rules``, ``storage_options``,
    ``delta``, ``async_save``, ``retention``, ...), except ``distributed`` (Lightning saves from global rank 0
    alone) and ``on_busy="skip"`` (Lightning records every checkpoint it asks for).
    """

    def __init__(self, url: str | os.PathLike[str], *, allow_pickle: bool = False, **manager_options: Any) -> None:
        if not isinstance(url, (str, os.PathLike)):
            raise InvalidArgumentError(f"VaultCheckpointIO takes the vault's URL or path (str or os.PathLike), got "
                                       f"{type(url).__name__}: it reopens the vault after each Trainer teardown, "
                                       "which a Store object does not survive")
        if not isinstance(allow_pickle, bool):
            raise InvalidArgumentError(f"allow_pickle must be a bool, got {allow_pickle!r}")
        _check_manager_options(manager_options)
        self.allow_pickle = allow_pickle
        self._url = url
        self._options = {**manager_options, "distributed": DistributedOptions(enabled=False)}
        self._manager: CheckpointManager | None = CheckpointManager(url, **self._options)  # bad options fail here
        self.url = self._manager.url
        self._pending: _Pending | None = None
        self._last_step: int | None = None  # the latest step this plugin saved, while stored
        self._last_fingerprint: tuple[Any, ...] = ()  # ... and what its state was (_fingerprint)
        self._last_refs: list[Any] = []  # ... and its values, kept alive so that no other takes their memory
        self._loaded_step: int | None = None  # the step loaded since the last save or teardown (a resume)

    @property
    def manager(self) -> CheckpointManager:
        """The CheckpointManager of the vault (opened again after a ``teardown``)."""
        if self._manager is None:
            self._manager = CheckpointManager(self._url, **self._options)
        return self._manager

    # -- CheckpointIO ----------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Store ``checkpoint`` as step ``checkpoint["global_step"]`` for ``path``; returns once the state is
        staged (asynchronous saves) or committed.

        A second path at the global step this plugin saved last, with the same state (every tensor the same
        memory, unmodified since; every other value equal), stores nothing more: the path becomes an alias of the
        stored step. A different state at that step (ModelCheckpoint's own bookkeeping changed between its top-k
        and ``last.ckpt`` saves), at the step this run resumed from, or at the step the path names already,
        replaces that step for every path naming it. Raises StepExistsError if the vault holds the step from
        elsewhere (another run) for other paths, InvalidArgumentError for ``storage_options`` (the vault's go to
        the constructor) or a checkpoint without an int ``global_step``, and the error of an earlier background
        save that failed.
        """
        if storage_options is not None:
            raise InvalidArgumentError("VaultCheckpointIO.save_checkpoint takes no storage_options (from "
                                       "trainer.save_checkpoint(..., storage_options=...)): pass the vault's storage "
                                       "options to VaultCheckpointIO(url, storage_options=...)")
        step = _global_step(checkpoint)
        key = path_key(path)
        refs: list[Any] = []
        fingerprint = _fingerprint(checkpoint, refs)
        self._settle(wait=False)
        if self._is_alias(step, fingerprint):
            self._add_alias(step, key)
        else:
            self._settle(wait=True)  # one save at a time: the previous one commits (or raises) first
            self._save(step, key, checkpoint, overwrite=self._replaces(step, key))
            self._last_fingerprint, self._last_refs = fingerprint, refs
        self._write_pointer(key, step)

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint dict stored for ``path`` (the step its pin names), as saved: the same structure, types
        and bits; tensors on the CPU, or moved to ``map_location`` (a device or its name).

        Waits first if ``path``'s save is in flight. Raises CheckpointPathNotFoundError (a FileNotFoundError)
        if no committed checkpoint is stored for ``path``, InvalidArgumentError for a ``map_location`` that is
        not a device, PickleNotAllowedError for pickled values without ``allow_pickle`` (or with
        ``weights_only=True``).
        """
        device = _device(map_location)
        keys = _lookup_keys(path)
        self._settle(wait=self._pending is not None and any(k in self._pending.paths for k in keys))
        step = next((s for s in map(self._pinned_step, keys) if s is not None), None)
        if step is None:
            raise self._not_found(keys[0])
        state = self.manager.restore(step, allow_pickle=self.allow_pickle and weights_only is not True)
        self._loaded_step = step
        return state if device is None else _to_device(state, device)

    def remove_checkpoint(self, path: Any) -> None:
        """Forget ``path``: remove its pin and pointer file, and delete its step from the vault once no pin names
        it (the chunks only it used go with the next ``gc``). A path with no checkpoint is left alone (as
        Lightning's TorchCheckpointIO does for a missing file)."""
        key = path_key(path)
        self._settle(wait=False)
        pending = self._pending
        in_flight = pending is not None and key in pending.paths
        if pending is not None and in_flight:
            pending.paths.remove(key)  # its save goes on; it is deleted after its commit if no path is left
        step = self._pinned_step(key)
        if step is not None:
            self._release(step, path_tag(key))
        elif not in_flight:
            log.debug("remove_checkpoint(%s): no committed checkpoint of %s is stored for it", key, self.url)
        self._remove_pointer(key)

    def teardown(self) -> None:
        """Wait for the save in flight, pin its paths, close the vault (a later call opens it again). Raises the
        error of a background save that failed (its paths' pointer files then name the last committed step)."""
        try:
            self._settle(wait=True)
        finally:
            self._last_step = self._loaded_step = None
            self._last_fingerprint, self._last_refs = (), []
            manager, self._manager = self._manager, None
            if manager is not None:
                manager.close()

    # -- saving ----------------------------------------------------------------
    def _is_alias(self, step: int, fingerprint: tuple[Any, ...]) -> bool:
        """Whether this plugin's latest save was at ``step`` with the same state: then the path only names it."""
        return step == self._last_step and fingerprint == self._last_fingerprint

    def _replaces(self, step: int, key: str) -> bool:
        """Whether a save at ``step`` replaces a step of this run: its own latest (another state at that global
        step), the one it resumed from, or the step ``key`` names already (as torch.save replaces the file)."""
        return step in (self._last_step, self._loaded_step) or self._pinned_step(key) == step

    def _add_alias(self, step: int, key: str) -> None:
        pending = self._pending
        if pending is not None and pending.step == step:
            if key not in pending.paths:
                pending.paths.append(key)
        else:
            self._attach(step, key)

    def _save(self, step: int, key: str, checkpoint: dict[str, Any], overwrite: bool) -> None:
        """Start the save of ``step`` (``overwrite``: replacing this run's own); a committed step from elsewhere is
        refused before any work."""
        metadata: dict[str, Any] = {"lightning": {"path": key}}
        if type(checkpoint.get("epoch")) is int:
            metadata["lightning"]["epoch"] = checkpoint["epoch"]
        try:
            handle = self.manager.save(step, checkpoint, metadata=metadata, overwrite=overwrite,
                                       allow_pickle=self.allow_pickle)
        except StepExistsError as exc:
            exc.args = (f"global step {step} is already stored in {self.url} by another run (or by this run before "
                        f"it resumed from an earlier checkpoint), so {key} cannot be stored: VaultCheckpointIO keeps "
                        "one checkpoint per global step. Resume from the vault's latest checkpoint "
                        "(trainer.fit(ckpt_path=...)), store into a new vault, or remove that step first "
                        f"(`ckptvault rm {self.url} {step}`)",)
            raise
        self._pending = _Pending(step, handle, [key])
        self._last_step, self._loaded_step = step, None

    def _settle(self, wait: bool) -> None:
        """Finish the bookkeeping of the save in flight once it is done (``wait``: wait for it): pin its paths,
        or, if it failed, point their pointer files back at their last committed steps and raise its error."""
        pending = self._pending
        if pending is None or not (wait or pending.handle.done()):
            return
        self._pending = None
        try:
            pending.handle.wait()
        except BaseException:
            self._last_step = None
            for key in pending.paths:
                self._repoint(key)
            raise
        for key in pending.paths:
            self._attach(pending.step, key)
        if not pending.paths:  # every path was removed while it was saved
            self._drop_if_unpinned(pending.step)

    # -- the mapping: pins -----------------------------------------------------
    def _pinned_step(self, key: str) -> int | None:
        try:
            return self.manager.step_of(path_tag(key))
        except PinNotFoundError:
            return None

    def _attach(self, step: int, key: str) -> None:
        """Pin committed ``step`` for ``key``, then release the step ``key`` named before (if another)."""
        tag = path_tag(key)
        self.manager.pin(step, tag)
        for old, tags in self.manager.pins().items():
            if old != step and tag in tags:
                self._release(old, tag)

    def _release(self, step: int, tag: str) -> None:
        self.manager.unpin(step, tag)
        self._drop_if_unpinned(step)

    def _drop_if_unpinned(self, step: int) -> None:
        """Delete ``step`` once no pin (this plugin's or a user's) names it; never the save in flight."""
        if (self._pending is not None and self._pending.step == step) or self.manager.pins().get(step):
            return
        try:
            self.manager.delete(step)
        except StepNotFoundError:
            return  # deleted already (by hand, or by retention)
        log.debug("deleted step %d of %s: no checkpoint path names it any more", step, self.url)
        if step == self._last_step:
            self._last_step = None
        if step == self._loaded_step:
            self._loaded_step = None

    # -- pointer files ---------------------------------------------------------
    def _write_pointer(self, key: str, step: int) -> None:
        """The pointer file at ``key``, replaced atomically on a local file system (one PUT on object storage)."""
        body = json.dumps({"format": POINTER_FORMAT, "vault": self.url, "step": step}).encode()
        fs = _filesystem(key)
        parent = os.path.dirname(key) if _is_local(key) else key.rsplit("/", 1)[0]
        fs.makedirs(parent, exist_ok=True)
        if not _is_local(key):
            fs.pipe_file(key, body)
            return
        tmp = f"{key}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "wb") as f:
            f.write(body)
        os.replace(tmp, key)

    def _read_pointer(self, key: str) -> dict[str, Any] | None:
        """The pointer file at ``key``; None if there is none, or the file there is not a pointer."""
        fs = _filesystem(key)
        try:
            with fs.open(key, "rb") as f:
                body = json.loads(f.read(_POINTER_MAX_BYTES))
        except (OSError, ValueError):
            return None
        if not isinstance(body, dict) or body.get("format") != POINTER_FORMAT:
            return None
        return body

    def _remove_pointer(self, key: str) -> None:
        """Delete the pointer file at ``key``; a file there that is not a pointer is not this plugin's to delete."""
        if self._read_pointer(key) is not None:
            _filesystem(key).rm(key)
        elif _filesystem(key).exists(key):
            log.warning("left %s in place: it is not a VaultCheckpointIO pointer file", key)

    def _repoint(self, key: str) -> None:
        """After a failed save: the pointer at ``key`` names the step still pinned for it, or goes."""
        step = self._pinned_step(key)
        if step is None:
            self._remove_pointer(key)
        else:
            self._write_pointer(key, step)

    def _not_found(self, key: str) -> CheckpointPathNotFoundError:
        found = self._read_pointer(key)
        if found is not None and found.get("vault") != self.url:
            why = f"the pointer file there names step {found.get('step')} of another vault, {found.get('vault')}: " \
                  f"load it with VaultCheckpointIO({found.get('vault')!r})"
        elif found is not None:
            why = f"the pointer file there names step {found.get('step')}, whose save did not commit or was deleted"
        elif _filesystem(key).exists(key):
            why = "the file there is not a VaultCheckpointIO pointer (a torch.save checkpoint? load it without the plugin)"
        else:
            steps = self.manager.steps()
            why = f"the vault holds steps {steps}" if steps else "the vault holds no checkpoint"
            why += f"; `ckptvault pins {self.url}` lists the paths stored (pins {TAG_PREFIX}<file name>.<hash>)"
        return CheckpointPathNotFoundError(f"no committed checkpoint of {self.url} is stored for {key}: {why}")


def _check_manager_options(options: dict[str, Any]) -> None:
    if "distributed" in options:
        raise InvalidArgumentError("VaultCheckpointIO takes no distributed=: Lightning saves a checkpoint from global "
                                   "rank 0 alone, so the plugin's manager never takes part in a collective save")
    async_options = options.get("async_options")
    on_busy = options.get("on_busy", getattr(async_options, "on_busy", "wait"))
    if on_busy == "skip":
        raise InvalidArgumentError("VaultCheckpointIO takes no on_busy='skip': Lightning's ModelCheckpoint records "
                                   "every checkpoint it asks for, so a skipped save would leave it naming a checkpoint "
                                   "that does not exist; use on_busy='wait' (the default)")


def _global_step(checkpoint: Any) -> int:
    step = checkpoint.get("global_step") if isinstance(checkpoint, dict) else None
    if type(step) is not int or step < 0:
        raise InvalidArgumentError(f"VaultCheckpointIO stores a checkpoint as the vault step of its 'global_step', "
                                   f"which must be an int >= 0; got {step!r}: save the dict Lightning's "
                                   "trainer.save_checkpoint makes, or add 'global_step'")
    return step


def _fingerprint(value: Any, refs: list[Any]) -> tuple[Any, ...]:
    """What ``value`` holds, cheaply: its structure and plain values, and per tensor its memory and version
    counter (bumped by every in-place change), not its bytes. Each tensor and object goes into ``refs``: while
    they are kept alive, equal fingerprints mean an unchanged state."""
    if isinstance(value, torch.Tensor):
        refs.append(value)
        return ("tensor", value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape),
                value.stride(), value.dtype, value.device, value._version)
    if isinstance(value, dict):
        return (type(value), tuple((k, _fingerprint(v, refs)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_fingerprint(v, refs) for v in value))
    if type(value) is float:
        return ("float", value.hex())  # NaN equals itself here
    if value is None or type(value) in (int, bool, str, bytes):
        return (type(value), value)
    refs.append(value)
    return ("object", id(value))


def _filesystem(key: str) -> Any:
    """The fsspec file system of a path key (the local one for local paths)."""
    return url_to_fs(key)[0]


def _is_local(key: str) -> bool:
    return "://" not in key


def _lookup_keys(path: Any) -> list[str]:
    """The keys a load tries: the path, then where its symbolic links lead (``ModelCheckpoint(save_last="link")``)."""
    key = path_key(path)
    real = os.path.realpath(key) if _is_local(key) else key
    return [key] if real == key else [key, real]


def _device(map_location: Any) -> torch.device | None:
    """The device ``map_location`` names (None: leave tensors on the CPU, where the vault restores them)."""
    if map_location is None:
        return None
    if isinstance(map_location, (str, torch.device)):
        device = torch.device(map_location)
        return None if device.type == "cpu" else device
    raise InvalidArgumentError(f"VaultCheckpointIO.load_checkpoint takes map_location as a device or its name "
                               f"('cuda:0'), got {type(map_location).__name__}: the vault restores tensors on the "
                               "CPU and can move them to one device")


def _to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor moved to ``device``; containers keep their types (and a state dict's
    ``_metadata``)."""
    move: Callable[[Any], Any] = lambda v: _to_device(v, device)  # noqa: E731 - one line, used three times
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        out = type(value)((k, move(v)) for k, v in value.items())
        if hasattr(value, "_metadata"):
            out._metadata = value._metadata  # type: ignore[attr-defined]
        return out
    if isinstance(value, (list, tuple)):
        return type(value)(move(v) for v in value)
    return value


def _register_with_standalone_lightning() -> None:
    """Make the plugin a CheckpointIO of the standalone ``pytorch_lightning`` package too (its Trainer checks the
    class of ``lightning_fabric``, another copy of the same interface), if that package is installed."""
    try:
        from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO as StandaloneCheckpointIO
    except ImportError:
        return
    if not issubclass(VaultCheckpointIO, StandaloneCheckpointIO):
        StandaloneCheckpointIO.register(VaultCheckpointIO)


_register_with_standalone_lightning()
