"""Predicted deltas (DeltaOptions(predict=True)): checkpoints one optimizer step apart store weights and moments
as the XOR with their prediction from the previous checkpoint; every restore is bit-exact."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ckptvault
from ckptvault import CheckpointManager, DeltaOptions
from ckptvault._format import jsontext
from ckptvault._format.manifest import encode_manifest, manifest_key
from ckptvault.errors import CorruptChunkError, CorruptManifestError, FormatVersionError, InvalidArgumentError, PredictionError
from helpers.one_rank_job import made_in_a_job


def _model(seed: int = 0, width: int = 32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Embedding(200, width), torch.nn.Linear(width, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 200))


def _train(make_opt, steps: int, url, *, scheduler=False, max_chain: int = 8, keyframe_every: int = 50,
           async_save: bool = True, predict: bool = True, noise: bool = False, width: int = 32,
           chunk_size: int | None = None) -> tuple[dict[int, dict], CheckpointManager]:
    model = _model(width=width)
    opt = make_opt(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5)) if scheduler else None
    saved = {}
    mgr = CheckpointManager(url, async_save=async_save, chunk_size=chunk_size,
                            delta=DeltaOptions(predict=predict, max_chain=max_chain, keyframe_every=keyframe_every))
    gen = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        x = torch.randint(0, 100, (8, 6), generator=gen)  # rows 100..199 of the embedding get no gradient
        loss = model(x).logsumexp(-1).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}
        if sched is not None:
            state["scheduler"] = sched.state_dict()
        if noise:  # a large array that changes every step and is no prediction's input: garbage once deleted
            state["noise"] = torch.randn(400_000, generator=gen)
        saved[step] = copy.deepcopy(state)
        mgr.save(step, state)
    mgr.wait()
    return saved, mgr


def _assert_same(restored, expected, path="") -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(restored, torch.Tensor), path
        assert restored.dtype == expected.dtype and torch.equal(restored, expected), path
    elif isinstance(expected, dict):
        assert set(restored) == set(expected), path
        for key in expected:
            _assert_same(restored[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(restored) == len(expected), path
        for k, (a, b) in enumerate(zip(restored, expected)):
            _assert_same(a, b, f"{path}.{k}")
    else:
        assert restored == expected, path


def _chain(mgr: CheckpointManager, step: int) -> list[dict]:
    """The levels of a checkpoint's restore chain with their records, read from their chunks."""
    from ckptvault._restore.chain import with_chain

    return [json.loads(level.body_text) for level in with_chain(mgr.vault, mgr.vault.read_manifest(step)).chain]


def _predicted_paths(mgr: CheckpointManager, step: int) -> set[str]:
    return {t["path"] for t in mgr.manifest(step)["tensors"] if "predict" in t}


def _two_groups_adamw(model):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("weight")]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 3e-3}],
                             lr=1e-3)


OPTIMIZERS = {
    "adamw-groups-scheduler": (_two_groups_adamw, True),
    "adamw-foreach": (lambda m: torch.optim.AdamW(m.parameters(), lr=2e-3, weight_decay=0.1, foreach=True), False),
    "adam-no-decay": (lambda m: torch.optim.Adam(m.parameters(), lr=1e-3), True),
    "adam-l2-decay": (lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, weight_decay=0.01), False),
    "adam-amsgrad": (lambda m: torch.optim.Adam(m.parameters(), lr=1e-3, amsgrad=True), False),
    "sgd-momentum": (lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4), True),
    "sgd-nesterov": (lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True), False),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_supported_optimizer_round_trips_bit_exact_with_predictions(tmp_path, name):
    make_opt, scheduler = OPTIMIZERS[name]
    saved, mgr = _train(make_opt, 6, tmp_path / "v", scheduler=scheduler)
    with mgr:
        predicted = _predicted_paths(mgr, 6)
        weights = {f"model.{k}" for k in saved[6]["model"]}
        assert weights <= predicted, f"weights not predicted: {sorted(weights - predicted)}"
        paths = [t["path"] for t in mgr.manifest(6)["tensors"]]
        second = {p for p in paths if p.endswith(("exp_avg_sq", "max_exp_avg_sq"))}
        assert second <= predicted  # recomputed from the gradient the first moments give
        first = [p for p in paths if p.endswith(("exp_avg", "momentum_buffer"))]
        assert first and sum(p in predicted for p in first) >= len(first) / 2  # where beta * old stores less
        assert len(mgr.manifest(6)["chain"]) == 5
        assert _predicted_paths(mgr, 1) == set()  # the first checkpoint has nothing to predict from
        assert mgr.info(6).added_bytes < 0.5 * mgr.info(1).added_bytes
    with CheckpointManager(tmp_path / "v") as fresh:
        for step in saved:
            _assert_same(fresh.restore(step), saved[step])


def test_predictions_store_far_less_than_xor_deltas(tmp_path):
    opt = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1)  # noqa: E731
    saved, predicted = _train(opt, 4, tmp_path / "p")
    _saved, plain = _train(opt, 4, tmp_path / "x", predict=False)
    with predicted, plain:
        assert predicted.info(4).logical_bytes == plain.info(4).logical_bytes
        assert predicted.info(4).added_bytes < 0.6 * plain.info(4).added_bytes
        _assert_same(predicted.restore(4), saved[4])


def test_synchronous_saves_predict_too(tmp_path):
    saved, mgr = _train(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), 3, tmp_path / "v", async_save=False)
    with mgr:
        assert _predicted_paths(mgr, 3)
        _assert_same(mgr.restore(3), saved[3])


def test_an_unsupported_optimizer_falls_back_and_stays_exact(tmp_path):
    saved, mgr = _train(lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3, momentum=0.5), 4, tmp_path / "v")
    with mgr:
        assert all(not _predicted_paths(mgr, s) for s in saved)
        assert mgr.manifest(4).get("chain") is None
        for step in saved:
            _assert_same(mgr.restore(step), saved[step])


def test_the_chain_cap_bounds_every_restore_chain(tmp_path):
    saved, mgr = _train(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), 8, tmp_path / "v", max_chain=2)
    with mgr:
        chains = [len(mgr.manifest(s).get("chain", [])) for s in saved]
        assert chains == [0, 1, 2, 0, 1, 2, 0, 1]
        keyframes = [s for s in saved if mgr.manifest(s)["keyframe_step"] == s]
        assert keyframes == [1, 4, 7]  # a chain at the cap is followed by a keyframe
        for step in saved:
            _assert_same(mgr.restore(step), saved[step])


def test_keyframes_end_chains(tmp_path):
    saved, mgr = _train(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), 7, tmp_path / "v", keyframe_every=3)
    with mgr:
        assert [len(mgr.manifest(s).get("chain", [])) for s in saved] == [0, 1, 2, 0, 1, 2, 0]
        _assert_same(mgr.restore(6), saved[6])


def test_pruning_and_gc_of_the_steps_a_checkpoint_is_predicted_from_keep_it_restorable(tmp_path):
    saved, mgr = _train(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), 6, tmp_path / "v", noise=True)
    with mgr:
        for step in range(1, 6):
            mgr.delete(step)
        _plan, result = mgr.gc(grace=0)
        assert result is not None and result.bytes_freed > 5 * 1_000_000  # the other steps' noise was collected
        assert mgr.steps() == [6]
        assert mgr.verify().ok
        _assert_same(mgr.restore(6), saved[6])


def test_restore_into_live_objects_and_by_keys(tmp_path):
    saved, mgr = _train(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), 4, tmp_path / "v")
    with mgr:
        model = _model(seed=5)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        mgr.restore(4, into={"model": model, "optimizer": opt})
        _assert_same(model.state_dict(), saved[4]["model"])
        _assert_same(opt.state_dict()["state"], saved[4]["optimizer"]["state"])
        _assert_same(mgr.restore(4, keys="model.*")["model"], saved[4]["model"])


def test_a_prediction_that_differs_fails_the_restore_loudly(tmp_path):
    saved, mgr = _train(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), 3, tmp_path / "v")
    with mgr:
        body = mgr.manifest(3)
        record = next(t for t in body["tensors"] if t.get("predict", {}).get("op") == "adam-param-1")
        record["predict"]["scalars"]["eps"] *= 2  # a well-formed manifest whose prediction no longer matches
        mgr.vault.store.put(manifest_key(3), encode_manifest(body))
        with pytest.raises(PredictionError, match=r"step 3: '.*', stored as the residual against its prediction \(adam-param-1\) "
                                                  r"from step 2, does not restore to the bytes it was saved with"):
            mgr.restore(3)
        _assert_same(mgr.restore(2), saved[2])  # the step it was predicted from is untouched


def test_flush_to_zero_refuses_to_restore_but_saves_fall_back(tmp_path):
    saved, mgr = _train(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), 3, tmp_path / "v", async_save=False)
    with mgr:
        torch.set_flush_denormal(True)
        try:
            with pytest.raises(PredictionError, match=r"flushes subnormal floats to zero .*set_flush_denormal\(False\)"):
                mgr.restore(3)
            mgr.save(4, saved[3])  # synchronous: computed on this thread, so not predicted
        finally:
            torch.set_flush_denormal(False)
        assert not _predicted_paths(mgr, 4)
        _assert_same(mgr.restore(3), saved[3])


def test_a_fresh_process_restores_a_chain_another_process_wrote(tmp_path):
    script = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})
        from test_predicted_deltas import _train
        saved, mgr = _train(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1), 5,
                            {str(tmp_path / 'v')!r}, scheduler=True)
        mgr.close()
        torch.save(saved[5], {str(tmp_path / 'expected.pt')!r})
    """)
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    assert len(ckptvault.CheckpointManager(tmp_path / "v").manifest(5)["chain"]) == 4
    _assert_same(ckptvault.load(tmp_path / "v", 5), expected)


def _adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)


def _resumed_saves(url, restored: int, steps: tuple[int, ...], saver: str = "thread",
                   restore: str = "manager") -> tuple[dict[int, dict], CheckpointManager]:
    """A resumed run: a new manager, a new model and AdamW given step ``restored``'s state (``restore``: by the
    manager in one call, by the manager model first and optimizer next, or by ``ckptvault.load``), then one
    optimizer step after another saved as ``steps``. ``restore="tensors"``: the model into its tensors, the
    optimizer as a new state."""
    from ckptvault import AsyncOptions

    model = _model(seed=5)
    opt = _adamw(model)
    mgr = CheckpointManager(url, delta=DeltaOptions(predict=True, keyframe_every=20, max_chain=19),
                            async_options=AsyncOptions(saver=saver))
    if restore == "manager":
        mgr.restore(restored, into={"model": model, "optimizer": opt})
    elif restore == "parts":  # as the Hugging Face Trainer resumes
        mgr.restore(restored, into={"model": model})
        mgr.restore(restored, into={"optimizer": opt})
    elif restore == "tensors":  # into the model's tensors in place, then the optimizer's state as new tensors
        mgr.restore(restored, into={"model": model.state_dict()})
        opt.load_state_dict(mgr.restore(restored, keys=["optimizer.*"])["optimizer"])
    else:
        state = ckptvault.load(url, restored)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
    saved, gen = {}, torch.Generator().manual_seed(9)
    for step in steps:
        model(torch.randint(0, 100, (8, 6), generator=gen)).logsumexp(-1).mean().backward()
        opt.step()
        opt.zero_grad()
        saved[step] = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step})
        mgr.save(step, saved[step])
    mgr.wait()
    return saved, mgr


@pytest.mark.parametrize(("saver", "restore", "log"), [
    ("thread", "manager", "kept 20 arrays of step 4 from its restore to predict step 5 from"),
    ("thread", "parts", "kept 20 arrays of step 4 from its restore to predict step 5 from"),
    ("thread", "tensors", "kept 20 arrays of step 4 from its restore to predict step 5 from"),
    ("thread", "load", "read back 20 arrays of step 4 to predict step 5 from"),  # 5 weights, 3 x 5 of AdamW's
    ("process", "manager", None),  # the saver process reads them back, and logs in its own process
])
def test_the_first_save_of_a_resumed_run_predicts_from_the_step_before(tmp_path, saver, restore, log, caplog):
    """A new manager kept no copy of the checkpoint before its first save: it takes step 4's weights and moments from
    its own restore of step 4 (the whole state, or its parts one after the other), or reads them back from the
    vault (restored some other way, or saved by a saver process), so step 5 is predicted as step 6 is, and both
    restore exactly."""
    _saved, first = _train(_adamw, 4, tmp_path / "v", keyframe_every=20, max_chain=19)
    first.close()
    with caplog.at_level("DEBUG", logger="ckptvault"):
        saved, mgr = _resumed_saves(tmp_path / "v", 4, (5, 6), saver, restore)
    with mgr:
        weights = {f"model.{name}" for name in saved[6]["model"]}
        assert weights <= _predicted_paths(mgr, 5) and weights <= _predicted_paths(mgr, 6)
        assert mgr.manifest(5)["keyframe_step"] == 1 and len(mgr.manifest(6)["chain"]) == 5
        assert mgr.info(5).added_bytes < 0.5 * mgr.info(4).stored_bytes  # an XOR delta of a step stores most of it
        for step in (5, 6):
            _assert_same(mgr.restore(step), saved[step])
    if log is not None:
        assert [r.getMessage() for r in caplog.records if "to predict step" in r.getMessage()] == [log]


def test_a_restore_of_an_earlier_step_keeps_nothing_for_the_first_save(tmp_path, caplog):
    _saved, first = _train(_adamw, 4, tmp_path / "v", keyframe_every=20, max_chain=19)
    first.close()
    with CheckpointManager(tmp_path / "v", delta=DeltaOptions(predict=True, keyframe_every=20, max_chain=19)) as mgr:
        mgr.restore(3)
        assert mgr._saver.predictor._restored is None  # noqa: SLF001 - no copies of a step no save predicts from
        state = mgr.restore(4, keys=["model.*"])
        assert len(mgr._saver.predictor._restored[2]) == 5  # noqa: SLF001 - the model's five arrays
        mgr.save(10, state)  # not the step after: the copies go once a save is committed
        mgr.wait()
        assert mgr._saver.predictor._restored is None  # noqa: SLF001


def test_a_restore_of_the_latest_step_lists_the_vault_once(tmp_path, monkeypatch):
    saved, first = _train(_adamw, 2, tmp_path / "v")
    first.close()
    with CheckpointManager(tmp_path / "v", delta=DeltaOptions(predict=True)) as mgr:
        calls = []
        real = mgr.latest_step
        monkeypatch.setattr(mgr, "latest_step", lambda: calls.append(1) or real())
        _assert_same(mgr.restore(), saved[2])
        assert len(calls) == 1 and mgr._saver.predictor._restored[0] == 2  # noqa: SLF001 - copies kept of step 2


def test_a_restore_whose_latest_step_cannot_be_listed_still_restores_and_keeps_nothing(tmp_path, monkeypatch):
    from ckptvault.errors import VaultError

    saved, first = _train(_adamw, 2, tmp_path / "v")
    first.close()
    with CheckpointManager(tmp_path / "v", delta=DeltaOptions(predict=True)) as mgr:
        def unlistable() -> None:
            raise VaultError("the listing failed")

        monkeypatch.setattr(mgr, "latest_step", unlistable)
        _assert_same(mgr.restore(2), saved[2])
        assert mgr._saver.predictor._restored is None  # noqa: SLF001


def test_a_resumed_run_with_a_lossy_array_keeps_copies_of_the_exact_ones_and_predicts_them(tmp_path, caplog):
    """A lossy record's read fills a buffer of its stored form, not of its values: the restore keeps no copy of it,
    still restores exactly what a plain restore does, and the first save predicts the model and optimizer."""
    options = {"delta": DeltaOptions(predict=True, keyframe_every=20, max_chain=19), "codec_rules": {"ema": "bf16"}}
    model = _model()
    opt = _adamw(model)
    with CheckpointManager(tmp_path / "v", **options) as first:
        for step in (1, 2):
            model(torch.randint(0, 100, (8, 6))).logsumexp(-1).mean().backward()
            opt.step()
            opt.zero_grad()
            first.save(step, {"model": model.state_dict(), "optimizer": opt.state_dict(), "ema": torch.randn(4096)})
    with CheckpointManager(tmp_path / "v", **options) as mgr, caplog.at_level("DEBUG", logger="ckptvault"):
        plain = ckptvault.load(tmp_path / "v", 2)
        state = mgr.restore(2)
        _assert_same(state, plain)
        copies = mgr._saver.predictor._restored[2]  # noqa: SLF001
        assert {mgr.manifest(2)["tensors"][i]["path"] for i in copies} == set(_named_paths(plain)) - {"ema"}
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        model(torch.randint(0, 100, (8, 6))).logsumexp(-1).mean().backward()
        opt.step()
        saved = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(), "ema": state["ema"]})
        mgr.save(3, saved)
        mgr.wait()
        assert {f"model.{name}" for name in saved["model"]} <= _predicted_paths(mgr, 3)
        _assert_same(mgr.restore(3, keys=["model.*", "optimizer.*"]), {k: saved[k] for k in ("model", "optimizer")})
    assert any(r.getMessage().startswith("kept 20 arrays of step 2 from its restore") for r in caplog.records)
    assert not [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


def _named_paths(state, path=""):
    """The key paths of every tensor of ``state``."""
    from ckptvault._tree import array_leaves

    return [p for p, _ in array_leaves(state, path)]


def test_a_resumed_run_reads_nothing_back_for_a_save_that_is_not_the_next_step(tmp_path, caplog):
    _saved, first = _train(_adamw, 4, tmp_path / "v", keyframe_every=20, max_chain=19)
    first.close()
    with caplog.at_level("DEBUG", logger="ckptvault"):
        saved, mgr = _resumed_saves(tmp_path / "v", 4, (6,))  # one optimizer step on, but not checkpoint step 5
    with mgr:
        assert _predicted_paths(mgr, 6) == set()
        assert not [r for r in caplog.records if "read back" in r.getMessage()]
        _assert_same(mgr.restore(6), saved[6])


def test_a_checkpoint_that_cannot_be_read_back_leaves_the_next_save_unpredicted_and_exact(tmp_path, caplog):
    from ckptvault._format.chunk_object import chunk_key

    _saved, first = _train(_adamw, 4, tmp_path / "v", keyframe_every=20, max_chain=19)
    with first:
        body = first.manifest(4)
    cid = body["chunks"][body["tensors"][0]["pieces"][0][0]]["id"]  # the weights' residuals, new in step 4
    assert next(c for c in body["chunks"] if c["id"] == cid)["new"]
    path = tmp_path / "v" / chunk_key(cid)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.chmod(0o644)
    path.write_bytes(bytes(data))
    saved, mgr = _resumed_saves(tmp_path / "v", 3, (5,))
    with mgr:
        assert _predicted_paths(mgr, 5) == set()
        _assert_same(mgr.restore(5), saved[5])
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and re.fullmatch(
        rf"step 5 is saved without predictions: step 4's arrays could not be read back \(CorruptChunkError: chunk "
        rf"{cid} is corrupt .*\)", warnings[0], re.S), warnings


def test_show_and_ls_say_what_a_restore_rebuilds_and_which_arrays_are_predicted(tmp_path):
    """A keyframe and predicted checkpoints, one of them deleted (the chains of later steps still hold it): the
    ``restore`` line of ``show``, its PREDICTED column and JSON, and ``ls --json``'s ``keyframe_step`` and ``chain``."""
    from click.testing import CliRunner

    from ckptvault.cli import main

    saved, mgr = _train(_adamw, 5, tmp_path / "v", keyframe_every=20, max_chain=19)
    with mgr:
        mgr.delete(2)  # step 3 stays restorable; what shows is its own chain
        info = mgr.info(5)
        assert (info.keyframe_step, info.chain) == (1, 4)
        assert {t.path: t.predicted for t in info.tensors if t.path.startswith("model.")} == dict.fromkeys(
            (f"model.{k}" for k in saved[5]["model"]), "adam-param-1")
        assert {t.path: t.predicted for t in info.tensors}["optimizer.state.0.step"] is None
    url = str(tmp_path / "v")
    shown = CliRunner().invoke(main, ["show", url, "5"])
    assert shown.exit_code == 0, shown.output
    assert "restore   predicted from step 4: rebuilds 4 checkpoints first, from keyframe 1\n" in shown.output
    rows = {line.split()[0]: line.split() for line in shown.output.split("\n\n")[1].splitlines()}
    assert rows["KEY"][-1] == "PREDICTED" and rows["model.0.weight"][-1] == "adam-param-1"
    assert rows["optimizer.state.0.exp_avg_sq"][-1] == "adam-sq-1" and rows["optimizer.state.0.step"][-1] == "-"
    keyframe = CliRunner().invoke(main, ["show", url, "1"])
    assert "restore   a keyframe (no earlier checkpoint needed)\n" in keyframe.output
    assert "PREDICTED" not in keyframe.output
    doc = json.loads(CliRunner().invoke(main, ["show", url, "5", "--json"]).output)
    assert (doc["keyframe_step"], doc["chain"]) == (1, 4)
    assert {t["path"]: t["predicted"] for t in doc["tensors"]}["model.3.bias"] == "adam-param-1"
    listed = json.loads(CliRunner().invoke(main, ["ls", url, "--json"]).output)["checkpoints"]
    assert [(c["step"], c["keyframe_step"], c["chain"]) for c in listed] == [(1, 1, 0), (3, 1, 2), (4, 1, 3), (5, 1, 4)]


def test_show_names_the_keyframe_of_an_xor_delta(tmp_path):
    from click.testing import CliRunner

    from ckptvault.cli import main

    with CheckpointManager(tmp_path / "v", async_save=False) as mgr:
        mgr.save(1, {"w": torch.arange(1000.0)})
        mgr.save(2, {"w": torch.arange(1000.0) + 1})
    shown = CliRunner().invoke(main, ["show", str(tmp_path / "v"), "2"])
    assert "restore   deltas against keyframe 1\n" in shown.output, shown.output


def test_the_manifest_declares_predictions_and_their_chain(tmp_path):
    _saved, mgr = _train(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), 3, tmp_path / "v")
    with mgr:
        body = mgr.manifest(3)
        assert "predicted" in body["requires"]
        assert [level["step"] for level in body["chain"]] == [2, 1]
        record = next(t for t in body["tensors"] if t.get("predict", {}).get("op") == "adam-sq-1")
        assert [i[1] for i in record["predict"]["inputs"]] == [1, 1, 0]
        assert {t["predict"].get("residual") for t in body["tensors"] if "predict" in t} == {"diff"}
        assert "residual-diff" in body["requires"]
        json.dumps(body)  # plain JSON


def test_a_chain_of_xor_and_diff_residuals_restores_bit_exact(tmp_path, monkeypatch):
    """Checkpoints written with XOR residuals (as before the difference existed) stay readable, and a chain whose
    deeper levels are XORs and whose later ones are differences restores every step exactly, streamed or not."""
    from ckptvault._delta import predict as predict_module

    model = _model(width=128)  # the embedding's arrays span two chunks: they stream
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    saved = {}
    with CheckpointManager(tmp_path / "v", async_save=False, chunk_size=64 << 10,
                           delta=DeltaOptions(predict=True, max_chain=10)) as mgr:
        for step in range(1, 7):
            monkeypatch.setattr(predict_module, "RESIDUAL", "xor" if step <= 3 else "diff")
            model(torch.arange(8)).sum().backward()
            opt.step()
            opt.zero_grad()
            saved[step] = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
            mgr.save(step, saved[step])
        forms = {step: {t["predict"].get("residual", "xor") for t in mgr.manifest(step)["tensors"] if "predict" in t}
                 for step in saved}
        assert forms == {1: set(), 2: {"xor"}, 3: {"xor"}, 4: {"diff"}, 5: {"diff"}, 6: {"diff"}}
        assert ["residual-diff" in mgr.manifest(step).get("requires", []) for step in saved] == [False] * 3 + [True] * 3
        assert len(mgr.manifest(6)["chain"]) == 5
    with CheckpointManager(tmp_path / "v") as fresh:
        for step in saved:
            _assert_same(fresh.restore(step), saved[step])
        assert fresh.verify().ok


@pytest.mark.parametrize(("options", "error", "message"), [
    ({"predict": "yes"}, InvalidArgumentError, r"predict must be true/false or Mapping, got .yes."),
    ({"predict": {"optimizer": 3}}, InvalidArgumentError, "dict of optimizer key path -> model key path"),
    ({"max_chain": 0}, InvalidArgumentError, "max_chain must be >= 1, got 0"),
])
def test_bad_prediction_options_are_refused(options, error, message):
    with pytest.raises(error, match=message):
        DeltaOptions(**options)


def test_optimizers_are_found_under_any_key_path_and_lookalikes_are_not():
    """An optimizer ``state_dict()`` inside lists and dicts (its groups a list or a tuple) is found at its key path; a
    dict with ``state`` whose ``param_groups`` are not dicts, or whose ``state`` is not a dict, is not one."""
    from ckptvault._delta.optimizers import find_slots
    from ckptvault._save.snapshot import take_snapshot
    from ckptvault.rules import CodecRules

    model = _model()
    first, second = torch.optim.AdamW(model.parameters(), lr=1e-3), torch.optim.SGD(model.parameters(), lr=0.1,
                                                                                      momentum=0.9)
    for opt in (first, second):
        model(torch.arange(8)).sum().backward()
        opt.step()
        opt.zero_grad()
    tupled = second.state_dict()
    tupled["param_groups"] = tuple(tupled["param_groups"])
    state = {"model": model.state_dict(), "run": [{"optim": first.state_dict()}, {"inner": {"sgd": tupled}}],
             "decoy": {"state": {"x": torch.ones(2)}, "param_groups": [1, 2]},
             "other": {"state": [1], "param_groups": [{"lr": 0.1}]}}
    snapshot = take_snapshot(state, CodecRules(None, "zstd"))
    slots = find_slots(snapshot.tree, list(snapshot.records), list(snapshot.views))
    assert {path for path, _pid in slots} == {"run.0.optim", "run.1.inner.sgd"}
    assert {slot.kind for slot in slots.values()} == {"adam", "sgd"}
    params = [snapshot.records[s.param].path for key, s in sorted(slots.items()) if key[0] == "run.0.optim"]
    assert params == [f"model.{name}" for name in model.state_dict()]


def test_naming_the_model_subtree_pairs_it(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ema = copy.deepcopy(model.state_dict())  # same shapes, before the model in state order: must not be paired
    saved = {}
    with CheckpointManager(tmp_path / "v", delta=DeltaOptions(predict={"optimizer": "model"})) as mgr:
        for step in (1, 2, 3):
            model(torch.randint(0, 100, (4, 3))).sum().backward()
            opt.step()
            opt.zero_grad()
            saved[step] = copy.deepcopy({"ema": ema, "model": model.state_dict(), "optimizer": opt.state_dict()})
            mgr.save(step, saved[step])
        mgr.wait()
        predicted = _predicted_paths(mgr, 3)
        assert {f"model.{k}" for k in saved[3]["model"]} <= predicted
        assert not any(p.startswith("ema.") for p in predicted)
        _assert_same(mgr.restore(3), saved[3])


def test_automatic_pairing_picks_the_array_the_optimizer_updates_among_lookalikes(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    frozen = copy.deepcopy(model.state_dict())  # same shapes, earlier in state order, never updated
    saved = {}
    with CheckpointManager(tmp_path / "v", delta=DeltaOptions(predict=True)) as mgr:
        for step in (1, 2, 3):
            model(torch.randint(0, 100, (4, 3))).sum().backward()
            opt.step()
            opt.zero_grad()
            saved[step] = copy.deepcopy({"a_frozen": frozen, "model": model.state_dict(), "optimizer": opt.state_dict()})
            mgr.save(step, saved[step])
        mgr.wait()
        params = [t for t in mgr.manifest(3)["tensors"] if t.get("predict", {}).get("op") == "adam-param-1"]
        assert sorted(t["path"] for t in params) == sorted(f"model.{k}" for k in saved[3]["model"])
        assert all(i[2].startswith("model.") for t in params for i in t["predict"]["inputs"] if i[0] == "p0")
        _assert_same(mgr.restore(3), saved[3])


def _named_state(model, opt) -> dict:
    """The state as ``torch.distributed.checkpoint.state_dict.get_state_dict`` gives it: the optimizer's state and
    groups keyed by parameter name instead of by id."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, opt)
    assert all(isinstance(k, str) for k in optim_state["state"])
    return {"model": model_state, "optim": optim_state}


def _reordered_groups_adamw(model):
    """Two groups that list the parameters against state order, so that order alone pairs the 64x64 arrays wrongly."""
    params = dict(model.named_parameters())
    return torch.optim.AdamW([{"params": [params["3.weight"], params["1.weight"]], "weight_decay": 0.1},
                              {"params": [params["3.bias"], params["1.bias"], params["0.weight"]], "lr": 3e-3}],
                             lr=1e-3)


def _square_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(100, 64), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 64))


def test_an_optimizer_state_keyed_by_parameter_name_pairs_each_with_the_array_of_its_name():
    from ckptvault._delta.optimizers import find_slots
    from ckptvault._save.snapshot import take_snapshot
    from ckptvault.rules import CodecRules

    model = _square_model()
    opt = _reordered_groups_adamw(model)
    model(torch.arange(8)).sum().backward()
    opt.step()
    snapshot = take_snapshot(_named_state(model, opt), CodecRules(None, "zstd"))
    slots = find_slots(snapshot.tree, list(snapshot.records), list(snapshot.views))
    assert sorted(pid for _path, pid in slots) == sorted(name for name, _ in model.named_parameters())
    assert {pid: snapshot.records[s.param].path for (_path, pid), s in slots.items()} == {
        name: f"model.{name}" for name, _ in model.named_parameters()}


@pytest.mark.parametrize("make_opt", [
    _reordered_groups_adamw,
    lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True),
], ids=["adamw-groups-scheduler", "sgd-nesterov"])
def test_optimizer_states_keyed_by_parameter_name_are_predicted_and_round_trip_bit_exact(tmp_path, make_opt):
    """The form torch.distributed.checkpoint's ``get_state_dict`` returns, with an LR scheduler: every weight and
    moment is predicted from the step before, pairs by name, and every step restores bit for bit."""
    model = _square_model()
    opt = make_opt(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    saved, gen = {}, torch.Generator().manual_seed(1)
    with CheckpointManager(tmp_path / "v", delta=DeltaOptions(predict=True, keyframe_every=20, max_chain=19)) as mgr:
        for step in range(1, 7):
            model(torch.randint(0, 100, (8, 5), generator=gen)).logsumexp(-1).mean().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
            saved[step] = copy.deepcopy({**_named_state(model, opt), "scheduler": sched.state_dict()})
            mgr.save(step, saved[step])
        mgr.wait()
        moments = ("exp_avg", "exp_avg_sq") if isinstance(opt, torch.optim.AdamW) else ("momentum_buffer",)
        names = [name for name, _ in model.named_parameters()]
        expected = {f"model.{n}" for n in names} | {f"optim.state.{n}.{m}" for n in names for m in moments}
        for step in range(2, 7):
            predicted = _predicted_paths(mgr, step)  # an SGD buffer's residual is the gradient: a tiny one may not pay
            assert predicted == expected if moments[0] == "exp_avg" else {f"model.{n}" for n in names} <= predicted <= expected
            params = [t for t in mgr.manifest(step)["tensors"] if t.get("predict", {}).get("op", "").endswith("param-1")
                      or t.get("predict", {}).get("op") == "sgd-nesterov-1"]
            assert {t["path"]: [i[2] for i in t["predict"]["inputs"] if i[0] == "p0"] for t in params} == {
                f"model.{n}": [f"model.{n}"] for n in names}
        for step in range(1, 7):
            _assert_same(mgr.restore(step), saved[step])


def test_the_readme_every_step_recipe_runs_and_predicts(tmp_path):
    readme = (__import__("pathlib").Path(__file__).resolve().parent.parent / "README.md").read_text()
    found = re.search(r"<!-- every-step-recipe[^\n]*-->\n```python\n(.*?)\n```\n", readme, re.S)
    assert found, "README.md has no code block marked <!-- every-step-recipe -->"
    subprocess.run([sys.executable, "-c", found.group(1)], cwd=tmp_path, check=True, timeout=120,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})
    with CheckpointManager(tmp_path / "every-step") as mgr:
        assert mgr.steps() == list(range(1, 41))
        chains = [len(mgr.manifest(s).get("chain", [])) for s in mgr.steps()]
        assert chains == list(range(20)) * 2  # keyframes at 1 and 21, each chain up to max_chain=19
        assert {"model.weight", "model.bias", "optimizer.state.0.exp_avg_sq"} <= _predicted_paths(mgr, 40)



def test_retention_that_keeps_only_the_latest_keeps_it_restorable(tmp_path):
    saved, mgr = _train(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), 5, tmp_path / "v", noise=True)
    with mgr:
        plan, result = mgr.prune(ckptvault.KeepLast(1))
        assert result is not None and mgr.steps() == [5]
        _plan, collected = mgr.gc(grace=0)
        assert collected is not None and collected.bytes_freed > 0
        _assert_same(mgr.restore(5), saved[5])


def test_a_distributed_manager_refuses_predictions():
    assert made_in_a_job("delta=ckptvault.DeltaOptions(predict=True)").startswith(
        "refused: DeltaOptions(predict=...) is for single-process saves")


def test_a_manifest_with_a_chain_encodes_as_its_json_body_does(tmp_path):
    _saved, mgr = _train(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), 4, tmp_path / "v")
    with mgr:
        manifest = mgr.vault.read_manifest(4)
        assert len(manifest.chain) == 3
        assert encode_manifest(manifest) == encode_manifest(manifest.to_json())  # the chain's text is spliced in
        assert mgr.vault.store.get(manifest_key(4)) == encode_manifest(manifest)


def test_a_convincing_first_candidate_ends_the_pairing_trial(tmp_path, monkeypatch):
    """Where state order already names the right array first, one trial per parameter settles its pairing; the
    lookalikes after it are not tried, later saves take the pairing without a trial, and it stays right."""
    from ckptvault._delta import predict as predict_module

    trials = []
    real = predict_module.predict
    monkeypatch.setattr(predict_module, "predict", lambda op, *rest: trials.append(op) or real(op, *rest))
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    frozen = copy.deepcopy(model.state_dict())  # same shapes, after the model in state order, never updated
    saved = {}
    with CheckpointManager(tmp_path / "v", async_save=False, delta=DeltaOptions(predict=True)) as mgr:
        for step in (1, 2, 3):
            model(torch.randint(0, 100, (4, 3))).sum().backward()
            opt.step()
            opt.zero_grad()
            saved[step] = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(), "z_frozen": frozen})
            mgr.save(step, saved[step])
        params = [t for t in mgr.manifest(3)["tensors"] if t.get("predict", {}).get("op") == "adam-param-1"]
        assert sorted(t["path"] for t in params) == sorted(f"model.{k}" for k in saved[3]["model"])
        assert all(i[2].startswith("model.") for t in params for i in t["predict"]["inputs"] if i[0] == "p0")
        assert trials == ["adam-param-1"] * len(params)  # step 2, one trial per parameter; step 3 none
        _assert_same(mgr.restore(3), saved[3])


def test_a_pairing_found_on_a_three_quarter_match_is_kept_until_its_prediction_stops_paying(tmp_path, monkeypatch):
    """A parameter whose prediction misses a few of the trial elements (changed outside the step) is not paired
    convincingly, so its first save tries every lookalike; it keeps that pairing on a 3/4 match, so the next save
    tries none. A save where the parameter was replaced outside the optimizer (its prediction stored nothing) drops
    the pairing, and the save after it tries the lookalikes again and finds the same array."""
    from ckptvault._delta import predict as predict_module

    trials = []
    real = predict_module.predict
    monkeypatch.setattr(predict_module, "predict", lambda op, *rest: trials.append(op) or real(op, *rest))
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(4096))
    lookalikes = {"b": torch.randn(4096), "c": torch.randn(4096)}  # same shape, after it in state order
    opt = torch.optim.SGD([weight], lr=0.1, momentum=0.9)
    saved, tried = {}, {}
    delta = DeltaOptions(predict=True, keyframe_growth=100)  # step 3's raw weight must not start a keyframe at 4
    with CheckpointManager(tmp_path / "v", async_save=False, delta=delta) as mgr:
        for step in (1, 2, 3, 4):
            (weight * torch.randn(weight.shape)).sum().backward()
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                weight[:20] = 0.5  # 236 of the 256 trial elements are still predicted exactly
                if step == 3:
                    weight.copy_(torch.randn(weight.shape))  # nothing of it follows from the step
            saved[step] = copy.deepcopy({"model": {"a": weight.detach(), **lookalikes}, "optimizer": opt.state_dict()})
            before = len(trials)
            mgr.save(step, saved[step])
            tried[step] = trials[before:]
            record = next(t for t in mgr.manifest(step)["tensors"] if t["path"] == "model.a")
            if step in (2, 4):
                assert [i[2] for i in record["predict"]["inputs"] if i[0] == "p0"] == ["model.a"]
            if step == 3:
                assert "predict" not in record
        assert tried == {1: [], 2: ["sgd-param-1"] * 3, 3: [], 4: ["sgd-param-1"] * 3}
        _assert_same(mgr.restore(4), saved[4])


def test_blocks_whose_prediction_does_not_pay_are_stored_as_they_are(tmp_path):
    """A parameter changed outside the optimizer step in one block (reset to a constant) keeps that block raw
    (``raw_blocks``); the other blocks stay predicted, and the restore is exact."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(3 * (64 << 10) // 4))  # three 64 KiB blocks
    opt = torch.optim.SGD([weight], lr=0.1, momentum=0.9)
    saved = {}
    with CheckpointManager(tmp_path / "v", chunk_size=64 << 10, async_save=False,
                           delta=DeltaOptions(predict=True)) as mgr:
        for step in (1, 2):
            (weight * torch.randn(weight.shape)).sum().backward()
            opt.step()
            opt.zero_grad()
            if step == 2:
                with torch.no_grad():
                    weight[16384:32768] = 0.5  # block 1: nothing the momentum predicts
            saved[step] = copy.deepcopy({"model": {"w": weight.detach()}, "optimizer": opt.state_dict()})
            mgr.save(step, saved[step])
        record = next(t for t in mgr.manifest(2)["tensors"] if t["path"] == "model.w")
        assert record["predict"]["op"] == "sgd-param-1" and record["predict"]["raw_blocks"] == [1]
        _assert_same(mgr.restore(2), saved[2])


@pytest.mark.parametrize("name", ["adamw-groups-scheduler", "adam-amsgrad", "sgd-nesterov"])
def test_small_records_predicted_together_store_what_separate_kernel_calls_store(tmp_path, monkeypatch, name):
    """Records of at most BATCH_UP_TO bytes with the same kernel and constants run in one kernel call: the
    checkpoints hold the same chunks and predictions as when each record has a call of its own, and restore exact."""
    from ckptvault._delta import predict as predict_module

    calls = []
    real = predict_module.residual_of
    monkeypatch.setattr(predict_module, "residual_of", lambda op, *rest: calls.append(op) or real(op, *rest))
    make_opt, scheduler = OPTIMIZERS[name]
    saved, together = _train(make_opt, 4, tmp_path / "together", scheduler=scheduler, async_save=False)
    batched_calls, calls[:] = len(calls), []
    monkeypatch.setattr(predict_module, "BATCH_UP_TO", 0)
    separate = CheckpointManager(tmp_path / "separate", async_save=False,
                                 delta=DeltaOptions(predict=True, max_chain=8, keyframe_every=50))
    for step, state in saved.items():
        separate.save(step, state)
    with together, separate:
        saved_calls = 0
        for step in (2, 3, 4):
            small = [t["predict"] for t in together.manifest(step)["tensors"] if "predict" in t and t["nbytes"] <= 4096]
            groups = {(p["op"], json.dumps(p["scalars"])) for p in small}
            assert len(small) >= 2 * len(groups)  # each kernel runs on both biases (or their moments) at once
            saved_calls += len(small) - len(groups)  # one call per group instead of one per record
        assert len(calls) - batched_calls == saved_calls
        for step in (2, 3, 4):
            mine, theirs = together.manifest(step), separate.manifest(step)
            assert [t.get("predict") for t in mine["tensors"]] == [t.get("predict") for t in theirs["tensors"]]
            assert [c["id"] for c in mine["chunks"]] == [c["id"] for c in theirs["chunks"]]
            _assert_same(together.restore(step), saved[step])


def test_a_residual_that_stores_in_almost_nothing_is_not_weighed_against_its_block():
    """The block estimate is skipped for a residual that stores in almost nothing, and made otherwise: a
    compressible block beside a random residual is kept raw. A residual of almost only zero bytes is not even
    estimated."""
    import numpy as np

    from ckptvault._delta import predict as predict_module

    block = 64 << 10
    actual = np.zeros(2 * block // 4, dtype=np.float32)
    residual = np.zeros_like(actual)
    residual[block // 4:] = np.random.default_rng(0).standard_normal(block // 4, dtype=np.float32)
    assert predict_module._raw_blocks(actual, residual, block) == [1]
    estimated = []
    real = predict_module._estimate
    try:
        predict_module._estimate = lambda sample, itemsize: estimated.append(len(sample)) or real(sample, itemsize)
        assert predict_module._raw_blocks(actual, np.zeros_like(actual), block) == []
        assert estimated == []  # no non-zero byte: nothing to estimate
        sparse = np.zeros_like(actual)
        sparse.view(np.uint8)[:: 32] = 7  # a 32nd of the bytes: more than the 64th that needs no estimate
        assert predict_module._raw_blocks(actual, sparse, block) == []
    finally:
        predict_module._estimate = real
    assert estimated == [predict_module.SAMPLE] * 2  # the residual's estimate of each block, never the block's


def test_a_small_record_is_kept_raw_when_its_residual_holds_more_non_zero_bytes_than_it():
    """A record smaller than SMALL is one block, judged by counting non-zero bytes, with no zstd estimate."""
    import numpy as np

    from ckptvault._delta import predict as predict_module

    actual = np.zeros(256, dtype=np.float32)
    actual[:8] = 1.0  # 16 non-zero bytes
    noisy = np.random.default_rng(0).integers(1, 1 << 8, 256, dtype=np.uint32).view(np.float32)  # 256 non-zero bytes
    sparse = np.zeros_like(actual)
    sparse.view(np.uint8)[:64:4] = 3  # 16 non-zero bytes: not more than the record's own
    real = predict_module._estimate
    try:
        predict_module._estimate = lambda *args: pytest.fail("a small record needs no estimate")
        assert predict_module._raw_blocks(actual, noisy, 64 << 10) == [0]
        assert predict_module._raw_blocks(actual, sparse, 64 << 10) == []
        assert predict_module._raw_blocks(np.ones_like(actual), noisy, 64 << 10) == []  # 512 non-zero bytes of its own
    finally:
        predict_module._estimate = real


def test_a_blocks_raw_estimate_is_reused_for_later_saves_unless_the_residual_comes_close():
    """Raw estimates of a record's blocks are remembered by step and reused for RAW_REUSE steps; a residual whose
    estimate comes CLOSE to the remembered one, or an older estimate, has the block estimated again."""
    import numpy as np

    from ckptvault._delta import predict as predict_module

    block = 64 << 10
    rng = np.random.default_rng(0)
    actual = rng.standard_normal(block // 4, dtype=np.float32)
    noisy = rng.integers(0, 1 << 12, block // 4, dtype=np.uint32).view(np.float32)  # a residual: 12 low bits of noise
    random = rng.integers(0, 1 << 32, block // 4, dtype=np.uint32).view(np.float32)  # one larger than the block
    estimated = []
    real = predict_module._estimate
    known: dict[int, tuple[float, int]] = {}
    try:
        predict_module._estimate = lambda sample, itemsize: estimated.append(len(sample)) or real(sample, itemsize)

        def blocks(residual, step):
            estimated.clear()
            found = predict_module._raw_blocks(actual, residual, block, known, step)
            return found, len(estimated)

        assert blocks(noisy, 1) == ([], 2)  # the residual's estimate and the block's, remembered
        assert set(known) == {0} and known[0][1] == 1
        assert blocks(noisy, 2) == ([], 1)  # the block's reused
        assert blocks(noisy, 1 + predict_module.RAW_REUSE - 1) == ([], 1)
        assert blocks(noisy, 1 + predict_module.RAW_REUSE) == ([], 2)  # too old: estimated again
        assert known[0][1] == 1 + predict_module.RAW_REUSE
        assert blocks(random, 2 + predict_module.RAW_REUSE) == ([0], 2)  # close to the block's: estimated again
    finally:
        predict_module._estimate = real


#: a model whose embedding (200 x 96 float32: 75 KiB) is cut into a whole chunk and a shorter one, and whose next
#: weights fill one chunk each, at this chunk size (arrays of a quarter chunk and more start their own chunks)
STREAMED = {"width": 96, "chunk_size": 64 << 10}


@pytest.fixture
def streamed_families(monkeypatch):
    """The families each restore streams through the kernels slice by slice (``_restore/streamed.py``)."""
    from ckptvault._restore import predicted as predicted_module

    seen: list[list] = []
    real = predicted_module.stream

    def spy(vault, manifest, levels, index, streamed, outputs):
        seen.append([(family, {levels[n][k].path for n, k in family.order}) for family in streamed])
        return real(vault, manifest, levels, index, streamed, outputs)

    monkeypatch.setattr(predicted_module, "stream", spy)
    return seen


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_arrays_cut_into_chunks_stream_through_the_kernels_bit_exact(tmp_path, name, streamed_families):
    make_opt, scheduler = OPTIMIZERS[name]
    saved, mgr = _train(make_opt, 6, tmp_path / "v", scheduler=scheduler, **STREAMED)
    mgr.close()
    with CheckpointManager(tmp_path / "v") as fresh:
        for step in saved:
            _assert_same(fresh.restore(step), saved[step])
    deepest = streamed_families[-1]  # step 6: five levels back to the keyframe
    paths = {path for _family, family_paths in deepest for path in family_paths}
    assert "model.0.weight" in paths and "model.3.weight" in paths
    embedding = next(family for family, family_paths in deepest if "model.0.weight" in family_paths)
    assert len(embedding.slices) == 2 and embedding.slices[-1] == (64 << 10, 200 * 96 * 4)  # the last slice shorter
    assert max(n for n, _k in embedding.order) == 5
    assert "model.0.bias" not in paths  # packed with other small arrays: rebuilt level by level, beside


def test_a_streamed_restore_of_part_of_the_state_and_into_live_objects_is_exact(tmp_path, streamed_families):
    saved, mgr = _train(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.1), 5, tmp_path / "v",
                        **STREAMED)
    with mgr:
        weights = mgr.restore(5, keys="model.*")  # the moments the weights are predicted from, rebuilt aside
        _assert_same(weights["model"], saved[5]["model"])
        assert "optimizer" not in weights
        model = _model(seed=7, width=96)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        mgr.restore(5, into={"model": model, "optimizer": opt})  # rebuilt in the live tensors' memory
        _assert_same(model.state_dict(), saved[5]["model"])
        _assert_same(opt.state_dict()["state"], saved[5]["optimizer"]["state"])
    assert len(streamed_families) >= 2 and all(streamed_families)


def test_a_streamed_prediction_that_differs_fails_the_restore_loudly(tmp_path, streamed_families):
    saved, mgr = _train(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), 3, tmp_path / "v", **STREAMED)
    with mgr:
        body = mgr.manifest(3)
        record = next(t for t in body["tensors"] if t["path"] == "model.0.weight")
        record["predict"]["scalars"]["eps"] *= 2
        mgr.vault.store.put(manifest_key(3), encode_manifest(body))
        with pytest.raises(PredictionError, match=r"step 3: 'model.0.weight', stored as the residual against its prediction "
                                                  r"\(adam-param-1\) from step 2, does not restore to the bytes"):
            mgr.restore(3)
        assert streamed_families
        _assert_same(mgr.restore(2), saved[2])


def test_a_swapped_residual_chunk_fails_the_streamed_restore_naming_the_chunk(tmp_path, streamed_families, monkeypatch):
    """The residual chunks of a predicted output are checked through its digest, not hashed as they are read: a chunk
    object swapped for another that decodes to as many bytes is still named as corrupt, not blamed on the
    prediction. Chunks of records returned as they are stored are hashed on read as always."""
    from ckptvault._vault import Vault

    saved, mgr = _train(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), 3, tmp_path / "v", **STREAMED)
    with mgr:
        body = mgr.manifest(3)
        record = next(t for t in body["tensors"] if t["path"] == "model.0.weight")
        assert "predict" in record
        level = next(t for t in _chain(mgr, 3)[0]["tensors"] if t["path"] == "model.0.weight")
        residual, other = (body["chunks"][r["pieces"][0][0]]["id"] for r in (record, level))
        checked: dict[str, set[bool]] = {}
        real = Vault.read_chunk

        def noting(self, cid, **kwargs):
            checked.setdefault(cid, set()).add(kwargs.get("verify", True))
            return real(self, cid, **kwargs)

        monkeypatch.setattr(Vault, "read_chunk", noting)
        _assert_same(mgr.restore(3), saved[3])
        unverified = {cid for cid, flags in checked.items() if False in flags}
        as_stored = {body["chunks"][p[0]]["id"] for t in body["tensors"] if "predict" not in t for p in t["pieces"]}
        assert residual in unverified and other in unverified  # the residual, and an input from the level below
        assert all(True in checked[cid] for cid in as_stored if cid in checked)
        _swap_and_restore(mgr, tmp_path / "v", residual, other)


@pytest.mark.parametrize("level", [1, 2])
def test_a_swapped_input_chunk_fails_the_streamed_restore_naming_the_chunk(tmp_path, streamed_families, level):
    """The chunks of a prediction's inputs (a record of the chain's levels below) are checked through the digests
    of the outputs they feed, not hashed as they are read: one swapped for another valid object of as many bytes
    is named as corrupt, not blamed on the prediction."""

    saved, mgr = _train(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), 3, tmp_path / "v", **STREAMED)
    with mgr:
        body = mgr.manifest(3)
        below = next(t for t in _chain(mgr, 3)[level - 1]["tensors"] if t["path"] == "model.0.weight")
        chunks = body["chunks"]
        swapped, raw = chunks[below["pieces"][0][0]]["id"], chunks[below["pieces"][0][0]]["raw"]
        other = next(c["id"] for c in chunks if c["raw"] == raw and c["id"] != swapped)
        _swap_and_restore(mgr, tmp_path / "v", swapped, other)
        assert streamed_families


def _swap_and_restore(mgr: CheckpointManager, vault: Path, swapped: str, other: str) -> None:
    """Replace chunk object ``swapped`` by ``other``'s (valid, as many raw bytes): restoring step 3 names it."""
    from ckptvault._format.chunk_object import chunk_key

    path = vault / chunk_key(swapped)
    path.chmod(0o644)
    path.write_bytes((vault / chunk_key(other)).read_bytes())
    with pytest.raises(CorruptChunkError, match=rf"chunk {swapped} is corrupt \(needed by step 3, tensor "
                                                r"'model.0.weight'\): BLAKE3 hash"):
        mgr.restore(3)


def test_a_damaged_chunk_of_a_chain_level_fails_the_streamed_restore_naming_it(tmp_path, streamed_families):
    from ckptvault._format.chunk_object import chunk_key

    saved, mgr = _train(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), 3, tmp_path / "v", **STREAMED)
    with mgr:
        body = mgr.manifest(3)
        level = next(t for t in _chain(mgr, 3)[1]["tensors"] if t["path"] == "model.0.weight")  # step 1's, a keyframe
        cid = body["chunks"][level["pieces"][1][0]]["id"]
        path = tmp_path / "v" / chunk_key(cid)
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.chmod(0o644)
        path.write_bytes(bytes(data))
        with pytest.raises(CorruptChunkError, match=rf"chunk {cid} is corrupt \(needed by step 3, tensor "
                                                    r"'model.0.weight'\)"):
            mgr.restore(3)
        assert streamed_families


def test_slices_hashed_as_they_finish_in_any_order_give_the_whole_arrays_digest():
    import random
    import threading

    import blake3
    import numpy as np

    from ckptvault._restore.streamed import _InOrder

    data = np.random.default_rng(0).integers(0, 255, 10_000, dtype=np.uint8)
    slices = [(lo, min(lo + 1024, len(data))) for lo in range(0, len(data), 1024)]
    hashed = _InOrder(data, slices)
    order = list(range(len(slices)))
    random.Random(0).shuffle(order)
    threads = [threading.Thread(target=hashed.finished, args=(j,)) for j in order]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert hashed.hexdigest() == blake3.blake3(data.data).hexdigest()


def test_the_restore_chain_is_stored_in_chunks_once_per_level_and_named_by_reference(tmp_path):
    saved, mgr = _train(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), 8, tmp_path / "v")
    with mgr:
        bodies = {step: mgr.manifest(step) for step in saved}
        for step in range(2, 9):
            body = bodies[step]
            assert "chain-chunks" in body["requires"]
            assert all(set(level) == {"step", "pieces"} for level in body["chain"])
            newest = {body["chunks"][c]["id"] for c, _offset, _length in body["chain"][0]["pieces"]}
            assert all(body["chunks"][c]["new"] for c, *_ in body["chain"][0]["pieces"])  # written by this save
            if step > 2:  # the levels before it pass on by reference: the same chunks, not written again
                previous = bodies[step - 1]
                assert body["chain"][1:] == previous["chain"]
                assert newest.isdisjoint({c["id"] for c in previous["chunks"]})
        sizes = {step: len(jsontext.dumps(body)) for step, body in bodies.items()}  # as JSON, not packed
        assert sizes[8] < 1.3 * sizes[2]  # seven levels deep, the manifest is about as large as at one
        levels = _chain(mgr, 8)
        assert [level["step"] for level in levels] == [7, 6, 5, 4, 3, 2, 1]
        assert mgr.verify().ok
        for step in saved:
            _assert_same(mgr.restore(step), saved[step])


def test_a_process_reads_and_checks_each_chain_level_once(tmp_path, monkeypatch):
    """Every later manifest of a chain names the same levels: restoring steps 7 and then 8 (or verifying them all)
    reads and checks each level's bytes once in a process, and the prediction inputs of every manifest still."""
    from ckptvault._format import schema
    from ckptvault._restore import chain

    saved, mgr = _train(_adamw, 8, tmp_path / "v")
    checked, inputs = [], []
    real_level, real_inputs = schema.check_chain_level, schema.check_chain_inputs
    monkeypatch.setattr(chain, "_CHECKED", chain.Remembered(chain.LEVELS_KEPT))  # none from other tests
    monkeypatch.setattr(chain, "check_chain_level", lambda m, n, *a: checked.append(m.chain[n].step) or real_level(m, n, *a))
    monkeypatch.setattr(chain, "check_chain_inputs", lambda m, *a: inputs.append(m.step) or real_inputs(m, *a))
    with mgr:
        _assert_same(mgr.restore(7), saved[7])
        assert sorted(checked) == [1, 2, 3, 4, 5, 6] and inputs == [7]
        _assert_same(mgr.restore(8), saved[8])
        assert sorted(checked) == [1, 2, 3, 4, 5, 6, 7] and inputs == [7, 8]  # level 7 is new to step 8's chain
        assert mgr.verify().ok
        assert sorted(checked) == [1, 2, 3, 4, 5, 6, 7] and inputs[2:] == [2, 3, 4, 5, 6, 7, 8]


def test_a_remembered_level_whose_chunks_do_not_fit_a_manifest_is_checked_again_and_refused(tmp_path):
    """A manifest naming a remembered level's bytes, but a chunk table its records do not fit (shorter chunks), is
    checked in full, as without the memo: CorruptManifestError naming the record's piece."""
    from dataclasses import replace as replaced

    from ckptvault._restore.chain import with_chain

    _saved, mgr = _train(_adamw, 3, tmp_path / "v")
    with mgr:
        manifest = mgr.vault.read_manifest(3)
        whole = with_chain(mgr.vault, manifest)  # remembers the levels of steps 2 and 1
        used = whole.chain[0].tensors[0].pieces[0].chunk  # a chunk a record of the newest level reads
        shrunk = tuple(replaced(c, raw=c.raw // 2) if i == used else c for i, c in enumerate(manifest.chunks))
        with pytest.raises(CorruptManifestError, match=r"field chain\[0\]\.tensors\[\d+\]\.pieces\[0\] bytes \d+\.\.\d+ "
                                                       rf"lie outside chunk {used} of {shrunk[used].raw} bytes"):
            with_chain(mgr.vault, replaced(manifest, chunks=shrunk))


def test_a_manifest_holding_its_chain_inline_still_restores_and_chains_on(tmp_path):
    """Manifests written before levels were stored in chunks hold each level's records inline; they restore, and
    a checkpoint predicted from one names its new level in chunks and passes the inline levels on."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    saved = {}
    with CheckpointManager(tmp_path / "v", async_save=False, delta=DeltaOptions(predict=True)) as mgr:
        for step in range(1, 6):
            model(torch.arange(8)).sum().backward()
            opt.step()
            opt.zero_grad()
            saved[step] = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict()})
            mgr.save(step, saved[step])
            if step == 4:  # as an earlier ckptvault wrote it: the same manifest, its chain inline
                body = mgr.manifest(4)
                body["chain"] = _chain(mgr, 4)
                body["requires"].remove("chain-chunks")
                mgr.vault.store.put(manifest_key(4), encode_manifest(body))
                assert all("tensors" in level for level in mgr.manifest(4)["chain"])
        chain = mgr.manifest(5)["chain"]
        assert "pieces" in chain[0] and len(chain) == 4 and all("tensors" in level for level in chain[1:])
        for step in saved:
            _assert_same(mgr.restore(step), saved[step])


def test_a_damaged_or_forged_chain_level_fails_the_restore_naming_it(tmp_path):
    from ckptvault._format.chunk_object import ChunkHeader, chunk_id, chunk_key, encode_object

    saved, mgr = _train(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), 3, tmp_path / "v")
    with mgr:
        body = mgr.manifest(3)
        index = body["chain"][0]["pieces"][0][0]
        level = _chain(mgr, 3)[0]
        forged = json.dumps({**level, "step": 999}).encode()  # hash-correct, but not the level the manifest names
        cid = chunk_id(forged)
        mgr.vault.store.put(chunk_key(cid), encode_object(ChunkHeader(codec=[], raw=len(forged)), forged))
        body["chunks"][index] = {"id": cid, "raw": len(forged), "stored": len(forged) + 64, "new": True}
        body["chain"][0]["pieces"] = [[index, 0, len(forged)]]
        mgr.vault.store.put(manifest_key(3), encode_manifest(body))
        with pytest.raises(CorruptManifestError, match=r"manifest manifests/0+3\.json in .*: field chain\[0\]\.step "
                                                       r"is 999, but the manifest lists the level as step 2"):
            mgr.restore(3)
        assert any("chain[0].step is 999" in problem for problem in mgr.verify(3).problems[3])

        path = tmp_path / "v" / chunk_key(cid)
        path.chmod(0o644)
        path.write_bytes(path.read_bytes()[:-1] + b"!")
        with pytest.raises(CorruptChunkError, match=rf"chunk {cid} is corrupt \(needed by step 3, tensor 'restore "
                                                    r"chain level 0 \(step 2\)'\)"):
            mgr.restore(3)
        _assert_same(mgr.restore(2), saved[2])


def test_a_predicted_checkpoint_copied_to_another_vault_restores_there(tmp_path):
    saved, mgr = _train(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), 5, tmp_path / "v")
    mgr.close()
    ckptvault.copy_checkpoints(tmp_path / "v", tmp_path / "copy", steps=[5])
    with CheckpointManager(tmp_path / "copy") as copy:
        assert copy.steps() == [5] and copy.verify().ok
        _assert_same(copy.restore(5), saved[5])


@pytest.mark.parametrize(("edit", "error", "message"), [
    (lambda body: body["chain"][0].update(pieces=[[len(body["chunks"]), 0, 10]]), CorruptManifestError,
     r"field chain\[0\]\.pieces\[0\]"),
    (lambda body: body["chain"][0].update(pieces=[]), CorruptManifestError,
     r"field chain\[0\]\.pieces must hold 1 to 268435456 bytes"),
    (lambda body: body["requires"].remove("chain-chunks"), CorruptManifestError,
     r"field requires does not name 'chain-chunks', but chain\[0\] is stored in chunks"),
    (lambda body: body["chain"][0].update(pieces=[body["chain"][0]["pieces"][0][:2] + [5]]), CorruptManifestError,
     r"manifest .* chain\[0\] is not valid JSON"),
    (lambda body: body["requires"].append("chain-chunks-2"), FormatVersionError, r"upgrade ckptvault"),
])
def test_a_manifest_whose_chain_levels_are_not_what_it_names_is_refused(tmp_path, edit, error, message):
    _saved, mgr = _train(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), 3, tmp_path / "v")
    with mgr:
        body = mgr.manifest(3)
        edit(body)
        mgr.vault.store.put(manifest_key(3), encode_manifest(body))
        with pytest.raises(error, match=message):
            mgr.restore(3)


def test_predictions_that_read_each_other_are_refused_as_a_cycle(tmp_path):
    """A forged manifest whose first moment is predicted from the second moment that is predicted from it."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with CheckpointManager(tmp_path / "v", async_save=False, delta=DeltaOptions(predict=True)) as mgr:
        for step in (1, 2):
            model(torch.randn(3, 8)).sum().backward()
            opt.step()
            mgr.save(step, {"model": model.state_dict(), "optimizer": opt.state_dict()})
        body = mgr.manifest(2)
        records = {t["path"]: t for t in body["tensors"]}
        second = records["optimizer.state.0.exp_avg_sq"]
        assert ["m1", 0, "optimizer.state.0.exp_avg"] in second["predict"]["inputs"]
        records["optimizer.state.0.exp_avg"]["predict"]["inputs"] = [["x0", 0, second["path"]]]
        mgr.vault.store.put(manifest_key(2), encode_manifest(body))
        with pytest.raises(CorruptManifestError, match=r"step 2: the predictions of 'optimizer.state.0.exp_avg' form a cycle"):
            mgr.restore(2)
        assert set(mgr.restore(1)) == {"model", "optimizer"}  # the step it was predicted from is untouched


def _first_predicted(body: dict, op: str = "adam-sq-1") -> dict:
    return next(t for t in body["tensors"] if t.get("predict", {}).get("op") == op)


@pytest.mark.parametrize(("edit", "error", "message"), [
    (lambda b: _first_predicted(b)["predict"].update(op="adam-sq-9"), CorruptManifestError,
     r"predict\.op is 'adam-sq-9', not one of the predictions format version 1 defines \(same-1, scale-1, "),
    (lambda b: _first_predicted(b)["predict"].update(op=7), CorruptManifestError,
     r"predict\.op must be a string, not"),
    (lambda b: _first_predicted(b)["predict"].pop("digest"), CorruptManifestError, r"predict\.digest is missing"),
    (lambda b: _first_predicted(b)["predict"].update(digest="AB" * 32), CorruptManifestError,
     r"predict\.digest is not a BLAKE3 hex digest"),
    (lambda b: _first_predicted(b)["predict"].update(digest="ab" * 31), CorruptManifestError,
     r"predict\.digest is not a BLAKE3 hex digest"),
    (lambda b: _first_predicted(b)["predict"]["inputs"].pop(), CorruptManifestError,
     r"predict\.inputs name roles \['m0', 'v0'\]; adam-sq-1 takes \['m0', 'm1', 'v0'\]"),
    (lambda b: _first_predicted(b)["predict"]["inputs"][0].pop(), CorruptManifestError,
     r"predict\.inputs\[0\] is not \[role, level, path\]"),
    (lambda b: _first_predicted(b)["predict"]["inputs"][0].__setitem__(1, 2), CorruptManifestError,
     r"predict\.inputs\[0\]\[1\] is 2, outside 0\.\.1"),
    (lambda b: _first_predicted(b)["predict"]["inputs"][0].__setitem__(2, "model.nowhere"), CorruptManifestError,
     r"predict\.inputs name 'model\.nowhere' 1 level\(s\) back, which the manifest does not hold with the record's "
     r"dtype and shape"),
    (lambda b: _first_predicted(b)["predict"]["scalars"].pop("b2"), CorruptManifestError,
     r"predict\.scalars name \['b1', 'one_minus_b1', 'one_minus_b2'\]; adam-sq-1 takes "
     r"\['b1', 'b2', 'one_minus_b1', 'one_minus_b2'\]"),
    (lambda b: _first_predicted(b)["predict"]["scalars"].update(b2="0.95"), CorruptManifestError,
     r"predict\.scalars\.b2 must be a finite number, not '0\.95'"),
    (lambda b: _first_predicted(b)["predict"].update(block=0), CorruptManifestError,
     r"predict\.block is 0, outside >= 1"),
    (lambda b: _first_predicted(b)["predict"].update(raw_blocks=[-1]), CorruptManifestError,
     r"predict\.raw_blocks\[0\] is -1, outside >= 0"),
    (lambda b: _first_predicted(b)["predict"].pop("from_step"), CorruptManifestError, r"predict\.from_step is missing"),
    (lambda b: _first_predicted(b).update(dtype="int32"), CorruptManifestError,
     r"predict is on a record of dtype int32; predictions are only of float32, float64"),
    (lambda b: b["requires"].remove("predicted"), CorruptManifestError,
     r"field requires does not name 'predicted', but records are predicted"),
    (lambda b: _first_predicted(b)["predict"].update(residual="rle"), CorruptManifestError,
     r"predict\.residual is 'rle', not one of the residuals format version 1 defines \(xor, diff\)"),
    (lambda b: _first_predicted(b)["predict"].update(residual=2), CorruptManifestError,
     r"predict\.residual must be a string, not"),
    (lambda b: b["requires"].remove("residual-diff"), CorruptManifestError,
     r"field requires does not name 'residual-diff', but tensors\[\d+\] is stored as a 'diff' residual"),
])
def test_a_malformed_prediction_in_a_manifest_is_refused_naming_the_field(tmp_path, edit, error, message):
    """Each check of a record's ``"predict"`` entry and of its inputs (a forged manifest, or one from a newer
    ckptvault): a typed error naming the manifest and the field, raised before anything is restored."""
    _saved, mgr = _train(lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3), 3, tmp_path / "v")
    with mgr:
        body = mgr.manifest(3)
        edit(body)
        mgr.vault.store.put(manifest_key(3), encode_manifest(body))
        with pytest.raises(error, match=rf"manifest manifests/0+3\.json in .*: field tensors\[\d+\]\.{message}"
                           if message.startswith("predict") else message):
            mgr.restore(3)


def test_a_prediction_on_a_lossy_record_is_refused(tmp_path):
    """A forged ``"predict"`` entry on a record stored lossily (predictions are of exact bytes only)."""
    with CheckpointManager(tmp_path / "v", async_save=False, codec_rules={"w": "fp16"}) as mgr:
        mgr.save(1, {"w": torch.randn(256), "x": torch.randn(256)})
        body = mgr.manifest(1)
        record = next(t for t in body["tensors"] if t["path"] == "w")
        assert record["lossy"]["codec"] == "fp16"
        record["predict"] = {"op": "same-1", "inputs": [["x0", 0, "x"]], "scalars": {}, "digest": "ab" * 32,
                             "block": 4096, "raw_blocks": [], "from_step": 1}
        body["requires"].append("predicted")
        mgr.vault.store.put(manifest_key(1), encode_manifest(body))
        with pytest.raises(CorruptManifestError, match=r"manifest manifests/0+1\.json in .*: field tensors\[\d+\]\."
                                                       r"predict is on a lossy record"):
            mgr.restore(1)
