"""restore(into=...) into live objects (anything with state_dict() / load_state_dict()), and the RNG helpers.

* a fresh model, AdamW, LambdaLR and GradScaler are restored completely from a checkpoint of trained ones: the
  model in place, the rest through load_state_dict (a fresh AdamW has no state tensors yet); the next training
  step is then bit-identical to the trained objects' next step;
* an optimizer that has state is restored in place (its tensors keep their memory);
* missing and unexpected keys are reported (strict=False) or a KeyMismatchError naming the key path (strict);
* plain values of the target come back in the report; objects without load_state_dict are leaves, as before;
* rng_state() / set_rng_state() round-trip through a vault exactly.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckptvault
from ckptvault._restore.live import RestoredObject, RestoreReport
from ckptvault.errors import InvalidArgumentError, KeyMismatchError
from ckptvault.rng import rng_state, set_rng_state
from conftest import assert_same_state


class Run:
    """A model, AdamW, a warm-up LambdaLR and a GradScaler that grows every step (so its scale moves)."""

    def __init__(self, seed: int, extra: bool = False) -> None:
        torch.manual_seed(seed)
        layers = [torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)]
        self.model = torch.nn.Sequential(*layers, *([torch.nn.Linear(4, 2)] if extra else []))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2 * (seed + 1), weight_decay=0.1)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: min(1.0, (s + 1) / 10))
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
        self.gen = torch.Generator().manual_seed(seed + 100)

    def train(self, steps: int) -> list[float]:
        losses = []
        for _ in range(steps):
            x = torch.randn(4, 8, generator=self.gen)
            loss = self.model(x).square().mean()
            self.opt.zero_grad()
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
            self.sched.step()
            losses.append(loss.item())
        return losses

    def objects(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.opt, "scheduler": self.sched, "scaler": self.scaler}

    def state(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict(),
                "scaler": self.scaler.state_dict(), "gen": self.gen.get_state(), "step": 3}


def _saved(path: Path) -> Run:
    trained = Run(seed=0)
    trained.train(3)
    with ckptvault.CheckpointManager(path) as mgr:
        mgr.save(3, trained.state()).wait()
    return trained


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return type(value)((k, _clone(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_clone(v) for v in value)
    return value


def test_fresh_objects_are_restored_completely(tmp_path: Path) -> None:
    trained = _saved(tmp_path / "v")
    fresh = Run(seed=1)
    assert not fresh.opt.state  # a fresh AdamW: no state tensors to restore into
    assert fresh.scaler.get_scale() == 2.0**10 != trained.scaler.get_scale()
    pointers = {k: v.data_ptr() for k, v in fresh.model.state_dict().items()}
    with ckptvault.CheckpointManager(tmp_path / "v") as mgr:
        report = mgr.restore(into={**fresh.objects(), "step": 0})
    assert isinstance(report, RestoreReport) and report.step == 3
    assert report["step"] == report.values["step"] == 3
    assert report.missing_keys == () and report.unexpected_keys == ()
    assert report.objects["model"] == RestoredObject("model", "model", 4, False, (), ())
    for name in ("optimizer", "scheduler", "scaler"):
        assert report.objects[name].loaded and report.objects[name].in_place == 0, name

    assert {k: v.data_ptr() for k, v in fresh.model.state_dict().items()} == pointers  # in place
    assert_same_state(trained.model.state_dict(), fresh.model.state_dict())
    assert_same_state(trained.opt.state_dict(), fresh.opt.state_dict())
    assert [fresh.opt.state[p]["step"].item() for p in fresh.model.parameters()] == [3.0] * 4
    assert fresh.opt.state[fresh.model[0].weight]["exp_avg"].data_ptr() != trained.opt.state[trained.model[0].weight][
        "exp_avg"].data_ptr()  # new tensors, not the saved run's
    assert fresh.sched.last_epoch == trained.sched.last_epoch == 3
    assert fresh.sched.get_last_lr() == trained.sched.get_last_lr() == [0.004]
    assert fresh.opt.param_groups[0]["lr"] == 0.004
    assert fresh.scaler.get_scale() == trained.scaler.get_scale() == 2.0**13
    assert fresh.scaler.state_dict() == trained.scaler.state_dict()

    fresh.gen.set_state(trained.gen.get_state())
    assert fresh.train(2) == trained.train(2)  # it continues exactly: nothing was left out
    assert_same_state(trained.model.state_dict(), fresh.model.state_dict())
    assert_same_state(trained.opt.state_dict(), fresh.opt.state_dict())


def test_an_optimizer_with_state_is_restored_in_place(tmp_path: Path) -> None:
    trained = _saved(tmp_path / "v")
    live = Run(seed=1)
    live.train(1)
    tensors = {(i, n): v for i, p in enumerate(live.model.parameters()) for n, v in live.opt.state[p].items()}
    pointers = {k: v.data_ptr() for k, v in tensors.items()}
    assert len(tensors) == 12 and not torch.equal(tensors[0, "exp_avg"], trained.opt.state_dict()["state"][0]["exp_avg"])
    with ckptvault.CheckpointManager(tmp_path / "v") as mgr:
        report = mgr.restore(into={"model": live.model, "optimizer": live.opt})
    assert report.objects["optimizer"].in_place == 12 and report.objects["optimizer"].loaded
    now = {(i, n): v for i, p in enumerate(live.model.parameters()) for n, v in live.opt.state[p].items()}
    assert {k: v.data_ptr() for k, v in now.items()} == pointers  # the same memory, still the optimizer's state
    assert_same_state(trained.opt.state_dict(), live.opt.state_dict())
    assert live.opt.param_groups[0]["lr"] == trained.opt.param_groups[0]["lr"]  # non-tensor state: loaded


def test_missing_and_unexpected_keys_are_reported_when_not_strict(tmp_path: Path) -> None:
    trained = Run(seed=0)
    trained.train(3)
    state = trained.state()
    state["model"]["extra.weight"] = torch.ones(3)
    with ckptvault.CheckpointManager(tmp_path / "v") as mgr:
        mgr.save(3, state).wait()
    wider = Run(seed=1, extra=True)  # holds 3.weight and 3.bias, which the checkpoint lacks
    ema = torch.nn.Linear(2, 2)
    ema_before = _clone(ema.state_dict())
    extra_before = _clone(wider.model[3].state_dict())
    with ckptvault.CheckpointManager(tmp_path / "v") as mgr:
        report = mgr.restore(into={"model": wider.model, "ema": ema, "step": 0, "epoch": 7}, strict=False)
    assert report.objects["model"] == RestoredObject("model", "model", 4, False, ("model.3.weight", "model.3.bias"),
                                                     ("model.extra.weight",))
    assert report.objects["ema"] == RestoredObject("ema", "ema", 0, False, ("ema.weight", "ema.bias"), ())
    assert report.missing_keys == ("model.3.weight", "model.3.bias", "ema.weight", "ema.bias", "epoch")
    assert report.unexpected_keys == ("model.extra.weight",)
    assert dict(report.values) == {"step": 3}
    assert_same_state(ema_before, ema.state_dict())  # not in the checkpoint: left unchanged
    assert_same_state(extra_before, wider.model[3].state_dict())
    assert torch.equal(wider.model[0].weight, trained.model[0].weight)


def test_strict_mismatches_are_key_mismatch_errors_naming_the_key_path(tmp_path: Path) -> None:
    _saved(tmp_path / "v")
    with ckptvault.CheckpointManager(tmp_path / "v") as mgr:
        wider = Run(seed=1, extra=True)
        before = _clone(wider.model.state_dict())
        with pytest.raises(KeyMismatchError, match=re.escape(
                "into= holds 2 tensors the checkpoint of step 3 does not (at its root): ['model.3.weight', "
                "'model.3.bias']; remove them from into=, or pass strict=False")):
            mgr.restore(3, into={"model": wider.model, "optimizer": wider.opt})
        assert_same_state(before, wider.model.state_dict())  # refused before anything was written

        fresh = Run(seed=1)
        before = _clone(fresh.model.state_dict())
        with pytest.raises(KeyMismatchError, match=re.escape(
                "into= object 'ema_scaler' (GradScaler) is not in the checkpoint of step 3: it holds nothing at "
                "'ema_scaler' (its "
                "top-level keys are ['gen', 'model', 'optimizer', 'scaler', 'scheduler', 'step']; "
                "saved keys near it: ['scaler']); pass strict=False")):
            mgr.restore(3, into={"model": fresh.model, "ema_scaler": torch.amp.GradScaler("cpu")})
        assert_same_state(before, fresh.model.state_dict())

        fresh.model[0].weight.data = torch.zeros(16, 8, dtype=torch.float64)
        for strict in (True, False):
            with pytest.raises(KeyMismatchError, match=re.escape(
                    "'model.0.weight': saved float32[16, 8], target is float64[16, 8]")):
                mgr.restore(3, into={"model": fresh.model, "optimizer": fresh.opt}, strict=strict)
        assert not fresh.opt.state  # nothing loaded either

        with pytest.raises(KeyMismatchError, match=re.escape(
                "'step': the checkpoint of step 3 holds no state dict for a GradScaler at 'step', but a 'int' node")):
            mgr.restore(3, into={"step": torch.amp.GradScaler("cpu")})
        with pytest.raises(InvalidArgumentError, match=re.escape("into= is a Sequential; pass a dict naming where")):
            mgr.restore(3, into=fresh.model)


class StateOnly:
    """Has state_dict() but no load_state_dict(): not a live object, a leaf as any other value."""

    def state_dict(self) -> dict[str, Any]:
        return {"x": torch.ones(1)}


def test_objects_without_load_state_dict_are_leaves_and_plain_targets_keep_their_behaviour(tmp_path: Path) -> None:
    trained = _saved(tmp_path / "v")
    fresh = Run(seed=1)
    leaf = StateOnly()
    with ckptvault.CheckpointManager(tmp_path / "v") as mgr:
        report = mgr.restore(into={"model": fresh.model, "gen": leaf, "rng": None})
        assert report.values["gen"].dtype == torch.uint8 and torch.equal(report.values["gen"], trained.gen.get_state())
        assert report.missing_keys == ("rng",) and set(report.objects) == {"model"}
        plain = {"model": Run(seed=2).model.state_dict(), "gen": leaf, "step": 0}
        assert mgr.restore(into=plain) is plain  # no live object: today's into=, which returns into
        assert plain["gen"] is leaf and plain["step"] == 0
        assert_same_state(trained.model.state_dict(), plain["model"])


def test_rng_helpers_round_trip_through_a_vault(tmp_path: Path) -> None:
    torch.manual_seed(5)
    np.random.seed(5)
    random.seed(5)
    torch.randn(3)
    np.random.standard_normal()  # leaves a cached Gaussian in numpy's state
    captured = rng_state()
    assert sorted(captured) == (["cuda", "numpy", "python", "torch"] if torch.cuda.is_available()
                                else ["numpy", "python", "torch"])

    def draws() -> tuple[Any, ...]:
        return torch.rand(4), torch.randn(2, 2), np.random.standard_normal(3), np.random.randint(0, 2**31), random.random()

    first = draws()
    with ckptvault.CheckpointManager(tmp_path / "v") as mgr:
        mgr.save(1, {"rng": captured}).wait()
        assert not torch.equal(draws()[0], first[0])  # the generators moved on
        restored = mgr.restore(1)["rng"]
    assert_same_state(captured, restored)  # the same types: numpy's and Python's states are tuples
    assert isinstance(restored["python"][1], tuple) and restored["numpy"][0] == "MT19937"
    set_rng_state(restored)
    again = draws()
    for a, b in zip(first, again, strict=True):
        assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else np.array_equal(a, b)), (a, b)

    with pytest.raises(InvalidArgumentError, match=re.escape("the RNG state lacks ['python']")):
        set_rng_state({"torch": captured["torch"], "numpy": captured["numpy"]})
    with pytest.raises(InvalidArgumentError, match="takes the dict rng_state"):
        set_rng_state([captured])  # type: ignore[arg-type]


def test_a_fresh_optimizer_restores_lossy_moments_as_restore_returns_them(tmp_path: Path) -> None:
    trained = Run(seed=0)
    trained.train(3)
    with ckptvault.CheckpointManager(tmp_path / "v", codec_rules={"optimizer.state.*.exp_avg*": "bf16"}) as mgr:
        mgr.save(3, trained.state()).wait()
        lossy = [t.path for t in mgr.info(3).tensors if t.error is not None]
        assert len(lossy) == 8  # the moments are stored lossy: the decoded values differ from the trained ones
        expected = mgr.restore(3)["optimizer"]
        fresh = Run(seed=1)
        mgr.restore(3, into={"optimizer": fresh.opt, "model": fresh.model})
    assert not torch.equal(expected["state"][0]["exp_avg_sq"], trained.opt.state_dict()["state"][0]["exp_avg_sq"])
    assert_same_state(expected, fresh.opt.state_dict())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_objects_and_rng_state(tmp_path: Path) -> None:
    trained = Run(seed=0)
    trained.train(3)
    with ckptvault.CheckpointManager(tmp_path / "v") as mgr:
        mgr.save(3, trained.state()).wait()
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).cuda()
        opt = torch.optim.AdamW(model.parameters())
        mgr.restore(3, into={"model": model, "optimizer": opt})
        assert model[0].weight.is_cuda and torch.equal(model[0].weight.cpu(), trained.model[0].weight)
        exp_avg = opt.state[model[0].weight]["exp_avg"]
        assert exp_avg.is_cuda and torch.equal(exp_avg.cpu(), trained.opt.state[trained.model[0].weight]["exp_avg"])
        captured = rng_state()
        assert len(captured["cuda"]) == torch.cuda.device_count()
        first = torch.rand(4, device="cuda")
        mgr.save(4, {"rng": captured}).wait()
        torch.rand(4, device="cuda")
        set_rng_state(mgr.restore(4)["rng"])
    assert torch.equal(torch.rand(4, device="cuda"), first)
