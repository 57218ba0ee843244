"""CheckpointManager: the user-facing API of a vault."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from .codecs import DEFAULT_CODEC
from .delta import DeltaPolicy, delta_context
from .errors import StepExistsError, VaultNotFoundError
from .format.manifest import manifest_key
from .handle import SaveHandle
from .info import CheckpointInfo, info_from_manifest
from .maintenance import MaintenanceMixin, Retention, apply_retention
from .restore import restore_into, restore_tree
from .rules import CodecRules
from .save import build_manifest, check_step, commit, write_chunks
from .snapshot import take_snapshot
from .stores import Store
from .vault import DEFAULT_CHUNK_SIZE, Vault
from .verify import VerifyReport, verify_steps

log = logging.getLogger(__name__)

Progress = Callable[[int], None]


class CheckpointManager(MaintenanceMixin):
    """Save, list, inspect and restore checkpoints in one vault.

    ``url`` is a local path, ``file://``, or ``memory://`` URL (or a Store).
    The vault is created on the first save; reading an absent vault finds no
    steps. ``codec`` is the default lossless codec for new vaults (``zstd``,
    ``lz4``, ``none``/``fast``, ``zstd-N``); ``codec_rules`` override it per key
    path, first match wins. Use as a context manager or call :meth:`close`.

    Incremental saves (``incremental=True``, the default): chunks identical to
    stored ones are never written again, and changed chunks are stored as XOR
    deltas against the same region of the latest keyframe when that is
    smaller. A keyframe (stored without deltas) is written every
    ``keyframe_every`` checkpoints, or when the previous checkpoint added more
    than ``keyframe_growth`` x the keyframe's stored bytes; so restoring any
    checkpoint reads at most one base chunk per chunk.
    """

    def __init__(
        self,
        url: str | os.PathLike[str] | Store,
        *,
        codec: str | None = None,
        codec_rules: Mapping[str, str] | Iterable[tuple[str, str]] | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        storage_options: dict[str, Any] | None = None,
        workers: int | None = None,
        incremental: bool = True,
        keyframe_every: int = 10,
        keyframe_growth: float = 0.9,
        retention: Any = None,
    ) -> None:
        self.vault = Vault(url, storage_options, workers)
        self.url = self.vault.url
        self._codec = codec
        self._chunk_size = chunk_size
        self._codec_rules = codec_rules
        CodecRules(codec_rules, codec or DEFAULT_CODEC)  # validate early
        self.delta_policy = DeltaPolicy(incremental, keyframe_every, keyframe_growth)
        self.retention = Retention.coerce(retention)

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
        """Save ``state`` as checkpoint ``step``; returns a handle whose ``wait()`` gives its info.

        The checkpoint becomes visible atomically when its manifest is written,
        last. Raises StepExistsError if ``step`` is committed and not ``overwrite``,
        UnsupportedObjectError (naming the key path) for values that need pickle.
        """
        check_step(step)
        handle = SaveHandle(step)
        desc = self.vault.descriptor() or self.vault.create(self._chunk_size, self._codec or DEFAULT_CODEC)
        if not overwrite and self.vault.store.exists(manifest_key(step)):
            raise StepExistsError(step, self.url)
        rules = CodecRules(self._codec_rules, self._codec or desc["codec"])
        snapshot = take_snapshot(state, rules, allow_pickle=allow_pickle, copy=False)
        handle.staged.set_result(None)
        try:
            delta = delta_context(self.vault, self.delta_policy, step)
            chunks, pieces = write_chunks(self.vault, snapshot, progress, delta)
            manifest = build_manifest(step, snapshot, chunks, pieces, metrics, metadata,
                                      delta.keyframe_step, delta.since_keyframe)
            commit(self.vault, step, manifest, overwrite)
        except BaseException as exc:
            handle.committed.set_exception(exc)
            raise
        handle.committed.set_result(info_from_manifest(manifest))
        if self.retention is not None:  # only now that the checkpoint is durable
            apply_retention(self.vault, self.retention, step)
        return handle

    def wait(self) -> None:
        """Wait for every save in flight (saves are synchronous in this version)."""

    # -- listing -----------------------------------------------------------
    def steps(self) -> list[int]:
        """Committed steps, ascending."""
        return self.vault.steps()

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def info(self, step: int | None = None) -> CheckpointInfo:
        """Statistics, metrics and metadata of ``step`` (default: latest)."""
        return info_from_manifest(self.vault.read_manifest(self._resolve(step)))

    def manifest(self, step: int | None = None) -> dict[str, Any]:
        """The verified manifest body of ``step`` (default: latest)."""
        return self.vault.read_manifest(self._resolve(step))

    # -- restoring ---------------------------------------------------------
    def restore(
        self,
        step: int | None = None,
        *,
        into: Any = None,
        keys: Iterable[str] | str | None = None,
        strict: bool = True,
        allow_pickle: bool = False,
        progress: Progress | None = None,
    ) -> Any:
        """Restore ``step`` (default: latest).

        Without ``into``: a new state with the saved structure and types
        (``keys`` limits it to matching key paths; only those are read).
        With ``into``: copies into the tensors of ``into`` in place (matched by
        key path at the root or under one saved subtree, e.g. ``model``) and
        returns ``into``; no second copy of the state is made.
        """
        manifest = self.vault.read_manifest(self._resolve(step))
        if into is not None:
            return restore_into(self.vault, manifest, into, strict, progress)
        return restore_tree(self.vault, manifest, keys, allow_pickle, progress)

    # -- maintenance -------------------------------------------------------
    def delete(self, step: int) -> None:
        """Remove checkpoint ``step`` (its manifest). Chunks it alone used are reclaimed by gc."""
        if not self.vault.store.exists(manifest_key(check_step(step))):  # a damaged manifest can still be deleted
            self.vault.read_manifest(step)  # raises VaultNotFoundError / StepNotFoundError naming the steps
        self.vault.store.delete(manifest_key(step))

    def verify(self, step: int | None = None, progress: Progress | None = None) -> VerifyReport:
        """Read and check every chunk of ``step`` (default: every step)."""
        steps = [step] if step is not None else self.steps()
        return verify_steps(self.vault, steps, progress)

    def _resolve(self, step: int | None) -> int:
        if step is not None:
            return check_step(step)
        latest = self.latest_step()
        if latest is None:
            self.vault.require()
            raise VaultNotFoundError(f"the vault at {self.url} has no committed checkpoint")
        return latest

    def close(self) -> None:
        self.vault.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"CheckpointManager({self.url!r})"
