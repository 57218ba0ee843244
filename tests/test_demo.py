"""The demo job (`ckptvault demo`) through the real entry point, and its bit-exact comparison."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import ckptvault
from ckptvault.cli import main
from ckptvault.cli.demo import format_report
from ckptvault.demo.check import DIGESTS_FILE, TORCH_FILE, diff_digests, state_digests, write_reference
from ckptvault.demo.run import DemoReport
from ckptvault.demo.train import TrainConfig, Trainer

ENTRY_POINT = Path(sys.executable).parent / "ckptvault"
# One intra-op thread: on a busy 2-core machine, OpenMP threads that spin-wait slow small steps down tenfold.
# The in-process reference run below uses the same count, so both runs do the same arithmetic.
THREADS = 1
TINY = ("--batch-size", "4", "--no-progress")


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    assert ENTRY_POINT.exists(), f"the ckptvault console script is not installed next to {sys.executable}"
    env = {**os.environ, "OMP_NUM_THREADS": str(THREADS)}
    return subprocess.run([str(ENTRY_POINT), *args], capture_output=True, text=True, timeout=300, check=False, env=env)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="module")
def demo_vault(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess[str]]:
    """One real demo run: 6 steps, a checkpoint every 2."""
    vault = tmp_path_factory.mktemp("demo") / "vault"
    proc = run_cli("demo", "--vault", str(vault), "--steps", "6", "--every", "2", "--repeat", "2", *TINY)
    return vault, proc


def test_demo_trains_checkpoints_and_restores_bit_exactly(demo_vault: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    vault, proc = demo_vault
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "trained 6 steps (step 0 -> 6)" in out
    assert "checkpoints" in out and "3 (steps 2, 4, 6)" in out and "3 files written" in out
    for row in ("logical bytes per checkpoint", "stored bytes per checkpoint", "added bytes per checkpoint (median)",
                "total for 3 checkpoints", "save: training blocked (median)", "save: until durable (median)",
                "restore time (median, fresh process)"):
        assert row in out, f"missing row {row!r} in:\n{out}"
    assert "(fsync included)" in out and "(torch.load, unpickler)" in out
    assert "restore of step 6 in a fresh process: bit-exact" in out
    assert not list(vault.parent.glob(".ckptvault-demo-*")), "the torch.save scratch folder was left behind"

    with ckptvault.CheckpointManager(vault) as mgr:
        assert mgr.steps() == [2, 4, 6]
        info = mgr.info(6)
        assert set(info.metrics) == {"loss", "lr"} and math.isfinite(info.metrics["loss"])
        assert info.metadata["job"] == "ckptvault-demo" and info.metadata["train"]["batch_size"] == 4
        state = mgr.restore()
    assert state["step"] == 6
    assert set(state) == {"model", "optimizer", "scheduler", "step", "rng"}
    assert type(state["rng"]["numpy"]) is tuple and type(state["rng"]["numpy"][1]) is np.ndarray
    assert type(state["rng"]["python"]) is tuple
    assert state["scheduler"]["last_epoch"] == 6
    assert len(state["optimizer"]["state"]) == len(list(Trainer().model.parameters()))


def test_demo_resume_continues_exactly_and_reports_json(demo_vault: tuple[Path, subprocess.CompletedProcess[str]]) -> None:
    vault, first = demo_vault
    assert first.returncode == 0, first.stderr

    again = run_cli("demo", "--vault", str(vault), "--steps", "2", *TINY)
    assert again.returncode == 2
    assert "already holds checkpoints (latest step 6)" in again.stderr and "--resume" in again.stderr

    proc = run_cli("demo", "--vault", str(vault), "--steps", "2", "--every", "2", "--resume", "--repeat", "1",
                   "--json", *TINY)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is True and report["check"]["num_mismatches"] == 0
    assert (report["start_step"], report["final_step"]) == (6, 8)
    assert report["steps"] == [2, 4, 6, 8]
    assert [len(report[k]) for k in ("save_s", "save_blocked_s", "torch_save_s", "added_bytes")] == [1, 1, 1, 1]
    assert report["logical_bytes"] > 0 and 0 < report["stored_bytes"] <= report["logical_bytes"] * 1.01

    # Resuming at step 6 in another process gives the state of an uninterrupted 8-step run, bit for bit.
    with torch_threads(THREADS):
        trainer = Trainer(TrainConfig(batch_size=4))
        for _ in range(8):
            trainer.train_step()
    resumed = ckptvault.load(str(vault), 8)
    assert diff_digests(state_digests(trainer.state()), state_digests(resumed)) == []


def test_digests_find_every_kind_of_difference() -> None:
    base = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "rng": ("MT", np.arange(4, dtype=np.uint32), 1.5),
            "step": 3, "zero": 0.0}
    assert diff_digests(state_digests(base), state_digests(base)) == []

    flipped = {**base, "w": base["w"].clone()}
    flipped["w"].view(torch.int32)[1, 2] ^= 1  # one low mantissa bit
    assert diff_digests(state_digests(base), state_digests(flipped)) == ["w"]

    variants = {
        "rng.1": {**base, "rng": ("MT", np.arange(4, dtype=np.int32), 1.5)},  # same values, other dtype
        "rng": {**base, "rng": ["MT", np.arange(4, dtype=np.uint32), 1.5]},  # tuple became list
        "zero": {**base, "zero": -0.0},
        "step": {**base, "step": 3.0},
    }
    for path, changed in variants.items():
        assert diff_digests(state_digests(base), state_digests(changed)) == [path], path

    extra = {**base, "more": 1}
    assert diff_digests(state_digests(base), state_digests(extra)) == ["", "more"]
    assert diff_digests(state_digests(extra), state_digests(base)) == ["", "more"]


def test_check_process_fails_when_the_saved_state_differs(tmp_path: Path) -> None:
    state = {"w": torch.randn(4, 4, generator=torch.Generator().manual_seed(0)), "step": 1}
    ckptvault.save(state, str(tmp_path / "vault"), step=1)
    modified = {"w": state["w"].clone(), "step": 1}
    modified["w"][0, 0] += 1e-6
    seconds, size = write_reference(modified, tmp_path / "ref")
    assert seconds > 0 and size == (tmp_path / "ref" / TORCH_FILE).stat().st_size
    assert json.loads((tmp_path / "ref" / DIGESTS_FILE).read_text())["w"].startswith("tensor torch.float32 (4, 4) ")

    proc = subprocess.run([sys.executable, "-m", "ckptvault.demo.check", "--vault", str(tmp_path / "vault"), "--step", "1",
                           "--reference", str(tmp_path / "ref"), "--repeat", "1"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1, proc.stderr
    result = json.loads(proc.stdout)
    assert result["ok"] is False and result["mismatches"] == ["w"] and result["num_mismatches"] == 1


def test_report_names_mismatches() -> None:
    report = DemoReport(vault="/v", codec="zstd", params=1000, steps=[2], start_step=0, final_step=2, final_loss=3.0,
                        train_s=1.0, logical_bytes=100, stored_bytes=80, vault_bytes=80, added_bytes=[80],
                        save_s=[0.01], save_blocked_s=[0.002], torch_save_s=[0.02], torch_save_bytes=110,
                        check={"ok": False, "step": 2, "entries": 7, "mismatches": ["model.w", "step"],
                               "num_mismatches": 2, "restore_median_s": 0.01, "torch_load_median_s": 0.02})
    assert not report.ok
    text = format_report(report)
    assert "restore of step 2 in a fresh process: MISMATCH in 2 of 7 entries: model.w, step" in text
    assert "80 B (0.800x)" in text and "110 B (1.100x)" in text


@pytest.mark.parametrize(("args", "message"), [
    (["--every", "0"], "Invalid value for '--every'"),
    (["--resume", "--fresh"], "--resume and --fresh exclude each other"),
    (["--vault", "memory://x"], "needs a local vault"),
])
def test_demo_rejects_bad_options(args: list[str], message: str) -> None:
    result = CliRunner().invoke(main, ["demo", "--steps", "1", *args])
    assert result.exit_code == 2
    assert message in result.output


def test_demo_takes_the_groups_storage_options_under_its_own(tmp_path: Path) -> None:
    """``ckptvault --storage-option K=V demo`` reaches the demo's vault; the demo's own --storage-option wins."""
    bad = CliRunner().invoke(main, ["--storage-option", "bogus=1", "demo", "--steps", "1", "--vault", str(tmp_path / "a")])
    assert bad.exit_code == 2 and "unknown storage_options for local vaults: ['bogus']" in bad.output, bad.output
    both = CliRunner().invoke(main, ["--storage-option", "drop_behind=1", "demo", "--steps", "1", "--vault",
                                     str(tmp_path / "b"), "--storage-option", "drop_behind=false", *TINY])
    assert both.exit_code == 0, both.output


def test_fresh_refuses_to_delete_a_folder_that_is_not_a_vault(tmp_path: Path) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    result = CliRunner().invoke(main, ["demo", "--steps", "1", "--fresh", "--vault", str(tmp_path)])
    assert result.exit_code == 2
    assert "is not a ckptvault vault" in result.output
    assert (tmp_path / "precious.txt").read_text() == "keep me"


@pytest.mark.parametrize("saver", ["thread", pytest.param("idle-process", marks=pytest.mark.skipif(
    not hasattr(os, "SCHED_IDLE"), reason="Linux's idle scheduling class"))])
def test_demo_checkpoints_every_step_as_predicted_deltas(tmp_path: Path, saver: str) -> None:
    vault = tmp_path / "vault"
    proc = run_cli("demo", "--vault", str(vault), "--steps", "4", "--every", "1", "--predict", "--saver", saver,
                   "--repeat", "1", *TINY)
    assert proc.returncode == 0, proc.stderr
    assert "restore of step 4 in a fresh process: bit-exact" in proc.stdout
    with ckptvault.CheckpointManager(vault) as mgr:
        assert mgr.steps() == [1, 2, 3, 4]
        assert [len(mgr.manifest(s).get("chain", [])) for s in mgr.steps()] == [0, 1, 2, 3]
        predicted = [t["path"] for t in mgr.manifest(4)["tensors"] if "predict" in t]
        assert any(p.startswith("model.") for p in predicted) and any(p.endswith("exp_avg_sq") for p in predicted)
        assert mgr.info(4).added_bytes < 0.5 * mgr.info(1).added_bytes

