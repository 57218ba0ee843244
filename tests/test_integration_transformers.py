"""The Hugging Face Trainer integration (ckptvault.integrations.transformers), with real ``Trainer.train`` runs.

A tiny GPT-2 built from a config (tests/helpers/hf_tiny.py) trains on random tokens on the CPU: checkpoints land
in the vault as steps and nowhere else, ``save_total_limit`` and the best checkpoint are kept as the Trainer's own
rotation keeps its folders (compared with a plain Trainer run), a run resumed from the vault ends bit for bit where
an uninterrupted run does, and every refused setting or resume is a typed error raised before anything changes.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import Trainer
from transformers.trainer_utils import rotate_checkpoints

import ckptvault
from ckptvault import CheckpointManager, DeltaOptions, KeepEvery, LocalOptions, RetentionInfo
from ckptvault.errors import InvalidArgumentError, KeyMismatchError, StepNotFoundError, VaultNotFoundError
from ckptvault.integrations.transformers import (
    BEST_STEP_METRIC,
    HOOKS,
    TrainerRotation,
    VaultTrainer,
    VaultTrainerMixin,
    missing_hooks,
    trainer_retention,
    vault_reference,
)
from conftest import assert_same_state
from helpers.hf_tiny import ScriptedScore, StopAt, argmax_logits, tiny_args, tiny_model, token_rows

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(autouse=True)
def one_thread() -> Any:
    """One intra-op thread: these models are tiny, and on a small shared machine more threads only contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _trainer(out: Path, vault: Any = None, *, rows: int = 24, callbacks: list[Any] | None = None,
             vault_options: dict[str, Any] | None = None, model_seed: int = 0, **args: Any) -> VaultTrainer:
    return VaultTrainer(model=tiny_model(model_seed), args=tiny_args(out, **args), train_dataset=token_rows(rows),
                        callbacks=callbacks, vault=vault, vault_options=vault_options)


def _training_state(trainer: Trainer) -> dict[str, Any]:
    """What a resumed run must reproduce exactly: weights, optimizer and scheduler states."""
    assert trainer.optimizer is not None and trainer.lr_scheduler is not None
    return {"model": trainer.model.state_dict(), "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.lr_scheduler.state_dict()}


def _losses(trainer: Trainer, after: int) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e and e["step"] > after}


def _resume_folders() -> set[str]:
    return {name for name in os.listdir(tempfile.gettempdir()) if name.startswith("ckptvault-resume-")}


def test_each_checkpoint_is_one_vault_step_and_no_folder(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path / "out", max_steps=6)
    trainer.train()
    assert sorted(os.listdir(tmp_path / "out")) == ["vault"]  # the default vault; no checkpoint-N folder
    assert trainer.vault.steps() == [2, 4, 6]
    saved = trainer.vault.restore(6)
    assert sorted(saved) == ["model", "optimizer", "rng", "scheduler", "trainer_state"]
    assert_same_state(_training_state(trainer), {key: saved[key] for key in ("model", "optimizer", "scheduler")})
    assert set(saved["rng"]) >= {"torch", "numpy", "python"}
    state = json.loads(saved["trainer_state"])
    assert state["global_step"] == 6 and state["log_history"] == trainer.state.log_history[:-1]  # not the summary
    info = trainer.vault.info(6)
    assert info.metrics["loss"] == next(e["loss"] for e in trainer.state.log_history if e.get("step") == 6)
    paths = {t.path for t in info.tensors}  # tensors stored as tensors: chunked, deduplicated, delta-encoded
    assert {"model.transformer.wte.weight", "optimizer.state.0.exp_avg"} <= paths


def test_save_total_limit_keeps_the_newest_and_their_keyframe(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path / "out", tmp_path / "vault", max_steps=8, save_total_limit=2)
    trainer.train()
    keyframes = {trainer.vault.manifest(step)["keyframe_step"] for step in (6, 8)}
    assert trainer.vault.steps() == sorted({6, 8} | keyframes)  # kept deltas need their keyframe's chunks anyway
    assert sorted(os.listdir(tmp_path / "out")) == []


def test_best_checkpoint_is_kept_and_loaded_as_the_trainer_does(tmp_path: Path) -> None:
    """With load_best_model_at_end, a plain Trainer keeps checkpoint-4 (the best) and checkpoint-8 (the newest) and
    ends with step 4's weights. The vault run, stopped after step 6 and resumed, keeps steps 4 and 8, ends with
    the same weights, and its step 8 holds the plain run's step 8 weights."""
    settings: dict[str, Any] = dict(max_steps=8, save_total_limit=2, eval_strategy="steps", eval_steps=2,
                                    load_best_model_at_end=True, metric_for_best_model="score", greater_is_better=True)

    def make(kind: str, scores: list[float], **extra: Any) -> Trainer:
        common = dict(model=tiny_model(), args=tiny_args(tmp_path / kind, **settings), train_dataset=token_rows(24),
                      eval_dataset=token_rows(8, seed=2), compute_metrics=ScriptedScore(scores),
                      preprocess_logits_for_metrics=argmax_logits, **extra)
        if kind == "plain":
            return Trainer(**common)
        return VaultTrainer(**common, vault=tmp_path / "v", vault_options={"incremental": False})

    plain = make("plain", [1, 5, 2, 3])
    plain.train()
    make("vault", [1, 5, 2], callbacks=[StopAt(6)]).train()
    vault = make("vault", [3])
    vault.train(resume_from_checkpoint=True)
    assert sorted(os.listdir(tmp_path / "plain")) == ["checkpoint-4", "checkpoint-8"]
    assert vault.vault.steps() == [4, 8]
    assert vault.state.best_model_checkpoint == vault_reference(vault.vault.url, 4)  # kept across the resume
    assert vault.vault.info(8).metrics[BEST_STEP_METRIC] == 4
    best = vault.vault.restore(4, keys=["model.*"])["model"]
    assert_same_state(best, vault.model.state_dict())
    assert_same_state(plain.model.state_dict(), vault.model.state_dict())
    last = vault.vault.restore(8, keys=["model.*"])["model"]
    assert not torch.equal(last["lm_head.weight"], best["lm_head.weight"])
    plain_last = load_file(tmp_path / "plain" / "checkpoint-8" / "model.safetensors")
    assert plain_last.keys() <= last.keys() and all(torch.equal(last[k], v) for k, v in plain_last.items())


@pytest.mark.parametrize(("steps", "limit", "best"), [
    ([2, 4, 6, 8], 2, None), ([2, 4, 6, 8], 2, 2), ([2, 4, 6, 8], 3, 4), ([2, 4, 6, 8], 1, 6), ([2, 4, 6, 8], 1, 8),
    ([2, 4], 3, None), ([5, 10, 15, 20, 25], 2, 5),
])
def test_rotation_keeps_what_the_trainers_rotation_keeps(tmp_path: Path, steps: list[int], limit: int,
                                                         best: int | None) -> None:
    for step in steps:
        (tmp_path / f"checkpoint-{step}").mkdir()
    rotate_checkpoints(str(tmp_path), limit, str(tmp_path / f"checkpoint-{best}") if best else None)
    left = sorted(int(name.split("-")[1]) for name in os.listdir(tmp_path))
    metrics = {BEST_STEP_METRIC: best} if best else {}
    infos = [RetentionInfo(step, float(step), metrics if step == steps[-1] else {}) for step in steps]
    assert sorted(TrainerRotation(limit).keeps(infos, 0.0)) == left
    kept = [d.step for d in trainer_retention(tiny_args(tmp_path, save_total_limit=limit), KeepEvery(10)).decide(infos, 0.0)
            if d.keep]
    assert kept == sorted(set(left) | {s for s in steps if s % 10 == 0})  # a caller's retention is united with it


@pytest.mark.parametrize("limit", [0, -1, 2.0, True])
def test_rotation_needs_a_positive_limit(limit: Any) -> None:
    with pytest.raises(InvalidArgumentError, match=f"save_total_limit must be a positive int, got {limit!r}"):
        TrainerRotation(limit)


def test_resumed_run_is_bit_identical_to_an_uninterrupted_one(tmp_path: Path) -> None:
    """Stopped after step 8 (epoch 1, two batches in: the Trainer skips them and restores the RNG after), a new
    process-like Trainer with a differently initialised model resumes from the vault and reaches step 10 with the
    same weights, optimizer and scheduler states and losses, bit for bit."""
    reference = Trainer(model=tiny_model(), args=tiny_args(tmp_path / "ref", max_steps=10, save_strategy="no"),
                        train_dataset=token_rows(24))
    reference.train()
    first = _trainer(tmp_path / "out", tmp_path / "vault", max_steps=10, save_steps=4, callbacks=[StopAt(8)])
    first.train()
    assert first.vault.steps() == [4, 8]
    before = _resume_folders()
    resumed = _trainer(tmp_path / "out", tmp_path / "vault", max_steps=10, save_steps=4, model_seed=7)
    resumed.train(resume_from_checkpoint=True)
    assert_same_state(_training_state(reference), _training_state(resumed))
    assert _losses(resumed, after=8) == _losses(reference, after=8) and len(_losses(resumed, after=8)) == 2
    assert resumed.vault.steps() == [4, 8, 10]
    assert os.listdir(tmp_path / "out") == [] and _resume_folders() <= before  # the trainer_state.json folder is gone


def test_a_checkpoint_every_step_with_predictions_resumes_bit_identical(tmp_path: Path) -> None:
    """``save_steps=1`` with predicted deltas: every step after the first stores the model's weights against their
    prediction, the resumed run's first save too (from the step before, as the resume restored it), and the resumed
    run ends bit for bit where an uninterrupted one does."""
    every_step = {"delta": DeltaOptions(predict=True, keyframe_every=20, max_chain=19)}
    reference = Trainer(model=tiny_model(), args=tiny_args(tmp_path / "ref", max_steps=10, save_strategy="no"),
                        train_dataset=token_rows(24))
    reference.train()
    first = _trainer(tmp_path / "out", tmp_path / "vault", max_steps=10, save_steps=1, callbacks=[StopAt(8)],
                     vault_options=every_step)
    first.train()
    resumed = _trainer(tmp_path / "out", tmp_path / "vault", max_steps=10, save_steps=1, model_seed=7,
                       vault_options=every_step)
    resumed.train(resume_from_checkpoint=True)
    assert_same_state(_training_state(reference), _training_state(resumed))
    assert resumed.vault.steps() == list(range(1, 11))
    weights = {f"model.{name}" for name, _ in resumed.model.named_parameters()}
    for step in range(1, 11):
        predicted = {t["path"] for t in resumed.vault.manifest(step)["tensors"] if "predict" in t}
        assert weights <= predicted if step > 1 else predicted == set(), step


def test_resume_from_another_vault_by_url_and_step(tmp_path: Path) -> None:
    """Vault URLs other than local paths, with their storage options: resuming step 2 of one fsspec vault into
    another reproduces the first run's step 4 checkpoint exactly."""
    options = {"storage_options": {"skip_instance_cache": False}}
    first_url, second_url = (f"fsspec+memory://hf-{uuid.uuid4().hex}/{name}" for name in ("a", "b"))
    first = _trainer(tmp_path / "a", first_url, max_steps=4, vault_options=options)
    first.train()
    second = _trainer(tmp_path / "b", second_url, max_steps=4, vault_options=options, model_seed=3)
    second.train(resume_from_checkpoint=vault_reference(first.vault.url, 2))
    assert first.vault.steps() == [2, 4] and second.vault.steps() == [4]
    parts = ["model.*", "optimizer.*", "scheduler.*", "rng.*"]
    assert_same_state(first.vault.restore(4, keys=parts), second.vault.restore(4, keys=parts))


@pytest.fixture
def vault_2_4(tmp_path: Path) -> Path:
    """A vault holding the steps 2 and 4 of a finished run."""
    _trainer(tmp_path / "first", tmp_path / "vault", max_steps=4).train()
    return tmp_path / "vault"


@pytest.mark.parametrize(("resume", "error", "message"), [
    (6, StepNotFoundError, "step 6 has no committed checkpoint in .*; committed steps: 2, 4"),
    (2, InvalidArgumentError, r"holds steps \[4\] after step 2 of .*: resume from its latest step"),
    (None, InvalidArgumentError, r"holds steps \[2, 4\] after the start of a new run"),
    (1.5, InvalidArgumentError, "resume_from_checkpoint takes True, a step .int., a vault URL or 'URL#step=N', got float"),
])
def test_a_refused_resume_changes_nothing(tmp_path: Path, vault_2_4: Path, resume: Any, error: type, message: str) -> None:
    trainer = _trainer(tmp_path / "out", vault_2_4, max_steps=6)
    weights = copy.deepcopy(trainer.model.state_dict())
    with pytest.raises(error, match=message):
        trainer.train(resume_from_checkpoint=resume)
    assert_same_state(weights, trainer.model.state_dict())
    assert trainer.vault.steps() == [2, 4] and trainer.state.global_step == 0


def test_resume_from_nothing_names_the_vault(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path / "out", tmp_path / "empty", max_steps=2)
    with pytest.raises(VaultNotFoundError, match="resume_from_checkpoint=True, but the vault at .*empty holds no checkpoint"):
        trainer.train(resume_from_checkpoint=True)
    with pytest.raises(VaultNotFoundError, match="no ckptvault vault at .*missing"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "missing"))
    assert trainer.vault.steps() == [] and not (tmp_path / "empty").exists()


def test_resume_needs_a_checkpoint_of_a_whole_training_state(tmp_path: Path) -> None:
    ckptvault.save({"weights": torch.ones(2)}, tmp_path / "other", step=3)
    trainer = _trainer(tmp_path / "out", tmp_path / "vault", max_steps=4)
    with pytest.raises(KeyMismatchError, match="step 3 of .*other was not saved by VaultTrainer .*top-level keys are "
                                               r"\['weights'\]"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "other"))
    only_model = _trainer(tmp_path / "out2", tmp_path / "models", max_steps=2, save_only_model=True)
    only_model.train()
    assert sorted(only_model.vault.restore(2)) == ["model", "trainer_state"]
    with pytest.raises(KeyMismatchError, match="step 2 of .*models holds no optimizer, rng, scheduler .saved with "
                                               "save_only_model=True., so training cannot resume from it"):
        _trainer(tmp_path / "out3", tmp_path / "fresh", max_steps=4).train(resume_from_checkpoint=str(tmp_path / "models"))


def test_settings_it_cannot_honour_are_refused_before_the_trainer_starts(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="push_to_hub=True uploads the checkpoint-N folders"):
        _trainer(tmp_path / "out", max_steps=2, push_to_hub=True, hub_model_id="nobody/nothing")
    assert not (tmp_path / "out").exists()  # refused before the Trainer (which would create the hub repository)
    with pytest.raises(InvalidArgumentError, match="single-process training only, got world_size=1, deepspeed=None, fsdp=True"):
        _trainer(tmp_path / "out", max_steps=2, fsdp=True)
    with pytest.raises(InvalidArgumentError, match="unsupported vault URL scheme 'bogus'"):
        _trainer(tmp_path / "out", "bogus://somewhere", max_steps=2)
    with pytest.raises(InvalidArgumentError, match="storage_options LocalOptions are not for fsspec"):
        _trainer(tmp_path / "out", "fsspec+memory://x/y", max_steps=2, vault_options={"storage_options": LocalOptions()})
    with pytest.raises(InvalidArgumentError, match=r"Shadowed must list VaultTrainerMixin before the Trainer class .*"
                                                   r"bases are \['Trainer', 'VaultTrainerMixin'\]"):

        class Shadowed(Trainer, VaultTrainerMixin):  # the Trainer's methods would win: nothing would go to the vault
            pass


def test_a_hyperparameter_search_trial_is_refused_before_training(tmp_path: Path) -> None:
    trainer = _trainer(tmp_path / "out", tmp_path / "vault", max_steps=4)
    with pytest.raises(InvalidArgumentError, match="does not checkpoint hyperparameter-search trials .each restarts at "
                                                   "step 0 in one vault.; search with the Trainer"):
        trainer.train(trial={"learning_rate": 1e-3})
    assert trainer.state.global_step == 0 and trainer.vault.steps() == []


def test_the_trainer_has_every_hook_the_mixin_overrides() -> None:
    assert missing_hooks(Trainer) == []
    assert missing_hooks(torch.nn.Module) == list(HOOKS)
    assert all(getattr(VaultTrainer, name) is getattr(VaultTrainerMixin, name) for name in HOOKS)


def test_the_readme_recipe_runs_and_then_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    text = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    marker = text.index("<!-- hf-trainer-recipe:")
    code = text[text.index("```python\n", marker) + len("```python\n"):text.index("```\n", marker + 30)]
    monkeypatch.chdir(tmp_path)
    runs = []
    for _ in range(2):  # the second run resumes from step 20, the end of its one epoch: it trains and saves nothing
        namespace: dict[str, Any] = {"__name__": "readme"}
        exec(compile(code, "README.md", "exec"), namespace)
        trainer = namespace["trainer"]
        runs.append((trainer.state.global_step, trainer.vault.steps(), copy.deepcopy(trainer.model.state_dict())))
        trainer.vault.close()
    with CheckpointManager("vault") as mgr:
        keyframes = {mgr.manifest(step)["keyframe_step"] for step in (15, 20)}
    assert runs[0][:2] == runs[1][:2] == (20, sorted({15, 20} | keyframes))
    assert_same_state(runs[0][2], runs[1][2])
    assert os.listdir("out") == []
