"""restore(into=...) with tied tensors: one saved record reachable under several key paths.

A model with tied input/output embeddings has two state_dict keys for one
tensor; the vault stores it once. Restoring into ``model.state_dict()`` must
fill both paths (and, in an untied target, both tensors).
"""

from __future__ import annotations

import pytest
import torch

from ckptvault import CheckpointManager
from ckptvault.demo.model import GPT, GPTConfig
from ckptvault.errors import KeyMismatchError

TINY = GPTConfig(seq_len=16, d_model=32, n_layer=1, n_head=2)


def _model(seed: int) -> GPT:
    torch.manual_seed(seed)
    return GPT(TINY)


def test_restore_into_a_tied_model_fills_every_tensor(tmp_path):
    source, target = _model(0), _model(1)
    with CheckpointManager(tmp_path / "v") as mgr:
        mgr.save(1, {"model": source.state_dict()}).wait()
        mgr.restore(1, into={"model": target.state_dict()})
    for name, tensor in source.state_dict().items():
        assert torch.equal(tensor, target.state_dict()[name]), name
    assert target.head.weight.data_ptr() == target.tok.weight.data_ptr()


def test_restore_into_untied_target_fills_both_aliases(tmp_path):
    state = _model(0).state_dict()
    untied = {k: torch.zeros_like(v) for k, v in state.items()}
    with CheckpointManager(tmp_path / "v") as mgr:
        mgr.save(1, state).wait()
        mgr.restore(1, into=untied)
    assert torch.equal(untied["head.weight"], state["tok.weight"])
    assert torch.equal(untied["tok.weight"], state["tok.weight"])


def test_restore_into_alias_of_wrong_shape_is_refused(tmp_path):
    state = _model(0).state_dict()
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    target["head.weight"] = torch.zeros(3, 3)
    with CheckpointManager(tmp_path / "v") as mgr:
        mgr.save(1, state).wait()
        with pytest.raises(KeyMismatchError, match=r"'head.weight': saved float32\[256, 32\], target is float32\[3, 3\]"):
            mgr.restore(1, into=target)


@pytest.mark.parametrize("n", [100, 2_000_000])  # packed with others in one chunk; alone in chunks of its own
def test_different_tensors_restored_into_shared_memory_keep_the_last(tmp_path, n):
    """Tensors saved apart but tied in the target (one tensor given for two key paths, or overlapping views): the
    restore neither fails nor blames a chunk (a chunk is hashed where it is decoded, so they are read apart) and
    the target ends with the last key path's values, as ``load_state_dict`` leaves it."""
    torch.manual_seed(n)
    state = {"a": torch.randn(n), "b": torch.randn(n), "c": torch.randn(n)}
    with CheckpointManager(tmp_path / "v", async_save=False) as mgr:
        mgr.save(1, state)
        shared, c = torch.zeros(n), torch.zeros(n)
        mgr.restore(1, into={"a": shared, "b": shared, "c": c})
        assert torch.equal(shared, state["b"]) and torch.equal(c, state["c"])
        whole = torch.zeros(n + n // 2)
        mgr.restore(1, into={"a": whole[:n], "b": whole[n // 2:], "c": c})  # overlapping by half
        assert torch.equal(whole[n // 2:], state["b"]) and torch.equal(whole[: n // 2], state["a"][: n // 2])


def test_equal_tensors_saved_apart_restore_into_a_tied_model(tmp_path):
    """A checkpoint that holds the tied embedding twice (saved from an untied model, equal values) restores into a
    tied model, both key paths into the one tensor."""
    source, target = _model(0), _model(1)
    untied = {k: v.clone() for k, v in source.state_dict().items()}  # two tensors with the same values
    with CheckpointManager(tmp_path / "v", async_save=False) as mgr:
        mgr.save(1, {"model": untied})
        mgr.restore(1, into={"model": target.state_dict()})
    assert torch.equal(target.tok.weight, source.tok.weight)
    assert target.head.weight.data_ptr() == target.tok.weight.data_ptr()


def test_shared_memory_of_predicted_records_is_rebuilt_apart(tmp_path):
    """Predicted records (rebuilt where they are restored, checked against their digests) restored into shared
    memory: no PredictionError, the last key path's values."""
    from ckptvault import DeltaOptions

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with CheckpointManager(tmp_path / "v", async_save=False, chunk_size=64 << 10,
                           delta=DeltaOptions(predict=True)) as mgr:
        for step in (1, 2):
            model(torch.randn(8, 256)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            mgr.save(step, {"model": model.state_dict(), "optimizer": opt.state_dict()})
        assert any("predict" in t for t in mgr.manifest(2)["tensors"])
        saved = {k: v.clone() for k, v in opt.state_dict()["state"][0].items()}
        shared = torch.zeros_like(saved["exp_avg"])
        mgr.restore(2, into={"optimizer": {"state": {0: {"exp_avg": shared, "exp_avg_sq": shared}}}}, strict=False)
        assert torch.equal(shared, saved["exp_avg_sq"])
