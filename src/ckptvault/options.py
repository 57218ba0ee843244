"""Typed option objects: each groups the settings of one concern of :class:`~ckptvault.CheckpointManager`.

``delta=DeltaOptions(...)`` (keyframes of incremental saves), ``async_options=AsyncOptions(...)`` (background
saves), ``lossy_safety=LossySafety(...)`` (what to do with an unsafe lossy result), ``storage_options=`` a
:class:`LocalOptions` or :class:`S3Options` (or a dict of the same keys), ``retention=`` a :class:`Retention`.
Every object checks its values when made, so a wrong one fails where it is written, naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ._argcheck import check_kind
from ._codecs.lossy import LossySafety
from ._maintenance.retention import Retention
from .errors import InvalidArgumentError
from .stores import LocalOptions, S3Options, StorageOptions

__all__ = ["AsyncOptions", "DeltaOptions", "DistributedOptions", "LocalOptions", "LossySafety", "Retention", "S3Options",
           "StorageOptions"]

#: what a save does while another is still in flight
ON_BUSY = ("wait", "skip")
#: where an asynchronous save's work runs after the snapshot
SAVERS = ("thread", "process", "idle-process")


@dataclass(frozen=True)
class DeltaOptions:
    """Keyframes of incremental saves (docs/DESIGN.md §6).

    A keyframe (stored without deltas) is written every ``keyframe_every`` checkpoints, or when the previous
    checkpoint added more than ``keyframe_growth`` x the keyframe's stored bytes; the checkpoints between store
    changed chunks as deltas against it, so restoring any checkpoint reads at most one base chunk per chunk.
    ``cache_keyframe`` keeps the byte planes of the latest keyframe's chunks in host memory so that delta saves
    encode against them instead of reading the keyframe back: all of them for a keyframe of up to 64 MiB, the high
    planes of a larger one (half the state's bytes for float32). ``None`` (the default) keeps it for asynchronous
    saves, whose staging copy is host memory already, filled when the keyframe is committed; for synchronous saves
    of states up to 64 MiB, it keeps the keyframe chunks their delta saves read back, so each is read once per
    keyframe; ``True`` always, filled when the keyframe is committed; ``False`` never. Figures:
    docs/benchmarks/incremental.md.

    ``predict=True``: a checkpoint saved one optimizer step after the previous one stores the weights and moments of
    Adam, AdamW and SGD (momentum, Nesterov) optimizers in the state as their difference from their prediction from
    that checkpoint, losslessly, where that stores less (docs/DESIGN.md §6). The optimizer's parameters pair with
    the model's arrays in state order (by name where the optimizer state is keyed by parameter name, as
    ``torch.distributed.checkpoint.state_dict.get_state_dict`` returns it); ``predict={"optimizer": "model"}`` names
    the model subtree of each optimizer key path instead. It keeps a copy of the weights and moments of the latest
    save in host memory. Restoring a predicted checkpoint rebuilds the ones it was predicted from first;
    ``max_chain`` caps how many: a checkpoint whose chain reached it is followed by a keyframe (as every
    ``keyframe_every`` checkpoints), so restore chains are at most ``min(max_chain, keyframe_every - 1)`` long. For
    a checkpoint every step: ``keyframe_every=20, max_chain=19`` (figures: docs/benchmarks/predicted.md).
    """

    keyframe_every: int = 10
    keyframe_growth: float = 0.9
    cache_keyframe: bool | None = None
    predict: bool | Mapping[str, str] = False
    max_chain: int = 4

    def __post_init__(self) -> None:
        check_kind("keyframe_every", self.keyframe_every, int)
        check_kind("keyframe_growth", self.keyframe_growth, int, float)
        check_kind("cache_keyframe", self.cache_keyframe, bool, type(None))
        if self.keyframe_every < 1:
            raise InvalidArgumentError(f"keyframe_every must be >= 1, got {self.keyframe_every}")
        if not 0 < self.keyframe_growth:
            raise InvalidArgumentError(f"keyframe_growth must be > 0, got {self.keyframe_growth}")
        check_kind("predict", self.predict, bool, Mapping)
        if isinstance(self.predict, Mapping) and not all(isinstance(k, str) and isinstance(v, str)
                                                         for k, v in self.predict.items()):
            raise InvalidArgumentError("predict must be True, False or a dict of optimizer key path -> model key path "
                                       f"(strings), got {dict(self.predict)!r}")
        check_kind("max_chain", self.max_chain, int)
        if self.max_chain < 1:
            raise InvalidArgumentError(f"max_chain must be >= 1, got {self.max_chain}")


@dataclass(frozen=True)
class AsyncOptions:
    """Asynchronous saves (``async_save=True``, the default): the state is staged into a reusable host buffer
    and written in the background.

    ``max_staging_bytes`` caps that buffer (None: no cap): with the thread saver a larger state is saved
    synchronously; a saver process cannot read the live state, so there such a save raises InvalidArgumentError.
    ``on_busy`` says what a save does while another is in flight: ``"wait"`` for it, or ``"skip"`` this one (it
    returns a skipped handle and warns).

    ``saver`` says where the work after the snapshot runs:

    * ``"thread"`` (the default): a background thread of the training process.
    * ``"process"``: a saver process of its own, started with the manager. The state is staged into shared memory
      and the process chunks, encodes, writes and commits it; training shares no interpreter lock with it.
    * ``"idle-process"``: the same process in Linux's idle scheduling class (``SCHED_IDLE``), so that it runs only
      on CPU time the training leaves unused. For jobs whose own threads do not keep every core busy; where they
      spin (OpenMP's default wait policy) an idle saver may get no time and ``save()`` waits for it.

    ``max_in_flight`` (saver processes only) is how many saves may be in flight at once, each staged in a buffer of
    its own (so up to that many host copies of the state); the saver process runs them in order. More than one lets
    a saver that is slower than some steps (a keyframe, a busy moment) catch up later instead of holding training
    up; ``on_busy`` applies once every buffer holds an unfinished save.

    A saver process needs a vault URL it can open itself (a local path, ``file://``, ``s3://`` or another fsspec
    URL; not ``memory://`` or a Store object) and a POSIX system (``"idle-process"``: Linux). The manager's retention
    runs in the saver process after each commit, unless its policies do not pickle there (a ``keep_if`` lambda, a
    policy class defined in the training script): then it runs in the training process, and with
    ``exclusive=True`` each save first waits for the one before it. ``progress=`` callbacks run in the training
    process; the saver's log records arrive in its ``ckptvault`` loggers.
    If the saver process dies, its save in flight fails with :class:`~ckptvault.errors.SaveError` and the next save
    starts a new one. Figures: docs/benchmarks/async.md (thread), docs/benchmarks/predicted.md (every step, each saver).
    """

    on_busy: str = "wait"
    max_staging_bytes: int | None = None
    saver: str = "thread"
    max_in_flight: int = 1

    def __post_init__(self) -> None:
        if self.on_busy not in ON_BUSY:
            raise InvalidArgumentError(f"on_busy must be one of {ON_BUSY}, got {self.on_busy!r}")
        check_kind("max_staging_bytes", self.max_staging_bytes, int, type(None))
        if self.max_staging_bytes is not None and self.max_staging_bytes < 0:
            raise InvalidArgumentError(f"max_staging_bytes must be at least 0 (None: no cap), got {self.max_staging_bytes}")
        if self.saver not in SAVERS:
            raise InvalidArgumentError(f"saver must be one of {SAVERS}, got {self.saver!r}")
        check_kind("max_in_flight", self.max_in_flight, int)
        if self.max_in_flight < 1:
            raise InvalidArgumentError(f"max_in_flight must be at least 1, got {self.max_in_flight}")
        if self.max_in_flight > 1 and self.saver == "thread":
            raise InvalidArgumentError(f"max_in_flight={self.max_in_flight} needs a saver process "
                                       "(saver='process' or 'idle-process'): the thread saver runs one save at a time")


@dataclass(frozen=True)
class DistributedOptions:
    """A CheckpointManager in a torch.distributed job (README, "Distributed training"; docs/DESIGN.md section 4).

    ``enabled``: ``None`` (the default) takes part in the job when torch.distributed is initialised (at any world
    size, one rank included) when the manager is made; ``True`` requires that (InvalidArgumentError otherwise);
    ``False`` never takes part (each process saves alone, as without torch.distributed).
    ``timeout``: seconds a collective step of a save or restore waits for the other ranks before it fails with
    :class:`~ckptvault.errors.RankFailedError` (a rank that dies is usually noticed at once; a hung one only then).
    ``per_rank``: glob patterns of key paths (``"loader"``, ``"rng.*"``) whose values every rank keeps apart, even
    where they are equal; values that differ between ranks are kept apart anyway (never one rank's copy for all).
    """

    enabled: bool | None = None
    timeout: float = 600.0
    per_rank: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_kind("enabled", self.enabled, bool, type(None))
        check_kind("timeout", self.timeout, int, float)
        if not 0 < self.timeout < float("inf"):
            raise InvalidArgumentError(f"timeout must be a positive number of seconds, got {self.timeout!r}")
        if isinstance(self.per_rank, str):
            object.__setattr__(self, "per_rank", (self.per_rank,))
        check_kind("per_rank", self.per_rank, tuple, list)
        object.__setattr__(self, "per_rank", tuple(self.per_rank))
        for pattern in self.per_rank:
            check_kind("per_rank pattern", pattern, str)
            if not pattern:
                raise InvalidArgumentError("per_rank patterns must not be empty")


#: the flat keyword spellings of earlier versions -> (the option object's keyword, its field)
FLAT_KEYWORDS = {
    "keyframe_every": ("delta", "keyframe_every"), "keyframe_growth": ("delta", "keyframe_growth"),
    "cache_keyframe": ("delta", "cache_keyframe"), "on_busy": ("async_options", "on_busy"),
    "max_staging_bytes": ("async_options", "max_staging_bytes"), "saver": ("async_options", "saver"),
    "max_in_flight": ("async_options", "max_in_flight"),
    "on_unsafe": ("lossy_safety", "on_unsafe"), "max_flushed": ("lossy_safety", "max_flushed"),
}
_GROUPS = {"delta": DeltaOptions, "async_options": AsyncOptions, "lossy_safety": LossySafety}


def grouped(given: dict[str, Any], flat: dict[str, Any]) -> dict[str, Any]:
    """The option objects ``given`` (keyword -> object or None), each defaulted, with the ``flat`` keywords folded
    into theirs: ``keyframe_every=5`` is ``delta=DeltaOptions(keyframe_every=5)``.

    A flat keyword this does not know is a TypeError, as for any function; one given together with its object is
    an InvalidArgumentError (which should win is not clear)."""
    unknown = sorted(set(flat) - set(FLAT_KEYWORDS))
    if unknown:
        raise TypeError(f"CheckpointManager() got an unexpected keyword argument {unknown[0]!r}"
                        + (f" (and {unknown[1:]})" if len(unknown) > 1 else ""))
    out: dict[str, Any] = {}
    for name, cls in _GROUPS.items():
        value = given.get(name)
        check_kind(name, value, cls, type(None))
        folded = {FLAT_KEYWORDS[k][1]: v for k, v in flat.items() if FLAT_KEYWORDS[k][0] == name}
        if value is not None and folded:
            raise InvalidArgumentError(f"{', '.join(sorted(folded))} and {name}= were both given: set "
                                       f"{', '.join(sorted(folded))} inside {name}={cls.__name__}(...) only")
        out[name] = replace(value or cls(), **folded) if folded else (value or cls())
    return out
