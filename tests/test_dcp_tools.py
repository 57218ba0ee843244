"""The ``ckptvault`` tools on a multi-rank vault: checkpoints that 2 real rank processes saved with
``torch.distributed.checkpoint`` and ``ckptvault.distributed.VaultWriter`` (tests/helpers/dcp_tools_worker.py:
gloo on CPU, FSDP2 ``fully_shard``, AdamW), whose arrays are stored as the shards the ranks held.

One module fixture saves steps 1-3 on 2 ranks into a local vault of 64 KiB chunks (the frozen layer's shards,
151 + 150 rows of 128 float32, span 2 chunks each; step 3 is step 2's state again) plus step 5, the same state as
step 3 saved whole by ``CheckpointManager.save``. The CLI runs in this process through click's runner (a fresh
interpreter per command costs seconds of torch import; one test runs the installed ``ckptvault`` script), and every
check compares what the tools say with the state the ranks held, gathered whole by rank 0 (``expected_<step>.pt``).

The S3 tests save on 2 ranks into an s3:// vault on the real Ceph gateway (tests/conftest_s3.py), load it on 3, run
``ls``/``verify`` on it, and count the requests of an unchanged second save.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result

import ckptvault
from ckptvault._reports.diff import diff_steps
from ckptvault._vault import Vault
from ckptvault.cli import main
from conftest import assert_same_state, chunk_files
from helpers import dcp_tools_worker, dcp_worker
from helpers.counting_store import CountingStore
from helpers.dcp_ranks import Shard, golden_ranks, golden_whole, save_as_ranks

pytest.register_assert_rewrite("conftest_s3")
from conftest_s3 import BUCKET, Gateway  # noqa: E402

pytest_plugins = ["conftest_s3"]  # the fixture rgw (the gateway)

DCP_STEPS = (1, 2, 3)
WHOLE_STEP = 5  # step 3's state saved by CheckpointManager.save: every array one whole record
ROWS = dcp_tools_worker.FROZEN_ROWS
FROZEN_BOXES = [{"offsets": [0, 0], "shape": [151, 128]}, {"offsets": [151, 0], "shape": [150, 128]}]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(vault, out): DCP steps 1-3 saved by 2 ranks, step 5 saved whole; ``out`` holds ``expected_<step>.pt``."""
    out = tmp_path_factory.mktemp("dcp-tools")
    root = out / "vault"
    dcp_worker.spawn(dcp_tools_worker.save_steps, 2, (str(root), str(out), None, False), out)
    with ckptvault.CheckpointManager(root) as mgr:
        mgr.save(WHOLE_STEP, _expected(out, 3), metrics={"loss": 0.2}).wait()
    return root, out


@pytest.fixture
def vault(saved: tuple[Path, Path], tmp_path: Path) -> Path:
    """A private copy of the module's vault, free to damage or prune."""
    return Path(shutil.copytree(saved[0], tmp_path / "vault"))


def _expected(out: Path, step: int) -> dict[str, Any]:
    """The state the ranks held at ``step``, whole: {"model", "optim", "extra"}."""
    return torch.load(out / f"expected_{step}.pt")


def _arrays(state: Any, path: str = "") -> dict[str, torch.Tensor]:
    """Key path -> tensor of every tensor in ``state`` (the key paths the manifest's records carry)."""
    if isinstance(state, torch.Tensor):
        return {path: state}
    if isinstance(state, dict):
        items = state.items()
    elif isinstance(state, (list, tuple)):
        items = enumerate(state)  # type: ignore[assignment]
    else:
        return {}
    return {k: v for key, value in items for k, v in _arrays(value, f"{path}.{key}" if path else str(key)).items()}


def run(*args: object) -> Result:
    """``ckptvault ARGS`` in this process (click's runner: stdout and stderr apart)."""
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def run_json(*args: object) -> Any:
    result = run(*args, "--json")
    assert result.exit_code == 0, (result.exit_code, result.stdout, result.stderr)
    return json.loads(result.stdout)


def _chunk_ids(root: Path | str, steps: Any, **options: Any) -> set[str]:
    """The chunk objects the manifests of ``steps`` need: the chunks they list and the delta bases of those."""
    with ckptvault.CheckpointManager(root, **options) as mgr:
        chunks = [c for s in steps for c in mgr.manifest(s)["chunks"]]
    return {c["id"] for c in chunks} | {c["base"] for c in chunks if c.get("base")}


# -- ls, show, info ---------------------------------------------------------------------------------------------
def test_the_fixture_saved_sharded_arrays_that_span_chunks(saved: tuple[Path, Path]) -> None:
    root, _ = saved
    with ckptvault.CheckpointManager(root) as mgr:
        body = mgr.manifest(1)
    shards = [t for t in body["tensors"] if t["path"] == "model.frozen.weight"]
    assert [(t["shape"], t["offsets"], t["global_shape"]) for t in shards] == [
        ([151, 128], [0, 0], [ROWS, 128]), ([150, 128], [151, 0], [ROWS, 128])]
    assert all(len(t["pieces"]) == 2 for t in shards)  # 77 KB each: 64 KiB + the rest


def test_ls_json_lists_dcp_and_whole_steps_as_the_library_sees_them(saved: tuple[Path, Path]) -> None:
    root, out = saved
    listing = run_json("ls", root)
    rows = {c["step"]: c for c in listing["checkpoints"]}
    assert sorted(rows) == [*DCP_STEPS, WHOLE_STEP] and listing["damaged"] == []
    arrays = len(_arrays(_expected(out, 3)))  # 17: 5 parameters, 4 x 3 AdamW states
    for step in DCP_STEPS:
        assert (rows[step]["sharded"], rows[step]["num_tensors"], rows[step]["max_shards"]) == (True, arrays, 2)
        assert rows[step]["num_shards"] == 2 * arrays - 4  # every array cut in 2 but the 4 step counters
        assert rows[step]["metrics"] == {"loss": 1.0 / step} and rows[step]["metadata"] == {"run": "dcp-tools"}
    assert (rows[WHOLE_STEP]["sharded"], rows[WHOLE_STEP]["num_tensors"], rows[WHOLE_STEP]["num_shards"],
            rows[WHOLE_STEP]["max_shards"]) == (False, arrays, arrays, 1)
    assert rows[3]["added_bytes"] == 0 < rows[2]["added_bytes"] < rows[1]["added_bytes"]  # dedup across steps
    logical = sum(t.numel() * t.element_size() for t in _arrays(_expected(out, 3)).values())
    assert {r["logical_bytes"] for r in rows.values()} == {logical}  # shards sum to the whole arrays
    with ckptvault.CheckpointManager(root) as mgr:
        for step, row in rows.items():
            info = mgr.info(step)
            assert (row["stored_bytes"], row["num_chunks"], row["sharded"], row["num_shards"]) == (
                info.stored_bytes, info.num_chunks, info.sharded, info.num_shards)
    text = run("ls", root).stdout.splitlines()
    assert [line.split()[0] for line in text[1:]] == ["1", "2", "3", "5"]


def test_show_lists_each_array_once_with_its_global_shape_and_shards(saved: tuple[Path, Path]) -> None:
    root, out = saved
    expected = _arrays(_expected(out, 2))
    shown = run_json("show", root, 2)
    tensors = {t["path"]: t for t in shown["tensors"]}
    assert len(tensors) == len(shown["tensors"]) == len(expected) and set(tensors) == set(expected)
    for path, tensor in expected.items():
        row = tensors[path]
        assert row["shape"] == list(tensor.shape) and row["dtype"] == str(tensor.dtype).removeprefix("torch.")
        assert row["nbytes"] == tensor.numel() * tensor.element_size()
        counter = path.endswith(".step")  # AdamW's step counters: 0-d, replicated, saved once by rank 0
        assert (row["shards"], len(row["boxes"])) == ((1, 1) if counter else (2, 2))
        assert sum(math.prod(b["shape"]) for b in row["boxes"]) == tensor.numel()
    assert tensors["model.frozen.weight"]["boxes"] == FROZEN_BOXES
    assert tensors["model.inner.weight"]["boxes"] == [{"offsets": [0, 0], "shape": [3, ROWS]},
                                                      {"offsets": [3, 0], "shape": [2, ROWS]}]
    assert sum(t["nbytes"] for t in shown["tensors"]) == shown["logical_bytes"]
    assert abs(sum(t["stored_bytes"] for t in shown["tensors"]) - shown["stored_bytes"]) <= len(tensors)  # rounding
    text = run("show", root, 2).stdout
    frozen = [line for line in text.splitlines() if line.startswith("model.frozen.weight")]
    assert len(frozen) == 1 and frozen[0].split()[2:6] == [f"{ROWS}x128", "2", "(dim", "0:"]
    assert "151+150" in frozen[0]
    assert f"sharded (a DCP checkpoint): {len(expected)} arrays stored as {2 * len(expected) - 4} shards" in text
    whole = run("show", root, WHOLE_STEP).stdout
    assert "SHARDS" not in whole and "sharded" not in whole
    assert [line for line in whole.splitlines() if line.startswith("model.frozen.weight")][0].split()[2] == f"{ROWS}x128"


def test_show_keys_filters_arrays_not_shards(saved: tuple[Path, Path]) -> None:
    shown = run_json("show", saved[0], 1, "-k", "model.*")
    assert [t["path"] for t in shown["tensors"]] == [
        "model.frozen.weight", "model.inner.weight", "model.inner.bias", "model.head.weight", "model.head.bias"]


def test_info_carries_the_shards(saved: tuple[Path, Path]) -> None:
    root, out = saved
    with ckptvault.CheckpointManager(root) as mgr:
        info, whole = mgr.info(3), mgr.info(WHOLE_STEP)
    frozen = next(t for t in info.tensors if t.path == "model.frozen.weight")
    assert (frozen.shape, frozen.nbytes, frozen.shards) == ((ROWS, 128), ROWS * 128 * 4, 2)
    assert frozen.boxes == (((0, 0), (151, 128)), ((151, 0), (150, 128)))
    assert info.to_dict(with_tensors=True)["tensors"][0]["boxes"] == FROZEN_BOXES
    assert (info.sharded, info.max_shards) == (True, 2) and (whole.sharded, whole.max_shards) == (False, 1)
    assert [(t.path, t.shape, t.nbytes) for t in info.tensors] == [(t.path, t.shape, t.nbytes) for t in whole.tensors]
    assert all(t.shards == 1 and t.boxes == () for t in whole.tensors)


# -- diff ------------------------------------------------------------------------------------------------------
def _bit_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[int, float]:
    """(elements whose bits differ, max |b - a| over them) of two float32 tensors."""
    mask = a.view(torch.int32) != b.view(torch.int32)
    return int(mask.sum()), float((b.double() - a.double()).abs()[mask].max()) if mask.any() else 0


def test_diff_compares_whole_arrays_of_sharded_steps(saved: tuple[Path, Path]) -> None:
    root, out = saved
    a, b = _arrays(_expected(out, 1)), _arrays(_expected(out, 2))
    result = run_json("diff", root, 1, 2)
    rows = {t["path"]: t for t in result["tensors"]}
    assert len(rows) == len(result["tensors"]) == len(b) and result["only_a"] == result["only_b"] == []
    for path, tensor in b.items():
        changed, worst = _bit_diff(a[path], tensor)
        row = rows[path]
        assert (row["shape"], row["numel"], row["changed"]) == (list(tensor.shape), tensor.numel(), changed), path
        assert row["max_abs_diff"] == pytest.approx(worst, rel=0, abs=0), path
    assert rows["model.frozen.weight"]["status"] == "same" and rows["model.frozen.weight"]["added_bytes"] == 0
    assert rows["model.inner.weight"]["status"] == "changed" and rows["model.inner.weight"]["added_bytes"] > 0
    totals = result["totals"]
    assert totals["elements"] == sum(t.numel() for t in b.values())
    assert totals["elements_changed"] == sum(_bit_diff(a[p], t)[0] for p, t in b.items())
    assert result["scalars"] == [{"path": "extra.step", "status": "changed", "a": 1, "b": 2}]  # not the shards nodes
    text = run("diff", root, 1, 2).stdout
    frozen = [line for line in text.splitlines() if line.startswith("model.frozen.weight")]
    assert len(frozen) == 1 and frozen[0].split()[2:5] == [f"{ROWS}x128", "0", "0"]


def test_diff_of_a_sharded_and_a_whole_save_of_one_state_finds_no_difference(saved: tuple[Path, Path]) -> None:
    """Step 3 (2 shards per array) and step 5 (whole arrays) share no chunk layout: every array is read,
    consolidated from its shards, and compared by value."""
    root, out = saved
    store = CountingStore(root)
    result = diff_steps(Vault(store), 3, WHOLE_STEP)
    assert [t.status for t in result.tensors] == ["same"] * len(_arrays(_expected(out, 3)))
    assert result.totals["elements_changed"] == 0 and result.only_a == result.only_b == []
    assert store.chunk_bytes_read() >= 2 * result.totals["elements"] * 4 * 0.5  # both sides read (compressed)
    shown = run_json("diff", root, WHOLE_STEP, 3)
    assert shown["totals"]["tensors_changed"] == 0 and shown["scalars"] == []


def test_diff_of_identical_sharded_steps_reads_no_chunk(saved: tuple[Path, Path]) -> None:
    root, _ = saved
    store = CountingStore(root)
    result = diff_steps(Vault(store), 2, 3)
    assert {t.status for t in result.tensors} == {"same"} and store.chunk_bytes_read() == 0
    assert [s["path"] for s in result.scalars] == ["extra.step"]


def test_diff_of_one_array_cut_into_other_shards_compares_values(tmp_path: Path) -> None:
    """World sizes 2 and 3 (DCP's protocol driven in this process, tests/helpers/dcp_ranks.py): 4 + 2 rows against
    2 + 2 + 2 rows, one element changed."""
    url = str(tmp_path / "vault")
    w = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    save_as_ranks(url, 1, [{"w": Shard((6, 4), (0, 0), w[:4].clone())}, {"w": Shard((6, 4), (4, 0), w[4:].clone())}])
    w[5, 3] = -1.0
    save_as_ranks(url, 2, [{"w": Shard((6, 4), (2 * r, 0), w[2 * r : 2 * r + 2].clone())} for r in range(3)])
    (row,) = diff_steps(Vault(url), 1, 2).tensors
    assert (row.path, row.shape, row.status, row.changed, row.max_abs_diff) == ("w", [6, 4], "changed", 1, 24.0)
    save_as_ranks(url, 3, golden_ranks())  # "m" (2x3 int16) cut along columns: 2 + 1
    shown = {line.split()[0]: line.split()[2:6] for line in run("show", url, 3).stdout.splitlines()[-3:]}
    assert shown == {"w": ["6x4", "2", "(dim", "0:"], "m": ["2x3", "2", "(dim", "1:"], "step": ["()", "1", "4", "B"]}
    assert "2 (dim 1: 2+1)" in run("show", url, 3, "-k", "m").stdout
    with ckptvault.CheckpointManager(url) as mgr:
        assert_same_state(golden_whole()["m"], mgr.restore(3)["m"])


# -- du, verify --------------------------------------------------------------------------------------------------
def test_du_accounts_for_every_chunk_of_every_rank(saved: tuple[Path, Path]) -> None:
    root, _ = saved
    usage = run_json("du", root)
    steps = [*DCP_STEPS, WHOLE_STEP]
    with ckptvault.CheckpointManager(root) as mgr:
        manifests = [mgr.manifest(s) for s in steps]
    raw = {c["id"]: c["raw"] for m in manifests for c in m["chunks"]}
    files = chunk_files(root)
    assert usage["checkpoints"] == 4 and usage["logical_bytes"] == sum(m["logical_bytes"] for m in manifests)
    assert usage["unique_raw_bytes"] == sum(raw.values())
    assert usage["objects"]["chunks"] == {"count": len(files), "bytes": sum(p.stat().st_size for p in files)}
    assert {p.name for p in files} == set(raw) and usage["unreferenced_chunks"]["count"] == 0
    assert [s["added_bytes"] for s in usage["steps"]] == [m["added_bytes"] for m in manifests]


def test_verify_reads_every_shard_and_names_the_steps_a_damaged_one_breaks(vault: Path) -> None:
    report = run_json("verify", vault)
    assert report["ok"] and report["chunks_checked"] == len(chunk_files(vault))
    with ckptvault.CheckpointManager(vault) as mgr:
        body = mgr.manifest(2)
    second = next(t for t in body["tensors"] if t["path"] == "model.frozen.weight" and t["offsets"] == [151, 0])
    victim = body["chunks"][second["pieces"][1][0]]["id"]  # the tail of rank 1's frozen shard, shared by 1-3
    path = next(p for p in chunk_files(vault) if p.name == victim)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    result = run("verify", vault, "--json")
    assert result.exit_code == 1
    report = json.loads(result.stdout)
    assert {c["step"]: c["ok"] for c in report["checkpoints"]} == {1: False, 2: False, 3: False, WHOLE_STEP: True}
    assert all(victim in p for c in report["checkpoints"] if not c["ok"] for p in c["problems"])


# -- cp, prune, gc -------------------------------------------------------------------------------------------------
def test_cp_copies_a_sharded_vault_that_loads_on_2_ranks_bit_exact(saved: tuple[Path, Path], tmp_path: Path) -> None:
    root, out = saved
    dst = tmp_path / "copy"
    report = run_json("cp", root, dst, "--verify")
    assert report["steps"] == [*DCP_STEPS, WHOLE_STEP]
    assert {p.name for p in chunk_files(dst)} == {p.name for p in chunk_files(root)}
    assert run_json("verify", dst)["ok"]
    dcp_worker.spawn(dcp_tools_worker.load_step, 2, (str(dst), str(tmp_path), 2, None), tmp_path)
    assert_same_state(_expected(out, 2), torch.load(tmp_path / "loaded_2_w2.pt"))
    with ckptvault.CheckpointManager(dst) as mgr:
        restored = mgr.restore(3)
        assert mgr.manifest(3) == ckptvault.CheckpointManager(root).manifest(3)
    expected = _expected(out, 3)
    assert_same_state(expected["model"], restored["model"])
    assert_same_state(expected["optim"], restored["optim"])
    assert restored["extra"] == expected["extra"]


def test_cp_of_some_steps_sends_only_their_chunks(saved: tuple[Path, Path], tmp_path: Path) -> None:
    root, out = saved
    dst = tmp_path / "part"
    report = run_json("cp", root, dst, "--steps", "2-3")
    assert report["steps"] == [2, 3]
    assert {p.name for p in chunk_files(dst)} == _chunk_ids(root, [2, 3])
    with ckptvault.CheckpointManager(dst) as mgr:
        assert mgr.steps() == [2, 3]
        assert_same_state(_expected(out, 2)["model"], mgr.restore(2)["model"])


def test_prune_and_gc_apply_retention_to_a_multi_rank_vault(vault: Path, saved: tuple[Path, Path]) -> None:
    """keep-last 1 keeps step 5 and whatever it needs (its keyframe); gc then frees exactly the chunks only the
    removed steps needed, shards of both ranks, and the kept steps restore bit for bit."""
    _, out = saved
    steps = [*DCP_STEPS, WHOLE_STEP]
    decision = run_json("prune", vault, "--keep-last", "1")
    kept, removed = sorted(decision["keep"]), sorted(decision["removed"])
    assert WHOLE_STEP in kept and removed and sorted(kept + removed) == steps
    with ckptvault.CheckpointManager(vault) as mgr:
        assert mgr.steps() == kept
    needed, before = _chunk_ids(vault, kept), {p.name for p in chunk_files(vault)}
    assert before - needed  # the removed steps' own chunks: garbage now, in the store until gc
    collected = run_json("gc", vault, "--grace", "0")
    assert {Path(r["key"]).name for r in collected["removed"]} == before - needed
    assert {p.name for p in chunk_files(vault)} == needed
    assert run_json("verify", vault)["ok"]
    with ckptvault.CheckpointManager(vault) as mgr:
        for step in kept:
            restored, expected = mgr.restore(step), _expected(out, 3 if step == WHOLE_STEP else step)
            assert_same_state(expected["model"], restored["model"])
            assert_same_state(expected["optim"], restored["optim"])


def test_the_installed_script_shows_a_sharded_step(saved: tuple[Path, Path]) -> None:
    """The real entry point once, in a fresh interpreter (the other tests use click's runner)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TQDM_")}
    done = subprocess.run([str(Path(sys.executable).with_name("ckptvault")), "show", str(saved[0]), "1", "-k",
                           "model.frozen.*"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.splitlines() if line.startswith("model.")]
    assert [r[:4] for r in rows] == [["model.frozen.weight", "float32", f"{ROWS}x128", "2"]]


# -- S3: the real gateway ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def on_s3(rgw: Gateway, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    """(url, out): steps 1-3 saved by 2 ranks into an s3:// vault, then step 4, step 3's state again, through
    clients that count their requests (``repeat_rank<r>.json``)."""
    out = tmp_path_factory.mktemp("dcp-s3")
    url = f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
    dcp_worker.spawn(dcp_tools_worker.save_steps, 2, (url, str(out), rgw.options(), True), out, timeout=300)
    return url, out


def _s3_args(rgw: Gateway) -> list[str]:
    return [arg for key, value in rgw.options().items() for arg in ("--storage-option", f"{key}={value}")]


def test_two_ranks_save_to_s3_and_three_load_bit_exact(rgw: Gateway, on_s3: tuple[str, Path],
                                                        tmp_path: Path) -> None:
    url, out = on_s3
    dcp_worker.spawn(dcp_tools_worker.load_step, 3, (url, str(tmp_path), 2, rgw.options()), tmp_path, timeout=300)
    assert_same_state(_expected(out, 2), torch.load(tmp_path / "loaded_2_w3.pt"))  # 101 + 100 + 100 rows
    listing = json.loads(run(*_s3_args(rgw), "ls", url, "--json").stdout)
    rows = {c["step"]: c for c in listing["checkpoints"]}
    assert sorted(rows) == [1, 2, 3, 4] and all(r["sharded"] and r["max_shards"] == 2 for r in rows.values())
    assert rows[3]["added_bytes"] == rows[4]["added_bytes"] == 0
    verified = run(*_s3_args(rgw), "verify", url, "--json")
    assert verified.exit_code == 0, verified.stderr
    report = json.loads(verified.stdout)
    assert report["ok"] and report["chunks_checked"] == len(_chunk_ids(url, [1, 2, 3, 4], storage_options=rgw.options()))
    with ckptvault.CheckpointManager(url, storage_options=rgw.options()) as mgr:
        restored = mgr.restore(4)
    assert_same_state(_expected(out, 3)["model"], restored["model"])
    assert_same_state(_expected(out, 3)["optim"], restored["optim"])


def test_an_unchanged_dcp_save_to_s3_costs_no_request_per_reused_chunk(rgw: Gateway, on_s3: tuple[str, Path]) -> None:
    """Step 4 repeats step 3: every chunk is reused. A touch (G5) is a CopyObject, a server-side copy of the chunk,
    and a probe a HEAD; the chunks of the committed manifests the save watches need neither (``_save/guard.py``):
    the commit's own existence check (a listing in a vault this small) stands for them."""
    url, out = on_s3
    reports = [json.loads((out / f"repeat_rank{rank}.json").read_text()) for rank in (0, 1)]
    copies = sum(r["requests"].get("CopyObject", 0) for r in reports)
    heads = [r["requests"].get("HeadObject", 0) for r in reports]
    reused = len(_chunk_ids(url, [4], storage_options=rgw.options()))
    summary = {f"rank{rank}": r["requests"] for rank, r in enumerate(reports)}
    assert reused >= 6 and copies == 0 and max(heads) < reused, (
        f"an unchanged DCP save of {reused} reused chunks made {copies} server-side copies (touches) and {heads} "
        f"HEADs; requests by rank: {summary}")
