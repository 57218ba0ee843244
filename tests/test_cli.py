"""The ``ckptvault`` command line, run through its real entry points against vaults the library wrote.

Every test starts a fresh interpreter (``python -m ckptvault`` or the installed
``ckptvault`` script), so each costs an import of torch (seconds).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ckptvault
from ckptvault._format.chunk_object import chunk_key

STEPS = (100, 200, 300)
CHUNK = 64 << 10
FROZEN = 80_000  # float32 elements: 312.5 KiB in chunks of their own, identical at every step


def _train_and_save(root: Path) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    frozen = torch.randn(FROZEN, generator=torch.Generator().manual_seed(1))
    with ckptvault.CheckpointManager(root, chunk_size=CHUNK) as mgr:
        for step in STEPS:
            loss = model(torch.randn(16, 32)).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "frozen": frozen, "step": step}
            mgr.save(step, state, metrics={"loss": loss.item(), "lr": 0.01}, metadata={"run": "cli-test"})


@pytest.fixture(scope="module")
def built_vault(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cli") / "vault"
    _train_and_save(root)
    return root


@pytest.fixture
def vault(built_vault: Path, tmp_path: Path) -> Path:
    """A private copy of the module's vault, free to damage or delete from."""
    return Path(shutil.copytree(built_vault, tmp_path / "vault"))


def cli(*args: object, script: bool = False) -> subprocess.CompletedProcess[str]:
    """Run the CLI in a new process; stdout/stderr captured (so stderr is not a terminal)."""
    head = [str(Path(sys.executable).with_name("ckptvault"))] if script else [sys.executable, "-m", "ckptvault"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TQDM_")}
    return subprocess.run([*head, *map(str, args)], capture_output=True, text=True, timeout=120, env=env)


def assert_error(proc: subprocess.CompletedProcess[str], code: int, *fragments: str) -> None:
    """A one-line ``error: ...`` on stderr, no traceback, nothing on stdout, the given exit code."""
    assert proc.returncode == code, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0]
    assert proc.stdout == ""


def manifest(root: Path, step: int) -> dict:
    with ckptvault.CheckpointManager(root) as mgr:
        return mgr.manifest(step)


# -- help and version -----------------------------------------------------------------
def test_group_help_lists_every_command_with_examples() -> None:
    proc = cli("--help")
    assert proc.returncode == 0, proc.stderr
    for command in ("ls", "show", "verify", "du", "rm"):
        assert f"\n  {command} " in proc.stdout
    assert "Examples:" in proc.stdout and "ckptvault verify ./ckpts" in proc.stdout
    assert "Exit status:" in proc.stdout


def test_installed_script_reports_version() -> None:
    proc = cli("--version", script=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"ckptvault {ckptvault.__version__}"


def test_command_help_documents_exit_status_and_json() -> None:
    proc = cli("verify", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "Usage: ckptvault verify [OPTIONS] URL [STEP]" in proc.stdout
    assert "1 if any checkpoint is damaged" in proc.stdout and "--json" in proc.stdout and "--progress" in proc.stdout


# -- ls / show -----------------------------------------------------------------------
def test_ls_prints_one_row_per_step(built_vault: Path) -> None:
    proc = cli("ls", built_vault)
    assert proc.returncode == 0, proc.stderr
    header, *rows = proc.stdout.strip().splitlines()
    assert header.split() == ["STEP", "TIME", "LOGICAL", "STORED", "ADDED", "COMPRESSION", "KEPT", "METRICS"]
    assert [int(r.split()[0]) for r in rows] == list(STEPS)
    assert all("loss=" in r and "lr=0.01" in r for r in rows)
    assert proc.stderr == ""


def test_storage_option_before_the_command_reaches_the_vault(built_vault: Path, tmp_path: Path) -> None:
    ok = cli("--storage-option", "drop_behind=false", "--storage-option", "direct_io=false", "ls", built_vault)
    assert ok.returncode == 0 and ok.stdout.splitlines()[0].split()[0] == "STEP", ok.stderr
    assert_error(cli("--storage-option", "bogus=1", "ls", built_vault), 2,
                 "unknown storage_options for local vaults: ['bogus']")
    assert_error(cli("--storage-option", "drop_behind=sometimes", "verify", built_vault), 2,
                 "drop_behind must be true or false, got 'sometimes'")
    malformed = cli("--storage-option", "drop_behind", "ls", built_vault)
    assert malformed.returncode == 2 and "'drop_behind' is not KEY=VALUE" in malformed.stderr
    two_vaults = cli("--storage-option", "drop_behind=false", "cp", built_vault, tmp_path / "copy")
    assert two_vaults.returncode == 2 and "give their options with --src-option and --dst-option" in two_vaults.stderr
    assert not (tmp_path / "copy").exists()


def test_ls_json_matches_library_info(built_vault: Path) -> None:
    proc = cli("ls", built_vault, "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert [c["step"] for c in out["checkpoints"]] == list(STEPS) and out["damaged"] == []
    with ckptvault.CheckpointManager(built_vault) as mgr:
        infos = [mgr.info(s) for s in STEPS]
    for row, info in zip(out["checkpoints"], infos):
        assert (row["logical_bytes"], row["stored_bytes"], row["added_bytes"]) == (
            info.logical_bytes, info.stored_bytes, info.added_bytes)
        assert row["metrics"] == info.metrics and row["metadata"] == {"run": "cli-test"}
        assert row["ratio"] == pytest.approx(info.stored_bytes / info.logical_bytes)
        assert row["compression"] == pytest.approx(info.logical_bytes / info.stored_bytes)
    # the frozen tensor's chunks are shared, so later checkpoints add less than they reference
    assert out["checkpoints"][1]["added_bytes"] < out["checkpoints"][1]["stored_bytes"]


def test_show_defaults_to_latest_and_lists_tensors_as_json(built_vault: Path) -> None:
    proc = cli("show", built_vault, "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["step"] == STEPS[-1] and out["metadata"] == {"run": "cli-test"}
    tensors = {t["path"]: t for t in out["tensors"]}
    weight = tensors["model.0.weight"]
    assert (weight["dtype"], weight["shape"], weight["nbytes"], weight["kind"]) == ("float32", [64, 32], 64 * 32 * 4, "torch")
    assert tensors["frozen"]["nbytes"] == FROZEN * 4 and 0 < tensors["frozen"]["stored_bytes"] <= FROZEN * 4
    assert "optimizer.state.0.exp_avg_sq" in tensors and out["num_tensors"] == len(tensors)


def test_show_step_with_key_filter_prints_header_and_table(built_vault: Path) -> None:
    proc = cli("show", built_vault, 100, "--keys", "optimizer.state.0.*")
    assert proc.returncode == 0, proc.stderr
    head, _, body = proc.stdout.partition("\n\n")
    assert head.splitlines()[0].split() == ["step", "100"]
    assert "run=cli-test" in head and "loss=" in head and "3 of " in head
    header, *rows = body.strip().splitlines()
    assert header.split() == ["KEY", "PATH", "DTYPE", "SHAPE", "LOGICAL", "STORED", "CODEC"]
    cells = {r.split()[0]: r.split()[1:] for r in rows}
    assert sorted(cells) == ["optimizer.state.0.exp_avg", "optimizer.state.0.exp_avg_sq", "optimizer.state.0.step"]
    assert cells["optimizer.state.0.exp_avg"][:2] == ["float32", "64x32"]
    assert cells["optimizer.state.0.step"][:2] == ["float32", "()"]


# -- du ------------------------------------------------------------------------------
def test_du_json_accounts_for_every_stored_byte(built_vault: Path) -> None:
    proc = cli("du", built_vault, "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    files = [p for p in built_vault.rglob("*") if p.is_file() and p.relative_to(built_vault).parts[0] != "tmp"]
    on_disk = sum(p.stat().st_size for p in files)
    assert out["physical_bytes"] == on_disk
    assert out["objects"]["manifests"]["count"] == len(STEPS)
    with ckptvault.CheckpointManager(built_vault) as mgr:
        assert out["logical_bytes"] == sum(mgr.info(s).logical_bytes for s in STEPS)
    assert out["dedup_saved_bytes"] >= 2 * FROZEN * 4 * 0.9  # the frozen tensor is stored once, not three times
    assert out["compression_saved_bytes"] > 0
    assert out["unique_raw_bytes"] == out["logical_bytes"] - out["dedup_saved_bytes"]
    assert out["unreferenced_chunks"] == {"count": 0, "bytes": 0} and out["missing_chunks"] == 0
    assert [s["step"] for s in out["steps"]] == list(STEPS)


def test_du_text_names_savings(built_vault: Path) -> None:
    proc = cli("du", built_vault)
    assert proc.returncode == 0, proc.stderr
    labels = [line.split("  ")[0].strip() for line in proc.stdout.splitlines() if line and not line[0].isspace()]
    for label in ("logical", "physical", "dedup saves", "compression", "unreferenced"):
        assert label in labels
    assert proc.stdout.rstrip().splitlines()[-1].split()[0] == str(STEPS[-1])


# -- verify --------------------------------------------------------------------------
def test_verify_intact_vault_exits_zero(built_vault: Path) -> None:
    proc = cli("verify", built_vault)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [line for line in proc.stdout.splitlines() if line.startswith("step ")] == [f"step {s}: OK" for s in STEPS]
    assert "all intact" in proc.stdout
    assert proc.stderr == ""  # no progress bar when stderr is not a terminal


def test_verify_progress_flag_forces_a_bar_on_stderr(built_vault: Path) -> None:
    proc = cli("verify", built_vault, 200, "--progress", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "verify" in proc.stderr and "B/s" in proc.stderr
    out = json.loads(proc.stdout)
    assert out["ok"] is True and [c["step"] for c in out["checkpoints"]] == [200]


def _only_chunk_of(root: Path, step: int) -> str:
    """A chunk that ``step`` references and no other checkpoint needs (listed or as a delta base)."""
    others = [manifest(root, s) for s in STEPS if s != step]
    used = {c["id"] for m in others for c in m["chunks"]} | {c.get("base") for m in others for c in m["chunks"]}
    mine = [c["id"] for c in manifest(root, step)["chunks"] if c["id"] not in used]
    assert mine, "the test vault should give the latest step a chunk of its own"
    return mine[0]


def test_verify_corrupt_chunk_exits_one_and_names_step_and_chunk(vault: Path) -> None:
    cid = _only_chunk_of(vault, 300)
    path = vault / chunk_key(cid)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x5A
    path.write_bytes(bytes(data))

    proc = cli("verify", vault)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert "step 100: OK" in lines and "step 200: OK" in lines
    damaged = lines.index("step 300: DAMAGED")
    assert cid in lines[damaged + 1] and "corrupt" in lines[damaged + 1]
    assert "1 of 3 checkpoints DAMAGED" in lines[-1]

    out = json.loads(cli("verify", vault, "--json").stdout)
    assert out["ok"] is False
    bad = [c for c in out["checkpoints"] if not c["ok"]]
    assert [c["step"] for c in bad] == [300] and cid in bad[0]["problems"][0]

    assert cli("verify", vault, 100).returncode == 0  # an undamaged step still verifies


def test_damaged_manifest_is_reported_by_ls_and_can_be_removed(vault: Path) -> None:
    path = vault / "manifests" / f"{200:020d}.json"
    path.write_bytes(path.read_bytes()[:300])
    proc = cli("ls", vault)
    assert proc.returncode == 1
    assert [line.split()[0] for line in proc.stdout.splitlines()[1:]] == ["100", "200", "300"]
    assert "DAMAGED" in proc.stdout and "step 200" in proc.stderr and "truncated" in proc.stderr

    proc = cli("rm", vault, 200)
    assert proc.returncode == 0, proc.stderr
    assert "was damaged" in proc.stderr
    with ckptvault.CheckpointManager(vault) as mgr:
        assert mgr.steps() == [100, 300]


# -- rm ------------------------------------------------------------------------------
def test_rm_deletes_checkpoints_and_leaves_chunks_for_gc(vault: Path) -> None:
    dry = json.loads(cli("rm", vault, 300, 100, "--dry-run", "--json").stdout)
    assert dry["dry_run"] is True and dry["deleted"] == [100, 300] and dry["remaining"] == [200]
    with ckptvault.CheckpointManager(vault) as mgr:
        assert mgr.steps() == list(STEPS)

    proc = cli("rm", vault, 300, 100)
    assert proc.returncode == 0, proc.stderr
    assert "deleted step(s) 100, 300" in proc.stdout and "ckptvault gc" in proc.stdout
    with ckptvault.CheckpointManager(vault) as mgr:
        assert mgr.steps() == [200]
        frozen = torch.randn(FROZEN, generator=torch.Generator().manual_seed(1))
        assert torch.equal(mgr.restore()["frozen"], frozen)  # shared chunks survive the deletion

    usage = json.loads(cli("du", vault, "--json").stdout)
    assert dry["reclaimable_chunks"] > 0  # step 300's own chunks
    assert usage["unreferenced_chunks"] == {"count": dry["reclaimable_chunks"], "bytes": dry["reclaimable_bytes"]}


def test_rm_with_an_unknown_step_deletes_nothing(vault: Path) -> None:
    assert_error(cli("rm", vault, 100, 7), 2, "step 7 has no committed checkpoint", "100, 200, 300")
    with ckptvault.CheckpointManager(vault) as mgr:
        assert mgr.steps() == list(STEPS)


# -- errors --------------------------------------------------------------------------
@pytest.mark.parametrize("command", ["ls", "verify"])
def test_missing_vault_is_a_one_line_error_with_exit_two(tmp_path: Path, command: str) -> None:
    missing = tmp_path / "nothing-here"
    assert_error(cli(command, missing), 2, "no ckptvault vault at", str(missing))
    assert not missing.exists()  # reading commands never create a vault


@pytest.mark.parametrize("command", ["show", "verify"])
def test_missing_step_is_a_one_line_error_with_exit_two(built_vault: Path, command: str) -> None:
    assert_error(cli(command, built_vault, 7), 2, "step 7 has no committed checkpoint", "committed steps: 100, 200, 300")


def test_bad_step_argument_is_a_usage_error(built_vault: Path) -> None:
    proc = cli("show", built_vault, "latest")
    assert proc.returncode == 2
    assert "Invalid value for '[STEP]'" in proc.stderr and "Traceback" not in proc.stderr


def test_rm_refuses_a_pinned_checkpoint_unless_forced(vault: Path) -> None:
    with ckptvault.CheckpointManager(vault) as mgr:
        mgr.pin(100, "best")
    assert_error(cli("rm", vault, 100, 200), 2, "step 100 is pinned as 'best'", "--force")
    with ckptvault.CheckpointManager(vault) as mgr:
        assert mgr.steps() == list(STEPS)

    proc = cli("rm", vault, 100, "--force")
    assert proc.returncode == 0, proc.stderr
    assert "removed the pins of step 100: best" in proc.stdout
    with ckptvault.CheckpointManager(vault) as mgr:
        assert mgr.steps() == [200, 300] and 100 not in mgr.pins()
