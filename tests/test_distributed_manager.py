"""CheckpointManager in a torch.distributed job: collective saves and restores (ckptvault/distributed/_collective.py).

Real processes and real collectives (tests/helpers/dist_manager.py: gloo on CPU, FSDP2 ``fully_shard``, AdamW):
an asynchronous save at 2 ranks resumed bit for bit at 2 ranks (per-rank RNG states and loader positions each
rank's own), restores at 1, 3 and 4 ranks from saves at 2 and 4 ranks, a rank whose storage fails and a rank
killed with SIGKILL while writing (no commit, a RankFailedError naming the rank on every survivor within seconds),
and a vault path that differs between ranks (refused before anything is written). The per-rank bookkeeping is also
checked in this process.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptvault
from ckptvault.distributed import VaultWriter
from ckptvault.distributed._per_rank import (
    PER_RANK,
    own_values,
    per_rank_paths,
    saved_ranks,
    units,
    unwrap_targets,
    wrap,
    wrap_targets,
)
from ckptvault.errors import InvalidArgumentError, KeyMismatchError, RankFailedError, UnsharedVaultError
from conftest import assert_same_state, manifest_files
from helpers import dcp_worker, dist_manager


def _json(path: Path) -> Any:
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """Steps 2 and 3 saved asynchronously by 2 ranks (and a refused second save of step 3)."""
    out = tmp_path_factory.mktemp("job")
    url = str(out / "vault")
    dcp_worker.spawn(dist_manager.train_and_save, 2, (url, str(out), True), out)
    return url, out


def test_every_rank_saves_collectively_and_sees_the_same_commits(job: tuple[str, Path]) -> None:
    url, out = job
    for rank in (0, 1):
        report = _json(out / f"save_rank{rank}.json")
        assert report["distributed"] is True and report["steps"] == [2, 3] and report["info_2"] == 2
        assert report["exists"].startswith("step 3 is already committed")  # a StepExistsError on every rank
        assert report["cached_bytes"] > 0  # asynchronous: the keyframe cache holds this rank's keyframe chunks
    assert [p.name for p in manifest_files(url)] == [f"{2:020d}.json", f"{3:020d}.json"]
    with ckptvault.CheckpointManager(url) as mgr:
        assert mgr.info(2).metrics == {"loss": 1.0}
        keyframe, later = mgr.manifest(2), mgr.manifest(3)
        assert (later["keyframe_step"], later["since_keyframe"]) == (2, 1)
        assert 0 < mgr.info(3).added_bytes < mgr.info(2).added_bytes
    assert any(c.get("base") in {k["id"] for k in keyframe["chunks"]} for c in later["chunks"])


def test_values_that_differ_between_ranks_are_kept_per_rank(job: tuple[str, Path]) -> None:
    """(DESIGN D4) Without a process group the checkpoint reads whole: the per-rank values of both ranks side by side, the
    values every rank had alike once."""
    url, _ = job
    with ckptvault.CheckpointManager(url) as mgr:
        state = mgr.restore(3)
    assert state["step"] == 3
    assert state["loader"] == {PER_RANK: {"0": {"position": 1}, "1": {"position": 11}}}  # marked per_rank=("loader",)
    torch_states = state["rng"]["torch"][PER_RANK]  # seeded per rank: found different, so kept apart
    assert set(torch_states) == {"0", "1"} and not torch.equal(torch_states["0"], torch_states["1"])


def test_without_a_process_group_a_sharded_checkpoint_restores_into_whole_tensors(job: tuple[str, Path]) -> None:
    """A plain (unsharded) model's state dict as ``into=``: each array rebuilt from its shards in place, a
    non-contiguous target through a copy; a target of another shape is refused naming it, before any read."""
    url, out = job
    expected = torch.load(out / "expected_3.pt")["model"]
    into = {key: torch.zeros_like(value) for key, value in expected.items()}
    into["head.weight"] = torch.zeros(expected["head.weight"].shape[::-1]).t()
    pointers = {key: value.data_ptr() for key, value in into.items()}
    with ckptvault.CheckpointManager(url) as mgr:
        assert mgr.restore(3, into=into) is into
        assert_same_state(expected, into)
        assert {key: value.data_ptr() for key, value in into.items()} == pointers
        with pytest.raises(KeyMismatchError, match=r"'model.inner.weight': saved float32\[5, 129\] \(as shards\), "
                                                   r"target is float32\[5, 128\]"):
            mgr.restore(3, into={"inner.weight": torch.zeros(5, 128)})


def test_a_resume_at_the_same_world_size_is_bit_exact(job: tuple[str, Path]) -> None:
    """Model, optimizer and each rank's RNG state restored in place: two more steps match the uninterrupted run."""
    url, out = job
    dcp_worker.spawn(dist_manager.resume, 2, (url, str(out), 2), out)
    assert_same_state(torch.load(out / "expected_3.pt"), torch.load(out / "restored_w2.pt"))
    assert_same_state(torch.load(out / "final.pt"), torch.load(out / "resumed_w2.pt"))
    assert [_json(out / f"resume_w2_rank{r}.json") for r in (0, 1)] == [
        {"step": 3, "loader": {"position": 1}, "strict_error": None},
        {"step": 3, "loader": {"position": 11}, "strict_error": None}]


@pytest.mark.parametrize("world", [1, 4])
def test_a_restore_at_another_world_size_is_exact(job: tuple[str, Path], world: int) -> None:
    """2 -> 1 and 2 -> 4 ranks: the DTensors resharded in place; the ranks the save did not have get no per-rank
    values (strict=False), the others their own."""
    url, out = job
    dcp_worker.spawn(dist_manager.resume, world, (url, str(out), 0), out, timeout=180)
    assert_same_state(torch.load(out / "expected_3.pt"), torch.load(out / f"restored_w{world}.pt"))
    reports = [_json(out / f"resume_w{world}_rank{r}.json") for r in range(world)]
    assert [r["loader"] for r in reports] == [{"position": 1}, {"position": 11}, None, None][:world]
    if world == 4:  # strict: ranks 2 and 3 have no value of their own, and every rank stops (none hangs)
        errors = [r["strict_error"] for r in reports]
        assert errors[2].startswith("KeyMismatchError: 'loader' holds per-rank values of ranks [0, 1], none of rank 2")
        assert all(e.startswith("RankFailedError: the restore of step 3 failed on ranks 2, 3") for e in errors[:2])


def test_a_save_at_four_ranks_restores_at_three(tmp_path: Path) -> None:
    url = str(tmp_path / "vault")
    dcp_worker.spawn(dist_manager.save_once, 4, (url, str(tmp_path)), tmp_path, timeout=180)
    dcp_worker.spawn(dist_manager.resume, 3, (url, str(tmp_path), 0), tmp_path, timeout=180)
    assert_same_state(torch.load(tmp_path / "expected_3.pt"), torch.load(tmp_path / "restored_w3.pt"))
    assert [_json(tmp_path / f"resume_w3_rank{r}.json")["loader"] for r in range(3)] == [
        {"position": 1}, {"position": 11}, {"position": 21}]


def test_a_rank_whose_storage_fails_commits_nothing_and_every_rank_is_told(tmp_path: Path) -> None:
    """(DESIGN D1, D2) Rank 1's chunk writes fail with ENOSPC: no manifest, and both ranks get its error."""
    url = str(tmp_path / "vault")
    codes = dist_manager.spawn_independent(dist_manager.fail_during_write, 2, (url, str(tmp_path), "raise", 30.0),
                                           tmp_path)
    assert codes == [0, 0]
    for rank in (0, 1):
        report = _json(tmp_path / f"fail_raise_rank{rank}.json")
        assert report["error"] == "RankFailedError" and report["steps"] == []
        assert report["failures"] == {"1": "StorageFullError: No space left on device (injected on rank 1)"}
        assert "the save of step 5 failed on rank 1" in report["text"] and "nothing was committed" in report["text"]
    assert manifest_files(url) == []


def test_a_rank_killed_while_writing_commits_nothing_and_the_survivors_name_it(tmp_path: Path) -> None:
    """(DESIGN D1, D2) SIGKILL of rank 1 of 4 inside its chunk writes: every survivor raises RankFailedError naming rank 1 (and
    only it) well within the 30 s timeout."""
    url = str(tmp_path / "vault")
    codes = dist_manager.spawn_independent(dist_manager.fail_during_write, 4, (url, str(tmp_path), "kill", 30.0),
                                           tmp_path, timeout=180)
    assert codes == [0, -9, 0, 0]
    for rank in (0, 2, 3):
        report = _json(tmp_path / f"fail_kill_rank{rank}.json")
        assert report["error"] == "RankFailedError" and report["steps"] == []
        assert list(report["failures"]) == ["1"] and report["failures"]["1"].startswith("stopped responding")
        assert report["seconds"] < 25
    assert manifest_files(url) == []


def test_a_rank_that_hangs_while_writing_fails_the_others_at_the_timeout(tmp_path: Path) -> None:
    """(DESIGN D2) Rank 1 stops inside its chunk writes but stays alive: rank 0's collective gives up at the 3 s
    timeout and it raises RankFailedError saying no rank stopped beating, before rank 1 wakes up."""
    url = str(tmp_path / "vault")
    codes = dist_manager.spawn_independent(dist_manager.fail_during_write, 2, (url, str(tmp_path), "hang", 3.0),
                                           tmp_path, timeout=60)
    assert codes == [0, 3]
    report = _json(tmp_path / "fail_hang_rank0.json")
    assert report["error"] == "RankFailedError" and report["failures"] == {} and report["steps"] == []
    assert "every rank still beats" in report["text"] and "the timeout (3 s)" in report["text"]
    assert 3 <= report["seconds"] < 8
    assert manifest_files(url) == []


def test_a_vault_path_that_differs_between_ranks_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    """(DESIGN D5) Each rank names a directory of its own: UnsharedVaultError on both, and no file anywhere."""
    base = tmp_path / "nodes"
    base.mkdir()
    dcp_worker.spawn(dist_manager.unshared, 2, (str(base), str(tmp_path)), tmp_path)
    for rank in (0, 1):
        report = _json(tmp_path / f"unshared_rank{rank}.json")
        assert report["ranks"] == {"1": report["ranks"]["1"]} and "is not shared by every rank" in report["error"]
        assert "shared file system" in report["error"] and "object store" in report["error"]
        assert report["files"] == []


def test_dcp_async_save_with_the_plugin_blocks_for_a_staged_copy_reused_across_saves(tmp_path: Path) -> None:
    """VaultWriter as DCP's AsyncStager: training goes on as soon as ``dcp.async_save`` returns, each step holds
    the state of its call, and the second save stages into the first one's buffers."""
    url = str(tmp_path / "vault")
    dcp_worker.spawn(dist_manager.plugin_async, 2, (url, str(tmp_path)), tmp_path)
    with ckptvault.CheckpointManager(url) as mgr:
        assert mgr.steps() == [1, 2]
        for step in (1, 2):
            saved = mgr.restore(step)
            assert_same_state(torch.load(tmp_path / f"async_{step}.pt"), {"model": saved["model"], "optim": saved["optim"]})
    for rank in (0, 1):
        report = _json(tmp_path / f"async_rank{rank}.json")
        assert report["reused"] is True and report["buffers"] > 0


def test_a_manager_made_on_one_rank_only_fails_naming_the_others_instead_of_hanging(tmp_path: Path) -> None:
    url = str(tmp_path / "vault")
    dcp_worker.spawn(dist_manager.lonely, 2, (url, str(tmp_path)), tmp_path)
    report = _json(tmp_path / "lonely_rank0.json")
    assert list(report["failures"]) == ["1"] and "every rank makes one" in report["failures"]["1"]
    assert "DistributedOptions(enabled=False)" in report["text"]
    assert report["alone"] == [False, [1]]


def test_an_unexpected_failure_of_retention_reaches_rank_0_typed_as_in_a_single_process(tmp_path: Path) -> None:
    """Rank 0 runs retention after each commit; a bug in it (not a VaultError) reaches rank 0's next wait as the
    SaveError a single-process manager gives, saying the checkpoint itself was committed. Rank 1 is not told."""
    url = str(tmp_path / "vault")
    dcp_worker.spawn(dist_manager.retention_fails, 2, (url, str(tmp_path)), tmp_path)
    first = _json(tmp_path / "retention_rank0.json")
    assert first == {"error": "SaveError", "cause": "RuntimeError", "steps": [1],
                     "text": "step 1 was committed, but the retention that runs after it failed: "
                             "RuntimeError: retention bug"}
    assert _json(tmp_path / "retention_rank1.json") == {"error": None, "steps": [1]}


def test_lossy_rules_apply_to_shards_with_measured_errors_and_load_at_another_world_size(tmp_path: Path) -> None:
    """bf16, int8-block and residual-int8 (against the keyframe's copy of the same shard) on FSDP2 shards saved at 2
    ranks: each shard's error is measured and recorded, within its codec's bound; weights not ruled stay exact; a
    load at 3 ranks decodes bit for bit what a restore without a process group gives."""
    url = str(tmp_path / "vault")
    dcp_worker.spawn(dist_manager.lossy_save, 2, (url, str(tmp_path)), tmp_path)
    with ckptvault.CheckpointManager(url) as mgr:
        body = mgr.manifest(2)
        whole = mgr.restore(2)
    exact = torch.load(tmp_path / "lossy_2.pt")
    assert {"sharded", "lossy"} <= set(body["requires"])
    ruled = [t for t in body["tensors"] if t.get("lossy") and t["lossy"]["codec"] != "lossless"]
    assert {t["lossy"]["codec"] for t in ruled} == {"bf16", "int8-block", "residual-int8"}
    assert len({tuple(t["offsets"]) for t in ruled if t["path"] == "model.inner.weight"}) == 2  # one per rank
    recorded: dict[str, float] = {}
    for t in ruled:
        recorded[t["path"]] = max(recorded.get(t["path"], 0.0), t["lossy"]["error"]["max_abs"])
    for name, state in exact["optim"]["state"].items():
        got = whole["optim"]["state"][name]
        sq, avg = state["exp_avg_sq"], state["exp_avg"]
        assert ((got["exp_avg_sq"] - sq).abs() <= sq.abs() * 2.0 ** -8).all(), name  # bf16 rounding
        assert (got["exp_avg"] - avg).abs().max() <= avg.abs().max() / 254 * 1.0001, name  # int8, per-block absmax
        for key in ("exp_avg", "exp_avg_sq"):
            measured = (got[key] - state[key]).abs().max().item()
            assert measured == pytest.approx(recorded[f"optim.state.{name}.{key}"], rel=1e-3, abs=1e-12)
    moved = (exact["model"]["inner.weight"] - torch.load(tmp_path / "lossy_1.pt")["model"]["inner.weight"]).abs().max()
    assert 0 < (whole["model"]["inner.weight"] - exact["model"]["inner.weight"]).abs().max() <= moved / 254 * 1.0001
    for key in ("frozen.weight", "inner.bias", "head.weight", "head.bias"):
        assert torch.equal(whole["model"][key], exact["model"][key])
    dcp_worker.spawn(dist_manager.lossy_load, 3, (url, str(tmp_path)), tmp_path)
    assert_same_state({"model": whole["model"], "optim": whole["optim"]}, torch.load(tmp_path / "lossy_loaded_w3.pt"))


def test_the_ranks_agree_on_how_each_lossy_array_is_stored(tmp_path: Path) -> None:
    """(DESIGN D3) int8 is unsafe for rank 0's shard of ``x`` only: rather than an array stored half lossy, every
    shard of it is stored exactly, saying why; ``y``, safe on both ranks, stays int8 on both."""
    url = str(tmp_path / "vault")
    dcp_worker.spawn(dist_manager.lossy_split, 2, (url, str(tmp_path)), tmp_path)
    with ckptvault.CheckpointManager(url) as mgr:
        body = mgr.manifest(1)
        whole = mgr.restore(1)
    x = [t for t in body["tensors"] if t["path"] == "x"]
    y = [t for t in body["tensors"] if t["path"] == "y"]
    assert len(x) == 2 and all(t["lossy"]["codec"] == "lossless" and t["lossy"]["requested"] == "int8-block:64"
                               for t in x)
    assert all("stored exactly on every rank: the ranks' shards came out as" in t["lossy"]["notes"][0] for t in x)
    assert [t["lossy"]["codec"] for t in y] == ["int8-block", "int8-block"]
    expected = torch.full((8, 64), 1e-3)
    expected[:4, 0] = 1e3
    assert torch.equal(whole["x"], expected)


# -- per-rank bookkeeping, in this process -------------------------------------------------------------------------

def test_per_rank_units_are_found_by_pattern_by_difference_and_by_absence() -> None:
    state = {"model": {"w": torch.ones(2)}, "rng": {"torch": torch.zeros(3)}, "loader": {"pos": 4}, "step": 1}
    found = {path: forced for path, _value, forced in units(state, ("loader",))}
    assert found == {("model", "w"): False, ("rng", "torch"): False, ("loader",): True, ("step",): False}
    same, other = {("step",): ("a", False)}, {("step",): ("b", False)}
    assert per_rank_paths([same, same]) == set()
    assert per_rank_paths([same, other]) == {("step",)}
    assert per_rank_paths([same, {}]) == {("step",)}
    assert per_rank_paths([{("loader",): ("a", True)}, {("loader",): ("a", True)}]) == {("loader",)}
    with pytest.raises(InvalidArgumentError, match="'__per_rank__' at model is ckptvault's own"):
        list(units({"model": {PER_RANK: 1}}, ()))


def test_per_rank_values_wrap_and_unwrap_for_each_rank() -> None:
    state = {"rng": {"torch": 5, "numpy": 6}, "step": 1}
    wrapped = wrap(state, {("rng", "torch")}, rank=1)
    assert wrapped == {"rng": {"torch": {PER_RANK: {"1": 5}}, "numpy": 6}, "step": 1}
    assert state == {"rng": {"torch": 5, "numpy": 6}, "step": 1}  # the caller's state is not changed
    saved = {("rng", "torch"): {0, 1}}
    tree = {"dict": [[{"str": "rng"}, {"dict": [[{"str": "torch"}, {"dict": [[{"str": PER_RANK}, {"dict": [
        [{"str": "0"}, {"int": 1}], [{"str": "1"}, {"int": 2}]]}]]}]]}]]}
    assert saved_ranks(tree) == saved
    into = {"rng": {"torch": -1, "numpy": -1}}
    undo = wrap_targets(into, saved, rank=1, world=2, strict=True)
    assert into == {"rng": {"torch": {PER_RANK: {"1": -1}}, "numpy": -1}}
    into["rng"]["torch"][PER_RANK]["1"] = 2  # what the load puts there
    unwrap_targets(into, undo)
    assert into == {"rng": {"torch": 2, "numpy": -1}}
    with pytest.raises(KeyMismatchError, match=r"'rng.torch' holds per-rank values of ranks \[0, 1\], none of rank 3"):
        wrap_targets(into, saved, rank=3, world=4, strict=True)
    assert into == {"rng": {"torch": 2, "numpy": -1}}  # put back as it was
    undo = wrap_targets(into, saved, rank=3, world=4, strict=False)
    assert into == {"rng": {"numpy": -1}}
    unwrap_targets(into, undo)
    assert into == {"rng": {"torch": 2, "numpy": -1}}
    whole = {"rng": {"torch": {PER_RANK: {"0": 1, "1": 2}}}, "step": 3}
    assert own_values(whole, 1) == {"rng": {"torch": 2}, "step": 3}
    with pytest.raises(KeyMismatchError, match="none of rank 2: pass strict=False"):
        own_values({"x": {PER_RANK: {"0": 1}}}, 2)
    assert own_values({"rng": {"torch": {PER_RANK: {"0": 1}}}, "step": 3}, 2, strict=False) == {"step": 3}


def test_a_run_of_a_record_reads_only_the_pieces_that_hold_it() -> None:
    from ckptvault._format.records import Piece
    from ckptvault._restore.tensors import clipped

    pieces = (Piece(0, 100, 40), Piece(1, 0, 60), Piece(2, 8, 20))  # a record of 120 bytes over three chunks
    assert clipped(pieces, 0, 120) == pieces
    assert clipped(pieces, 30, 20) == (Piece(0, 130, 10), Piece(1, 0, 10))
    assert clipped(pieces, 100, 20) == (Piece(2, 8, 20),)
    assert clipped(pieces, 40, 60) == (Piece(1, 0, 60),)


def test_distributed_options_check_their_fields() -> None:
    assert ckptvault.DistributedOptions(per_rank="loader").per_rank == ("loader",)
    with pytest.raises(InvalidArgumentError, match="timeout must be a positive number of seconds, got 0"):
        ckptvault.DistributedOptions(timeout=0)
    with pytest.raises(InvalidArgumentError, match="enabled must be"):
        ckptvault.DistributedOptions(enabled="yes")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="per_rank patterns must not be empty"):
        ckptvault.DistributedOptions(per_rank=("",))


def test_without_torch_distributed_a_manager_saves_alone_unless_told_to_take_part(tmp_path: Path) -> None:
    with ckptvault.CheckpointManager(tmp_path / "v") as mgr:
        assert mgr.distributed is False
    with pytest.raises(InvalidArgumentError, match="torch.distributed is not initialised: call"):
        ckptvault.CheckpointManager(tmp_path / "v", distributed=ckptvault.DistributedOptions(enabled=True))
    with pytest.raises(InvalidArgumentError, match="distributed must be DistributedOptions"):
        ckptvault.CheckpointManager(tmp_path / "v", distributed={"timeout": 5})  # type: ignore[arg-type]


def test_the_writer_checks_its_codec_rules(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="bf17"):
        VaultWriter(tmp_path, 1, codec_rules={"optim.*": "bf17"})
    assert VaultWriter(tmp_path, 1, codec_rules={"optim.*": "bf16"}).codec_rules == [("optim.*", "bf16")]


def test_rank_failed_errors_name_the_ranks_and_pickle() -> None:
    import pickle

    exc = RankFailedError("the save of step 4", {3: "stopped responding", 1: "OSError: boom"})
    assert str(exc) == ("the save of step 4 failed on ranks 1, 3: rank 1: OSError: boom; rank 3: stopped responding; "
                        "nothing was committed")
    again = pickle.loads(pickle.dumps(exc))
    assert type(again) is RankFailedError and again.failures == {1: "OSError: boom", 3: "stopped responding"}
    unshared = UnsharedVaultError("/data/v", {2: "node-b"})
    assert "rank 2 on node-b cannot see an object rank 0 wrote there" in str(unshared)
