"""restore(into=...): the target decides what is read, as in torch.distributed.checkpoint.

* ``into`` mirrors the saved tree from its root (``{"model": model.state_dict()}``) or sits under one saved
  subtree (a bare ``model.state_dict()`` under ``model``);
* only the tensors it names are read, and only their chunks fetched: a checkpoint's other subtrees, and
  siblings inside a subtree it names, are neither read nor an error;
* ``strict=True``: a target tensor the checkpoint lacks is a KeyMismatchError naming its key path, raised before
  anything is written; ``strict=False``: it is skipped and left unchanged;
* a dtype or shape mismatch is a KeyMismatchError either way; non-tensor leaves of the target are left alone.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptvault
from ckptvault._format.chunk_object import chunk_key
from ckptvault.errors import CorruptChunkError, KeyMismatchError
from conftest import assert_same_state
from helpers.counting_store import CountingStore

CHUNK = 64 << 10  # the smallest chunk size: arrays of 16 KiB and more get chunks of their own


def _train_state(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model and its AdamW after one step (so the optimizer holds exp_avg, exp_avg_sq and step)."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 128))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2 * (seed + 1))
    model(torch.randn(4, 64)).square().mean().backward()
    opt.step()
    return model, opt


def _clone(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):  # dict or OrderedDict (a state_dict), kept as it is
        return type(state)((k, _clone(v)) for k, v in state.items())
    if isinstance(state, list):
        return [_clone(v) for v in state]
    return state


def _saved(path: Path | str, store: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Save step 1 (model + optimizer + a scalar) into a fresh vault; returns clones of what was saved."""
    model, opt = _train_state(seed=0)
    with ckptvault.CheckpointManager(store if store is not None else path, chunk_size=CHUNK) as mgr:
        mgr.save(1, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": 1}).wait()
    return _clone(model.state_dict()), _clone(opt.state_dict())


def _chunk_keys(manifest: dict[str, Any], wanted: Any) -> set[str]:
    """Storage keys of the chunks holding the tensors whose key path satisfies ``wanted(path)``."""
    chunks = manifest["chunks"]
    return {chunk_key(chunks[c]["id"]) for t in manifest["tensors"] if wanted(t["path"]) for c, _o, _n in t["pieces"]}


def _damage(root: Path, keys: set[str]) -> None:
    for key in keys:
        path = root / key
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))


def _pointers(state: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, int]]:
    return {k: (v, v.data_ptr()) for k, v in state.items()}


def _opt_state_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {f"{i}.{name}": v for i, p in enumerate(opt.param_groups[0]["params"]) for name, v in opt.state[p].items()}


# -- 1, 2: one subtree of a model + optimizer checkpoint --------------------------------------------------------


def test_into_the_model_subtree_alone_restores_it_bit_exact_in_place(tmp_path: Path) -> None:
    saved_model, saved_opt = _saved(tmp_path / "v")
    fresh, fresh_opt = _train_state(seed=1)
    target = fresh.state_dict()
    before = _pointers(target)
    opt_before = _clone(fresh_opt.state_dict())
    assert not torch.equal(target["0.weight"], saved_model["0.weight"])
    with ckptvault.CheckpointManager(tmp_path / "v") as mgr:
        into = {"model": target}
        assert mgr.restore(1, into=into) is into  # strict=True by default; the optimizer is simply not read
    for key, (tensor, ptr) in before.items():
        assert target[key] is tensor and tensor.data_ptr() == ptr, key
        assert torch.equal(tensor, saved_model[key]), key
    assert torch.equal(fresh[2].weight, saved_model["2.weight"])  # the module's parameters changed in place
    assert_same_state(opt_before, fresh_opt.state_dict())  # the optimizer, not named, is untouched


def test_into_the_optimizer_subtree_alone_restores_its_state_in_place(tmp_path: Path) -> None:
    saved_model, saved_opt = _saved(tmp_path / "v")
    fresh, fresh_opt = _train_state(seed=1)
    live = _opt_state_tensors(fresh_opt)
    before = {k: v.data_ptr() for k, v in live.items()}
    model_before = _clone(fresh.state_dict())
    assert not torch.equal(live["0.exp_avg"], saved_opt["state"][0]["exp_avg"])
    with ckptvault.CheckpointManager(tmp_path / "v") as mgr:
        mgr.restore(1, into={"optimizer": fresh_opt.state_dict()})
    assert set(live) == {f"{i}.{n}" for i in range(4) for n in ("step", "exp_avg", "exp_avg_sq")}
    for key, tensor in live.items():  # the optimizer's own state tensors, written in place
        index, name = key.split(".")
        assert tensor.data_ptr() == before[key], key
        assert torch.equal(tensor, saved_opt["state"][int(index)][name]), key
    assert fresh_opt.param_groups[0]["lr"] == 2e-2 != saved_opt["param_groups"][0]["lr"]  # non-tensor leaves: left alone
    assert_same_state(model_before, fresh.state_dict())


# -- 3: a target tensor the checkpoint lacks ----------------------------------------------------------------------


def test_a_target_tensor_the_checkpoint_lacks_is_an_error_naming_it_or_skipped_when_not_strict(tmp_path: Path) -> None:
    saved_model, _ = _saved(tmp_path / "v")
    fresh, _ = _train_state(seed=1)
    target = {**fresh.state_dict(), "extra.weight": torch.full((3,), 7.0)}
    untouched = _clone(target)
    with ckptvault.CheckpointManager(tmp_path / "v") as mgr:
        message = ("into= holds 1 tensors the checkpoint of step 1 does not (at its root): ['model.extra.weight']; "
                   "remove them from into=, or pass strict=False to skip them (they are left unchanged)")
        with pytest.raises(KeyMismatchError, match=re.escape(message)):
            mgr.restore(1, into={"model": target})
        assert_same_state(untouched, target)  # refused before anything was written
        bare = "into= holds 1 tensors the checkpoint of step 1 does not (under 'model'): ['extra.weight']"
        with pytest.raises(KeyMismatchError, match=re.escape(bare)):
            mgr.restore(1, into=target)  # the same, mounted under "model"
        assert_same_state(untouched, target)

        mgr.restore(1, into={"model": target}, strict=False)
        assert torch.equal(target["extra.weight"], torch.full((3,), 7.0))
        assert_same_state(dict(saved_model), {k: v for k, v in target.items() if k != "extra.weight"})

        again = {**_train_state(seed=2)[0].state_dict(), "extra.weight": torch.full((3,), 7.0)}
        mgr.restore(1, into=again, strict=False)  # mounted under "model", extra skipped
        assert torch.equal(again["extra.weight"], torch.full((3,), 7.0))
        assert_same_state(dict(saved_model), {k: v for k, v in again.items() if k != "extra.weight"})


def test_a_target_the_checkpoint_holds_nothing_of_is_an_error_even_when_not_strict(tmp_path: Path) -> None:
    _saved(tmp_path / "v")
    with ckptvault.CheckpointManager(tmp_path / "v") as mgr:
        for strict in (True, False):
            with pytest.raises(KeyMismatchError, match=re.escape(
                    "into= tensors ['nope.w'] are not in the checkpoint of step 1, at its root or under any one key "
                    "(its top-level keys are ['model', 'optimizer'])")):
                mgr.restore(1, into={"nope": {"w": torch.zeros(2)}}, strict=strict)


# -- 4: dtype and shape mismatches -------------------------------------------------------------------------------


@pytest.mark.parametrize("strict", [True, False])
def test_dtype_and_shape_mismatches_are_errors(tmp_path: Path, strict: bool) -> None:
    _saved(tmp_path / "v")
    with ckptvault.CheckpointManager(tmp_path / "v") as mgr:
        target = _train_state(seed=1)[0].state_dict()
        target["0.weight"] = torch.zeros(64, 256)
        untouched = _clone(target)
        with pytest.raises(KeyMismatchError, match=re.escape(
                "'model.0.weight': saved float32[256, 64], target is float32[64, 256]; "
                "restore without into= and convert, or fix the target")):
            mgr.restore(1, into={"model": target}, strict=strict)
        assert_same_state(untouched, target)
        target = _train_state(seed=1)[0].state_dict()
        target["2.bias"] = torch.zeros(128, dtype=torch.float64)
        with pytest.raises(KeyMismatchError, match=re.escape("'2.bias': saved float32[128], target is float64[128]")):
            mgr.restore(1, into=target, strict=strict)


def test_every_dtype_and_shape_mismatch_is_listed_in_one_error_before_anything_is_read(tmp_path: Path) -> None:
    """As ``load_state_dict``: all mismatches at once (a plain target and a live one), and the target untouched."""
    _saved(tmp_path / "v")
    with ckptvault.CheckpointManager(tmp_path / "v") as mgr:
        model = _train_state(seed=1)[0]
        target = model.state_dict()
        target["0.weight"] = torch.zeros(64, 256)
        target["2.bias"] = torch.zeros(128, dtype=torch.float64)
        untouched = _clone(target)
        message = ("2 into= tensors differ in dtype or shape from the checkpoint of step 1: "
                   "'0.weight': saved float32[256, 64], target is float32[64, 256]; "
                   "'2.bias': saved float32[128], target is float64[128]; "
                   "restore without into= and convert, or fix the target")
        with pytest.raises(KeyMismatchError, match=re.escape(message) + "$"):
            mgr.restore(1, into=target)
        assert_same_state(untouched, target)  # not even the tensors that match were written

        live_before = _clone(model.state_dict())
        model[0].weight.data = torch.zeros(256, 32)
        model[2].bias.data = torch.zeros(128, dtype=torch.float64)
        with pytest.raises(KeyMismatchError, match=re.escape(
                "2 into= tensors differ in dtype or shape from the checkpoint of step 1: "
                "'model.0.weight': saved float32[256, 64], target is float32[256, 32]; "
                "'model.2.bias': saved float32[128], target is float64[128]; restore without")):
            mgr.restore(1, into={"model": model, "step": 0})
        assert torch.equal(model[0].bias, live_before["0.bias"]) and torch.equal(model[2].weight, live_before["2.weight"])


def test_a_long_list_of_mismatches_is_capped(memory_url: str) -> None:
    from ckptvault._restore.tensors import SHOWN_MISMATCHES

    count = SHOWN_MISMATCHES + 3
    with ckptvault.CheckpointManager(memory_url) as mgr:
        mgr.save(1, {f"t{i:02d}": torch.ones(2) for i in range(count)}).wait()
        target = {f"t{i:02d}": torch.zeros(3) for i in range(count)}
        with pytest.raises(KeyMismatchError) as info:
            mgr.restore(1, into=target)
        text = str(info.value)
        assert text.count("target is float32[3]") == SHOWN_MISMATCHES
        assert f"{count} into= tensors differ" in text and "; and 3 more; restore without into=" in text
        assert all(torch.equal(t, torch.zeros(3)) for t in target.values())


def test_a_missing_key_lists_the_nearby_saved_keys_under_its_mount_point(tmp_path: Path) -> None:
    _saved(tmp_path / "v")
    with ckptvault.CheckpointManager(tmp_path / "v") as mgr:
        target = _train_state(seed=1)[0].state_dict()
        target["0.weigth"] = target.pop("0.weight")  # a typo: the saved 0.weight is what it meant
        untouched = _clone(target)
        message = ("into= holds 1 tensors the checkpoint of step 1 does not (under 'model'): ['0.weigth']; "
                   "saved keys near them: {'0.weigth': ['0.weight']}; remove them from into=")
        with pytest.raises(KeyMismatchError, match=re.escape(message)) as info:
            mgr.restore(1, into=target)
        assert "optimizer" not in str(info.value)  # keys of another subtree are not offered
        assert_same_state(untouched, target)
        with pytest.raises(KeyMismatchError, match=re.escape(
                "(at its root): ['model.0.weigth']; saved keys near them: {'model.0.weigth': ['model.0.weight']}")):
            mgr.restore(1, into={"model": target})
        del target["0.weigth"]
        target["extra"] = torch.zeros(1)  # nothing saved is near it: no list
        with pytest.raises(KeyMismatchError, match=re.escape("(under 'model'): ['extra']; remove them")):
            mgr.restore(1, into=target)


# -- 5: what the target does not name is not read -----------------------------------------------------------------


def test_a_subtree_the_target_does_not_name_is_not_read(tmp_path: Path) -> None:
    saved_model, saved_opt = _saved(tmp_path / "v")
    with ckptvault.CheckpointManager(tmp_path / "v") as mgr:
        manifest = mgr.manifest(1)
    model_keys = _chunk_keys(manifest, lambda p: p.startswith("model."))
    opt_only = _chunk_keys(manifest, lambda p: p.startswith("optimizer.")) - model_keys
    assert len(opt_only) >= 4  # exp_avg and exp_avg_sq of both weights have chunks of their own
    _damage(tmp_path / "v", opt_only)
    (tmp_path / "v" / sorted(opt_only)[0]).unlink()  # one missing, the others corrupt

    with ckptvault.CheckpointManager(tmp_path / "v") as mgr:
        target = _train_state(seed=1)[0].state_dict()
        mgr.restore(1, into={"model": target})
        assert_same_state(saved_model, target)
        bare = _train_state(seed=2)[0].state_dict()
        mgr.restore(1, into=bare)
        assert_same_state(saved_model, bare)
        with pytest.raises(CorruptChunkError, match=r"needed by step 1, tensor 'optimizer\.state\.\d\.exp_avg"):
            mgr.restore(1, into={"model": _train_state(seed=1)[0].state_dict(),
                                 "optimizer": _train_state(seed=1)[1].state_dict()})
        with pytest.raises(CorruptChunkError):
            mgr.restore(1)


def test_a_sibling_inside_a_named_subtree_is_not_read(tmp_path: Path) -> None:
    saved_model, _ = _saved(tmp_path / "v")
    with ckptvault.CheckpointManager(tmp_path / "v") as mgr:
        manifest = mgr.manifest(1)
    first = _chunk_keys(manifest, lambda p: p == "model.0.weight")
    second_only = _chunk_keys(manifest, lambda p: p == "model.2.weight") - _chunk_keys(manifest, lambda p: p != "model.2.weight")
    assert second_only
    _damage(tmp_path / "v", second_only)
    with ckptvault.CheckpointManager(tmp_path / "v") as mgr:
        w = torch.zeros(256, 64)
        mgr.restore(1, into={"model": {"0.weight": w}})  # model.0.bias, model.2.* are siblings it does not name
        assert torch.equal(w, saved_model["0.weight"])
        assert first.isdisjoint(second_only)
        with pytest.raises(CorruptChunkError, match=r"tensor 'model\.2\.weight'"):
            mgr.restore(1, into={"model": {"2.weight": torch.zeros(128, 256)}})


def test_only_the_chunks_of_named_tensors_are_fetched(tmp_path: Path) -> None:
    store = CountingStore(tmp_path / "v")
    saved_model, saved_opt = _saved(tmp_path / "v", store)
    with ckptvault.CheckpointManager(store) as mgr:
        manifest = mgr.manifest(1)
        every = _chunk_keys(manifest, lambda p: True)
        model_keys = _chunk_keys(manifest, lambda p: p.startswith("model."))
        assert model_keys < every
        for into, wanted in [
            ({"model": _train_state(seed=1)[0].state_dict()}, model_keys),
            (_train_state(seed=1)[0].state_dict(), model_keys),
            ({"model": {"2.weight": torch.zeros(128, 256)}}, _chunk_keys(manifest, lambda p: p == "model.2.weight")),
            ({"optimizer": _train_state(seed=1)[1].state_dict()}, _chunk_keys(manifest, lambda p: p.startswith("optimizer."))),
        ]:
            store.read.clear()
            mgr.restore(1, into=into)
            assert {k for k in store.read if k.startswith("chunks/")} == wanted
        store.read.clear()
        mgr.restore(1)
        assert {k for k in store.read if k.startswith("chunks/")} == every
        full = store.chunk_bytes_read()
        store.read.clear()
        mgr.restore(1, into={"model": _train_state(seed=1)[0].state_dict()})
        assert store.chunk_bytes_read() < full / 2  # the optimizer (twice the model) was not fetched


# -- 6: a bare state dict mounts under its saved subtree ----------------------------------------------------------


def test_a_bare_state_dict_still_mounts_under_its_subtree(tmp_path: Path) -> None:
    saved_model, saved_opt = _saved(tmp_path / "v")
    fresh, fresh_opt = _train_state(seed=1)
    target = fresh.state_dict()
    before = _pointers(target)
    with ckptvault.CheckpointManager(tmp_path / "v") as mgr:
        assert mgr.restore(1, into=target) is target
        for key, (tensor, ptr) in before.items():
            assert target[key] is tensor and tensor.data_ptr() == ptr, key
        assert_same_state(saved_model, target)
        opt_target = fresh_opt.state_dict()
        mgr.restore(1, into=opt_target)  # under "optimizer"
        assert_same_state(saved_opt["state"], opt_target["state"])
        half = {"0.weight": torch.zeros(256, 64)}  # part of a subtree mounts too
        mgr.restore(1, into=half)
        assert torch.equal(half["0.weight"], saved_model["0.weight"])


def test_a_target_that_fits_several_subtrees_is_refused(tmp_path: Path) -> None:
    w = torch.randn(4)
    with ckptvault.CheckpointManager(tmp_path / "v") as mgr:
        mgr.save(1, {"model": {"w": w}, "ema": {"w": w + 1}}).wait()
        with pytest.raises(KeyMismatchError, match=re.escape("into= matches several places in the checkpoint of step 1: "
                                                             "['ema', 'model']")):
            mgr.restore(1, into={"w": torch.zeros(4)})
        target = {"model": {"w": torch.zeros(4)}}
        mgr.restore(1, into=target)
        assert torch.equal(target["model"]["w"], w)
