"""torch.distributed.checkpoint (DCP) into a vault: ckptvault.distributed's VaultWriter, VaultReader and planners.

The end-to-end tests run real processes with real collectives (tests/helpers/dcp_worker.py: gloo on CPU, a model
sharded with FSDP2 ``fully_shard`` and trained with AdamW): a save on 2 ranks, loads on 2, 3 (uneven shards) and 1
(no process group) ranks checked bit for bit against the full state dict the saver gathered, deduplication across
steps, values without pickle, a restore without a process group, verify and gc, a failing rank. The rest drives the
writer's DCP protocol by hand in this process (tests/helpers/dcp_ranks.py) for the schema of sharded manifests
(docs/DESIGN.md section 4, "DCP checkpoints").
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict

import ckptvault
from ckptvault._format import schema
from ckptvault._format.manifest import decode_manifest, encode_manifest
from ckptvault._vault import Vault
from ckptvault.distributed import VaultLoadPlanner, VaultReader, VaultSavePlanner, VaultWriter
from ckptvault.errors import (
    CorruptManifestError,
    FormatVersionError,
    PickleNotAllowedError,
    StepExistsError,
    StorageFullError,
    UnsupportedObjectError,
)
from ckptvault.stores import open_store
from ckptvault.testing.faults import FaultyStore
from conftest import assert_same_state, chunk_files, manifest_files
from helpers import dcp_worker
from helpers.dcp_ranks import Shard, golden_ranks, golden_whole, save_as_ranks


def _child(node: dict[str, Any], key: str) -> dict[str, Any]:
    """The child at ``key`` of a dict node (or of a manifest body's tree)."""
    node = node.get("tree", node)
    return next(child for k, child in node["dict"] if k == {"str": key})


def _failure_in(call: Any) -> BaseException:
    """The one rank's exception inside the CheckpointException (a BaseException) that DCP raises for it."""
    with pytest.raises(CheckpointException) as info:
        call()
    ((exc, _),) = info.value.failures.values()
    return exc


# -- the real thing: processes, gloo, FSDP2 ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """A vault with steps 1-3 saved by 2 ranks (and a refused step 1, a failed step 4), and what the ranks saw."""
    out = tmp_path_factory.mktemp("dcp")
    url = str(out / "vault")
    dcp_worker.spawn(dcp_worker.save_run, 2, (url, str(out)), out)
    return url, out


def _expected(out: Path, step: int) -> dict[str, Any]:
    return torch.load(out / f"expected_{step}.pt")


def _report(out: Path, rank: int) -> dict[str, Any]:
    return json.loads((out / f"save_rank{rank}.json").read_text())


def test_two_ranks_commit_one_manifest_per_step_with_every_shard(saved: tuple[str, Path]) -> None:
    url, _ = saved
    with ckptvault.CheckpointManager(url) as mgr:
        assert mgr.steps() == [1, 2, 3]
        body, keyframe = mgr.manifest(2), mgr.manifest(1)
    assert keyframe["requires"] == ["sharded"]
    assert body["requires"] == ["sharded", "xplanes"] and body["metrics"] == {"loss": 0.5}  # a delta needs xplanes
    shards = [t for t in body["tensors"] if t["path"] == "model.frozen.weight"]
    assert [(t["shape"], t["offsets"], t["global_shape"]) for t in shards] == [
        ([65, 128], [0, 0], [129, 128]), ([64, 128], [65, 0], [129, 128])]  # FSDP2 cuts 129 rows 65 + 64
    assert [k for k, _ in body["tree"]["dict"]] == [{"str": "model"}, {"str": "optim"}, {"str": "extra"}]
    node = _child(_child(body, "model"), "frozen.weight")
    assert [body["tensors"][i]["path"] for i in node["shards"]] == ["model.frozen.weight"] * 2


def test_a_later_step_adds_less_and_an_unchanged_one_adds_nothing(saved: tuple[str, Path]) -> None:
    """(b) The frozen layer's chunks are stored once (dedup across steps and ranks); the first save compresses."""
    url, _ = saved
    with ckptvault.CheckpointManager(url) as mgr:
        first, second, same = mgr.info(1), mgr.info(2), mgr.info(3)
    assert 0 < second.added_bytes < first.added_bytes
    assert first.stored_bytes < first.logical_bytes
    assert same.added_bytes == 0 and same.stored_bytes == second.stored_bytes


def test_a_later_step_stores_its_changed_shards_as_deltas_against_the_keyframe(saved: tuple[str, Path]) -> None:
    """The coordinator chose once: step 1 is the keyframe, step 2 a delta against it, each rank's changed chunks
    encoded against the keyframe chunk of the same shard (matched by key path and offsets)."""
    url, _ = saved
    with ckptvault.CheckpointManager(url) as mgr:
        first, second = mgr.manifest(1), mgr.manifest(2)
    assert (first["keyframe_step"], first["since_keyframe"]) == (1, 0)
    assert (second["keyframe_step"], second["since_keyframe"]) == (1, 1)
    keyframe_ids = {c["id"] for c in first["chunks"]}
    bases = [c["base"] for c in second["chunks"] if c.get("base")]
    assert bases and set(bases) <= keyframe_ids


@pytest.mark.parametrize("world, vault_planner", [(2, False), (3, True)], ids=["2-ranks-default-planner",
                                                                               "3-ranks-uneven-VaultLoadPlanner"])
def test_load_at_another_world_size_is_exact(saved: tuple[str, Path], tmp_path: Path, world: int,
                                             vault_planner: bool) -> None:
    """(a) DCP intersects the saved boxes (65 + 64 rows) with the loading ranks' (43 + 43 + 43 on 3 ranks)."""
    url, out = saved
    dcp_worker.spawn(dcp_worker.load_run, world, (url, str(tmp_path), 2, vault_planner), tmp_path)
    loaded = torch.load(tmp_path / f"loaded_w{world}.pt")
    assert_same_state(_expected(out, 2), loaded)


def test_load_without_a_process_group_into_a_plain_model_never_unpickles(saved: tuple[str, Path],
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """(a, c) World size 1: whole tensors from 2 shards each, values back with VaultLoadPlanner while every way to
    unpickle raises."""
    url, out = saved
    net = dcp_worker.Net(1)
    opt = torch.optim.AdamW([p for p in net.parameters() if p.requires_grad], lr=1e-2)
    model, optim = get_state_dict(net, opt)
    state = {"model": model, "optim": optim, "extra": dcp_worker.placeholder_values()}
    expected = _expected(out, 2)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("something unpickled while loading")

    for module, name in ((torch, "load"), (pickle, "loads"), (pickle, "load")):
        monkeypatch.setattr(module, name, refuse)
    dcp.load(state, storage_reader=VaultReader(url, 2), planner=VaultLoadPlanner())
    monkeypatch.undo()
    assert_same_state(expected["model"], dict(state["model"]))  # a plain model's state dict is an OrderedDict
    assert_same_state(expected["optim"], state["optim"])
    assert state["extra"] == dcp_worker.values(2)


def test_values_are_stored_without_pickle(saved: tuple[str, Path]) -> None:
    """(c) The manifest says no pickle; values are tree nodes; no chunk holds a pickle or torch.save stream."""
    url, _ = saved
    with ckptvault.CheckpointManager(url) as mgr:
        body = mgr.manifest(2)
    assert body["pickle"] is False and {t["kind"] for t in body["tensors"]} == {"torch"}
    assert _child(body, "extra") == {"dict": [[{"str": "step"}, {"int": 2}], [{"str": "run"}, {"dict": [
        [{"str": "name"}, {"str": "dcp-test"}], [{"str": "lr"}, {"float": (1e-2).hex()}],
        [{"str": "tags"}, {"list": [{"str": "a"}, {"str": "b"}]}]]}]]}
    vault = Vault(url)
    for path in chunk_files(url):  # deltas too: read whole, against their base
        raw = bytes(vault.read_chunk(path.name))
        pickled = raw[:1] == b"\x80" and raw[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05") and raw.endswith(b".")
        assert b"data.pkl" not in raw and b"PK\x03\x04" not in raw and not pickled, path.name


def test_restore_without_a_process_group_gives_whole_tensors_and_the_tools_work(saved: tuple[str, Path]) -> None:
    """(d) CheckpointManager.restore consolidates the shards, nested as the state given to dcp.save; verify, ls and
    show work on the vault, and gc keeps every chunk a manifest names."""
    url, out = saved
    with ckptvault.CheckpointManager(url) as mgr:
        for step in (1, 2):
            restored = mgr.restore(step)
            expected = _expected(out, step)
            assert_same_state(expected["model"], restored["model"])
            assert_same_state(expected["optim"], restored["optim"])
            assert restored["extra"] == dcp_worker.values(step)
        named = {c["id"] for s in mgr.steps() for c in mgr.manifest(s)["chunks"]}
        mgr.gc(grace=0)
        assert {p.name for p in chunk_files(url)} == named
        assert mgr.verify().ok
        assert_same_state(_expected(out, 2)["model"], mgr.restore(3)["model"])
    for command in (["verify", url], ["ls", url], ["show", url, "2"]):
        done = subprocess.run([sys.executable, "-m", "ckptvault", *command], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
    assert "model.frozen.weight" in done.stdout


def test_a_failing_rank_commits_nothing_and_every_rank_sees_why(saved: tuple[str, Path]) -> None:
    """(e) Rank 1 holds a value that needs pickle: its write_data fails, the coordinator never commits step 4, and
    both ranks get a CheckpointException holding rank 1's UnsupportedObjectError, which names the key."""
    url, out = saved
    assert not (Path(url) / "manifests" / f"{4:020d}.json").exists()
    for rank in (0, 1):
        fault = _report(out, rank)["fault"]
        assert fault["types"] == {"1": "UnsupportedObjectError"}
        assert "extra.rank1_only" in fault["text"] and "allow_pickle" in fault["text"]


def test_a_committed_step_is_refused_on_every_rank(saved: tuple[str, Path]) -> None:
    """The coordinator refuses step 1 before any rank writes; the StepExistsError crosses to rank 1 intact."""
    _, out = saved
    for rank in (0, 1):
        exists = _report(out, rank)["exists"]
        assert exists["types"] == {"0": "StepExistsError"} and "step 1 is already committed" in exists["text"]


# -- in one process: the writer's protocol by hand ---------------------------------------------------------------

def test_two_ranks_in_one_process_round_trip_through_memory(memory_url: str) -> None:
    save_as_ranks(memory_url, 5, golden_ranks())
    save_as_ranks(memory_url, 6, golden_ranks())
    with ckptvault.CheckpointManager(memory_url) as mgr:
        assert_same_state(golden_whole(), mgr.restore(5))
        assert mgr.info(6).added_bytes == 0 and mgr.info(5).added_bytes > 0
        assert_same_state({"w": golden_whole()["w"]}, mgr.restore(5, keys="w"))
    for planner in (None, VaultLoadPlanner()):
        state = {"w": torch.zeros(6, 4), "m": torch.zeros(2, 3, dtype=torch.int16), "step": torch.tensor(0.0),
                 "lr": 0.0, "name": "", "tags": []}
        dcp.load(state, storage_reader=VaultReader(memory_url), planner=planner)
        assert_same_state(golden_whole(), state)


def test_a_value_that_needs_pickle_is_refused_naming_its_key_unless_allowed(local_url: str) -> None:
    ranks = golden_ranks()
    ranks[1]["obj.inner"] = complex(1, 2)
    with pytest.raises(UnsupportedObjectError, match="obj.inner"):
        save_as_ranks(local_url, 1, ranks)
    assert not manifest_files(local_url)
    save_as_ranks(local_url, 1, ranks, allow_pickle=True)
    with ckptvault.CheckpointManager(local_url) as mgr:
        assert mgr.manifest(1)["pickle"] is True
    state = {"obj": {"inner": 0j}}
    refused = _failure_in(lambda: dcp.load(state, storage_reader=VaultReader(local_url, 1)))
    assert isinstance(refused, PickleNotAllowedError) and "obj.inner" in str(refused)
    dcp.load(state, storage_reader=VaultReader(local_url, 1, allow_pickle=True))
    assert state == {"obj": {"inner": complex(1, 2)}}


def test_a_planner_without_lookup_object_needs_allow_pickle(local_url: str) -> None:
    """DCP's torch.save stream of a value is loaded (pickle) only with allow_pickle; the value is then stored as
    JSON all the same."""
    with pytest.raises(UnsupportedObjectError, match="torch.save streams"):
        save_as_ranks(local_url, 1, golden_ranks(), streams=True)
    save_as_ranks(local_url, 1, golden_ranks(), streams=True, allow_pickle=True)
    with ckptvault.CheckpointManager(local_url) as mgr:
        assert mgr.manifest(1)["pickle"] is False
        assert_same_state(golden_whole(), mgr.restore(1))


def test_a_rank_whose_store_fails_commits_nothing(local_url: str) -> None:
    """Rank 1 cannot write its chunks: its write_data raises the store's typed error, and nothing is committed."""
    faulty = FaultyStore(open_store(local_url), fail=1.0, methods=("put_if_absent",), keys=("chunks/",),
                         error=StorageFullError)
    with pytest.raises(StorageFullError, match="injected fault"):
        save_as_ranks([local_url, faulty], 1, golden_ranks())
    assert not manifest_files(local_url)


def test_a_committed_step_is_refused_unless_overwrite(local_url: str) -> None:
    save_as_ranks(local_url, 1, golden_ranks())
    with pytest.raises(StepExistsError):
        save_as_ranks(local_url, 1, golden_ranks())
    save_as_ranks(local_url, 1, golden_ranks(), overwrite=True)


def test_errors_pickle_as_themselves() -> None:
    """DCP pickles a rank's exception to the others: ckptvault's errors must come back as their own class."""
    for exc in (StepExistsError(3, "memory://x"), UnsupportedObjectError("a.b", object(), "hint")):
        back = pickle.loads(pickle.dumps(exc))
        assert type(back) is type(exc) and str(back) == str(exc) and vars(back) == vars(exc)


def test_vault_save_planner_gives_other_writers_json(tmp_path: Path) -> None:
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    state = {"w": torch.arange(4.0), "cfg": {"name": "x", "betas": (0.9, 0.99)}, "n": 3}
    dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path)), planner=VaultSavePlanner())
    target = {"w": torch.zeros(4), "cfg": {"name": "", "betas": ()}, "n": 0}
    dcp.load(target, storage_reader=FileSystemReader(str(tmp_path)), planner=VaultLoadPlanner())
    assert_same_state(state, target)
    dcp.save({"w": torch.zeros(1), "n": 1}, storage_writer=FileSystemWriter(str(tmp_path / "pickled")))
    refused = _failure_in(lambda: dcp.load({"w": torch.zeros(1), "n": 0}, planner=VaultLoadPlanner(),
                                           storage_reader=FileSystemReader(str(tmp_path / "pickled"))))
    assert isinstance(refused, PickleNotAllowedError) and "never unpickles" in str(refused)


# -- the schema of sharded manifests (f) -------------------------------------------------------------------------

def _body(url: str) -> dict[str, Any]:
    (path,) = manifest_files(url)
    return json.loads(path.read_bytes()[88:-1])


def _as_tensor_node(body: dict[str, Any]) -> None:
    node = _child(body, "w")
    node.clear()
    node["tensor"] = 0


HOSTILE = {
    "outside-global-shape": (lambda b: b["tensors"][1].update(offsets=[5, 0]), r"tensors\[1\].offsets.*outside"),
    "duplicate-offsets": (lambda b: b["tensors"][1].update(offsets=[0, 0]), r"tensors\[1\].offsets.*same place"),
    "mismatched-dtype": (lambda b: b["tensors"][1].update(dtype="int32"), r"tensors\[1\].dtype.*float32"),
    "mismatched-global-shape": (lambda b: b["tensors"][1].update(global_shape=[7, 4]), r"tensors\[1\].global_shape"),
    "overlap": (lambda b: b["tensors"][1].update(offsets=[3, 0]), r"tensors\[1\].offsets.*overlaps"),
    "gap": (lambda b: _child(b, "w").update(shards=[0]), r"tree.dict\[0\]\[1\].shards.*16 elements"),
    "huge-global-shape": (lambda b: [b["tensors"][i].update(global_shape=[1 << 40, 4]) for i in (0, 1)],
                          r"tree.dict\[0\]\[1\].shards.*global_shape"),
    "extra-dimension": (lambda b: b["tensors"][0].update(offsets=[0, 0, 0]), r"tensors\[0\].offsets.*dimensions"),
    "a-shard-as-a-tensor": (_as_tensor_node, r"tensors\[0\].offsets.*no shards node"),
    "shared-shard": (lambda b: _child(b, "w").update(shards=[0, 1, 1]), r"shards\[2\] names tensors\[1\], which another"),
    "no-feature": (lambda b: b.pop("requires"), r"field requires.*'sharded'"),
}


@pytest.mark.parametrize("mutation", sorted(HOSTILE))
def test_hostile_sharded_manifests_are_refused_naming_the_field(local_url: str, mutation: str) -> None:
    save_as_ranks(local_url, 1, golden_ranks())
    body = _body(local_url)
    change, message = HOSTILE[mutation]
    change(body)
    with pytest.raises(CorruptManifestError, match=message):
        decode_manifest(encode_manifest(body), "hostile", 1)


def test_the_unchanged_manifest_passes(local_url: str) -> None:
    """The hostile tests' baseline: every mutation above is what makes its manifest fail."""
    save_as_ranks(local_url, 1, golden_ranks())
    decode_manifest(encode_manifest(_body(local_url)), "baseline", 1)


def test_a_reader_without_the_feature_refuses_it(local_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    save_as_ranks(local_url, 1, golden_ranks())
    monkeypatch.setattr(schema, "KNOWN_FEATURES", frozenset({"lossy", "xplanes"}))  # a reader before "sharded"
    with pytest.raises(FormatVersionError, match="sharded"):
        decode_manifest(encode_manifest(_body(local_url)), "old reader", 1)


def test_a_writer_bug_cannot_commit_an_unreadable_manifest(local_url: str) -> None:
    """Two ranks claiming the same box: the coordinator refuses to commit what readers would refuse."""
    ranks = golden_ranks()
    ranks[1]["w"] = Shard((6, 4), (2, 0), torch.zeros(2, 4))
    with pytest.raises(ckptvault.errors.SaveError, match="overlaps"):
        save_as_ranks(local_url, 1, ranks)
    assert not manifest_files(local_url)


def test_writer_and_reader_check_their_arguments(local_url: str) -> None:
    with pytest.raises(ckptvault.errors.InvalidArgumentError):
        VaultWriter(local_url, -1)
    with pytest.raises(ckptvault.errors.InvalidArgumentError):
        VaultWriter(local_url, 1).reset("not-a-step")
    with pytest.raises(ckptvault.errors.InvalidArgumentError, match="allow_pickle"):
        VaultReader(local_url, 1, allow_pickle="yes")  # type: ignore[arg-type]


@pytest.mark.parametrize("n", [100, 2_000_000])  # packed with others in one chunk; alone in chunks of its own
def test_load_into_tensors_tied_in_the_target_but_saved_apart(tmp_path: Path, n: int) -> None:
    """Different saved tensors loaded into one target tensor (tied in the loading model, not when saved) are read
    apart: no chunk is blamed, and the target holds one of the saved values whole, as DCP's FileSystemReader
    leaves it."""
    torch.manual_seed(n)
    saved = {"a": torch.randn(n), "b": torch.randn(n)}
    url = str(tmp_path / "v")
    dcp.save(dict(saved), storage_writer=VaultWriter(url, 1))
    shared = torch.zeros(n)
    dcp.load({"a": shared, "b": shared}, storage_reader=VaultReader(url, 1))
    assert torch.equal(shared, saved["a"]) or torch.equal(shared, saved["b"])


@pytest.mark.parametrize("n", [100, 2_000_000])  # packed with others in one chunk; alone in chunks of its own
def test_restore_into_tensors_tied_in_the_target_but_saved_apart_as_shards(tmp_path: Path, n: int) -> None:
    """The same through ``restore(into=)``, which rebuilds arrays stored as shards in their targets: arrays whose
    targets share memory are rebuilt apart and copied in after the reads, the last key path winning as with
    ``load_state_dict``; no chunk is blamed, and the untied target beside them is filled too."""
    torch.manual_seed(n)
    saved = {"a": torch.randn(n), "b": torch.randn(n), "c": torch.randn(n)}
    url = str(tmp_path / "v")
    dcp.save(dict(saved), storage_writer=VaultWriter(url, 1))
    shared, alone = torch.zeros(n), torch.zeros(n)
    with ckptvault.CheckpointManager(url) as mgr:
        assert "shards" in json.dumps(mgr.manifest(1)["tree"])
        target = {"a": shared, "b": shared, "c": alone}
        assert mgr.restore(1, into=target) is target
    assert torch.equal(shared, saved["b"]) and torch.equal(alone, saved["c"])
