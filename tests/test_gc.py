"""Garbage collection, prune, pins and CheckpointManager(retention=...) on real vaults (no mocks)."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckptvault import CheckpointManager
from ckptvault._format.chunk_object import ChunkHeader, chunk_id, chunk_key, encode_object, parse_object
from ckptvault._format.manifest import decode_manifest, encode_manifest, manifest_key
from ckptvault._maintenance.gc import execute_gc, plan_gc
from ckptvault._maintenance.prune import execute_prune, plan_prune
from ckptvault._maintenance.retention import KeepEvery, KeepLast, Retention
from ckptvault.cli import main
from ckptvault.errors import InvalidArgumentError, MaintenanceRefusedError, SaveError, StepNotFoundError
from conftest import assert_same_state, chunk_files, manifest_files

CHUNK = 64 << 10
HOUR = 3600.0


def state_for(step: int, n: int = 40_000) -> dict[str, torch.Tensor]:
    """A state whose "w" differs at every step and whose "frozen" part never changes (shared chunks)."""
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(n, generator=g), "frozen": torch.arange(n, dtype=torch.float32)}


def age(root: Path, seconds: float) -> None:
    """Move the mtime of every object in the vault (chunks, manifests, pins, tmp) ``seconds`` into the past."""
    for path in root.rglob("*"):
        if path.is_file():
            st = path.stat()
            os.utime(path, (st.st_atime - seconds, st.st_mtime - seconds))


def referenced(root: Path) -> set[str]:
    """Chunk ids the manifests reach, delta bases followed through chunk headers (independent of ckptvault.gc)."""
    todo = []
    for path in manifest_files(root):
        body = decode_manifest(path.read_bytes(), str(path)).to_json()
        for entry in body["chunks"]:
            todo.append(entry["id"])
            if entry.get("base"):
                todo.append(entry["base"])
    seen: set[str] = set()
    while todo:
        cid = todo.pop()
        if cid in seen:
            continue
        seen.add(cid)
        obj = root / chunk_key(cid)
        if obj.exists():
            header, _ = parse_object(cid, obj.read_bytes())
            if header.base:
                todo.append(header.base)
    return seen


def orphans(root: Path) -> set[str]:
    return {p.name for p in chunk_files(root)} - referenced(root)


def put_stray_chunk(root: Path, payload: bytes, base: str | None = None) -> str:
    """Write a well-formed, unreferenced chunk object directly (as a save that died before committing would)."""
    cid = chunk_id(payload)
    path = root / chunk_key(cid)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_object(ChunkHeader(codec=[], raw=len(payload), base=base), payload))
    return cid


@pytest.fixture
def vault(tmp_path: Path) -> Path:
    """Steps 0..3 of full (non-delta) checkpoints, then step 1 deleted: its "w" chunks are garbage."""
    root = tmp_path / "vault"
    with CheckpointManager(root, chunk_size=CHUNK, incremental=False, async_save=False) as mgr:
        for step in range(4):
            mgr.save(step, state_for(step))
        mgr.delete(1)
    return root


# -- gc --------------------------------------------------------------------------------------------
def test_gc_removes_old_unreferenced_chunks_and_keeps_the_rest(vault: Path) -> None:
    """Only chunks no manifest names and older than the grace period are deleted; every checkpoint still restores (DESIGN G2)."""
    garbage = orphans(vault)
    assert len(garbage) >= 2  # "w" of step 1
    live_before = {p.name for p in chunk_files(vault)} - garbage
    age(vault, 2 * HOUR)
    with CheckpointManager(vault) as mgr:
        plan, result = mgr.gc(HOUR)
        assert result is not None
        assert {g.key.rsplit("/", 1)[1] for g in result.deleted if g.kind == "chunk"} == garbage
        assert result.bytes_freed == sum(g.size for g in plan.candidates) > 0
        assert plan.clock == "store" and len(plan.live) == len(live_before)
        assert {p.name for p in chunk_files(vault)} == live_before
        for step in mgr.steps():
            assert_same_state(state_for(step), mgr.restore(step))
        assert mgr.verify().ok
        _, again = mgr.gc(0)
        assert again is not None and again.deleted == []


def test_gc_keeps_unreferenced_chunks_younger_than_the_grace_period(vault: Path) -> None:
    """An unreferenced chunk is garbage only once its mtime is at least grace seconds old (DESIGN G2)."""
    garbage = orphans(vault)
    with CheckpointManager(vault) as mgr:
        plan, result = mgr.gc(HOUR)
        assert plan.candidates == [] and result is not None and result.deleted == []
        assert plan.fresh_unreferenced == len(garbage)
        age(vault, 0.6 * HOUR)
        assert mgr.gc(HOUR)[1].deleted == []  # type: ignore[union-attr]
        age(vault, 0.6 * HOUR)
        assert len(mgr.gc(HOUR)[1].deleted) == len(garbage)  # type: ignore[union-attr]
    assert orphans(vault) == set()


def test_dry_run_deletes_nothing(vault: Path) -> None:
    before = sorted(p.name for p in chunk_files(vault))
    with CheckpointManager(vault) as mgr:
        plan, result = mgr.gc(0, dry_run=True)
    assert result is None and len(plan.candidates) == len(orphans(vault)) > 0
    assert sorted(p.name for p in chunk_files(vault)) == before


def test_delta_bases_stay_while_a_checkpoint_needs_them(tmp_path: Path) -> None:
    """Real incremental saves: step 1's changed chunks are XOR deltas against step 0 (the keyframe).
    Mark follows every delta's base (DESIGN G1)."""
    root = tmp_path / "vault"
    base_state = state_for(0, 200_000)
    nudged = {"w": base_state["w"] + 1e-3, "frozen": base_state["frozen"]}
    with CheckpointManager(root, chunk_size=CHUNK, async_save=False) as mgr:
        mgr.save(0, base_state)
        mgr.save(1, nudged)
        bases = {c["base"] for c in mgr.manifest(1)["chunks"] if c.get("base")}
        assert bases, "expected delta chunks in step 1"
        mgr.delete(0)
        age(root, 2 * HOUR)
        _, result = mgr.gc(HOUR)
        assert result is not None
        deleted = {g.key.rsplit("/", 1)[1] for g in result.deleted}
        assert not bases & deleted
        assert all((root / chunk_key(b)).exists() for b in bases)
        assert_same_state(nudged, mgr.restore(1))
        assert mgr.verify().ok


def test_bases_named_only_in_chunk_headers_are_followed(vault: Path) -> None:
    """A manifest entry names base B; B's own header names C, which no manifest lists: both stay. (DESIGN G1)"""
    c = put_stray_chunk(vault, b"C" * 1000)
    b = put_stray_chunk(vault, b"B" * 1000, base=c)
    unrelated = put_stray_chunk(vault, b"U" * 1000)
    body = decode_manifest((vault / manifest_key(3)).read_bytes(), "step 3").to_json()
    body["step"] = 50
    body["chunks"].append({"id": body["chunks"][0]["id"], "raw": 1, "stored": 1, "new": False, "base": b})
    (vault / manifest_key(50)).write_bytes(encode_manifest(body))
    age(vault, 2 * HOUR)
    with CheckpointManager(vault) as mgr:
        plan, result = mgr.gc(HOUR)
    assert {b, c} <= plan.live
    assert (vault / chunk_key(b)).exists() and (vault / chunk_key(c)).exists()
    assert not (vault / chunk_key(unrelated)).exists()
    assert result is not None and unrelated in {g.key.rsplit("/", 1)[1] for g in result.deleted}


def test_corrupt_manifest_makes_gc_and_prune_refuse(vault: Path) -> None:
    """An unreadable manifest makes gc and prune refuse, and they delete nothing (DESIGN G1)."""
    path = vault / manifest_key(2)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x01
    path.write_bytes(bytes(data))
    age(vault, 2 * HOUR)
    before = sorted(p.name for p in chunk_files(vault))
    with CheckpointManager(vault) as mgr:
        with pytest.raises(MaintenanceRefusedError, match=r"the manifests of steps 2 cannot be read .*step 2: "
                           r"CorruptManifestError: .*BLAKE3.*nothing was deleted") as info:
            mgr.gc(0)
        assert list(info.value.problems) == [2]
        with pytest.raises(MaintenanceRefusedError, match="refusing to collect garbage or prune"):
            mgr.prune(KeepLast(1))
    assert sorted(p.name for p in chunk_files(vault)) == before
    assert len(manifest_files(vault)) == 3


def test_execute_rechecks_manifests_committed_after_the_plan(vault: Path) -> None:
    """A manifest that appears between plan and execute makes its chunks live again.
    A candidate touched since the plan is skipped as fresh (DESIGN G3)."""
    age(vault, 2 * HOUR)
    with CheckpointManager(vault) as mgr:
        plan = plan_gc(mgr.vault, HOUR)
        doomed = [g for g in plan.candidates if g.kind == "chunk"]
        revived = doomed[0].key.rsplit("/", 1)[1]
        body = mgr.manifest(3)
        body["step"] = 60
        body["chunks"].append({"id": revived, "raw": 1, "stored": 1, "new": False})
        mgr.vault.store.put(manifest_key(60), encode_manifest(body))
        touched = doomed[1]
        mgr.vault.store.touch(touched.key)  # as a save reusing it would
        result = execute_gc(mgr.vault, plan)
    assert (vault / chunk_key(revived)).exists() and (vault / touched.key).exists()
    assert result.skipped_live == 1 and result.skipped_fresh == 1
    assert len(result.deleted) == len(doomed) - 2


def test_maintenance_summarises_a_manifest_once_and_again_when_its_bytes_change(
        vault: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Gc and prune read every manifest, but decode each one's bytes once per process (a retention runs after
    every save); a manifest whose bytes changed, even with its modification time put back, is decoded again and
    the chunks it names now stay live."""
    from ckptvault._maintenance import gc as maintenance
    from ckptvault._vault import Vault

    decoded: list[int] = []
    real = Vault.decode_manifest
    monkeypatch.setattr(Vault, "decode_manifest", lambda self, step, data: decoded.append(step) or real(self, step, data))
    monkeypatch.setattr(maintenance, "_summaries", maintenance.Remembered(8))  # as in a process that wrote none
    monkeypatch.setattr(maintenance, "_written", maintenance.Remembered(maintenance.WRITTEN_KEPT))
    age(vault, 2 * HOUR)
    with CheckpointManager(vault) as mgr:
        plan = plan_gc(mgr.vault, HOUR)
        assert sorted(decoded) == [0, 2, 3]
        decoded.clear()
        plan_prune(mgr.vault, KeepLast(1))
        assert plan_gc(mgr.vault, HOUR).candidates == plan.candidates and decoded == []
        revived = next(g for g in plan.candidates if g.kind == "chunk").key.rsplit("/", 1)[1]
        body = mgr.manifest(3)
        body["chunks"].append({"id": revived, "raw": 1, "stored": 1, "new": False})
        path = vault / manifest_key(3)
        before = path.stat()
        path.write_bytes(encode_manifest(body))
        os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
        decoded.clear()
        again = plan_gc(mgr.vault, HOUR)
        assert decoded == [3] and revived in again.live
        assert revived not in {g.key.rsplit("/", 1)[1] for g in again.candidates}


@pytest.mark.filterwarnings("ignore:metric loss=nan is not a finite number")
def test_a_retention_after_a_save_decodes_no_manifest_its_process_wrote(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A committing process remembers its manifest's summary from the manifest it encoded, so the retention after
    every save decodes none; each remembered summary equals the one decoded from the stored bytes (keyframes, XOR
    deltas, predicted deltas, a lossy residual; metrics, a diverged one included)."""
    from ckptvault import DeltaOptions
    from ckptvault._maintenance import gc as maintenance
    from ckptvault._vault import Vault

    decoded: list[int] = []
    real = Vault.decode_manifest
    monkeypatch.setattr(Vault, "decode_manifest", lambda self, step, data: decoded.append(step) or real(self, step, data))
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    url = tmp_path / "v"
    with CheckpointManager(url, async_save=False, delta=DeltaOptions(predict=True, keyframe_every=4, max_chain=3),
                           codec_rules={"*noise*": "residual-int8"}, retention=Retention(keep_last=3)) as mgr:
        for step in range(1, 9):
            model(torch.randn(8, 64)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "noise": torch.randn(512)}
            mgr.save(step, state, metrics={"loss": float("nan") if step == 5 else 1.0 / step})
        assert decoded == [] and mgr.steps() == [5, 6, 7, 8]  # 5: the keyframe of the rest
        remembered = {s: maintenance._summarise(mgr.vault, s) for s in mgr.steps()}
        assert decoded == [] and mgr.manifest(8)["chain"] and "lossy" in str(mgr.manifest(8))
    monkeypatch.setattr(maintenance, "_summaries", maintenance.Remembered(maintenance.SUMMARIES_KEPT))
    monkeypatch.setattr(maintenance, "_written", maintenance.Remembered(maintenance.WRITTEN_KEPT))
    assert len(remembered) > maintenance.WRITTEN_KEPT - 1
    decoded.clear()
    with CheckpointManager(url) as mgr:
        assert {s: maintenance._summarise(mgr.vault, s) for s in mgr.steps()} == remembered
    assert sorted(decoded) == [5, 6, 7, 8]


def test_a_process_that_saves_without_retention_remembers_only_its_last_manifests(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckptvault._maintenance import gc as maintenance

    monkeypatch.setattr(maintenance, "_summaries", maintenance.Remembered(maintenance.SUMMARIES_KEPT))
    monkeypatch.setattr(maintenance, "_written", maintenance.Remembered(maintenance.WRITTEN_KEPT))
    with CheckpointManager(tmp_path / "v", async_save=False) as mgr:
        for step in range(10):
            mgr.save(step, state_for(step))
    assert len(maintenance._written._found) == maintenance.WRITTEN_KEPT and not maintenance._summaries._found


def test_gc_sweeps_old_temp_files_markers_and_pins_of_deleted_steps(vault: Path) -> None:
    """The age rule also sweeps temp files, gc markers and pins of uncommitted steps named as ckptvault names them (DESIGN G2)."""
    dead, marker = f"{'d' * 32}.part", f"clock-{'0123' * 8}"  # named exactly as the store and gc name them
    (vault / "tmp").mkdir(exist_ok=True)
    (vault / "tmp" / dead).write_bytes(b"x" * 100)
    (vault / "tmp" / "dead.part").write_bytes(b"x")  # not a name the store gives: not gc's to delete
    (vault / "gc").mkdir(exist_ok=True)
    (vault / "gc" / marker).write_bytes(b"")
    (vault / "gc" / "clock-0123").write_bytes(b"")
    with CheckpointManager(vault) as mgr:
        mgr.pin(2, "gone-soon")
        mgr.pin(3, "stays")
        mgr.delete(2)
        age(vault, 2 * HOUR)
        (vault / "tmp" / f"{'e' * 32}.part").write_bytes(b"y")  # a write in progress
        _, result = mgr.gc(HOUR)
        assert result is not None
        kinds = sorted((g.kind, g.key) for g in result.deleted if g.kind != "chunk")
        assert kinds == [("marker", f"gc/{marker}"), ("pin", "pins/00000000000000000002/gone-soon"),
                         ("temp", f"tmp/{dead}")]
        assert mgr.pins() == {3: frozenset({"stays"})}
    assert (vault / "tmp" / f"{'e' * 32}.part").exists()
    assert (vault / "tmp" / "dead.part").exists() and (vault / "gc" / "clock-0123").exists()


def test_negative_grace_is_refused(vault: Path) -> None:
    with CheckpointManager(vault) as mgr, pytest.raises(InvalidArgumentError, match="grace must be >= 0 seconds"):
        mgr.gc(-1)


# -- pins and prune --------------------------------------------------------------------------------
def test_pin_protects_from_prune_and_unpin_releases(vault: Path) -> None:
    with CheckpointManager(vault) as mgr:
        mgr.pin(0, "release-1")
        mgr.pin(0, "release-1")  # idempotent
        mgr.pin(2, "best")
        assert mgr.pins() == {0: frozenset({"release-1"}), 2: frozenset({"best"})}
        plan, result = mgr.prune(KeepLast(1))
        assert result is not None and result.deleted == [] and mgr.steps() == [0, 2, 3]
        assert {d.step: d.reasons for d in plan.decisions} == {0: ("pinned:release-1",), 2: ("pinned:best",),
                                                                3: ("latest", "last 1")}
        assert mgr.unpin(0, "release-1") is True and mgr.unpin(0, "release-1") is False
        _, result = mgr.prune(KeepLast(1))
        assert result is not None and result.deleted == [0] and mgr.steps() == [2, 3]
        assert result.bytes_freed > 0


def test_pin_of_an_uncommitted_step_fails_and_leaves_no_pin(vault: Path) -> None:
    with CheckpointManager(vault) as mgr:
        with pytest.raises(StepNotFoundError, match="step 1 has no committed checkpoint .*committed steps: 0, 2, 3"):
            mgr.pin(1, "x")
        with pytest.raises(InvalidArgumentError, match="invalid pin tag '../x'"):
            mgr.pin(0, "../x")
        assert mgr.pins() == {}


def test_prune_rechecks_pins_and_latest_before_deleting(vault: Path) -> None:
    with CheckpointManager(vault) as mgr:
        plan = plan_prune(mgr.vault, KeepLast(1))
        assert plan.drop == [0, 2]
        mgr.pin(0, "late")  # pinned by another process after the plan
        mgr.delete(3)  # and step 2 is now the latest
        result = execute_prune(mgr.vault, plan)
        assert result.deleted == [] and result.skipped == {0: "pinned", 2: "latest"}
        assert mgr.steps() == [0, 2]


def test_prune_reports_bytes_released_for_gc(vault: Path) -> None:
    with CheckpointManager(vault) as mgr:
        plan, _ = mgr.prune(KeepLast(1), dry_run=True)
        w_chunks = {c["id"]: c["stored"] for s in (0, 2) for c in mgr.manifest(s)["chunks"]}
        shared = {c["id"] for c in mgr.manifest(3)["chunks"]}
        assert plan.released_bytes == sum(v for k, v in w_chunks.items() if k not in shared) > 0
        assert mgr.steps() == [0, 2, 3]


# -- CheckpointManager(retention=...) -------------------------------------------------------------
def test_manager_applies_retention_after_each_commit(tmp_path: Path) -> None:
    root = tmp_path / "vault"
    retention = Retention(KeepLast(2), KeepEvery(4), gc_grace=0)
    with CheckpointManager(root, chunk_size=CHUNK, incremental=False, retention=retention, async_save=False) as mgr:
        for step in range(10):
            mgr.save(step, state_for(step))
            if step == 1:
                mgr.pin(1, "first")
        assert mgr.steps() == [0, 1, 4, 8, 9]
        for step in mgr.steps():
            assert_same_state(state_for(step), mgr.restore(step))
    assert orphans(root) == set()  # the manager collected with grace 0


def test_manager_never_drops_the_step_it_just_saved(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "v", chunk_size=CHUNK, retention=KeepLast(1), async_save=False,
                           incremental=False) as mgr:
        mgr.save(10, state_for(10))
        mgr.save(20, state_for(20))
        mgr.save(5, state_for(5))  # an older step number: not the latest, but just saved
        assert mgr.steps() == [5, 20]
        mgr.save(30, state_for(30))
        assert mgr.steps() == [30]


def test_retention_with_deltas_keeps_the_keyframe_and_stays_restorable(tmp_path: Path) -> None:
    states = {}
    with CheckpointManager(tmp_path / "v", chunk_size=CHUNK, keyframe_every=4, async_save=False,
                           retention=Retention(keep_last=2, gc_grace=0)) as mgr:
        base = state_for(0, 100_000)
        for step in range(7):
            states[step] = {"w": base["w"] + step * 1e-3, "frozen": base["frozen"]}
            mgr.save(step, states[step])
        keyframes = {mgr.manifest(s)["keyframe_step"] for s in mgr.steps()}
        assert set(mgr.steps()) == {5, 6} | keyframes
        for step in mgr.steps():
            assert_same_state(states[step], mgr.restore(step))
        assert mgr.verify().ok
    assert orphans(tmp_path / "v") == set()


def test_retention_runs_after_background_saves(tmp_path: Path) -> None:
    """With async saves (the default), retention runs in the background after each commit; close() waits for it."""
    root = tmp_path / "v"
    with CheckpointManager(root, chunk_size=CHUNK, incremental=False, retention=Retention(keep_last=2, gc_grace=0)) as mgr:
        for step in range(5):
            mgr.save(step, state_for(step))
    with CheckpointManager(root) as mgr:
        assert mgr.steps() == [3, 4]
        assert_same_state(state_for(3), mgr.restore(3))
    assert orphans(root) == set()


def test_failed_retention_does_not_fail_the_save(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "v"
    with CheckpointManager(root, chunk_size=CHUNK, retention=KeepLast(1), async_save=False) as mgr:
        mgr.save(1, state_for(1))
        path = root / manifest_key(1)
        path.write_bytes(path.read_bytes()[:-5])  # damage it
        with caplog.at_level(logging.WARNING, logger="ckptvault"):
            info = mgr.save(2, state_for(2)).wait()
        assert info.step == 2 and mgr.steps() == [1, 2]
        assert "retention after step 2 was not applied: refusing" in caplog.text


def test_a_managers_gc_with_a_grace_period_runs_at_most_once_per_sixteenth_of_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After a prune that deleted something the manager collects garbage, then not again until gc_grace / GC_SPREAD
    has passed; a prune meanwhile leaves it due, and it runs at the first commit after that (grace 0: each time)."""
    from ckptvault._maintenance import prune as prune_module

    clock = [1000.0]
    runs: list[float] = []
    real = prune_module.collect
    monkeypatch.setattr(prune_module.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(prune_module, "collect", lambda vault, grace: runs.append(grace) or real(vault, grace))
    grace = 16 * 60.0  # a gc at most once a minute
    with CheckpointManager(tmp_path / "v", chunk_size=CHUNK, async_save=False, incremental=False,
                           retention=Retention(keep_last=1, gc_grace=grace)) as mgr:
        mgr.save(0, state_for(0))
        assert runs == []  # nothing pruned yet
        for step in (1, 2, 3):
            clock[0] += 10
            mgr.save(step, state_for(step))
        assert runs == [grace] and mgr.steps() == [3]  # after step 1's prune only
        clock[0] += 60
        mgr.save(4, state_for(4))
        assert runs == [grace, grace]
        clock[0] += 61
        mgr.save(4, state_for(4), overwrite=True)  # prunes nothing, and none did since the last gc
        assert len(runs) == 2
    with CheckpointManager(tmp_path / "w", chunk_size=CHUNK, async_save=False, incremental=False,
                           retention=Retention(keep_last=1, gc_grace=0)) as mgr:
        runs.clear()
        for step in range(4):
            mgr.save(step, state_for(step))
        assert runs == [0.0] * 3


@pytest.mark.parametrize("async_save", [True, False])
def test_an_unexpected_failure_of_retention_is_reported_typed_after_the_commit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool) -> None:
    """A bug in retention (not a VaultError, which is only logged) reaches the caller on the next save, wait or
    close as a SaveError that says the checkpoint itself was committed; the checkpoint is kept."""
    import ckptvault.manager

    def broken(vault: object, retention: object, step: int, exclusive: bool = False, pacer: object = None) -> None:
        raise RuntimeError("retention bug")

    monkeypatch.setattr(ckptvault.manager, "apply_retention", broken)
    root = tmp_path / "v"
    with CheckpointManager(root, chunk_size=CHUNK, retention=KeepLast(1), async_save=async_save) as mgr:
        with pytest.raises(SaveError, match=r"^step 1 was committed, but the retention that runs after it failed: "
                                            r"RuntimeError: retention bug$") as caught:
            handle = mgr.save(1, state_for(1))  # a synchronous save raises here, after its commit
            assert handle.wait().step == 1  # the background save itself succeeded
            mgr.wait()
        assert isinstance(caught.value.__cause__, RuntimeError)
        assert mgr.steps() == [1]
        assert_same_state(state_for(1), mgr.restore(1))


def test_prune_without_a_policy_is_refused(vault: Path) -> None:
    with CheckpointManager(vault) as mgr, pytest.raises(InvalidArgumentError, match="prune needs a retention policy"):
        mgr.prune()


# -- CLI -------------------------------------------------------------------------------------------
def run_cli(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def test_cli_prune_then_gc(vault: Path) -> None:
    code, out, _ = run_cli("pin", vault, 0, "keep")
    assert code == 0 and "pinned step 0 as 'keep'" in out
    code, out, _ = run_cli("prune", vault, "--keep-last", 1, "--dry-run")
    assert code == 0 and "would remove 1 checkpoints: 2" in out and "keeping 2 checkpoints" in out
    assert len(manifest_files(vault)) == 3
    code, out, _ = run_cli("prune", vault, "--keep-last", 1, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["removed"] == [2] and doc["keep"] == [0, 3] and doc["manifest_bytes_freed"] > 0
    age(vault, 2 * HOUR)
    code, out, _ = run_cli("gc", vault, "--grace", 60, "--dry-run")
    assert code == 0 and out.startswith("would remove ") and "chunks" in out
    code, out, _ = run_cli("gc", vault, "--grace", 60, "--json")
    doc = json.loads(out)
    assert code == 0 and doc["bytes_freed"] == sum(r["size"] for r in doc["removed"]) > 0
    assert {r["kind"] for r in doc["removed"]} == {"chunk"} and doc["clock"] == "store"
    assert orphans(vault) == set()
    code, out, _ = run_cli("gc", vault)
    assert code == 0 and out.startswith("removed nothing; 0 B freed")
    code, out, _ = run_cli("unpin", vault, 0, "keep", "--json")
    assert code == 0 and json.loads(out)["removed"] is True


def test_cli_errors(vault: Path) -> None:
    code, _, err = run_cli("prune", vault)
    assert code == 2 and "retention needs at least one policy" in err
    code, _, err = run_cli("prune", vault, "--keep-best", 2)
    assert code == 2 and "--keep-best needs --metric NAME" in err
    code, _, err = run_cli("pin", vault, 7, "x")
    assert code == 2 and "step 7 has no committed checkpoint" in err
    (vault / manifest_key(3)).write_bytes(b"{}")
    code, _, err = run_cli("gc", vault)
    assert code == 3 and "error: refusing to collect garbage" in err and "steps 3" in err


def test_store_clock_is_used(vault: Path) -> None:
    with CheckpointManager(vault) as mgr:
        before = time.time()
        plan = plan_gc(mgr.vault, 0)
    assert plan.clock == "store" and abs(plan.now - before) < 60
    assert not (vault / "gc").exists() or not any((vault / "gc").iterdir())


def test_gc_and_prune_on_a_memory_store(memory_url: str) -> None:
    with CheckpointManager(memory_url, chunk_size=CHUNK, incremental=False, async_save=False) as mgr:
        for step in range(3):
            mgr.save(step, state_for(step))
        ids = {s: {c["id"] for c in mgr.manifest(s)["chunks"]} for s in range(3)}
        _, pruned = mgr.prune(KeepLast(1))
        assert pruned is not None and pruned.deleted == [0, 1]
        plan, result = mgr.gc(0)
        assert plan.clock == "store" and result is not None
        deleted = {g.key.rsplit("/", 1)[1] for g in result.deleted if g.kind == "chunk"}
        assert deleted == (ids[0] | ids[1]) - ids[2] and len(deleted) >= 2
        assert_same_state(state_for(2), mgr.restore(2))
        assert mgr.verify().ok
        assert not list(mgr.vault.store.list("gc/"))
