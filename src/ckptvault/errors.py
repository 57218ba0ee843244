"""Typed exceptions raised by ckptvault.

Every exception derives from :class:`VaultError`. Where a builtin exception has
the same meaning, the subclass inherits it too, so ``except FileNotFoundError``
keeps working for callers who do not know ckptvault.

Storage errors are split into :class:`RetryableStorageError` (a transient
fault: retrying the same call may succeed) and :class:`PermanentStorageError`
(retrying cannot help: fix the configuration or free space first).
"""

from __future__ import annotations

from typing import Any


def _rebuild(cls: type[BaseException], args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    """An unpickled error: its class, message and attributes, without calling its ``__init__``."""
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class VaultError(Exception):
    """Base class of every error ckptvault raises on purpose.

    Every one pickles as itself, although most take other ``__init__`` arguments than their message
    (``StepExistsError(step, url)``): torch.distributed sends a failed rank's exception to the others by pickle,
    and so do process pools."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.args, dict(vars(self)))


class VaultNotFoundError(VaultError, FileNotFoundError):
    """The URL does not hold a vault (nothing was ever saved there)."""


class StepNotFoundError(VaultError, FileNotFoundError):
    """The requested step has no committed checkpoint."""

    def __init__(self, step: int, url: str, available: list[int] | None = None) -> None:
        self.step = step
        shown = ""
        if available is not None:
            shown = f"; committed steps: {_short_list(available)}" if available else "; the vault is empty"
        super().__init__(f"step {step} has no committed checkpoint in {url}{shown}")


class StepExistsError(VaultError, FileExistsError):
    """A checkpoint for this step is already committed."""

    def __init__(self, step: int, url: str) -> None:
        self.step = step
        super().__init__(
            f"step {step} is already committed in {url}; pass overwrite=True to replace it "
            "or save under another step"
        )


class CorruptDataError(VaultError, ValueError):
    """Stored bytes do not match what the format promises."""


class CorruptChunkError(CorruptDataError):
    """A chunk object failed its hash check or could not be decoded."""

    def __init__(self, chunk: str, reason: str, step: int | None = None, tensor: str | None = None) -> None:
        self.chunk, self.step, self.tensor, self.reason = chunk, step, tensor, reason
        where = []
        if step is not None:
            where.append(f"step {step}")
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        at = f" (needed by {', '.join(where)})" if where else ""
        super().__init__(f"chunk {chunk} is corrupt{at}: {reason}; run `ckptvault verify` to list every damaged checkpoint")


class CorruptManifestError(CorruptDataError):
    """A manifest is truncated, fails its checksum or is not valid JSON."""


class FormatVersionError(VaultError):
    """The vault or an object in it uses a format version this ckptvault cannot read."""


class UnsupportedObjectError(VaultError, TypeError):
    """The state holds a value ckptvault does not store without pickle."""

    def __init__(self, path: str, value: object, hint: str = "") -> None:
        self.path = path
        kind = type(value).__module__ + "." + type(value).__qualname__
        extra = f" {hint}" if hint else ""
        super().__init__(
            f"cannot store {kind} at key path {path!r}: supported values are torch tensors, numpy arrays, "
            f"dict/list/tuple and int/float/bool/str/bytes/None.{extra} Convert it, or pass allow_pickle=True "
            "to save it with pickle (loading will then need allow_pickle=True too)"
        )


class PinNotFoundError(VaultError, LookupError):
    """No committed checkpoint is pinned under the requested tag."""

    def __init__(self, tag: str, url: str, tags: list[str] | None = None) -> None:
        self.tag = tag
        known = f"; tags in use: {', '.join(tags)}" if tags else "; the vault has no pins"
        super().__init__(f"no committed checkpoint in {url} is pinned as {tag!r}{known}. Pin one with "
                         f"mgr.pin(step, {tag!r}) or `ckptvault pin URL STEP {tag}`; `ckptvault pins URL` lists them")


class SourceNotFoundError(VaultError, FileNotFoundError):
    """An import source (a file or folder to read a checkpoint from, outside any vault) does not exist."""


class PickleNotAllowedError(VaultError):
    """Loading a checkpoint that holds pickled values requires allow_pickle=True."""


class KeyMismatchError(VaultError, KeyError):
    """``into=`` or ``keys=`` name tensors the checkpoint does not hold, or shapes/dtypes differ."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class InvalidArgumentError(VaultError, ValueError):
    """An argument has a value ckptvault cannot use."""


class LossyCodecError(VaultError, ValueError):
    """A lossy codec would destroy data (flush, overflow, NaN) and ``LossySafety(on_unsafe="fail")`` asked for an
    error instead of a fallback."""


class StorageError(VaultError, OSError):
    """A storage operation failed."""


class RetryableStorageError(StorageError):
    """A transient storage fault; the same call may succeed if retried."""


class PermanentStorageError(StorageError):
    """A storage fault retrying cannot fix (permissions, missing bucket, bad credentials)."""


class StorageFullError(PermanentStorageError):
    """The storage ran out of space. Committed checkpoints are intact; free space and save again."""


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """A storage key does not exist."""


class UnsafeLinkError(PermanentStorageError):
    """A symbolic link in a local vault leads outside it: the store refuses to read, copy or delete through it.

    Opening a vault whose ``tmp/`` or key folders are links outside it needs ``storage_options={"external_links":
    True}``; a link on a single object is never followed out of the vault.
    """


class OversizedObjectError(CorruptDataError):
    """An object is larger than anything ckptvault writes under its key; it was refused before it was read."""

    def __init__(self, key: str, size: int, limit: int, url: str) -> None:
        self.key, self.size, self.limit = key, size, limit
        super().__init__(f"object {key!r} in {url} is {size} bytes, more than the {limit} an object of its kind can be: "
                         "it was not written by ckptvault; run `ckptvault verify` and remove it")


class SaveError(VaultError):
    """A save failed; nothing was committed for its step."""


class RankFailedError(SaveError):
    """A collective save or restore in a distributed job failed on some ranks; nothing was committed.

    Raised on every surviving rank. ``failures`` maps each failed rank to what went wrong there (its error as
    ``"Type: message"``, or that it stopped responding: killed, hung, or its machine lost). Chunks the other ranks
    already wrote are left for ``gc``; the same save may be run again once every rank is up."""

    def __init__(self, what: str, failures: dict[int, str], detail: str | None = None) -> None:
        self.failures = dict(sorted(failures.items()))
        shown = "; ".join(f"rank {rank}: {why}" for rank, why in list(self.failures.items())[:8])
        more = f"; and {len(self.failures) - 8} more ranks" if len(self.failures) > 8 else ""
        ranks = f" on rank{'s' if len(self.failures) != 1 else ''} {_short_list(sorted(self.failures))}: {shown}{more}"
        tail = f" ({detail})" if detail else ""
        super().__init__(f"{what} failed{ranks if self.failures else ''}{tail}; nothing was committed")


class UnsharedVaultError(VaultError, ValueError):
    """The ranks of a distributed job do not see the same vault (a node-local path that differs between machines).

    Detected before any rank writes. ``ranks`` maps each rank that did not see what rank 0 wrote to its host."""

    def __init__(self, url: str, ranks: dict[int, str]) -> None:
        self.ranks = dict(sorted(ranks.items()))
        shown = ", ".join(f"rank {rank} on {host}" for rank, host in list(self.ranks.items())[:8])
        super().__init__(f"the vault {url} is not shared by every rank: {shown} cannot see an object rank 0 wrote "
                         "there (a node-local path that differs between machines?). Use a path on a shared file "
                         "system that every node mounts, or an object store (s3://...)")


class ManagerClosedError(VaultError, RuntimeError):
    """A CheckpointManager was used after :meth:`~ckptvault.CheckpointManager.close` (or after its ``with`` block)."""

    def __init__(self, what: str, url: str) -> None:
        super().__init__(f"{what} called on a closed CheckpointManager({url!r}): close() (or the end of its `with` "
                         "block) released its vault; open a new CheckpointManager to keep saving or reading")


class UnmatchedRuleWarning(VaultError, UserWarning):
    """A ``codec_rules`` pattern matched no tensor of the first state a CheckpointManager saved, so it changes nothing
    (a typo, or key paths other than the rule expects). A warning; to make it an error that stops that save before
    anything is written: ``warnings.filterwarnings("error", category=UnmatchedRuleWarning)``."""


class CheckpointPathNotFoundError(VaultError, FileNotFoundError):
    """A training framework's checkpoint path (Lightning's ``epoch=0-step=10.ckpt``) names no committed checkpoint
    of the vault an integration stores into (``ckptvault.integrations``)."""


class MaintenanceRefusedError(VaultError):
    """prune or gc refused to run: some manifests cannot be read, so what they reference is unknown.

    Nothing was deleted. ``problems`` maps each unreadable step to what is wrong with it.
    """

    def __init__(self, problems: dict[int, str], url: str) -> None:
        self.problems = dict(problems)
        steps = sorted(problems)
        first = problems[steps[0]]
        super().__init__(
            f"refusing to collect garbage or prune in {url}: the manifests of steps {_short_list(steps)} cannot be "
            f"read (step {steps[0]}: {first}), so the chunks they reference are unknown; nothing was deleted. "
            "Run `ckptvault verify`, then delete or restore those steps (`ckptvault rm URL STEP`) and run again"
        )


def _short_list(values: list[int], limit: int = 8) -> str:
    if len(values) <= limit:
        return ", ".join(map(str, values))
    head = ", ".join(map(str, values[: limit // 2]))
    tail = ", ".join(map(str, values[-limit // 2 :]))
    return f"{head}, ..., {tail}"


class PredictionError(CorruptDataError):
    """A predicted array (stored as its residual against its prediction from the step before) did not restore to the bytes
    it was saved with (its digest differs), or cannot be computed exactly on this thread. Its chunks were intact:
    the prediction differed. As after any restore that fails part way, tensors given as ``into=`` targets then hold
    undefined bytes; a restore into new tensors returns nothing."""
