"""The Hugging Face ``Trainer`` checkpointing into a vault: :class:`VaultTrainer` and :class:`VaultTrainerMixin`.

::

    from ckptvault.integrations.transformers import VaultTrainer

    trainer = VaultTrainer(model=model, args=args, train_dataset=data, vault="s3://bucket/run-1")
    trainer.train()                               # every checkpoint the Trainer makes is one step of the vault
    trainer.train(resume_from_checkpoint=True)    # in a new process: the latest step, bit for bit

Each checkpoint is one :meth:`~ckptvault.CheckpointManager.save` of the global step, a tree of tensors and plain
values (no pickle): ``model`` (``model.state_dict()``), ``optimizer``, ``scheduler``, ``scaler`` (when the
accelerator has one), ``rng`` (:func:`ckptvault.rng_state`) and ``trainer_state`` (the text of
``trainer_state.json``); with ``save_only_model=True`` only ``model`` and ``trainer_state``. The vault's
``metrics`` hold what the Trainer logged at that step plus ``best_global_step`` (the step of
``best_model_checkpoint``), which :class:`TrainerRotation` reads.

Why a Trainer subclass and not a callback: a callback runs after the Trainer wrote its ``checkpoint-N`` folder,
so every checkpoint would be written in full to local disk first. The mixin replaces ``Trainer._save_checkpoint``
(nothing is written to ``output_dir``) and the private loaders the Trainer calls on resume, each at the moment the
Trainer calls it (the weights before ``accelerator.prepare``, the optimizer and scheduler after, the RNG after the
skipped batches), so the Trainer's own resume logic, data skipping included, runs unchanged. Those hooks are
private API of transformers 5 (:data:`HOOKS`); importing this module fails if the installed Trainer lacks one.
``train()`` reads ``trainer_state.json`` by path itself, so a resume writes that one file (a few KB, nothing else)
into a temporary folder that is removed when ``train()`` returns.

Saves are asynchronous (the manager's default): the training loop waits while the state is copied into host
staging memory, then writes continue in the background; ``train()`` returns once every checkpoint is committed.
Single process only: ``world_size > 1``, DeepSpeed and FSDP are refused, and so are ``push_to_hub`` (it uploads
``checkpoint-N`` folders that are never written) and hyperparameter-search trials (each restarts at step 0).
The contract: docs/INTEGRATIONS.md, "Hugging Face Trainer".
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import logging
import math
import os
import re
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from transformers import Trainer, TrainingArguments
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import TrainOutput

from .._maintenance.retention import Policy, Retention, RetentionInfo
from ..errors import InvalidArgumentError, KeyMismatchError, VaultError, VaultNotFoundError
from ..manager import CheckpointManager
from ..rng import rng_state, set_rng_state
from ..stores import Store

__all__ = ["BEST_STEP_METRIC", "HOOKS", "TrainerRotation", "VaultTrainer", "VaultTrainerMixin", "missing_hooks",
           "trainer_retention", "vault_reference"]

log = logging.getLogger(__name__)

TRAINER_STATE_NAME = "trainer_state.json"  # the file name Trainer.train() reads on resume
#: the metric each checkpoint records: the step of the Trainer's best_model_checkpoint (what TrainerRotation keeps)
BEST_STEP_METRIC = "best_global_step"
#: the Trainer methods the mixin overrides (private API of transformers 5)
HOOKS = ("_save_checkpoint", "_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_scaler",
         "_load_rng_state", "_load_best_model", "_init_training_state")
_REFERENCE = re.compile(r"^(?P<url>.+)#step=(?P<step>[0-9]+)$")

if TYPE_CHECKING:
    _TrainerBase = Trainer
else:
    _TrainerBase = object


def missing_hooks(trainer_class: type) -> list[str]:
    """The names of :data:`HOOKS` that ``trainer_class`` lacks (empty for a Trainer this mixin works with)."""
    return [name for name in HOOKS if not callable(getattr(trainer_class, name, None))]


if missing_hooks(Trainer):
    raise ImportError(f"ckptvault.integrations.transformers needs transformers 5 (its Trainer lacks {missing_hooks(Trainer)})")


def vault_reference(url: str, step: int) -> str:
    """``"URL#step=N"``: how ``best_model_checkpoint`` names a vault step; ``train(resume_from_checkpoint=...)``
    takes it too."""
    return f"{url}#step={step}"


def _parse_reference(text: str) -> tuple[str, int | None]:
    """``(url, step)`` of ``"URL#step=N"``; ``(text, None)`` for a bare URL (its latest step)."""
    match = _REFERENCE.match(text)
    return (match["url"], int(match["step"])) if match else (text, None)


@dataclasses.dataclass(frozen=True)
class TrainerRotation:
    """``save_total_limit`` as the Trainer's own ``rotate_checkpoints`` applies it: the newest checkpoint and the
    best one (the step the newest checkpoint's ``best_global_step`` metric names, if it is committed) are always
    kept, and the newest others until ``limit`` are kept in all.

    Pure and stable under its own result, as every retention policy. The vault keeps on top of it what every
    retention keeps: pinned steps and the keyframe of each kept delta checkpoint (its chunks are needed anyway).
    """

    limit: int

    def __post_init__(self) -> None:
        if type(self.limit) is not int or self.limit < 1:
            raise InvalidArgumentError(f"save_total_limit must be a positive int, got {self.limit!r}")

    def keeps(self, infos: Sequence[RetentionInfo], now: float) -> dict[int, str]:
        if not infos:
            return {}
        newest = max(infos, key=lambda info: info.step)
        steps = sorted(info.step for info in infos)
        kept = {newest.step: f"save_total_limit={self.limit} (newest)"}
        best = newest.metrics.get(BEST_STEP_METRIC)
        if type(best) is int and best in steps:
            kept[best] = f"save_total_limit={self.limit} (best_model_checkpoint)"
        total = max(self.limit, len(kept))
        for step in reversed(steps):
            if len(kept) >= total:
                break
            kept.setdefault(step, f"save_total_limit={self.limit}")
        return kept


def trainer_retention(args: TrainingArguments, retention: Retention | Policy | Iterable[Policy] | None) -> Retention | None:
    """The vault's retention for ``args``: ``retention`` (the caller's) united with :class:`TrainerRotation` of
    ``args.save_total_limit`` when that is set and positive (the Trainer deletes nothing otherwise)."""
    given = Retention.coerce(retention)
    limit = args.save_total_limit
    if limit is None or limit <= 0:
        return given
    if given is None:
        return Retention(TrainerRotation(limit))
    return Retention(*given.policies, TrainerRotation(limit), gc=given.gc, gc_grace=given.gc_grace)


def _check_arguments(args: TrainingArguments) -> None:
    """Refuse settings whose checkpoints this integration would not write as the Trainer does, before any work."""
    if args.push_to_hub:
        raise InvalidArgumentError("push_to_hub=True uploads the checkpoint-N folders the Trainer writes, and "
                                   "VaultTrainer writes none: set push_to_hub=False, and push the final model after "
                                   "training (trainer.save_model(dir), then upload dir)")
    if args.deepspeed or args.fsdp or args.world_size > 1:
        raise InvalidArgumentError(f"VaultTrainer checkpoints single-process training only, got world_size="
                                   f"{args.world_size}, deepspeed={args.deepspeed!r}, fsdp={args.fsdp!r}: train in "
                                   "one process, or use the Trainer's own checkpointing")


def _check_bases(cls: type) -> None:
    """The mixin must come before the Trainer in ``cls``'s bases, or the Trainer's methods would shadow its own."""
    mro = cls.__mro__
    if Trainer in mro and mro.index(VaultTrainerMixin) > mro.index(Trainer):
        raise InvalidArgumentError(f"{cls.__name__} must list VaultTrainerMixin before the Trainer class among its "
                                   f"bases, as in `class {cls.__name__}(VaultTrainerMixin, Trainer)`; its bases are "
                                   f"{[base.__name__ for base in cls.__bases__]}")


def _top_level_keys(manifest: Mapping[str, Any]) -> set[str]:
    """The string keys at the root of a checkpoint's tree (docs/DESIGN.md section 4: ``{"dict": [[key, node]]}``)."""
    tree = manifest.get("tree", {})
    pairs = tree.get("dict", tree.get("odict", []))
    return {key["str"] for key, _ in pairs if isinstance(key, dict) and "str" in key}


@dataclasses.dataclass
class _Resume:
    """Where the run being resumed comes from: ``manager``'s ``step``, and the folder the Trainer reads
    ``trainer_state.json`` from (the marker the loaders recognise)."""

    manager: CheckpointManager
    step: int
    folder: str
    best_model_checkpoint: str | None


class VaultTrainerMixin(_TrainerBase):
    """Mix into a ``transformers.Trainer`` class (first among the bases) to checkpoint into a vault.

    ``vault``: the vault's URL, path or :class:`~ckptvault.Store` (default ``<output_dir>/vault``).
    ``vault_options``: keywords of :class:`~ckptvault.CheckpointManager` (``storage_options``, ``codec``,
    ``async_save``, ``exclusive``, ``retention``, ...); a ``retention`` is united with ``save_total_limit``
    (:func:`trainer_retention`). The manager is :attr:`vault`; it stays open after ``train()``.

    ``train(resume_from_checkpoint=...)`` takes ``True`` (the vault's latest step), a step (``int``), a vault
    URL (its latest step; opened with the same ``storage_options``) or ``"URL#step=N"``; a folder holding
    ``trainer_state.json`` is resumed by the Trainer as usual. The vault must not hold steps after the one a run
    starts from (none for a new run): the run would save them again. Errors: ``VaultNotFoundError`` (no
    checkpoint there), ``StepNotFoundError`` (listing the committed steps), ``KeyMismatchError`` (a step not
    saved by this class, or saved with ``save_only_model=True``), ``InvalidArgumentError`` (later steps, bad
    settings), each raised before training starts.
    """

    vault: CheckpointManager
    _vault_resume: _Resume | None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _check_bases(cls)  # at the class statement: with the bases the other way round, __init__ would not run

    def __init__(self, *args: Any, vault: str | os.PathLike[str] | Store | None = None,
                 vault_options: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        given = _given_training_args(super().__init__, args, kwargs)
        if given is not None:  # before Trainer.__init__, which creates the hub repository for push_to_hub
            _check_arguments(given)
        super().__init__(*args, **kwargs)
        if given is None:  # the Trainer made its default arguments
            _check_arguments(self.args)
        options = dict(vault_options or {})
        retention = trainer_retention(self.args, options.pop("retention", None))
        target = os.path.join(self.args.output_dir or "trainer_output", "vault") if vault is None else vault
        self.vault = CheckpointManager(target, retention=retention, **options)
        self._vault_storage_options = options.get("storage_options")
        self._vault_resume = None

    # -- training ----------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | int | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None) -> TrainOutput:
        """``Trainer.train``, resuming from a vault step (see the class) and returning once every checkpoint
        of the run is committed."""
        if trial is not None or self.hp_search_backend is not None:
            raise InvalidArgumentError("VaultTrainer does not checkpoint hyperparameter-search trials (each restarts "
                                       "at step 0 in one vault); search with the Trainer, then train with VaultTrainer")
        with self._resume_source(resume_from_checkpoint) as resume:
            self._vault_resume = resume
            # not from the vault: None, False or a Trainer folder, which the Trainer resumes itself
            passed = resume_from_checkpoint if isinstance(resume_from_checkpoint, str) else None
            checkpoint = resume.folder if resume is not None else passed
            try:
                output = super().train(checkpoint, trial, ignore_keys_for_eval)
            except BaseException:
                try:
                    self.vault.wait()
                except VaultError as exc:  # the training error is the one to raise; the save's is logged
                    log.error("a checkpoint save failed too: %s", exc)
                raise
            finally:
                self._vault_resume = None
        self.vault.wait()
        return output

    @contextlib.contextmanager
    def _resume_source(self, value: str | bool | int | None) -> Iterator[_Resume | None]:
        """The vault step ``value`` names, with its ``trainer_state.json`` in a temporary folder; None for a new
        run or a Trainer folder. Checks every condition first, so a refused resume leaves nothing behind."""
        if value is None or value is False:
            self._refuse_later_steps(0, "the start of a new run")
            yield None
            return
        if isinstance(value, str) and os.path.isfile(os.path.join(value, TRAINER_STATE_NAME)):
            self._refuse_later_steps(_folder_step(value), f"the checkpoint folder {value}")
            yield None
            return
        with self._source_manager(value) as (manager, step):
            manifest = manager.manifest(step)
            _check_resumable(manifest, manager.url, step)
            self._refuse_later_steps(step, f"step {step} of {manager.url}")
            state = json.loads(manager.restore(step, keys=["trainer_state"])["trainer_state"])
            best = state.get("best_model_checkpoint")
            state["best_model_checkpoint"] = None  # not a folder: the Trainer would warn and drop it (restored later)
            with tempfile.TemporaryDirectory(prefix="ckptvault-resume-") as folder:
                with open(os.path.join(folder, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
                    f.write(json.dumps(state, indent=2, sort_keys=True) + "\n")  # as TrainerState.save_to_json
                log.info("resuming from step %d of %s", step, manager.url)
                yield _Resume(manager, step, folder, best)

    @contextlib.contextmanager
    def _source_manager(self, value: str | bool | int) -> Iterator[tuple[CheckpointManager, int]]:
        """The manager holding the step ``value`` names (this trainer's, or another vault's, closed afterwards)."""
        if isinstance(value, int):  # True (bool is an int) or a step
            step = self.vault.latest_step() if value is True else value
            if step is None:
                raise VaultNotFoundError(f"resume_from_checkpoint=True, but the vault at {self.vault.url} holds no "
                                         "checkpoint: train without resume_from_checkpoint to start the run there")
            yield self.vault, step
            return
        if not isinstance(value, str):
            raise InvalidArgumentError(f"resume_from_checkpoint takes True, a step (int), a vault URL or 'URL#step=N', "
                                       f"got {type(value).__name__} {value!r}")
        url, step = _parse_reference(value)
        other = CheckpointManager(url, storage_options=self._vault_storage_options)
        try:
            manager = self.vault if other.url == self.vault.url else other
            yield manager, manager.info(step).step  # VaultNotFoundError, StepNotFoundError naming the URL
        finally:
            other.close()

    def _refuse_later_steps(self, start: int, source: str) -> None:
        later = [step for step in self.vault.steps() if step > start]
        if later:
            raise InvalidArgumentError(
                f"the vault at {self.vault.url} holds steps {later} after {source}, which this run would save again: "
                f"resume from its latest step (resume_from_checkpoint=True), delete them (trainer.vault.delete(step) "
                f"or `ckptvault rm URL STEP`), or give the run another vault")

    # -- saving ------------------------------------------------------------
    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's checkpoint as one vault step, the global step, instead of a ``checkpoint-N`` folder.

        In the order of ``Trainer._save_checkpoint``: the FLOs, ``best_model_checkpoint`` (this step's reference
        when this step is the best), the stateful callbacks' states, then one save of the whole tree; retention
        runs after its commit. Returns once the state is staged (asynchronous saves) or committed.
        """
        self.store_flos()
        step = self.state.global_step
        if self.state.best_global_step == step:
            self.state.best_model_checkpoint = vault_reference(self.vault.url, step)
        self._export_callback_states()
        self.vault.save(step, self._checkpoint_state(), metrics=self._checkpoint_metrics(step))

    def _export_callback_states(self) -> None:
        """Record the ``ExportableState`` callbacks' and the control's states in the TrainerState, as the Trainer does."""
        states: Any = self.state.stateful_callbacks  # a dict by name once the state exists (typed as its input list)
        for callback in [*self.callback_handler.callbacks, self.control]:
            if not isinstance(callback, ExportableState):
                continue
            name, exported = type(callback).__name__, callback.state()
            if isinstance(states.get(name), list):
                states[name].append(exported)
            else:
                states[name] = exported

    def _checkpoint_state(self) -> dict[str, Any]:
        """The tree one checkpoint saves: tensors as tensors (dedup and deltas across checkpoints), no pickle."""
        model: Any = self.model  # Any: typed Optional, and set by the Trainer before its first step
        optimizer: Any = self.optimizer
        scheduler: Any = self.lr_scheduler
        state: dict[str, Any] = {"model": model.state_dict(), "trainer_state": _trainer_state_text(self.state)}
        if self.args.save_only_model:
            return state
        state["optimizer"] = optimizer.state_dict()
        state["scheduler"] = scheduler.state_dict()
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            state["scaler"] = scaler.state_dict()
        state["rng"] = rng_state()
        return state

    def _checkpoint_metrics(self, step: int) -> dict[str, Any]:
        """The finite numbers logged at ``step`` (loss, eval metrics, ...) and the best checkpoint's step."""
        logged: dict[str, Any] = {}
        for entry in self.state.log_history:
            if entry.get("step") == step:
                logged.update(entry)
        metrics = {key: value for key, value in logged.items() if key != "step" and _finite(value)}
        best = self.state.best_model_checkpoint
        url, best_step = _parse_reference(best) if best else ("", None)
        if best_step is not None and url == self.vault.url:
            metrics[BEST_STEP_METRIC] = best_step
        return metrics

    # -- resuming ----------------------------------------------------------
    def _from_vault(self, checkpoint: str | None) -> _Resume | None:
        """The resume in progress when ``checkpoint`` is its folder (the Trainer passes it to every loader)."""
        resume = self._vault_resume
        return resume if resume is not None and checkpoint == resume.folder else None

    def _init_training_state(self, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's, then the resumed ``best_model_checkpoint`` (a vault reference) put back into the state."""
        result = super()._init_training_state(*args, **kwargs)
        if self._vault_resume is not None:  # kept out of the file the Trainer read: it is not a folder
            self.state.best_model_checkpoint = self._vault_resume.best_model_checkpoint
        return result

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """The weights, in place, before ``accelerator.prepare`` (strict: every tensor of the model must be saved)."""
        resume = self._from_vault(resume_from_checkpoint)
        if resume is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        resume.manager.restore(resume.step, into={"model": self.model if model is None else model})

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """The optimizer's and the scheduler's states, through their ``load_state_dict``, once both exist."""
        resume = self._from_vault(checkpoint)
        if resume is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        resume.manager.restore(resume.step, into={"optimizer": self.optimizer, "scheduler": self.lr_scheduler})

    def _load_scaler(self, checkpoint: str | None) -> None:
        """The gradient scaler's state, when the accelerator has a scaler."""
        resume = self._from_vault(checkpoint)
        if resume is None:
            return super()._load_scaler(checkpoint)
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            resume.manager.restore(resume.step, into={"scaler": scaler})

    def _load_rng_state(self, checkpoint: str | None) -> None:
        """Every generator's state, where the Trainer restores them (after the batches it skips on resume)."""
        resume = self._from_vault(checkpoint)
        if resume is None:
            return super()._load_rng_state(checkpoint)
        set_rng_state(resume.manager.restore(resume.step, keys=["rng"])["rng"])

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the weights of the step ``best_model_checkpoint`` names, in place."""
        reference = self.state.best_model_checkpoint or ""
        url, step = _parse_reference(reference)
        if step is None:
            return super()._load_best_model()
        log.info("loading the best model from step %d of %s (score: %s)", step, url, self.state.best_metric)
        if url == self.vault.url:
            self.vault.restore(step, into={"model": self.model})
            return
        with CheckpointManager(url, storage_options=self._vault_storage_options) as other:
            other.restore(step, into={"model": self.model})


class VaultTrainer(VaultTrainerMixin, Trainer):
    """``transformers.Trainer`` checkpointing into a vault (see :class:`VaultTrainerMixin`)."""


def _given_training_args(init: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> TrainingArguments | None:
    """The ``args`` (TrainingArguments) a call of the Trainer's ``init`` with ``args``/``kwargs`` would receive."""
    try:
        bound = inspect.signature(init).bind_partial(*args, **kwargs)
    except TypeError:
        return None  # the Trainer's own __init__ reports the bad call
    given = bound.arguments.get("args")
    return given if isinstance(given, TrainingArguments) else None


def _check_resumable(manifest: Mapping[str, Any], url: str, step: int) -> None:
    """KeyMismatchError unless the checkpoint holds what a bit-exact resume restores."""
    saved = _top_level_keys(manifest)
    if "trainer_state" not in saved or "model" not in saved:
        raise KeyMismatchError(f"step {step} of {url} was not saved by VaultTrainer (its top-level keys are "
                               f"{sorted(saved)}, not model and trainer_state): restore it with ckptvault.load")
    lacking = sorted({"optimizer", "scheduler", "rng"} - saved)
    if lacking:
        raise KeyMismatchError(f"step {step} of {url} holds no {', '.join(lacking)} (saved with save_only_model=True), "
                               "so training cannot resume from it; load its weights with trainer.vault.restore("
                               f"{step}, into={{'model': model}}) and train without resume_from_checkpoint")


def _folder_step(folder: str) -> int:
    """The global step recorded in a Trainer checkpoint folder's ``trainer_state.json``."""
    with open(os.path.join(folder, TRAINER_STATE_NAME), encoding="utf-8") as f:
        return int(json.load(f).get("global_step", 0))


def _trainer_state_text(state: Any) -> str:
    """The TrainerState as ``trainer_state.json`` holds it (``TrainerState.save_to_json``'s text)."""
    return json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n"


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
