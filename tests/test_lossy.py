"""Lossy compression: bf16, fp16, block int8 and int8 weight residuals, chosen per tensor by rules.

States come from a real small GPT trained with AdamW; saves go into real local vaults. What restore returns
is checked three ways: against the exact values (per-element error bounds of each codec), against an
independent numpy decoding of the bytes the vault stored (restore gives exactly what the manifest
promises, deltas included), and the manifest's recorded error against the error recomputed here in float64.
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckptvault
from ckptvault import CheckpointManager
from ckptvault._codecs import lossy, lossy_kernels
from ckptvault._maintenance.gc import collect
from ckptvault._reports.diff import diff_steps
from ckptvault._restore.tensors import read_into
from ckptvault._save.lossy import LossyBuffers
from ckptvault._tree import leaf_paths
from ckptvault.demo.data import batch, stdlib_bytes
from ckptvault.demo.model import GPT, GPTConfig
from ckptvault.errors import InvalidArgumentError, LossyCodecError
from ckptvault.rules import CodecRules
from conftest import assert_same_state, manifest_files

CFG = GPTConfig(seq_len=32, d_model=64, n_layer=2, n_head=2)
STEPS = 8
CHUNK = 64 << 10  # the smallest chunks: tensors of the GPT span or share a few, so deltas have chunks to work on


@pytest.fixture(scope="module")
def run() -> list[dict[str, Any]]:
    """Deep copies of a small GPT + AdamW training state after each of STEPS steps (lr 1e-3: weights move)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only wait for each other on a shared machine
    try:
        torch.manual_seed(0)
        model = GPT(CFG)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        data, gen = stdlib_bytes(1 << 20), torch.Generator().manual_seed(0)
        states = []
        for step in range(STEPS):
            x, y = batch(data, 4, CFG.seq_len, gen)
            opt.zero_grad(set_to_none=True)
            model.loss(x, y).backward()
            opt.step()
            states.append(copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}))
        return states
    finally:
        torch.set_num_threads(threads)


def leaves(state: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state by dotted key path."""
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, (list, tuple)) else ()
    out: dict[str, torch.Tensor] = {}
    for key, value in items:
        out.update(leaves(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def save_all(root: Path, states: dict[int, Any], rules: Any, **kwargs: Any) -> CheckpointManager:
    """Save ``states`` (step -> state) in order into a new vault; returns the open manager (caller closes)."""
    mgr = CheckpointManager(root, codec_rules=rules, chunk_size=CHUNK, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # fallbacks are tested on their own below
        for step, state in states.items():
            mgr.save(step, state)
        mgr.wait()
    return mgr


def records(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Key path -> tensor record, tied aliases included (``model.head.weight`` is ``model.tok.weight``)."""
    tensors = manifest["tensors"]
    return {path: tensors[next(iter(node.values()))] for path, node in leaf_paths(manifest["tree"]).items()
            if next(iter(node)) in ("tensor", "ndarray")}


def codec_of(record: dict[str, Any]) -> str:
    return (record.get("lossy") or {}).get("codec", "lossless")


# -- an independent decoder of what the vault stored ------------------------------------------------------
def stored_bytes(mgr: CheckpointManager, manifest: dict[str, Any], key: Any, nbytes: int) -> np.ndarray:
    buf = np.empty(nbytes, np.uint8)
    read_into(mgr.vault, mgr.vault.read_manifest(manifest["step"]), {key: memoryview(buf)})
    return buf


def decode_stored(mgr: CheckpointManager, step: int) -> dict[str, np.ndarray]:
    """float32 values of every lossy float32 tensor of ``step``, decoded with numpy from its stored bytes."""
    manifest = mgr.manifest(step)
    tensors = manifest["tensors"]
    out = {}
    for i, rec in enumerate(tensors):
        codec = codec_of(rec)
        if codec == "lossless" or rec["kind"] == "part":
            continue
        assert rec["dtype"] == "float32"
        data = stored_bytes(mgr, manifest, i, rec["nbytes"])
        if codec == "bf16":
            values = (data.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif codec == "fp16":
            values = data.view(np.float16).astype(np.float32)
        else:
            j = rec["lossy"]["parts"]["scale"]
            scale = stored_bytes(mgr, manifest, j, tensors[j]["nbytes"]).view(np.float32)
            values = data.view(np.int8).astype(np.float32) * np.repeat(scale, rec["lossy"]["block"])[: data.size]
            if codec == "residual-int8":
                values = stored_bytes(mgr, manifest, ("base", i), 4 * data.size).view(np.float32) + values
        out[rec["path"]] = values.reshape(rec["shape"])
    return out


def errors_of(exact: torch.Tensor, restored: torch.Tensor) -> dict[str, float]:
    """The lossy error statistics, recomputed in float64 with numpy."""
    a, b = exact.double().numpy().ravel(), restored.double().numpy().ravel()
    d = b - a
    nonzero = a != 0
    return {"max_abs": float(np.abs(d).max()) if d.size else 0.0,
            "rel_l2": float(np.linalg.norm(d) / np.linalg.norm(a)) if np.any(nonzero) else float(np.linalg.norm(d)),
            "flushed": float((nonzero & (b == 0)).sum() / max(int(nonzero.sum()), 1))}


def int8_bound(x: np.ndarray, block: int) -> np.ndarray:
    """Per element: half the quantisation step of its block (absmax / 127 / 2), in float64."""
    flat = x.astype(np.float64).ravel()
    padded = np.pad(np.abs(flat), (0, -flat.size % block)).reshape(-1, block)
    return np.repeat(padded.max(axis=1) / 127 / 2, block)[: flat.size]


# -- each codec's error bound -----------------------------------------------------------------------------
def test_bf16_is_within_half_an_ulp_and_restores_float32(run: list[dict[str, Any]], tmp_path: Path) -> None:
    with save_all(tmp_path / "v", {3: run[3]}, {"*": "bf16"}) as mgr:
        restored = mgr.restore(3)
        manifest = mgr.manifest(3)
    exact, got = leaves(run[3]), leaves(restored)
    assert restored["step"] == 3
    for path, x in exact.items():
        r = got[path]
        assert r.dtype == x.dtype == torch.float32 and r.shape == x.shape, path
        assert codec_of(records(manifest)[path]) == "bf16", path
        a, b = x.double(), r.double()
        normal = a.abs() >= 2.0**-126
        assert torch.all((b - a).abs()[normal] <= 2.0**-8 * a.abs()[normal]), path
        assert torch.all(b[a == 0] == 0), path
    assert (exact["model.tok.weight"] != got["model.tok.weight"]).any(), "bf16 changed nothing: the test could not fail"


def test_fp16_error_bound_on_weights_and_exact_optimizer(run: list[dict[str, Any]], tmp_path: Path) -> None:
    with save_all(tmp_path / "v", {3: run[3]}, {"model.*": "fp16"}) as mgr:
        restored = mgr.restore(3)
    assert_same_state(run[3]["optimizer"], restored["optimizer"])
    for path, x in leaves(run[3]["model"]).items():
        r = restored["model"][path]
        assert r.dtype == torch.float32 and r.shape == x.shape
        a, b = x.double(), r.double()
        normal = a.abs() >= 2.0**-14
        assert torch.all((b - a).abs()[normal] <= 2.0**-11 * a.abs()[normal]), path
        assert torch.all((b - a).abs()[~normal] <= 2.0**-25), path  # fp16 subnormals: spacing 2^-24


@pytest.mark.parametrize("block", [64, 100])  # 100 divides no tensor size here: partial last blocks
def test_int8_block_error_is_at_most_half_a_step(run: list[dict[str, Any]], tmp_path: Path, block: int) -> None:
    with save_all(tmp_path / "v", {3: run[3]}, {"*": f"int8-block:{block}"}, max_flushed=1.0) as mgr:
        restored, manifest = mgr.restore(3), mgr.manifest(3)
    for path, x in leaves(run[3]).items():
        rec = records(manifest)[path]
        assert (codec_of(rec), rec["lossy"]["block"], rec["lossy"]["stored_dtype"]) == ("int8-block", block, "int8")
        a, b = x.double().numpy().ravel(), restored_leaf(restored, path).double().numpy().ravel()
        assert np.all(np.abs(b - a) <= int8_bound(a, block) * (1 + 1e-5) + 2.0**-22 * np.abs(a)), path


def restored_leaf(state: Any, path: str) -> torch.Tensor:
    return leaves(state)[path]


@pytest.mark.parametrize("codec", ["bf16", "fp16", "int8-block:64", "residual-int8:64"])
def test_recorded_errors_match_the_restored_tensors(run: list[dict[str, Any]], tmp_path: Path, codec: str) -> None:
    states = {0: run[0], 5: run[5]}  # step 0 is the keyframe a residual is against
    with save_all(tmp_path / "v", states, {"model.*": codec}, max_flushed=1.0) as mgr:
        restored, manifest, info = mgr.restore(5), mgr.manifest(5), mgr.info(5)
    by_path = {t.path: t for t in info.tensors}
    checked = 0
    for path, x in leaves(run[5]["model"]).items():
        path = f"model.{path}"
        rec = records(manifest)[path]
        assert codec_of(rec) == codec.split(":")[0], path
        recorded, mine = rec["lossy"]["error"], errors_of(x, restored_leaf(restored, path))
        assert recorded["max_abs"] == pytest.approx(mine["max_abs"], rel=1e-6, abs=1e-12), path
        assert recorded["rel_l2"] == pytest.approx(mine["rel_l2"], rel=1e-3, abs=1e-12), path
        assert recorded["flushed"] == pytest.approx(mine["flushed"], abs=1e-12), path
        assert (recorded["overflow"], recorded["nan"]) == (0, 0)
        assert by_path[rec["path"]].error == recorded and by_path[rec["path"]].codec.startswith(codec.split(":")[0])
        checked += mine["max_abs"] > 0
    assert checked, "no tensor changed: the comparison could not fail"


# -- residuals ------------------------------------------------------------------------------------------
def test_residual_error_follows_movement_and_never_accumulates(run: list[dict[str, Any]], tmp_path: Path) -> None:
    """Every checkpoint is int8(w_j - w_0) against the exact keyframe: its error is bounded by its own
    quantisation step however many checkpoints lie between it and the keyframe. (DESIGN L3)"""
    rules = {"model.*": "residual-int8:64"}
    with save_all(tmp_path / "v", dict(enumerate(run)), rules, keyframe_every=STEPS) as mgr:
        assert_same_state(run[0], mgr.restore(0))  # the keyframe holds the weights exactly
        exact0 = {p: t.double().numpy().ravel() for p, t in leaves(run[0]["model"]).items()}
        for j in (7, 1, 4, 7, 3):  # out of order and repeated: each restore stands alone
            manifest, restored = mgr.manifest(j), mgr.restore(j)
            assert_same_state(run[j]["optimizer"], restored["optimizer"])
            worst = 0.0
            for path, x in leaves(run[j]["model"]).items():
                rec = records(manifest)[f"model.{path}"]
                assert (codec_of(rec), rec["lossy"]["base_step"]) == ("residual-int8", 0)
                a, b = x.double().numpy().ravel(), restored["model"][path].double().numpy().ravel()
                moved = a - exact0[path]
                bound = int8_bound(moved, 64) * (1 + 1e-5) + 2.0**-23 * (np.abs(a) + np.abs(moved))
                assert np.all(np.abs(b - a) <= bound), (j, path)
                if np.abs(moved).max() > 0:
                    worst = max(worst, np.abs(b - a).max() / np.abs(moved).max())
            assert 0 < worst <= 1 / 254 + 1e-4, j  # relative to the movement: the same at j=1 and j=7


def test_residual_is_much_smaller_than_int8_of_the_weights(run: list[dict[str, Any]], tmp_path: Path) -> None:
    with save_all(tmp_path / "r", {0: run[0], 1: run[1]}, {"model.*": "residual-int8:64"}) as mgr:
        residual = records(mgr.manifest(1))
        exact_bytes = sum(t.stored_bytes for t in mgr.info(0).tensors if t.path.startswith("model."))
        residual_bytes = sum(t.stored_bytes for t in mgr.info(1).tensors if t.path.startswith("model."))
    with save_all(tmp_path / "q", {1: run[1]}, {"model.*": "int8-block:64"}, max_flushed=1.0) as mgr:
        direct = records(mgr.manifest(1))
    matrices = [p for p, r in residual.items() if p.startswith("model.") and len(r["shape"]) == 2]
    assert len(matrices) > 8
    for path in matrices:  # (a LayerNorm bias starts at 0: its movement is its value, and the gain is small)
        assert residual[path]["lossy"]["error"]["max_abs"] < direct[path]["lossy"]["error"]["max_abs"] / 10, path
    assert residual_bytes < 0.35 * exact_bytes


def test_residuals_survive_deleting_the_keyframe_and_gc(run: list[dict[str, Any]], tmp_path: Path) -> None:
    """A residual's chunk table names the keyframe copy's chunks: gc keeps them once the keyframe is deleted (DESIGN L4)."""
    with save_all(tmp_path / "v", {0: run[0], 1: run[1], 2: run[2]}, {"model.*": "residual-int8"}) as mgr:
        before = mgr.restore(2)
        mgr.delete(0)
        plan, _result = collect(mgr.vault, grace=0)
        assert plan.candidates, "gc found nothing to delete: the keyframe's own chunks should have gone"
        assert_same_state(before, mgr.restore(2))
        assert mgr.verify(2).ok
        mgr.save(3, run[3]).wait()  # no keyframe left: a new one, stored exactly
        assert "lossy" not in records(mgr.manifest(3))["model.tok.weight"]


# -- restore: dtype, shape, into=, keys= -------------------------------------------------------------------
def test_restore_into_live_model_and_optimizer_in_place(run: list[dict[str, Any]], tmp_path: Path) -> None:
    with save_all(tmp_path / "v", {0: run[0], 4: run[4]}, "residual") as mgr:
        expected = mgr.restore(4)
        torch.manual_seed(1)
        model = GPT(CFG)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model.loss(*batch(stdlib_bytes(1 << 20), 2, CFG.seq_len, torch.Generator().manual_seed(3))).backward()
        opt.step()  # creates the optimizer state to restore into
        weight = model.blocks[0].mlp[0].weight
        pointer = weight.data_ptr()
        mgr.restore(4, into={"model": model.state_dict(), "optimizer": opt.state_dict()})
        part = mgr.restore(4, keys=["optimizer.state.0", "model.ln_f.weight"])
    assert weight.data_ptr() == pointer and weight.dtype == torch.float32
    assert_same_state(expected["model"], model.state_dict())
    assert_same_state(expected["optimizer"]["state"], opt.state_dict()["state"])
    assert_same_state(expected["optimizer"]["state"][0], part["optimizer"]["state"][0])
    assert_same_state(expected["model"]["ln_f.weight"], part["model"]["ln_f.weight"])
    assert not torch.equal(expected["model"]["blocks.0.mlp.0.weight"], run[4]["model"]["blocks.0.mlp.0.weight"])


# -- safety -------------------------------------------------------------------------------------------------
def test_fp16_flushing_adam_second_moments_falls_back_to_bf16(run: list[dict[str, Any]], tmp_path: Path) -> None:
    """fp16 flushing more than max_flushed of the non-zero values is unsafe and falls back to bf16 with a note (DESIGN L1, L2)."""
    with CheckpointManager(tmp_path / "v", codec_rules={"*exp_avg_sq": "fp16"}) as mgr:
        with pytest.warns(RuntimeWarning, match=r"fp16 on 'optimizer\.state\.\d+\.exp_avg_sq' is unsafe: [\d.]+% of "
                                                r"non-zero values flushed to zero \(limit 5\.0%.*\); fell back to bf16"):
            mgr.save(3, run[3]).wait()
        rec = records(mgr.manifest(3))["optimizer.state.0.exp_avg_sq"]
        info = {t.path: t for t in mgr.info(3).tensors}["optimizer.state.0.exp_avg_sq"]
        restored = mgr.restore(3)["optimizer"]["state"][0]["exp_avg_sq"]
    exact = run[3]["optimizer"]["state"][0]["exp_avg_sq"]
    assert exact.to(torch.float16).eq(0).logical_and(exact.ne(0)).float().mean() > 0.05, "fp16 would not flush"
    assert codec_of(rec) == "bf16" and info.codec == "bf16+zstd"
    assert "fell back to bf16" in rec["lossy"]["notes"][0] and info.notes == tuple(rec["lossy"]["notes"])
    assert errors_of(exact, restored)["flushed"] == 0.0 and rec["lossy"]["error"]["flushed"] == 0.0


def test_fp16_overflow_falls_back(tmp_path: Path) -> None:
    """A finite value cast to inf is unsafe: fp16 falls back to bf16 (DESIGN L1, L2)."""
    state = {"big": torch.tensor([1e5, -7e4, 1.0, 3.0]), "fine": torch.tensor([1.0, 2.0])}
    with CheckpointManager(tmp_path / "v", codec_rules={"*": "fp16"}) as mgr:
        with pytest.warns(RuntimeWarning, match=r"fp16 on 'big' is unsafe: 2 values overflowed to inf; fell back to bf16"):
            mgr.save(1, state).wait()
        restored, manifest = mgr.restore(1), mgr.manifest(1)
    assert torch.isfinite(restored["big"]).all() and restored["big"][0] == pytest.approx(1e5, rel=2**-8)
    assert (codec_of(records(manifest)["big"]), codec_of(records(manifest)["fine"])) == ("bf16", "fp16")


def test_int8_flushing_falls_back_and_max_flushed_decides(tmp_path: Path) -> None:
    """int8 flushing is unsafe beyond max_flushed and falls back to bf16; within it the result is kept (DESIGN L1, L2)."""
    values = torch.full((256,), 1e-6)
    values[0] = 1.0  # one large value per block: every small one rounds to zero
    with CheckpointManager(tmp_path / "a", codec_rules={"*": "int8-block"}) as mgr:
        with pytest.warns(RuntimeWarning, match=r"int8-block:256 on 'x' is unsafe: 99\.6% of non-zero values flushed"):
            mgr.save(1, {"x": values}).wait()
        assert codec_of(records(mgr.manifest(1))["x"]) == "bf16"
    with CheckpointManager(tmp_path / "b", codec_rules={"*": "int8-block"}, max_flushed=1.0) as mgr:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            mgr.save(1, {"x": values}).wait()
        assert codec_of(records(mgr.manifest(1))["x"]) == "int8-block"
        assert (mgr.restore(1)["x"][1:] == 0).all()


@pytest.mark.parametrize("async_save", [False, True])
def test_on_unsafe_fail_raises_with_the_path_and_commits_nothing(run: list[dict[str, Any]], tmp_path: Path,
                                                                 async_save: bool) -> None:
    """on_unsafe='fail' raises LossyCodecError naming the key path, and nothing is committed (DESIGN L2)."""
    root = tmp_path / "v"
    match = r"fp16 on 'optimizer\.state\.0\.exp_avg_sq' is unsafe: .* flushed to zero .*; choose a safer codec"
    with CheckpointManager(root, codec_rules={"*exp_avg_sq": "fp16"}, on_unsafe="fail", async_save=async_save) as mgr:
        with pytest.raises(LossyCodecError, match=match) as caught:
            mgr.save(3, run[3]).wait()
        assert isinstance(caught.value, ValueError)
        assert mgr.steps() == []
    assert manifest_files(root) == []


def test_on_unsafe_keep_keeps_and_warns(run: list[dict[str, Any]], tmp_path: Path) -> None:
    """on_unsafe='keep' stores the unsafe result with a warning and a note (DESIGN L2)."""
    with CheckpointManager(tmp_path / "v", codec_rules={"*exp_avg_sq": "fp16"}, on_unsafe="keep") as mgr:
        with pytest.warns(RuntimeWarning, match=r"exp_avg_sq' is unsafe: .*; kept because on_unsafe='keep'"):
            mgr.save(3, run[3]).wait()
        rec = records(mgr.manifest(3))["optimizer.state.0.exp_avg_sq"]
        restored = mgr.restore(3)["optimizer"]["state"][0]["exp_avg_sq"]
    exact = run[3]["optimizer"]["state"][0]["exp_avg_sq"]
    assert codec_of(rec) == "fp16" and "kept because" in rec["lossy"]["notes"][0]
    flushed = errors_of(exact, restored)["flushed"]
    assert flushed > 0.05 and rec["lossy"]["error"]["flushed"] == pytest.approx(flushed)


def test_bad_safety_settings_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=r"on_unsafe must be one of \('fallback', 'fail', 'keep'\), got 'ignore'"):
        CheckpointManager(tmp_path / "v", on_unsafe="ignore")
    with pytest.raises(InvalidArgumentError, match=r"max_flushed must be within \[0, 1\], got 2"):
        CheckpointManager(tmp_path / "v", max_flushed=2)


def test_non_float_and_numpy_values_stay_exact_under_lossy_rules(tmp_path: Path) -> None:
    state = {"ids": torch.arange(1000, dtype=torch.int64), "mask": torch.rand(300) > 0.5,
             "half": torch.randn(500).half(), "np": np.random.default_rng(0).standard_normal(400).astype(np.float32),
             "wide": torch.randn(500, dtype=torch.float64)}
    with CheckpointManager(tmp_path / "v", codec_rules={"half": "bf16", "*": "int8-block"}, max_flushed=1.0) as mgr:
        mgr.save(1, state).wait()
        restored, manifest = mgr.restore(1), mgr.manifest(1)
    for key in ("ids", "mask", "half", "np"):  # bf16 does not shrink float16; int8 needs a float tensor
        assert codec_of(records(manifest)[key]) == "lossless" and records(manifest)[key]["codec"] == "zstd", key
        assert_same_state(state[key], restored[key])
    assert codec_of(records(manifest)["wide"]) == "int8-block" and restored["wide"].dtype == torch.float64


# -- rules and presets ------------------------------------------------------------------------------------
def test_rules_first_match_wins_and_dtype_filters(tmp_path: Path) -> None:
    rules = CodecRules([("model.*", "bf16"), ("model.w", "fp16"), ("*@float64", "int8-block:32"), ("*", "lz4")], "zstd")
    assert [rules.codec_for("model.w", "float32"), rules.codec_for("x", "float64"), rules.codec_for("x", "float32")] == [
        "bf16", "int8-block:32", "lz4"]
    state = {"model": {"w": torch.randn(64)}, "a": torch.randn(64, dtype=torch.float64), "b": torch.randn(64)}
    with CheckpointManager(tmp_path / "v", codec_rules={"model": "fp16", "*@float64": "bf16", "*@float32": "lossless"}) as mgr:
        mgr.save(1, state).wait()
        got = {p: (codec_of(r), r["codec"]) for p, r in records(mgr.manifest(1)).items()}
    assert got == {"model.w": ("fp16", "zstd"), "a": ("bf16", "zstd"), "b": ("lossless", "zstd")}


@pytest.mark.parametrize("codec", ["int8", "bf16:4", "int8-block:4", "fp16+brotli", "residual", "int8-block:x"])
def test_bad_codec_names_in_rules_are_refused(tmp_path: Path, codec: str) -> None:
    with pytest.raises(InvalidArgumentError, match=r"unknown codec|takes no parameter|block size must be 8\.\.1048576"):
        CheckpointManager(tmp_path / "v", codec_rules={"*": codec})


# -- lossy and incremental together -------------------------------------------------------------------------
def test_lossy_and_deltas_compose_restore_gives_what_the_manifest_promises(run: list[dict[str, Any]],
                                                                           tmp_path: Path) -> None:
    with save_all(tmp_path / "v", dict(enumerate(run)), "moments-compact", keyframe_every=STEPS) as mgr:
        delta_lossy = 0
        for step in range(STEPS):
            manifest, restored = mgr.manifest(step), mgr.restore(step)
            decoded = decode_stored(mgr, step)
            got = leaves(restored)
            for path, exact in leaves(run[step]).items():
                rec = records(manifest)[path]
                if codec_of(rec) == "lossless":
                    assert_same_state(exact, got[path], path)
                    continue
                assert torch.equal(got[path], torch.from_numpy(decoded[path])), (step, path)
                assert all(math.isfinite(v) for v in rec["lossy"]["error"].values()), (step, path)
                chunks = manifest["chunks"]
                delta_lossy += any(chunks[c].get("base") for c, _o, _n in rec["pieces"])
            assert {codec_of(r) for p, r in records(manifest).items() if p.endswith("exp_avg_sq")} == {"bf16"}
            assert "int8-block" in {codec_of(r) for p, r in records(manifest).items() if p.endswith("exp_avg")}
        assert delta_lossy, "no lossy tensor was stored as a delta: the composition was not exercised"


def test_diff_compares_decoded_values(run: list[dict[str, Any]], tmp_path: Path) -> None:
    with save_all(tmp_path / "v", {1: run[1], 2: run[2]}, "moments-compact") as mgr:
        a, b = leaves(mgr.restore(1)), leaves(mgr.restore(2))
        result = diff_steps(mgr.vault, 1, 2)
    by_path = {t.path: t for t in result.tensors}
    assert not any("#" in p for p in by_path), "block scales are not tensors of the checkpoint"
    for path in ("optimizer.state.0.exp_avg", "optimizer.state.0.exp_avg_sq", "model.tok.weight"):
        t = by_path[path]
        assert t.max_abs_diff == pytest.approx(float((b[path].double() - a[path].double()).abs().max()), rel=1e-6)
        assert t.changed == int((b[path] != a[path]).sum()) and t.nbytes == a[path].numel() * 4


# -- the fast measurement equals the reference ----------------------------------------------------------------
def test_fast_measurement_equals_the_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    cases = {
        "zeros and -0": torch.where(torch.rand(3 << 19, generator=gen) < 0.3, torch.tensor(-0.0),
                                    torch.randn(3 << 19, generator=gen)),
        "tiny negatives": -torch.rand(70_000, generator=gen) * 1e-9,
        "below float32 square range": torch.rand(5000, generator=gen) * 1e-30,
        "fp16 overflow": torch.tensor([7e4, -1e5, 1.0] * 100),
        "inf in a block": torch.tensor([1.0, float("inf"), -2.0] * 100),
        "0-d": torch.tensor(3.25),
    }
    for name, t in cases.items():
        for spec in (lossy.LossySpec("bf16"), lossy.LossySpec("fp16"), lossy.LossySpec("int8-block", 64)):
            fast = lossy.encode(t, spec).error
            reference = lossy.measure(t, lossy.decode(spec, lossy.encode(t, spec).parts, t.dtype, list(t.shape)))
            assert fast.keys() == reference.keys()
            for key, value in reference.items():
                assert fast[key] == pytest.approx(value, rel=1e-4, nan_ok=True), (name, spec, key)
    assert lossy.encode(cases["fp16 overflow"], lossy.LossySpec("fp16")).error["overflow"] == 200
    assert lossy.encode(cases["inf in a block"], lossy.LossySpec("int8-block", 64)).error["nan"] > 0
    assert lossy.encode(cases["tiny negatives"], lossy.LossySpec("fp16")).error["flushed"] > 0.9


def test_fused_kernels_store_exactly_what_torch_stores() -> None:
    """bf16/fp16 bits equal ``Tensor.to`` on every kind of float32 (random bit patterns: NaN payloads, infs,
    subnormals; dense runs over fp16's subnormal range and its largest finite values); int8 blocks and scales
    equal the torch reference, residuals included, with a short last block."""
    gen = np.random.default_rng(5)
    patterns = [gen.integers(0, 2**32, size=1 << 20, dtype=np.uint64).astype(np.uint32),
                np.arange(0x33000000, 0x39000000, 1009, dtype=np.uint32), np.arange(0x477F0000, 0x47810000, 7, dtype=np.uint32)]
    x = torch.from_numpy(np.concatenate(patterns).view(np.float32))
    for spec, dtype in ((lossy.LossySpec("bf16"), torch.bfloat16), (lossy.LossySpec("fp16"), torch.float16)):
        assert torch.equal(lossy.encode(x, spec).parts["q"].view(torch.int16), x.to(dtype).view(torch.int16)), spec
    tgen = torch.Generator().manual_seed(5)
    values = torch.randn(100_003, generator=tgen) * torch.logspace(-20, 20, 100_003)
    base = values + torch.randn(100_003, generator=tgen) * 1e-3
    for block in (8, 256, 1000):
        for spec, expected in ((lossy.LossySpec("int8-block", block), lossy._int8_block(values, block)),
                               (lossy.LossySpec("residual-int8", block), lossy._int8_block(values - base, block))):
            fused = lossy.encode(values, spec, base)
            assert torch.equal(fused.parts["q"], expected["q"]) and torch.equal(fused.parts["scale"], expected["scale"])
            reference = lossy.measure(values, lossy.decode(spec, fused.parts, torch.float32, [100_003], base))
            assert fused.error == pytest.approx(reference, rel=1e-9), spec


@pytest.mark.parametrize("half", [False, True], ids=["bf16", "fp16"])
def test_cast_kernels_count_every_special_value_whichever_block_it_falls_in(half: bool) -> None:
    """The cast kernels count flushes in their fast pass and every other special case only in blocks (of
    ``_BLOCK`` values) whose magnitudes reach the overflow bound (or leave the float32 sums' range). Each value
    just inside or outside the flush bound (2^-25 for fp16: a tie, rounded to even, so to zero) or the overflow
    bound, alone in an otherwise ordinary block (at its start, middle or end) that gets a fast pass, is counted
    as torch's cast says, the error sums equal float64 sums of the float32 differences, and two calls split off
    a block boundary count what one call counts."""
    block = lossy_kernels._BLOCK
    flush = 0x33000000 if half else 0x00008000  # bits of the largest magnitude that may round to zero
    upper = int(lossy_kernels._OVERFLOW_HALF if half else lossy_kernels._OVERFLOW_BF16)
    edges = [flush - 1, flush, flush + 1, upper - 1, upper, upper + 1, 0x7F800000, 0x7FC00001, 0, 1]
    gen = np.random.default_rng(11)
    spacing = lossy_kernels._EXACT_RUN + 2  # after a special block, the next _EXACT_RUN are cast exactly anyway
    bits = (gen.standard_normal((spacing * len(edges) + 1) * block).astype(np.float32) * 0.02).view(np.uint32)
    for k, value in enumerate(edges):  # one edge value every ``spacing`` blocks; the blocks between stay ordinary
        position = spacing * k * block + (0, block // 2, block - 1)[k % 3]
        bits[position] = value | (0x80000000 if k % 2 else 0)
    x = torch.from_numpy(bits.view(np.float32))
    restored = x.to(torch.float16 if half else torch.bfloat16).float()
    finite = torch.isfinite(x)
    diff = (restored - x)[finite].double()  # float32 differences, summed in float64
    expected_counts = (int((finite & (x != 0)).sum()), int((finite & (x != 0) & (restored == 0)).sum()),
                       int((finite & torch.isinf(restored)).sum()), 0)
    cast = lossy_kernels.cast_fp16 if half else lossy_kernels.cast_bf16
    q = np.empty(bits.size, np.uint16)
    whole = cast(bits, q)
    assert tuple(whole[3:]) == expected_counts and expected_counts[1] >= 3 and expected_counts[2] == 2
    assert np.uint32(whole[0]).view(np.float32) == float(diff.abs().max())
    assert whole[1] == pytest.approx(float((diff * diff).sum()), rel=1e-6)  # ordinary blocks sum in float32
    assert whole[2] == pytest.approx(float((x[finite].double() ** 2).sum()), rel=1e-6)
    assert torch.equal(torch.from_numpy(q.view(np.int16)), x.to(torch.float16 if half else torch.bfloat16).view(torch.int16))
    split = 3 * block + 123
    first, second = cast(bits[:split], q[:split]), cast(bits[split:], q[split:])
    assert tuple(whole[3:]) == tuple(a + b for a, b in zip(first[3:], second[3:]))
    assert whole[1] == pytest.approx(first[1] + second[1], rel=1e-6) and whole[0] == max(first[0], second[0])


@pytest.mark.parametrize("scale", [2.0**30, 2.0**24, 2.0**23, 2.0**-71, 2.0**-72, 2.0**-110, 1e-4],
                         ids=["2^30", "2^24", "2^23", "2^-71", "2^-72", "2^-110", "1e-4"])
def test_bf16_error_sums_keep_float64_accuracy_at_every_magnitude(scale: float) -> None:
    """The fast pass sums a block's squares in float32 (scaled by 2^32), only where they stay normal and their
    sum finite (:data:`_FLOAT32_SUMS`); blocks of larger or smaller values sum in float64. At each magnitude,
    in blocks that are all such values and in one ordinary block around a single such value, the sums equal
    float64 sums of the float32 differences to 1e-6."""
    block = lossy_kernels._BLOCK
    gen = np.random.default_rng(7)
    uniform = (gen.uniform(1.0, 2.0, 4 * block) * scale).astype(np.float32)
    mixed = (gen.standard_normal(4 * block) * 0.02).astype(np.float32)
    mixed[block + 17] = np.float32(scale)
    for values in (uniform, mixed):
        x = torch.from_numpy(values)
        diff = (x.to(torch.bfloat16).float() - x).double()
        q = np.empty(values.size, np.uint16)
        sums = lossy_kernels.cast_bf16(values.view(np.uint32), q)
        assert sums[1] == pytest.approx(float((diff * diff).sum()), rel=1e-6) and sums[1] > 0
        assert sums[2] == pytest.approx(float((x.double() ** 2).sum()), rel=1e-6)
        assert tuple(sums[3:]) == (values.size, 0, 0, 0)


@pytest.mark.parametrize(("scale", "block"), [
    (2.0**30, 256), (2.0**24, 256), (2.0**23, 256), (2.0**-59, 256), (2.0**-60, 256), (2.0**-100, 256), (1e-4, 256),
    (1.5 * 2.0**23, 1 << 20), (1e-4, 1 << 13)],
    ids=["2^30", "2^24", "2^23", "2^-59", "2^-60", "2^-100", "1e-4", "2^23 in blocks of 2^20", "blocks of 2^13"])
def test_int8_error_sums_keep_float64_accuracy_at_every_magnitude(scale: float, block: int) -> None:
    """int8 blocks of at most _BLOCK values whose magnitudes lie in _INT8_FLOAT32_SUMS sum their squares in
    float32; larger blocks and other magnitudes in float64. Either way the sums equal the float64 reference
    to 1e-6, for blocks all at one magnitude and for ordinary blocks holding one such value."""
    gen = np.random.default_rng(8)
    uniform = torch.from_numpy((gen.uniform(1.0, 2.0, 2 * block) * scale).astype(np.float32))
    mixed = torch.from_numpy((gen.standard_normal(2 * block) * 0.02).astype(np.float32))
    mixed[block + 5] = scale
    spec = lossy.LossySpec("int8-block", block)
    for x in (uniform, mixed):
        encoded = lossy.encode(x, spec)
        reference = lossy.measure(x, lossy.decode(spec, encoded.parts, x.dtype, list(x.shape)))
        for key, value in reference.items():
            assert encoded.error[key] == pytest.approx(value, rel=1e-6, nan_ok=True), key


_FMAX = float(np.finfo(np.float32).max)


@pytest.mark.parametrize(("values", "base", "special"), [
    ([_FMAX, 1.0, -3.0, 0.0], None, "overflow"),  # 127 x (FLT_MAX / 127) rounds past FLT_MAX
    ([2.0**125 * 1.0000001, 1e30, -2.0, 5e-3], None, None),  # just above the bound: counted exactly
    ([2.0**125 * 0.9999999, 1e30, -2.0, 5e-3], None, None),  # just below: the fast loop
    ([_FMAX, -_FMAX * 0.5, 1.0, 0.0], [_FMAX * 0.75, _FMAX * 0.5, 1.5, 0.0], "overflow"),
    ([_FMAX * 0.9, 1.0], [-_FMAX * 0.9, 0.0], "nan"),  # the difference is -inf
    ([_FMAX, 0.0], [3.402808457402182e38, -(2.0**112)], "overflow"),  # small residuals, but base + q * scale > FLT_MAX
], ids=["FLT_MAX", "above 2^125", "below 2^125", "residual past FLT_MAX", "residual of opposite huge values",
        "small residual of FLT_MAX"])
def test_int8_blocks_that_may_overflow_are_counted_exactly(values: list[float], base: list[float] | None,
                                                           special: str | None) -> None:
    """int8 blocks whose values or residuals reach 2^125 are quantised by the loop that counts overflows and
    NaNs; the error equals the torch reference on each side of that bound, and blocks of ordinary values
    around them keep their counts."""
    repeat = 64
    x = torch.tensor(values * repeat + [0.5, -0.25, 1e-9, 0.0] * 64)
    spec = lossy.LossySpec("int8-block" if base is None else "residual-int8", 64)
    base_t = None if base is None else torch.tensor(base * repeat + [0.25, -0.25, 0.0, 0.0] * 64)
    encoded = lossy.encode(x, spec, base_t)
    reference = lossy.measure(x, lossy.decode(spec, encoded.parts, x.dtype, list(x.shape), base_t))
    assert encoded.error.keys() == reference.keys()
    for key, value in reference.items():
        assert encoded.error[key] == pytest.approx(value, rel=1e-9, nan_ok=True), key
    if special is not None:
        assert reference[special] > 0


def test_a_kept_overflow_is_recorded_as_inf(tmp_path: Path) -> None:
    """on_unsafe="keep" stores a result with infs; its error (max abs inf) goes into the strict-JSON manifest
    as a string and comes back as a float."""
    t = torch.ones(1000)
    t[5] = 1e5
    with pytest.warns(RuntimeWarning, match="1 values overflowed to inf; kept because"):
        info = ckptvault.save({"x": t}, tmp_path / "v", 1, codec_rules={"*": "fp16"}, on_unsafe="keep")
    assert info.tensors[0].error is not None and info.tensors[0].error["max_abs"] == math.inf
    with CheckpointManager(tmp_path / "v") as mgr:
        assert records(mgr.manifest(1))["x"]["lossy"]["error"]["max_abs"] == "inf"
        assert mgr.restore(1)["x"][5] == math.inf
    assert "inf" in cli("show", tmp_path / "v").stdout


def test_a_certainly_unsafe_result_is_not_measured_to_the_end() -> None:
    """With fallback or fail, measuring stops once the result is certainly unsafe; with keep it never stops."""
    tiny = torch.rand(3 << 20, generator=torch.Generator().manual_seed(0)) * 1e-9  # fp16 flushes all of it
    encoded, notes = lossy.encode_safely("m", tiny, lossy.LossySpec("fp16"), lossy.LossySafety())
    assert encoded is not None and encoded.spec.kind == "bf16" and "partial" not in encoded.error
    assert notes == ["fp16 on 'm' is unsafe: 100.0% of non-zero values flushed to zero (limit 5.0%; measured on the "
                     "first 262144 of 3145728 values); fell back to bf16"]  # 2^16 cast, then 2^16 and 2^17 counted
    big = torch.ones(3 << 20)
    big[-1] = 1e5
    with pytest.raises(LossyCodecError, match=r"fp16 on 'b' is unsafe: 1 values overflowed to inf"):
        lossy.encode_safely("b", big, lossy.LossySpec("fp16"), lossy.LossySafety("fail"))  # in the last block
    with pytest.warns(RuntimeWarning, match="kept because"):
        kept, _ = lossy.encode_safely("m", tiny, lossy.LossySpec("fp16"), lossy.LossySafety("keep"))
    assert kept is not None and "partial" not in kept.error and kept.error["flushed"] == 1.0
    stopped = lossy.encode(tiny, lossy.LossySpec("fp16"), give_up=0.05)  # cast block by block, stopped early
    assert stopped.error["partial"]
    first = lossy._KERNEL_BLOCKS[0]
    assert torch.equal(stopped.parts["q"][:first], tiny[:first].to(torch.float16))  # the block that decided it
    for policy in ("fallback", "fail", "keep"):  # a partial result is never stored
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                kept, _ = lossy.encode_safely("m", tiny, lossy.LossySpec("fp16"), lossy.LossySafety(policy))
        except LossyCodecError:
            continue
        assert kept is not None and "partial" not in kept.error
        assert torch.equal(kept.parts["q"], tiny.to(kept.parts["q"].dtype))


def _sentinel_alloc(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An Alloc whose memory holds a value no encoding here writes: -128 for int8, 0xFFFF (a NaN) for 16 bits."""
    t = torch.empty(shape, dtype=dtype)
    t.view(torch.uint8).fill_(0x80 if dtype == torch.int8 else 0xFF)
    return t


@pytest.mark.parametrize("spec", [lossy.LossySpec("fp16"), lossy.LossySpec("int8-block", 256),
                                  lossy.LossySpec("residual-int8", 256)], ids=["fp16", "int8", "residual"])
def test_a_doomed_attempt_encodes_only_its_first_call_and_counts_the_rest(spec: lossy.LossySpec) -> None:
    """Half the values flush, evenly spread: the attempt stops after its first kernel call (the rest of the
    output is never written) and counts flushes without encoding (2^16, then 2^17 and 2^18 values) until
    more than 5% of the tensor certainly flushes. Encoding instead of counting would have written those
    values too. A residual has no such count: it encodes until the values encoded flush more than 5% of the
    tensor even if the rest flushed nothing (three calls of 2^16, 2^17 and 2^18 values)."""
    n, first = 4 << 20, lossy._KERNEL_BLOCKS[0]
    gen = torch.Generator().manual_seed(3)
    x = torch.rand(n, generator=gen) + 0.5
    x[::2] = torch.rand(n // 2, generator=gen) * 1e-9 + 1e-12  # flushes in fp16, and in int8 next to 0.5..1.5
    base = torch.zeros(n)  # a residual against zeros quantises x itself
    stopped = lossy.encode(x, spec, base, give_up=0.05, alloc=_sentinel_alloc)
    q = stopped.parts["q"].reshape(-1).view(torch.int16 if spec.kind == "fp16" else torch.int8)
    sentinel = -1 if spec.kind == "fp16" else -128
    written = int((q != sentinel).sum())
    assert int((q[:written] != sentinel).sum()) == written  # the calls made wrote a prefix
    assert written == (7 * first if spec.kind == "residual-int8" else first)
    assert stopped.error["partial"] and stopped.error["values"] == n
    assert stopped.error["examined"] == (7 * first if spec.kind == "residual-int8" else 8 * first)
    assert stopped.error["flushed"] == pytest.approx(0.5, abs=0.01)
    assert lossy.encode(x, spec, base).error["flushed"] == pytest.approx(0.5, abs=1e-3)


@pytest.mark.parametrize("spec", [lossy.LossySpec("fp16"), lossy.LossySpec("int8-block", 256)], ids=["fp16", "int8"])
def test_a_tensor_unsafe_only_in_its_first_part_is_encoded_whole_and_kept(spec: lossy.LossySpec) -> None:
    """The first kernel call's values all flush, the rest none: counting the rest shows the whole tensor safe
    (1.6% flushed), so the attempt goes on to the end and is stored exactly as without the early check."""
    n, first = 4 << 20, lossy._KERNEL_BLOCKS[0]
    x = torch.rand(n, generator=torch.Generator().manual_seed(4)) + 0.5
    x[:first] = 1e-9
    if spec.kind == "int8-block":
        x[:first:256] = 1.0  # each block's scale: the other values flush
    encoded, notes = lossy.encode_safely("t", x, spec, lossy.LossySafety())
    assert encoded is not None and encoded.spec == spec and not notes and "partial" not in encoded.error
    reference = lossy.encode(x, spec)
    assert torch.equal(encoded.parts["q"], reference.parts["q"]) and encoded.error == reference.error
    assert encoded.error["flushed"] == pytest.approx(first * (255 / 256 if spec.kind == "int8-block" else 1) / n)


@pytest.mark.parametrize("spec", [lossy.LossySpec("bf16"), lossy.LossySpec("int8-block", 64)], ids=["bf16", "int8"])
def test_memory_of_the_wrong_size_from_an_allocator_is_refused_not_overrun(spec: lossy.LossySpec) -> None:
    """The kernels write through an Alloc's memory without bounds checks: a buffer of the wrong size, type or
    layout is an error naming the part, before anything is written (here: int16 memory viewed as float32, half
    the values; the same memory as another dtype; a strided view)."""
    def half_size(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.int16).view(dtype) if dtype == torch.float32 else lossy.fresh(name, shape, dtype)

    def wrong_type(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.uint8 if dtype.itemsize == 1 else torch.int16)

    def strided(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty((*shape[:-1], 2 * shape[-1]), dtype=dtype)[..., ::2]

    x = torch.rand(1000, generator=torch.Generator().manual_seed(6))
    for alloc, part in ((wrong_type, "q"), (strided, "q")) + (((half_size, "scale"),) if spec.kind == "int8-block" else ()):
        with pytest.raises(RuntimeError, match=f"the allocator returned .* for '{part}'; asked for "):
            lossy.encode(x, spec, alloc=alloc)
        if part == "q":  # the torch path (float64 here) allocates only "q", and checks it too
            with pytest.raises(RuntimeError, match="the allocator returned .* for 'q'"):
                lossy.encode(x.double(), spec, alloc=alloc)


def test_flush_counts_agree_with_the_kernels() -> None:
    """count_cast_flushes equals the cast kernels' non-zero and flushed counts on every kind of float32 (random
    bit patterns, dense runs across fp16's flush bound); count_int8_flushes counts the same non-zero values and
    at most the flushes quantise_int8 makes, nearly all of them on ordinary data, and none in blocks whose scale
    is infinite, NaN or subnormal."""
    gen = np.random.default_rng(9)
    patterns = [gen.integers(0, 2**32, size=1 << 18, dtype=np.uint64).astype(np.uint32),
                np.arange(0x32F00000, 0x33100000, 13, dtype=np.uint32), np.arange(0, 0x20000, 3, dtype=np.uint32)]
    bits = np.concatenate(patterns)
    q16 = np.empty(bits.size, np.uint16)
    for half, cast in ((True, lossy_kernels.cast_fp16), (False, lossy_kernels.cast_bf16)):
        sums = cast(bits, q16)
        assert lossy_kernels.count_cast_flushes(bits, half) == (sums[3], sums[4]) and sums[4] > 1000, half
    values = (gen.standard_normal(1 << 20) * np.exp(gen.uniform(-30, 5, 1 << 20))).astype(np.float32)
    values[:256] = np.inf
    values[256:512] = np.nan
    values[512:768] = np.array([381] + [2] * 255, np.uint32).view(np.float32)  # scale 3 x 2^-149: half of it
    values[600] = 0.0  # rounds up to 2 x 2^-149, which is 2/3 of the scale and so does not flush
    q8, scale = np.empty(values.size, np.int8), np.empty(values.size // 256, np.float32)
    sums = lossy_kernels.quantise_int8(values, 256, q8, scale)
    nonzero, flushed = lossy_kernels.count_int8_flushes(values, 256)
    finite_nonzero = np.isfinite(values) & (values != 0)
    assert nonzero == sums[3] == int(finite_nonzero.sum())
    assert 0.999 * sums[4] <= flushed <= sums[4] and flushed > 10_000
    assert lossy_kernels.count_int8_flushes(values[:768], 256) == (255, 0)


# -- entry points -------------------------------------------------------------------------------------------
def test_top_level_save_takes_presets_and_safety(run: list[dict[str, Any]], tmp_path: Path) -> None:
    with pytest.raises(LossyCodecError, match="exp_avg_sq"):
        ckptvault.save(run[3], tmp_path / "a", 3, codec_rules={"*exp_avg_sq": "fp16"}, on_unsafe="fail")
    info = ckptvault.save(run[3], tmp_path / "b", 3, codec_rules="moments-compact")
    assert {t.codec for t in info.tensors if t.path.endswith("exp_avg_sq")} == {"bf16+zstd"}
    assert ckptvault.load(tmp_path / "b")["model"]["tok.weight"].equal(run[3]["model"]["tok.weight"])


def test_show_prints_codec_error_and_fallback_notes(run: list[dict[str, Any]], tmp_path: Path) -> None:
    root = tmp_path / "v"
    save_all(root, {3: run[3]}, {"*exp_avg_sq": "fp16", "*exp_avg": "int8-block:64"}).close()
    text = cli("show", root, "-k", "optimizer.state.0")
    assert text.returncode == 0, text.stderr
    header = next(line for line in text.stdout.splitlines() if line.startswith("KEY PATH"))
    assert "CODEC" in header and "MAX ABS ERR" in header and "REL L2" in header and header.endswith("FLUSHED")
    row = next(line for line in text.stdout.splitlines() if line.startswith("optimizer.state.0.exp_avg "))
    assert "int8-block:64+zstd" in row and row.rstrip().endswith("%")
    assert ("note: optimizer.state.0.exp_avg_sq: fp16 on 'optimizer.state.0.exp_avg_sq' is unsafe:" in text.stdout
            and "fell back to bf16" in text.stdout)
    as_json = cli("show", root, "--json")
    tensors = {t["path"]: t for t in json.loads(as_json.stdout)["tensors"]}
    with CheckpointManager(root) as mgr:
        recs = records(mgr.manifest(3))
    assert tensors["optimizer.state.0.exp_avg_sq"]["codec"] == "bf16+zstd"
    assert tensors["optimizer.state.0.exp_avg_sq"]["notes"] == recs["optimizer.state.0.exp_avg_sq"]["lossy"]["notes"]
    assert tensors["optimizer.state.0.exp_avg"]["error"] == recs["optimizer.state.0.exp_avg"]["lossy"]["error"]
    assert tensors["model.tok.weight"]["error"] is None and tensors["model.tok.weight"]["notes"] == []


def cli(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ckptvault", *map(str, args)], capture_output=True, text=True, timeout=120)


# -- output buffers reused across saves ------------------------------------------------------------------
def test_casts_into_reused_buffers_round_exactly_as_to_does() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(10_000, generator=gen) * torch.logspace(-30, 30, 10_000)
    x[:8] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3.0e38, 1e-45, 65520.0])
    buffers = LossyBuffers()
    for spec, dtype in ((lossy.LossySpec("bf16"), torch.bfloat16), (lossy.LossySpec("fp16"), torch.float16)):
        q = lossy.encode(x, spec, alloc=buffers.allocator("x")).parts["q"]
        expected = x.to(dtype)
        assert q.dtype == dtype and torch.equal(q.view(torch.int16), expected.view(torch.int16))


def test_asynchronous_lossy_saves_reuse_their_output_memory_and_keep_each_checkpoint_right(
        run: list[dict[str, Any]], tmp_path: Path) -> None:
    rules = {"optimizer.state.*.exp_avg": "int8-block", "*": "bf16"}
    with CheckpointManager(tmp_path / "v", codec_rules=rules, chunk_size=CHUNK) as mgr:
        buffers = mgr._saver._lossy_buffers
        pointers = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # small moments may fall back from int8 to bf16
            for step in (3, 4, 5):
                mgr.save(step, run[step]).wait()
                pointers.append({k: b.data_ptr() for k, b in buffers._buffers.items()})
        assert pointers[0] and pointers[0] == pointers[1] == pointers[2]  # steady state: nothing reallocated
        held = buffers.nbytes
        lossy_bytes = sum(r["nbytes"] for r in mgr.manifest(5)["tensors"] if codec_of(r) != "lossless")
        assert lossy_bytes <= held <= 1.01 * lossy_bytes + 4096
        for step in (3, 4, 5):  # later saves overwrote the buffers; every committed checkpoint is still its own
            expected = decode_stored(mgr, step)
            restored = leaves(mgr.restore(step))
            for path, values in expected.items():
                assert np.array_equal(restored[path].numpy(), values), path
        mgr.save(6, {"other": torch.ones(1000)}).wait()
        assert [k[0] for k in buffers._buffers] == ["other"]  # the old state's buffers were released


def test_synchronous_saves_do_not_hold_lossy_memory(run: list[dict[str, Any]], tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "v", codec_rules={"*": "bf16"}, async_save=False) as mgr:
        mgr.save(1, run[1])
        assert mgr._saver._lossy_buffers.nbytes == 0
        restored = leaves(mgr.restore(1))
        for path, values in decode_stored(mgr, 1).items():
            assert np.array_equal(restored[path].numpy(), values), path
