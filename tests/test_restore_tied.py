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
