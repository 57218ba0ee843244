"""CUDA states: the asynchronous snapshot, restores into GPU tensors, deltas and lossy codecs.

These run only where torch sees a CUDA device (skipped elsewhere, CI included); they passed on an H200
(docs/benchmarks/gpu.md). What must hold on a GPU:

* ``save`` returns only once the device-to-host copies into the pinned staging buffer have landed: training
  that changes every tensor on the GPU right after it cannot reach the checkpoint;
* the manifest records each tensor's device; a restore without ``into=`` gives CPU tensors, one with
  ``into=`` writes into the GPU tensors in place;
* deltas and lossy codecs see exactly the bytes a CPU state would give.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ckptvault import CheckpointManager
from ckptvault._save.staging import StagingBuffer
from conftest import assert_same_state

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CHUNK = 1 << 20


class GpuTraining:
    """An MLP with AdamW on the GPU; one step changes every parameter and moment in place."""

    def __init__(self, seed: int = 0, width: int = 2048) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(256, width), nn.GELU(), nn.Linear(width, width), nn.GELU(),
                                   nn.Linear(width, 16)).cuda()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.gen = torch.Generator(device="cuda").manual_seed(seed + 1)

    def train(self, steps: int = 1) -> None:
        for _ in range(steps):
            x = torch.randn(64, 256, device="cuda", generator=self.gen)
            self.opt.zero_grad()
            self.model(x).square().mean().backward()
            self.opt.step()

    def state(self, step: int) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.opt.state_dict(), "step": step}


def on_cpu(state: Any) -> Any:
    """A CPU deep copy (what a restore without into= gives)."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return type(state)((k, on_cpu(v)) for k, v in state.items())
    if isinstance(state, (list, tuple)):
        return type(state)(on_cpu(v) for v in state)
    return copy.deepcopy(state)


def records(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {t["path"]: t for t in manifest["tensors"]}


def test_training_on_the_gpu_right_after_save_does_not_reach_the_checkpoint(tmp_path: Path) -> None:
    training = GpuTraining()
    training.train(2)
    big = torch.randn(64 << 20, device="cuda")  # 256 MiB: device-to-host copies that take a while to land
    expected = {"train": on_cpu(training.state(2)), "big": on_cpu(big)}
    with CheckpointManager(tmp_path / "v", chunk_size=CHUNK) as mgr:
        handle = mgr.save(2, {"train": training.state(2), "big": big})
        assert handle.staged.done()
        assert mgr._saver._staging.pinned, "staging memory is pinned for a state that holds CUDA tensors"
        big.mul_(-3.0).add_(1.0)  # training goes on, on the GPU, at once
        training.train(3)
        torch.cuda.synchronize()
        mgr.wait()
        restored = mgr.restore(2)
        manifest = mgr.manifest(2)
    assert_same_state(expected, restored)
    assert not torch.equal(expected["big"], big.cpu()), "training changed nothing: the test could not fail"
    devices = {r["path"]: r.get("device") for r in manifest["tensors"]}
    assert devices["big"] == "cuda:0" and devices["train.model.0.weight"] == "cuda:0"
    assert devices["train.optimizer.state.0.step"] in (None, "cuda:0")  # AdamW keeps `step` on the CPU by default


def test_restore_into_gpu_model_and_optimizer_writes_in_place(tmp_path: Path) -> None:
    source = GpuTraining(seed=0)
    source.train(3)
    with CheckpointManager(tmp_path / "v", chunk_size=CHUNK) as mgr:
        mgr.save(3, source.state(3)).wait()
        target = GpuTraining(seed=5)
        target.train(1)  # creates the optimizer state to restore into
        weight = target.model[2].weight
        pointer = weight.data_ptr()
        mgr.restore(3, into={"model": target.model.state_dict(), "optimizer": target.opt.state_dict()})
    assert weight.data_ptr() == pointer and weight.device.type == "cuda"
    assert_same_state(on_cpu(source.model.state_dict()), on_cpu(target.model.state_dict()))
    assert_same_state(on_cpu(source.opt.state_dict()["state"]), on_cpu(target.opt.state_dict()["state"]))


def test_deltas_and_lossy_moments_of_a_gpu_state(tmp_path: Path) -> None:
    training = GpuTraining()
    expected = {}
    # every value moves under Adam, so deltas are large: keyframe_growth=4 keeps them deltas all the same
    with CheckpointManager(tmp_path / "v", chunk_size=CHUNK, keyframe_every=3, keyframe_growth=4.0,
                           codec_rules="moments-bf16") as mgr:
        for step in range(3):
            training.train(1)
            expected[step] = on_cpu(training.state(step))
            mgr.save(step, training.state(step))
        mgr.wait()
        for step in range(3):
            restored, manifest = mgr.restore(step), mgr.manifest(step)
            assert manifest["keyframe_step"] == 0 and manifest["since_keyframe"] == step
            assert_same_state(expected[step]["model"], restored["model"])
            for index, moments in expected[step]["optimizer"]["state"].items():
                got = restored["optimizer"]["state"][index]
                assert torch.equal(got["step"], moments["step"])
                for name in ("exp_avg", "exp_avg_sq"):
                    rec = records(manifest)[f"optimizer.state.{index}.{name}"]
                    assert rec["lossy"]["codec"] == "bf16" and got[name].dtype == torch.float32
                    assert torch.equal(got[name], moments[name].to(torch.bfloat16).float()), (step, index, name)
        assert any(c.get("base") for c in mgr.manifest(2)["chunks"]), "step 2 stored no delta"


def test_odd_gpu_tensors_round_trip_async_and_sync(tmp_path: Path) -> None:
    base = torch.randn(300, 200, device="cuda")
    state = {
        "transposed": base.t(),  # not contiguous
        "sliced_half": base.half()[::3, 5:17],
        "bf16": torch.randn(4097, device="cuda", dtype=torch.bfloat16),
        "scalar": torch.tensor(2.5, device="cuda", dtype=torch.float64),
        "mask": torch.rand(1000, device="cuda") > 0.5,
        "ints": torch.randint(-(2**40), 2**40, (513,), device="cuda", dtype=torch.int64),
        "empty": torch.empty(0, 7, device="cuda"),
        "cpu_too": torch.arange(10),
    }
    expected = on_cpu(state)
    for async_save in (True, False):
        with CheckpointManager(tmp_path / f"v{async_save}", chunk_size=CHUNK, async_save=async_save) as mgr:
            mgr.save(1, state).wait()
            assert_same_state(expected, mgr.restore(1))
            into = {k: torch.zeros_like(v) for k, v in state.items()}
            mgr.restore(1, into=into)
            assert_same_state(expected, on_cpu(into))
            assert all(into[k].device == state[k].device for k in state)


def test_staging_buffer_is_pinned_and_reused() -> None:
    staging = StagingBuffer()
    first = staging.acquire(1 << 20, pinned=True)
    assert staging.pinned and first.is_pinned()
    assert staging.acquire(1 << 10).data_ptr() == first.data_ptr()  # a pinned buffer serves CPU-only saves too
