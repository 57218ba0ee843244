"""Incremental checkpoints: dedup of unchanged chunks, XOR deltas against a keyframe, keyframe cadence.

Every test trains a real torch model with a real optimizer and saves into a real local vault with the
default asynchronous saves (waited for before reading). Chunks are 64 KiB so that small models span
several chunks; arrays of at least 16 KiB get chunks of their own, smaller ones are packed together.
"""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import ckptvault
from ckptvault import CheckpointManager, DeltaOptions
from ckptvault._delta import policy
from ckptvault._delta.policy import KeyframeCache
from ckptvault._format.chunk_object import chunk_key, parse_object
from ckptvault._maintenance.gc import collect
from ckptvault._save import pipeline
from ckptvault.errors import CorruptChunkError, InvalidArgumentError, PermanentStorageError
from conftest import assert_same_state
from helpers.counting_store import CountingStore

CHUNK = 64 << 10
HEADER_SLACK = 256  # object header + codec framing of one chunk, generously


def manager(root: Path, **kwargs: Any) -> CheckpointManager:
    return CheckpointManager(root, chunk_size=CHUNK, **kwargs)


def snapshot_state(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    """A deep copy of the training state, so later steps cannot change what a test compares against."""
    return copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step})


def train_step(model: nn.Module, opt: torch.optim.Optimizer, gen: torch.Generator, width: int = 256) -> None:
    x = torch.randn(32, width, generator=gen)
    opt.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    opt.step()


def save_run(root: Path, model: nn.Module, opt: torch.optim.Optimizer, steps: int, **kwargs: Any
             ) -> dict[int, dict[str, Any]]:
    """Train ``steps`` steps, saving after each; return the saved states by step."""
    states = train_states(model, opt, steps)
    with manager(root, **kwargs) as mgr:
        for step, state in states.items():
            mgr.save(step, state)
        mgr.wait()
    return states


def train_states(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> dict[int, dict[str, Any]]:
    """Deep copies of the training state after each of ``steps`` steps (batches from a fixed seed)."""
    gen = torch.Generator().manual_seed(1)
    states = {}
    for step in range(steps):
        train_step(model, opt, gen)
        states[step] = snapshot_state(model, opt, step)
    return states


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 64))


def delta_chunks(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in manifest["chunks"] if c.get("base")]


def chunk_ids_of(manifest: dict[str, Any], prefix: str) -> set[str]:
    """Ids of every chunk holding bytes of a tensor whose key path starts with ``prefix``."""
    chunks = manifest["chunks"]
    return {chunks[p[0]]["id"] for t in manifest["tensors"] if t["path"].startswith(prefix) for p in t["pieces"]}


def assert_restores_exactly(mgr: CheckpointManager, states: dict[int, Any]) -> None:
    for step, state in states.items():
        assert_same_state(state, mgr.restore(step))


# -- unchanged data costs nothing ------------------------------------------------------------------------


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update ``B @ A`` (B starts at zero, as in LoRA)."""

    def __init__(self, width: int, rank: int) -> None:
        super().__init__()
        self.base = nn.Linear(width, width, bias=False)
        self.base.weight.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, width) * 0.01)
        self.lora_b = nn.Parameter(torch.zeros(width, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + x @ self.lora_a.T @ self.lora_b.T


def test_frozen_base_with_adapters_adds_only_adapter_and_optimizer_bytes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(LoRALinear(256, 4), nn.Tanh(), LoRALinear(256, 4), nn.Tanh(), LoRALinear(256, 4))
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-3)
    states = save_run(tmp_path / "v", model, opt, 3)
    adapter_bytes = sum(p.numel() * 4 for p in trainable)
    opt_bytes = sum(v.numel() * v.element_size() for s in opt.state_dict()["state"].values() for v in s.values())
    frozen_bytes = sum(m.base.weight.numel() * 4 for m in model if isinstance(m, LoRALinear))
    assert frozen_bytes > 10 * (adapter_bytes + opt_bytes)  # the frozen base dominates the state
    with manager(tmp_path / "v") as mgr:
        keyframe = mgr.manifest(0)
        frozen_chunks = chunk_ids_of(keyframe, "model.0.base") | chunk_ids_of(keyframe, "model.2.base")
        for step in (1, 2):
            m = mgr.manifest(step)
            assert chunk_ids_of(m, "model.4.base") == chunk_ids_of(keyframe, "model.4.base")
            new = {c["id"] for c in m["chunks"] if c["new"]}
            assert not new & frozen_chunks, "a frozen weight was written again"
            assert 0 < m["added_bytes"] <= adapter_bytes + opt_bytes + len(new) * HEADER_SLACK
            assert m["added_bytes"] < 0.12 * keyframe["added_bytes"]
        assert_restores_exactly(mgr, states)


def test_saving_the_same_state_again_adds_nothing(tmp_path: Path) -> None:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train_step(model, opt, torch.Generator().manual_seed(0))
    state = snapshot_state(model, opt, 0)
    with manager(tmp_path / "v") as mgr:
        mgr.save(0, state)
        mgr.save(1, state).wait()
        first, second = mgr.manifest(0), mgr.manifest(1)
        assert second["added_bytes"] == 0
        assert not any(c["new"] for c in second["chunks"])
        assert {c["id"] for c in second["chunks"]} == {c["id"] for c in first["chunks"]}
        assert_same_state(state, mgr.restore(1))


def test_frozen_layers_keep_their_chunks(tmp_path: Path) -> None:
    model = mlp()
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    states = save_run(tmp_path / "v", model, opt, 3)
    with manager(tmp_path / "v") as mgr:
        frozen = chunk_ids_of(mgr.manifest(0), "model.0.weight")
        assert len(frozen) == 4  # 256 KiB in four chunks of its own
        for step in (1, 2):
            m = mgr.manifest(step)
            assert chunk_ids_of(m, "model.0.weight") == frozen
            assert not any(c["new"] for c in m["chunks"] if c["id"] in frozen)
        assert_restores_exactly(mgr, states)


class TiedLM(nn.Module):
    """An embedding whose weight is also the output projection (weight tying, as in GPT-2)."""

    def __init__(self, vocab: int = 1024, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.hidden = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embed(tokens))))


def test_tied_weights_are_stored_once_and_stay_tied(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    states = {}
    with manager(tmp_path / "v") as mgr:
        for step in range(3):
            tokens = torch.randint(0, 1024, (8, 16), generator=gen)
            opt.zero_grad()
            nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
            opt.step()
            states[step] = snapshot_state(model, opt, step)
            mgr.save(step, states[step])
        mgr.wait()
        table_bytes = 1024 * 64 * 4
        for step in range(3):
            m = mgr.manifest(step)
            paths = [t["path"] for t in m["tensors"]]
            assert "model.embed.weight" in paths and "model.head.weight" not in paths  # one record, two key paths
            every = _tensors(states[step])
            distinct = {t.untyped_storage().data_ptr(): t for t in every}.values()
            assert m["logical_bytes"] == sum(t.numel() * t.element_size() for t in distinct)
            assert m["logical_bytes"] == sum(t.numel() * t.element_size() for t in every) - table_bytes
        restored = mgr.restore(2)
        assert_same_state(states[2], restored)
        tied = restored["model"]["head.weight"], restored["model"]["embed.weight"]
        assert tied[0].untyped_storage().data_ptr() == tied[1].untyped_storage().data_ptr()


def _tensors(state: Any) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    if isinstance(state, dict):
        return [t for v in state.values() for t in _tensors(v)]
    if isinstance(state, (list, tuple)):
        return [t for v in state for t in _tensors(v)]
    return []


def test_sparse_embedding_updates_cost_about_the_touched_rows(tmp_path: Path) -> None:
    """SparseAdam touches 40 of 8192 rows per step: weights and both moments change only there."""
    torch.manual_seed(0)
    rows, width, touched_per_step = 8192, 32, 40
    emb = nn.Embedding(rows, width, sparse=True)
    opt = torch.optim.SparseAdam(emb.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    states, touched = {}, set()
    with manager(tmp_path / "v") as mgr:
        for step in range(4):
            index = torch.randperm(rows, generator=gen)[:touched_per_step]
            touched |= set(index.tolist()) if step else set()
            opt.zero_grad()
            emb(index).pow(2).sum().backward()
            opt.step()
            states[step] = copy.deepcopy({"model": emb.state_dict(), "optimizer": opt.state_dict()})
            mgr.save(step, states[step])
            mgr.wait()
            m = mgr.manifest(step)
            if step == 0:
                continue
            # rows changed since the keyframe, in the weight and both moments
            changed_bytes = len(touched) * width * 4 * 3
            assert delta_chunks(m), "expected the changed table chunks to be stored as deltas"
            assert m["added_bytes"] <= 2 * changed_bytes + len(m["chunks"]) * HEADER_SLACK
            assert m["added_bytes"] < 0.1 * mgr.manifest(0)["added_bytes"]
        assert_restores_exactly(mgr, states)


# -- deltas ---------------------------------------------------------------------------------------------


def test_deltas_are_smaller_bit_exact_and_one_level_deep(tmp_path: Path) -> None:
    """Every delta's base is a full keyframe chunk, so restoring a chunk reads at most two objects (DESIGN C2)."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    states = save_run(tmp_path / "v", model, opt, 4, keyframe_every=10)
    with manager(tmp_path / "v") as mgr:
        keyframe = mgr.manifest(0)
        key_chunks = {c["id"]: c for c in keyframe["chunks"]}
        assert not delta_chunks(keyframe)
        for step in (1, 2, 3):
            m = mgr.manifest(step)
            assert (m["keyframe_step"], m["since_keyframe"]) == (0, step)
            deltas = delta_chunks(m)
            assert len(deltas) >= 8, "the changed 256 KiB weights and moments should be deltas"
            for entry in deltas:
                base = entry["base"]
                assert base in key_chunks and key_chunks[base].get("base") is None
                assert mgr.vault.chunk_base(base) is None  # the base object is a full chunk: chains stop there
                assert mgr.vault.chunk_base(entry["id"]) == base
                assert entry["stored"] < key_chunks[base]["stored"]
            assert m["added_bytes"] < 0.9 * keyframe["added_bytes"]
        assert_restores_exactly(mgr, states)
        assert mgr.verify().ok


def test_a_delta_that_does_not_pay_is_stored_in_full(tmp_path: Path) -> None:
    """Incompressible bytes replaced by fresh incompressible bytes: the XOR is no smaller, so no delta."""
    gen = torch.Generator().manual_seed(0)
    states = {s: {"noise": torch.randint(0, 256, (256 << 10,), dtype=torch.uint8, generator=gen)} for s in range(2)}
    with manager(tmp_path / "v") as mgr:
        for step, state in states.items():
            mgr.save(step, state)
        mgr.wait()
        m = mgr.manifest(1)
        assert m["keyframe_step"] == 0 and len(m["chunks"]) == 4
        assert not delta_chunks(m)
        assert all(c["new"] for c in m["chunks"])
        assert_restores_exactly(mgr, states)


def test_incremental_false_stores_no_deltas(tmp_path: Path) -> None:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    states = save_run(tmp_path / "v", model, opt, 3, incremental=False)
    with manager(tmp_path / "v") as mgr:
        for step in range(3):
            m = mgr.manifest(step)
            assert not delta_chunks(m)
            assert (m["keyframe_step"], m["since_keyframe"]) == (step, 0)
        assert_restores_exactly(mgr, states)


# -- keyframe cadence -------------------------------------------------------------------------------------


def cadence(mgr: CheckpointManager) -> list[tuple[int, int]]:
    return [(mgr.manifest(s)["keyframe_step"], mgr.manifest(s)["since_keyframe"]) for s in mgr.steps()]


def test_a_keyframe_every_k_checkpoints(tmp_path: Path) -> None:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    states = save_run(tmp_path / "v", model, opt, 7, keyframe_every=3)
    with manager(tmp_path / "v") as mgr:
        assert cadence(mgr) == [(0, 0), (0, 1), (0, 2), (3, 0), (3, 1), (3, 2), (6, 0)]
        for step in (3, 6):
            assert not delta_chunks(mgr.manifest(step))
        four = {c["base"] for c in delta_chunks(mgr.manifest(4))}
        assert four and four <= {c["id"] for c in mgr.manifest(3)["chunks"]}  # deltas follow the new keyframe
        assert_restores_exactly(mgr, states)


def test_keyframe_every_one_means_no_deltas(tmp_path: Path) -> None:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    save_run(tmp_path / "v", model, opt, 3, keyframe_every=1)
    with manager(tmp_path / "v") as mgr:
        assert cadence(mgr) == [(0, 0), (1, 0), (2, 0)]


def test_a_keyframe_when_the_previous_checkpoint_grew_too_much(tmp_path: Path) -> None:
    """keyframe_growth=0.05: a delta checkpoint that added more than 5% of the keyframe forces a keyframe."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    states = save_run(tmp_path / "v", model, opt, 5, keyframe_growth=0.05)
    with manager(tmp_path / "v") as mgr:
        assert mgr.manifest(1)["added_bytes"] > 0.05 * mgr.manifest(0)["stored_bytes"]
        assert cadence(mgr) == [(0, 0), (0, 1), (2, 0), (2, 1), (4, 0)]
        assert_restores_exactly(mgr, states)
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    save_run(tmp_path / "x", model, opt, 5, keyframe_growth=10.0)
    with manager(tmp_path / "x") as mgr:
        assert cadence(mgr) == [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4)]


@pytest.mark.parametrize(("every", "growth"), [(0, 0.9), (3, 0.0), (3, -1.0)])
def test_bad_keyframe_settings_are_refused(tmp_path: Path, every: int, growth: float) -> None:
    with pytest.raises(InvalidArgumentError, match="keyframe_every must be >= 1" if every < 1 else "keyframe_growth must be > 0"):
        CheckpointManager(tmp_path / "v", keyframe_every=every, keyframe_growth=growth)


def test_a_keyframe_when_the_keyframes_manifest_was_deleted(tmp_path: Path) -> None:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    gen = torch.Generator().manual_seed(0)
    states = {}
    with manager(tmp_path / "v") as mgr:
        for step in range(2):
            train_step(model, opt, gen)
            states[step] = snapshot_state(model, opt, step)
            mgr.save(step, states[step])
        mgr.wait()
        mgr.delete(0)
        train_step(model, opt, gen)
        states[2] = snapshot_state(model, opt, 2)
        mgr.save(2, states[2]).wait()
        m = mgr.manifest(2)
        assert (m["keyframe_step"], m["since_keyframe"]) == (2, 0)
        assert not delta_chunks(m)
        train_step(model, opt, gen)
        states[3] = snapshot_state(model, opt, 3)
        mgr.save(3, states[3]).wait()
        assert mgr.manifest(3)["keyframe_step"] == 2 and delta_chunks(mgr.manifest(3))
        del states[0]
        assert_restores_exactly(mgr, states)  # step 1's deltas still find the old keyframe's chunks


# -- deletion, gc and damage ------------------------------------------------------------------------------


def test_gc_after_deleting_the_keyframe_keeps_every_delta_restorable(tmp_path: Path) -> None:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    states = save_run(tmp_path / "v", model, opt, 4, keyframe_every=10)
    with manager(tmp_path / "v") as mgr:
        bases = {c["base"] for s in (1, 2, 3) for c in delta_chunks(mgr.manifest(s))}
        assert bases
        only_keyframe = {c["id"] for c in mgr.manifest(0)["chunks"]} - bases
        mgr.delete(0)
        plan, result = collect(mgr.vault, grace=0)
        assert result is not None
        deleted = {g.key for g in result.deleted}
        assert not {chunk_key(b) for b in bases} & deleted, "gc deleted a delta base"
        still_used = {c["id"] for s in (1, 2, 3) for c in mgr.manifest(s)["chunks"]}
        assert only_keyframe - still_used, "the keyframe should own some chunks no later checkpoint uses"
        assert {chunk_key(c) for c in only_keyframe - still_used} <= deleted
        report = mgr.verify()
        assert report.ok and report.checked == [1, 2, 3], report.problems
        del states[0]
        assert_restores_exactly(mgr, states)


def test_a_corrupt_base_chunk_fails_the_delta_restore(tmp_path: Path) -> None:
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    save_run(tmp_path / "v", model, opt, 2)
    with manager(tmp_path / "v") as mgr:
        delta = delta_chunks(mgr.manifest(1))[0]
        path = tmp_path / "v" / chunk_key(delta["base"])
        data = bytearray(path.read_bytes())
        header, _ = parse_object(delta["base"], bytes(data))
        data[-1] ^= 0xFF  # damage the payload, keep the header readable
        path.chmod(0o644)
        path.write_bytes(bytes(data))
        with pytest.raises(CorruptChunkError) as caught:
            mgr.restore(1)
        message = str(caught.value)
        assert delta["base"] in message and "delta base" in message and "step 1" in message
        assert header.base is None
        report = mgr.verify(1)
        assert not report.ok and any(delta["base"] in p for p in report.problems[1])


# -- states whose shape or key set changes ----------------------------------------------------------------


def test_resized_embedding_and_new_param_group_are_stored_in_full_and_restore_exactly(tmp_path: Path) -> None:
    torch.manual_seed(0)
    emb = nn.Embedding(1000, 64)
    head = nn.Linear(64, 64)
    opt = torch.optim.AdamW(list(emb.parameters()) + list(head.parameters()), lr=1e-4)
    gen = torch.Generator().manual_seed(0)

    def step_once() -> None:
        tokens = torch.randint(0, emb.num_embeddings, (32,), generator=gen)
        opt.zero_grad()
        head(emb(tokens)).pow(2).mean().backward()
        opt.step()

    states = {}
    with manager(tmp_path / "v") as mgr:
        step_once()
        states[0] = snapshot_state(nn.ModuleDict({"emb": emb, "head": head}), opt, 0)
        mgr.save(0, states[0])
        # grow the vocabulary by 200 rows (a fresh embedding and optimizer, as when resizing token embeddings)
        grown = nn.Embedding(1200, 64)
        with torch.no_grad():
            grown.weight[:1000] = emb.weight
        emb = grown
        extra = nn.Linear(64, 64)
        opt = torch.optim.AdamW(list(emb.parameters()) + list(head.parameters()), lr=1e-4)
        opt.add_param_group({"params": list(extra.parameters()), "lr": 1e-3})
        step_once()
        extra(torch.randn(4, 64)).sum().backward()
        opt.step()
        states[1] = snapshot_state(nn.ModuleDict({"emb": emb, "head": head, "extra": extra}), opt, 1)
        mgr.save(1, states[1]).wait()
        m = mgr.manifest(1)
        assert m["keyframe_step"] == 0
        by_path = {t["path"]: t for t in m["tensors"]}
        assert by_path["model.emb.weight"]["shape"] == [1200, 64]
        resized = chunk_ids_of(m, "model.emb.weight") | chunk_ids_of(m, "model.extra")
        assert not any(c.get("base") for c in m["chunks"] if c["id"] in resized)
        assert len(m["tensors"]) > len(mgr.manifest(0)["tensors"])
        assert len(states[1]["optimizer"]["param_groups"]) == 2
        assert_restores_exactly(mgr, states)


def test_xor_never_modifies_its_inputs_unless_asked() -> None:
    """Saves XOR the caller's (or the staging buffer's) bytes: that memory must stay untouched."""
    import numpy as np

    from ckptvault._codecs.xor import xor

    data = np.arange(1001, dtype=np.uint8)
    base = np.full(1001, 0x5A, dtype=np.uint8)
    before = data.copy()
    out = np.frombuffer(xor(memoryview(data), memoryview(base)), dtype=np.uint8)
    assert np.array_equal(data, before) and np.array_equal(out, before ^ 0x5A)
    np.frombuffer(xor(memoryview(data), memoryview(base), in_place=True), dtype=np.uint8)
    assert np.array_equal(data, before ^ 0x5A)  # in place: only for the decoder's own scratch bytes


# -- the keyframe cache -------------------------------------------------------------------------------------


def mlp_states(steps: int, lr: float = 1e-5) -> dict[int, dict[str, Any]]:
    model = mlp()
    return train_states(model, torch.optim.AdamW(model.parameters(), lr=lr), steps)


def cached_run(store: CountingStore, states: dict[int, dict[str, Any]],
               cached: bool | None) -> tuple[int, list[dict[str, Any]]]:
    """Keyframe 0, then deltas 1..3 (checked restorable): (chunk bytes those delta saves read, their manifests)."""
    with CheckpointManager(store, chunk_size=CHUNK, cache_keyframe=cached, keyframe_every=10) as mgr:
        mgr.save(0, states[0]).wait()
        store.read.clear()
        for step in (1, 2, 3):
            mgr.save(step, states[step]).wait()
        read = store.chunk_bytes_read()
        cache = mgr._saver._keyframe_cache
        raw = sum(c["raw"] for c in mgr.manifest(0)["chunks"])
        if cached is False:
            assert cache is None
        else:  # every plane of a small keyframe, the high half of every float32 chunk of a large one
            assert cache is not None and cache.nbytes == (raw if raw <= policy.ALL_PLANES_UP_TO else raw // 2)
        assert len(delta_chunks(mgr.manifest(3))) >= 8
        assert_restores_exactly(mgr, states)
        return read, [mgr.manifest(s) for s in (1, 2, 3)]


def test_by_default_an_async_manager_caches_a_small_keyframe_whole_and_its_deltas_read_nothing(tmp_path: Path) -> None:
    states = mlp_states(4, lr=1e-3)
    store = CountingStore(tmp_path / "v")
    with CheckpointManager(store, chunk_size=CHUNK) as mgr:
        mgr.save(0, states[0]).wait()
        mgr.wait()
        assert mgr._saver._keyframe_cache.nbytes == sum(c["raw"] for c in mgr.manifest(0)["chunks"])
        store.read.clear()
        for step in (1, 2, 3):
            mgr.save(step, states[step]).wait()
        assert store.chunk_bytes_read() == 0 and len(delta_chunks(mgr.manifest(3))) >= 8
        assert_restores_exactly(mgr, states)


def test_by_default_a_sync_manager_keeps_the_small_keyframe_chunks_its_first_delta_read(tmp_path: Path) -> None:
    """The keyframe save copies nothing (its caller would wait for that); the first delta save reads each base chunk
    it needs once, as before, and keeps it; later deltas against that keyframe read nothing. The next keyframe's
    deltas read its chunks, into the same memory."""
    states = mlp_states(8, lr=1e-3)
    store = CountingStore(tmp_path / "v")
    with CheckpointManager(store, chunk_size=CHUNK, async_save=False, keyframe_every=3, keyframe_growth=10) as mgr:
        cache = mgr._saver._keyframe_cache

        def buffers() -> set[int]:
            return {kept.ctypes.data for _typesize, kept in cache._chunks.values()}

        mgr.save(1, states[1])
        assert cache.nbytes == 0
        reads, first = {}, set()
        for step in range(2, 8):
            store.read.clear()
            mgr.save(step, states[step])
            reads[step] = store.chunk_bytes_read()
            first = first or buffers()
        assert [mgr.manifest(s)["keyframe_step"] for s in range(1, 8)] == [1, 1, 1, 4, 4, 4, 7]
        assert reads[2] > 0 and reads[3] == 0  # step 2 read keyframe 1's chunks, step 3 nothing
        assert reads[5] > 0 and reads[6] == 0  # step 5 read keyframe 4's chunks, into the same memory
        assert cache._step == 4 and buffers() == first
        assert len(delta_chunks(mgr.manifest(6))) >= 8
        assert_restores_exactly(mgr, {s: states[s] for s in range(1, 8)})


def test_by_default_large_keyframes_are_cached_in_halves_and_not_kept_by_sync_deltas(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    states = mlp_states(4, lr=1e-3)
    monkeypatch.setattr(policy, "ALL_PLANES_UP_TO", 1 << 10)
    monkeypatch.setattr(pipeline, "ALL_PLANES_UP_TO", 1 << 10)
    for async_save, cached in ((False, None), (True, None), (False, True)):
        store = CountingStore(tmp_path / f"v{async_save}{cached}")
        with CheckpointManager(store, chunk_size=CHUNK, async_save=async_save, cache_keyframe=cached,
                               keyframe_growth=10) as mgr:
            mgr.save(1, states[1]).wait()
            mgr.wait()
            raw = sum(c["raw"] for c in mgr.manifest(1)["chunks"])
            kept = raw // 2 if async_save or cached else 0
            assert mgr._saver._keyframe_cache.nbytes == kept
            for step in (2, 3):
                store.read.clear()
                mgr.save(step, states[step]).wait()
                assert delta_chunks(mgr.manifest(step))
                assert (store.chunk_bytes_read() > 0) is (kept == 0)
            assert mgr._saver._keyframe_cache.nbytes == kept
            assert_restores_exactly(mgr, {s: states[s] for s in (1, 2, 3)})


def test_no_cache_without_deltas_or_with_cache_keyframe_false_nor_in_the_one_call_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for options in ({"keyframe_every": 1}, {"incremental": False}):  # no delta would ever use it
        with CheckpointManager(tmp_path / "v", cache_keyframe=True, **options) as mgr:
            assert mgr._saver._keyframe_cache is None
    with CheckpointManager(tmp_path / "v", cache_keyframe=False, async_save=False) as mgr:
        assert mgr._saver._keyframe_cache is None
    kept: list[str] = []
    real_begin, real_keep = KeyframeCache.begin, KeyframeCache.keep_read

    def begin(cache: KeyframeCache, step: int) -> None:
        kept.append(f"begin {step}")
        real_begin(cache, step)

    def keep_read(cache: KeyframeCache, step: int, *args: Any) -> None:
        kept.append(f"read {step}")
        real_keep(cache, step, *args)

    monkeypatch.setattr(KeyframeCache, "begin", begin)
    monkeypatch.setattr(KeyframeCache, "keep_read", keep_read)
    states = mlp_states(4, lr=1e-3)
    for n, options in enumerate(({"keyframe_growth": 10}, {"delta": DeltaOptions(keyframe_every=5, keyframe_growth=10)},
                                 {"keyframe_every": 5, "keyframe_growth": 10})):
        for step in (1, 2, 3):  # a keyframe, then deltas that read it back
            ckptvault.save(states[step], tmp_path / f"one{n}", step=step, chunk_size=CHUNK, **options)
        with CheckpointManager(tmp_path / f"one{n}") as mgr:
            assert delta_chunks(mgr.manifest(3))
    assert kept == []  # each call's manager ends with it: no later delta would use a cache
    ckptvault.save(states[1], tmp_path / "asked", step=1, cache_keyframe=True)
    assert kept == ["begin 1"]  # unless asked


def test_by_default_a_keyframe_too_large_to_stage_is_not_cached_unless_asked(tmp_path: Path) -> None:
    """max_staging_bytes says host memory is short: such a keyframe is saved synchronously and, by default, not cached."""
    states = mlp_states(2, lr=1e-3)  # about 1.8 MB
    for cached, expect_reads in ((None, True), (True, False)):
        store = CountingStore(tmp_path / f"v{cached}")
        with CheckpointManager(store, chunk_size=CHUNK, max_staging_bytes=1 << 20, cache_keyframe=cached) as mgr:
            mgr.save(0, states[0]).wait()
            assert (mgr._saver._keyframe_cache.nbytes > 0) is not expect_reads
            store.read.clear()
            mgr.save(1, states[1]).wait()
            assert (store.chunk_bytes_read() > 0) is expect_reads
            assert delta_chunks(mgr.manifest(1))
            assert_restores_exactly(mgr, states)


def test_with_a_cached_keyframe_dense_deltas_read_nothing_and_store_the_same(tmp_path: Path) -> None:
    """lr 1e-3: every element's high mantissa byte changes, so the low planes are noise, cached or not."""
    states = mlp_states(4, lr=1e-3)
    (read_plain, plain), (read_cached, cached) = (cached_run(CountingStore(tmp_path / f"v{c}"), states, c)
                                                  for c in (False, None))
    assert read_cached == 0, "delta saves against a cached keyframe read no chunk"
    assert read_plain > 0.5 * sum(c["stored"] for c in plain[0]["chunks"])
    assert [m["chunks"] for m in cached] == [m["chunks"] for m in plain]


def test_with_a_cached_keyframe_barely_changed_chunks_read_their_base_and_store_about_the_same(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """lr 1e-5: most high mantissa bytes stay put, so a low plane may XOR to less: chunks of a keyframe too large to
    cache whole read their base."""
    monkeypatch.setattr(policy, "ALL_PLANES_UP_TO", 1 << 10)
    states = mlp_states(4)
    (read_plain, plain), (read_cached, cached) = (cached_run(CountingStore(tmp_path / f"v{c}"), states, c)
                                                  for c in (False, True))
    assert 0 < read_cached < 0.25 * read_plain
    for plain_manifest, cached_manifest in zip(plain, cached, strict=True):
        assert [c["id"] for c in cached_manifest["chunks"]] == [c["id"] for c in plain_manifest["chunks"]]
        assert cached_manifest["added_bytes"] <= 1.02 * plain_manifest["added_bytes"]


def test_with_a_small_cached_keyframe_barely_changed_chunks_read_nothing_and_store_the_same(tmp_path: Path) -> None:
    """Every plane of a small keyframe is cached: a low plane that XORs to less is XORed without a read."""
    states = mlp_states(4)
    (read_plain, plain), (read_cached, cached) = (cached_run(CountingStore(tmp_path / f"v{c}"), states, c)
                                                  for c in (False, True))
    assert read_plain > 0 and read_cached == 0
    assert [m["chunks"] for m in cached] == [m["chunks"] for m in plain]


def test_the_next_keyframe_reuses_the_cache_memory_and_its_deltas_use_the_new_planes(tmp_path: Path) -> None:
    states = mlp_states(4, lr=1e-3)
    store = CountingStore(tmp_path / "v")
    with CheckpointManager(store, chunk_size=CHUNK, keyframe_every=2) as mgr:
        cache = mgr._saver._keyframe_cache

        def buffers() -> set[int]:
            return {kept.ctypes.data for _typesize, kept in cache._chunks.values()}

        mgr.save(0, states[0])
        mgr.wait()  # the save and the cache filled after its commit
        first = buffers()
        mgr.save(1, states[1]).wait()
        mgr.save(2, states[2])  # a keyframe: the same shapes, so the same memory
        mgr.wait()
        assert mgr.manifest(2)["keyframe_step"] == 2 and buffers() == first
        store.read.clear()
        mgr.save(3, states[3]).wait()  # a delta against step 2's planes, not step 0's
        assert store.chunk_bytes_read() == 0
        assert {c["base"] for c in delta_chunks(mgr.manifest(3))} <= {c["id"] for c in mgr.manifest(2)["chunks"]}
        assert len(delta_chunks(mgr.manifest(3))) >= 8
        assert_restores_exactly(mgr, states)


def test_a_keyframe_save_reports_its_commit_before_it_fills_the_keyframe_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Filling the cache (splitting and copying half the state) runs after the commit: a save's wait() does not
    pay for it, and the next save waits for it before staging over the bytes it copies."""
    states = mlp_states(2, lr=1e-3)
    release, filling = threading.Event(), threading.Event()
    kept = KeyframeCache._kept

    def gated(cache: KeyframeCache, item: Any, every_plane: bool) -> Any:
        filling.set()
        assert release.wait(30), "the test never released the fill"
        return kept(cache, item, every_plane)

    monkeypatch.setattr(KeyframeCache, "_kept", gated)
    store = CountingStore(tmp_path / "v")
    with CheckpointManager(store, chunk_size=CHUNK) as mgr:
        cache = mgr._saver._keyframe_cache
        info = mgr.save(0, states[0]).wait(timeout=20)  # returns while the fill is held
        assert info is not None and info.step == 0 and mgr.steps() == [0]
        assert filling.wait(20) and cache.nbytes == 0
        release.set()
        mgr.wait()
        assert cache.nbytes == sum(c["raw"] for c in mgr.manifest(0)["chunks"])
        store.read.clear()
        mgr.save(1, states[1]).wait()
        assert delta_chunks(mgr.manifest(1)) and store.chunk_bytes_read() == 0
        assert_restores_exactly(mgr, states)


def test_a_keyframe_cache_that_cannot_be_filled_costs_its_deltas_reads_not_the_save(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    states = mlp_states(2, lr=1e-3)

    def out_of_memory(cache: KeyframeCache, item: Any, every_plane: bool) -> Any:
        raise MemoryError("injected: no memory for the keyframe cache")

    monkeypatch.setattr(KeyframeCache, "_kept", out_of_memory)
    store = CountingStore(tmp_path / "v")
    with CheckpointManager(store, chunk_size=CHUNK) as mgr:
        mgr.save(0, states[0]).wait()
        mgr.wait()
        assert mgr._saver._keyframe_cache.nbytes == 0
        assert "could not keep keyframe 0 in the keyframe cache (MemoryError: injected" in caplog.text
        store.read.clear()
        mgr.save(1, states[1]).wait()  # a delta all the same, against the keyframe read back
        assert delta_chunks(mgr.manifest(1)) and store.chunk_bytes_read() > 0
        assert_restores_exactly(mgr, states)


def test_a_failed_keyframe_save_leaves_no_cache_and_later_deltas_read_the_store(tmp_path: Path) -> None:
    states = mlp_states(3)
    store = CountingStore(tmp_path / "v")
    with CheckpointManager(store, chunk_size=CHUNK, cache_keyframe=True, keyframe_every=2) as mgr:
        mgr.save(0, states[0]).wait()  # keyframe 0, cached
        mgr.save(1, states[1]).wait()  # a delta against it
        store.fail_chunk_writes = True  # step 2 would be the next keyframe: it fails, nothing committed
        with pytest.raises(PermanentStorageError, match="injected failure"):
            mgr.save(2, states[2]).wait()
        store.fail_chunk_writes = False
        assert mgr._saver._keyframe_cache.nbytes == 0  # the failed keyframe's bytes were dropped
        assert mgr.steps() == [0, 1]
        mgr.save(2, states[2]).wait()  # retried: a keyframe again, cached again
        assert mgr.manifest(2)["keyframe_step"] == 2
        assert_restores_exactly(mgr, states)


def test_delta_saves_reread_no_manifest_their_saver_committed(tmp_path: Path) -> None:
    """Each delta save needs the latest manifest and its keyframe's: a saver that committed them keeps them parsed,
    the keyframe too after many more saves than it keeps of the latest."""
    store = CountingStore(tmp_path / "v")
    state = {"w": torch.arange(4096, dtype=torch.float32)}
    with CheckpointManager(store, chunk_size=CHUNK, async_save=False, keyframe_every=20) as mgr:
        for step in range(12):
            state["w"][step] += 1.0
            mgr.save(step, state)
        manifest_reads = {key: n for key, n in store.read.items() if key.startswith("manifests/")}
        assert mgr.manifest(11)["keyframe_step"] == 0
    assert manifest_reads == {}, f"delta saves read manifests their saver had committed: {manifest_reads}"
    with CheckpointManager(store, chunk_size=CHUNK) as mgr:
        assert_same_state(state, mgr.restore(11))


class ListingStore(CountingStore):
    """A counting store that also counts listings of the manifests."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.manifest_listings = 0

    def list(self, prefix: str = ""):  # type: ignore[no-untyped-def]
        if prefix.startswith("manifests"):
            self.manifest_listings += 1
        return super().list(prefix)


def test_a_save_a_few_steps_after_its_savers_last_one_finds_its_base_without_listing_the_vault(tmp_path: Path) -> None:
    """Consecutive saves, and saves a few steps apart (up to policy.NEARBY), take the step their saver committed last
    as the one before them, checking the steps in between by name: the vault's manifests are never listed, however
    many it holds. Further apart, the manifests are listed."""
    store = ListingStore(tmp_path / "v")
    state = {"w": torch.arange(4096, dtype=torch.float32)}
    with CheckpointManager(store, chunk_size=CHUNK, async_save=False, keyframe_every=50) as mgr:
        mgr.save(0, state)
        listed = store.manifest_listings
        for step in [*range(1, 6), 9, 9 + policy.NEARBY]:
            state["w"][step % 4096] += 1.0
            mgr.save(step, state)
        assert store.manifest_listings == listed
        assert cadence(mgr) == [(0, n) for n in range(8)]
        listed = store.manifest_listings
        mgr.save(10 + 2 * policy.NEARBY, state)
        assert store.manifest_listings == listed + 1
        assert cadence(mgr)[-1] == (0, 8)


def test_a_step_another_writer_committed_in_between_or_the_loss_of_the_last_one_is_noticed(tmp_path: Path) -> None:
    """The by-name lookup of the previous step sees a step committed in between by another manager (a delta after
    it, not after the saver's own last one), and a last step deleted since (a delta after the one before it)."""
    state = {"w": torch.arange(4096, dtype=torch.float32)}
    with CheckpointManager(tmp_path / "v", chunk_size=CHUNK, async_save=False, keyframe_every=50) as mine, \
            CheckpointManager(tmp_path / "v", chunk_size=CHUNK, async_save=False, keyframe_every=50) as other:
        mine.save(0, state)
        mine.save(1, state)
        other.save(2, state)  # its manager lists the vault: a delta after step 1
        mine.save(4, state)
        assert cadence(mine) == [(0, 0), (0, 1), (0, 2), (0, 3)]
        mine.delete(4)
        mine.save(5, state)  # step 4, the last it committed, is gone: after step 2
        assert [(s, mine.manifest(s)["since_keyframe"]) for s in mine.steps()] == [(0, 0), (1, 1), (2, 2), (5, 3)]
