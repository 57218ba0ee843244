"""Local vaults laid out to mislead: folders and objects that are symbolic links, and names that only look like keys.

Real vaults (made by CheckpointManager saves), real symlinks, real files. What is checked each time is the outcome:
which error (and what it says), which files exist afterwards and what they hold, what a restore returns.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from ckptvault import CheckpointManager
from ckptvault._format.chunk_object import chunk_key
from ckptvault._format.manifest import manifest_key
from ckptvault._maintenance.copy import copy_checkpoints
from ckptvault._maintenance.retention import KeepLast
from ckptvault.cli import main
from ckptvault.errors import InvalidArgumentError, UnsafeLinkError
from ckptvault.stores import LocalStore
from conftest import assert_same_state, chunk_files

CHUNK = 64 << 10
STEPS = (0, 1, 2)
DAY = 86400.0
OLD_TEMP = f"{'a' * 32}.part"  # named as the store names temporary files: gc's to sweep, if it may
STRAY_CHUNK = "ab/ab" + "0" * 62  # named as a chunk: gc's to delete, if it may


def state_for(step: int) -> dict[str, torch.Tensor]:
    """"w" differs at every step, "frozen" never changes (chunks shared by every step)."""
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(20_000, generator=g), "frozen": torch.arange(20_000, dtype=torch.float32)}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hostile") / "vault"
    with CheckpointManager(root, chunk_size=CHUNK, incremental=False, async_save=False) as mgr:
        for step in STEPS:
            mgr.save(step, state_for(step))
        mgr.pin(0, "release")
    return root


@pytest.fixture
def vault(built: Path, tmp_path: Path) -> Path:
    """A private copy of the module's vault (steps 0, 1, 2; step 0 pinned as "release")."""
    return Path(shutil.copytree(built, tmp_path / "vault"))


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """A folder outside the vault (another disk, as far as the vault can tell)."""
    path = tmp_path / "elsewhere"
    path.mkdir()
    return path


# -- helpers -------------------------------------------------------------------------------------------------------
def snapshot(folder: Path) -> dict[str, bytes]:
    """Relative path -> bytes of every file under ``folder`` (links not followed)."""
    out = {}
    for dirpath, _dirs, files in os.walk(folder):
        for name in files:
            path = Path(dirpath, name)
            if not path.is_symlink():
                out[str(path.relative_to(folder))] = path.read_bytes()
    return out


def age(folder: Path, seconds: float) -> None:
    """Set the mtime of every file under ``folder`` (folder links followed; a file link and its target both)
    ``seconds`` into the past."""
    when = time.time() - seconds
    for dirpath, _dirs, files in os.walk(folder, followlinks=True):
        for name in files:
            path = Path(dirpath, name)
            if path.exists():
                os.utime(path, (when, when))
            if path.is_symlink():
                os.utime(path, (when, when), follow_symlinks=False)


def move_out(vault: Path, folder: str, target: Path) -> Path:
    """Move ``vault/folder`` to ``target`` and leave a symbolic link in its place (an admin's move to another disk)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    if (vault / folder).exists():
        shutil.move(str(vault / folder), str(target))
    else:
        target.mkdir()
    (vault / folder).symlink_to(target, target_is_directory=True)
    return target


def plant(folder: Path, files: dict[str, bytes]) -> None:
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)


def run_cli(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
    return result.exit_code, result.stdout, result.stderr


def assert_cli_error(outcome: tuple[int, str, str], code: int, *fragments: str) -> None:
    """Exit ``code``, one ``error: ...`` line on stderr holding ``fragments``, nothing on stdout."""
    exit_code, out, err = outcome
    assert exit_code == code, (exit_code, out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert out == ""


def other_files(folder: str) -> dict[str, bytes]:
    """Files no vault wrote, for the outside copy of ``folder``: some named exactly as the vault names its own."""
    common = {OLD_TEMP: b"not a vault's temporary file", "notes.txt": b"someone's notes"}
    named = {"tmp": {}, "chunks": {STRAY_CHUNK: b"someone's file that looks like a chunk"},
             "manifests": {"00000000000000000007.json": b"someone's file that looks like a manifest"},
             "pins": {"00000000000000000007/keep": b"someone's file that looks like a pin"}}[folder]
    return common | named


# -- key folders that are links leading outside ---------------------------------------------------------------------
def link_out_with_old_files(vault: Path, elsewhere: Path, folder: str) -> tuple[Path, dict[str, bytes]]:
    """Move ``folder`` of the vault to ``elsewhere`` behind a link, plant old files named like vault keys there;
    returns the link's target and a snapshot of ``elsewhere`` to compare with afterwards."""
    target = move_out(vault, folder, elsewhere / folder)
    plant(target, other_files(folder))
    age(elsewhere, 2 * DAY)
    return target, snapshot(elsewhere)


@pytest.mark.parametrize("folder", ["tmp", "chunks", "manifests", "pins"])
def test_gc_refuses_a_vault_whose_key_folder_links_outside(vault: Path, elsewhere: Path, folder: str) -> None:
    target, before = link_out_with_old_files(vault, elsewhere, folder)
    with CheckpointManager(vault) as mgr, pytest.raises(UnsafeLinkError) as caught:
        mgr.gc()
    message = str(caught.value)
    assert str(vault / folder) in message and str(target.resolve()) in message
    assert "external_links" in message and "Replace the link" in message
    assert snapshot(elsewhere) == before


@pytest.mark.parametrize("folder", ["tmp", "chunks", "manifests", "pins"])
def test_cli_gc_refuses_a_vault_whose_key_folder_links_outside(vault: Path, elsewhere: Path, folder: str) -> None:
    _target, before = link_out_with_old_files(vault, elsewhere, folder)
    assert_cli_error(run_cli("gc", vault, "--grace", 0), 3, str(vault / folder), "external_links=true")
    assert snapshot(elsewhere) == before


@pytest.mark.parametrize("folder", ["chunks", "manifests", "pins"])
@pytest.mark.parametrize("operation", ["prune", "delete", "unpin", "pin"])
def test_deleting_operations_refuse_a_vault_whose_key_folder_links_outside(
        vault: Path, elsewhere: Path, folder: str, operation: str) -> None:
    target = move_out(vault, folder, elsewhere / folder)
    plant(target, other_files(folder))
    before = snapshot(elsewhere)
    with CheckpointManager(vault) as mgr, pytest.raises(UnsafeLinkError, match="external_links"):
        if operation == "prune":
            mgr.prune(KeepLast(1))
        elif operation == "delete":
            mgr.delete(1)
        elif operation == "unpin":
            mgr.unpin(0, "release")
        else:
            mgr.pin(2, "best")
    assert snapshot(elsewhere) == before


@pytest.mark.parametrize("command", [("rm", 1), ("rm", 0, "--force"), ("prune", "--keep-last", 1), ("unpin", 0, "release")])
def test_cli_deleting_commands_refuse_a_vault_whose_manifests_link_outside(
        vault: Path, elsewhere: Path, command: tuple[object, ...]) -> None:
    move_out(vault, "manifests", elsewhere / "manifests")
    before = snapshot(elsewhere)
    name, *rest = command
    assert_cli_error(run_cli(name, vault, *rest), 3, str(vault / "manifests"), "outside the vault")
    assert snapshot(elsewhere) == before


def test_a_folder_linked_outside_after_the_vault_was_opened_is_still_never_deleted_in(vault: Path, elsewhere: Path) -> None:
    with CheckpointManager(vault) as mgr:
        assert mgr.steps() == list(STEPS)  # opened and checked while the layout was sound
        move_out(vault, "manifests", elsewhere / "manifests")
        before = snapshot(elsewhere)
        with pytest.raises(UnsafeLinkError, match="outside the vault"):
            mgr.delete(1)
        with pytest.raises(UnsafeLinkError, match="outside the vault"):
            mgr.vault.store.delete(manifest_key(1))
    assert snapshot(elsewhere) == before


def test_delete_resolves_its_folder_every_time_not_from_a_cache(tmp_path: Path, elsewhere: Path) -> None:
    store = LocalStore(tmp_path / "store")
    key = "chunks/ab/" + "ab" * 32
    store.put(key, b"inside")
    assert store.get(key) == b"inside"  # the folder is now known to be inside
    shutil.move(str(tmp_path / "store/chunks/ab"), str(elsewhere / "ab"))
    (tmp_path / "store/chunks/ab").symlink_to(elsewhere / "ab", target_is_directory=True)
    with pytest.raises(UnsafeLinkError, match="refuses to delete"):
        store.delete(key)
    assert (elsewhere / "ab" / key.rsplit("/", 1)[1]).read_bytes() == b"inside"


def test_a_pin_folder_linked_outside_is_neither_listed_nor_deleted_in(vault: Path, elsewhere: Path) -> None:
    plant(elsewhere / "pins-of-9", {"victim": b"someone's file"})
    (vault / "pins" / f"{9:020d}").symlink_to(elsewhere / "pins-of-9", target_is_directory=True)  # a step not committed
    age(vault, 2 * DAY)
    age(elsewhere, 2 * DAY)
    with CheckpointManager(vault) as mgr:
        assert mgr.pins() == {0: frozenset({"release"})}
        _, result = mgr.gc(60)
        assert result is not None and not [g for g in result.deleted if g.kind == "pin"]
        with pytest.raises(UnsafeLinkError, match=f"pins/{9:020d}"):
            mgr.unpin(9, "victim")
    assert (elsewhere / "pins-of-9" / "victim").read_bytes() == b"someone's file"


# -- external_links=True ---------------------------------------------------------------------------------------------
def test_external_links_option_is_validated(vault: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="external_links must be true or false"):
        CheckpointManager(vault, storage_options={"external_links": "yes"})


def test_with_external_links_linked_folders_are_part_of_the_vault(vault: Path, elsewhere: Path) -> None:
    for folder in ("tmp", "chunks", "manifests", "pins"):
        move_out(vault, folder, elsewhere / folder)
    strangers = {"chunks/README": b"not a chunk", "chunks/ab/notes.txt": b"not a chunk either",
                 "tmp/keep.txt": b"not a temporary file", "tmp/" + "b" * 31 + ".part": b"one hex digit short",
                 "manifests/notes.json": b"not a manifest", "pins/README": b"not a pin"}
    plant(elsewhere, strangers)
    (elsewhere / "tmp" / "a-folder").mkdir()
    plant(elsewhere, {f"tmp/{OLD_TEMP}": b"left by a killed write"})
    options = {"external_links": True}
    with CheckpointManager(vault, storage_options=options, chunk_size=CHUNK, incremental=False, async_save=False) as mgr:
        mgr.save(3, state_for(3))
        for step in (*STEPS, 3):
            assert_same_state(state_for(step), mgr.restore(step))
        mgr.delete(1)  # its "w" chunks become garbage
        live = {p.name for p in chunk_files(elsewhere)} - {"notes.txt", "README"}
        age(elsewhere, 2 * DAY)
        plan, result = mgr.gc(60)
        assert result is not None
        swept = {g.key for g in result.deleted}
        assert f"tmp/{OLD_TEMP}" in swept and sum(g.kind == "chunk" for g in result.deleted) >= 1
        assert mgr.steps() == [0, 2, 3]
        for step in (0, 2, 3):
            assert_same_state(state_for(step), mgr.restore(step))
        assert mgr.verify().ok
    assert {p.name for p in chunk_files(elsewhere)} - {"notes.txt", "README"} == live - {
        g.key.rsplit("/", 1)[1] for g in result.deleted if g.kind == "chunk"}
    assert {rel: (elsewhere / rel).read_bytes() for rel in strangers} == strangers
    assert (elsewhere / "tmp" / "a-folder").is_dir()
    assert all(not p.is_symlink() for p in chunk_files(elsewhere))  # the chunks were written through the links


def test_cli_with_external_links_works_through_linked_folders(vault: Path, elsewhere: Path) -> None:
    move_out(vault, "chunks", elsewhere / "chunks")
    code, out, err = run_cli("--storage-option", "external_links=true", "ls", vault)
    assert code == 0 and err == "" and all(str(s) in out for s in STEPS)
    code, out, err = run_cli("--storage-option", "external_links=true", "verify", vault)
    assert code == 0, (out, err)
    assert_cli_error(run_cli("ls", vault), 3, str(vault / "chunks"), "external_links=true")


def test_with_external_links_an_object_link_leading_outside_is_still_refused(vault: Path, elsewhere: Path) -> None:
    move_out(vault, "chunks", elsewhere / "chunks")
    victim = chunk_files(elsewhere)[0]
    outside = elsewhere / "not-the-vault" / victim.name
    outside.parent.mkdir()
    shutil.move(str(victim), str(outside))
    victim.symlink_to(outside)
    store = LocalStore(vault, external_links=True)
    key = chunk_key(victim.name)
    for read in (store.get, store.get_transient, store.stat, store.touch, store.exists,
                 lambda k: store.get_range(k, 0, 8)):
        with pytest.raises(UnsafeLinkError, match="never follows a link on an object"):
            read(key)
    store.delete(key)
    assert not victim.is_symlink() and not victim.exists()  # the link went, its target stays
    assert outside.is_file()


# -- object files that are links -------------------------------------------------------------------------------------
def link_a_chunk_out(vault: Path, elsewhere: Path) -> tuple[Path, bytes]:
    """Move a chunk only step 2 names out of the vault and leave a link to it: (the link, the bytes it leads to)."""
    with CheckpointManager(vault) as mgr:
        others = {c["id"] for step in (0, 1) for c in mgr.manifest(step)["chunks"]}
        cid = next(c["id"] for c in mgr.manifest(2)["chunks"] if c["id"] not in others)
    link = vault / chunk_key(cid)
    outside = elsewhere / cid
    shutil.move(str(link), str(outside))
    link.symlink_to(outside)
    return link, outside.read_bytes()


def test_restore_and_verify_refuse_a_chunk_that_links_outside(vault: Path, elsewhere: Path) -> None:
    link, _ = link_a_chunk_out(vault, elsewhere)
    with CheckpointManager(vault) as mgr:
        assert_same_state(state_for(1), mgr.restore(1))  # steps that do not need it are unaffected
        with pytest.raises(UnsafeLinkError) as caught:
            mgr.restore(2)
        assert str(link) in str(caught.value) and str(elsewhere.resolve()) in str(caught.value)
        with pytest.raises(UnsafeLinkError, match=link.name):
            mgr.verify(2)
    assert_cli_error(run_cli("verify", vault), 3, str(link), "symbolic link")
    assert_cli_error(run_cli("diff", vault, 1, 2), 3, str(link))  # reads the chunks of both steps


def test_cp_refuses_a_chunk_that_links_outside_and_never_copies_its_bytes(vault: Path, elsewhere: Path) -> None:
    link, outside_bytes = link_a_chunk_out(vault, elsewhere)
    dest = vault.parent / "dest"
    with pytest.raises(UnsafeLinkError, match=link.name):
        copy_checkpoints(vault, dest)
    assert_cli_error(run_cli("cp", vault, vault.parent / "dest2"), 3, str(link))
    for root in (dest, vault.parent / "dest2"):
        held = snapshot(root) if root.exists() else {}
        assert outside_bytes not in held.values()
        assert not any(key.endswith(link.name) for key in held)
        assert not (root / "manifests" / f"{2:020d}.json").exists()


def test_gc_refuses_to_judge_an_unreferenced_chunk_that_links_outside(vault: Path, elsewhere: Path) -> None:
    link, outside_bytes = link_a_chunk_out(vault, elsewhere)
    with CheckpointManager(vault) as mgr:
        mgr.delete(2)  # the linked chunk is garbage now
        age(vault, 2 * DAY)
        with pytest.raises(UnsafeLinkError, match=link.name):
            mgr.gc(60)
    assert link.is_symlink() and (elsewhere / link.name).read_bytes() == outside_bytes


def test_a_link_to_a_file_inside_the_vault_works(vault: Path) -> None:
    with CheckpointManager(vault) as mgr:
        cid = mgr.manifest(2)["chunks"][0]["id"]
    link = vault / chunk_key(cid)
    spare = vault / "spare" / cid
    spare.parent.mkdir()
    shutil.move(str(link), str(spare))
    link.symlink_to(os.path.relpath(spare, link.parent))
    with CheckpointManager(vault) as mgr:
        assert_same_state(state_for(2), mgr.restore(2))
        assert mgr.verify().ok
        assert mgr.vault.store.stat(chunk_key(cid)).size == spare.stat().st_size
    dest = vault.parent / "dest"
    copy_checkpoints(vault, dest, [2])
    copied = dest / chunk_key(cid)
    assert copied.is_file() and not copied.is_symlink() and copied.read_bytes() == spare.read_bytes()
    with CheckpointManager(dest) as mgr:
        assert_same_state(state_for(2), mgr.restore(2))


def test_a_fan_out_folder_linked_inside_the_vault_works_without_the_option(vault: Path) -> None:
    fan_out = sorted((vault / "chunks").iterdir())[0]
    moved = vault / "spare" / fan_out.name
    moved.parent.mkdir()
    shutil.move(str(fan_out), str(moved))
    fan_out.symlink_to(os.path.relpath(moved, fan_out.parent), target_is_directory=True)
    with CheckpointManager(vault) as mgr:
        for step in STEPS:
            assert_same_state(state_for(step), mgr.restore(step))
        assert {p.name for p in moved.iterdir()} <= {i.key.rsplit("/", 1)[1] for i in mgr.vault.store.list("chunks/")}


# -- names that only look like keys ----------------------------------------------------------------------------------
def plant_junk(vault: Path) -> dict[str, bytes]:
    """Objects whose names resemble keys; each holds bytes a careless parser would act on. Returns them."""
    manifest = (vault / manifest_key(2)).read_bytes()
    junk = {"manifests/²³.json": manifest, f"manifests/sub/{2:020d}.json": manifest,
            f"manifests/{2:021d}.json": manifest, f"manifests/{2:020d}.json\n": manifest,
            "pins/²/tag": b"{}", f"pins/{0:020d}/.hidden": b"{}", f"pins/{0:019d}/short": b"{}",
            "chunks/zz/notahash": b"junk", "chunks/ab/" + "cd" * 32: b"fan-out does not match",
            "chunks/ab/" + "AB" * 32: b"upper case", f"gc/clock-{'0' * 31}": b"", "tmp/dead.part": b"x"}
    plant(vault, junk)
    (vault / "tmp" / OLD_TEMP).mkdir(parents=True)  # a folder named as a temporary file
    return junk


def test_names_that_only_look_like_keys_are_ignored_and_never_deleted(vault: Path) -> None:
    """Objects whose names only look like keys are not listed, and gc, prune and rm never delete them (DESIGN G2)."""
    junk = plant_junk(vault)
    with CheckpointManager(vault) as mgr:
        mgr.delete(1)
        assert mgr.steps() == [0, 2]
        assert mgr.pins() == {0: frozenset({"release"})}
        age(vault, 2 * DAY)
        _, result = mgr.gc(60)
        assert result is not None and result.deleted
        assert all(g.key not in junk for g in result.deleted)
        _, pruned = mgr.prune(KeepLast(1))
        assert pruned is not None and pruned.deleted == [] and mgr.steps() == [0, 2]  # 0 pinned, 2 latest
        for step in (0, 2):
            assert_same_state(state_for(step), mgr.restore(step))
        assert mgr.verify().ok
    assert {rel: (vault / rel).read_bytes() for rel in junk} == junk
    assert (vault / "tmp" / OLD_TEMP).is_dir()


def test_cli_ignores_names_that_only_look_like_keys(vault: Path) -> None:
    junk = plant_junk(vault)
    age(vault, 2 * DAY)
    code, out, err = run_cli("ls", vault, "--json")
    assert code == 0 and err == "", err
    assert '"step": 23' not in out and out.count('"step": 2,') == 1
    code, out, err = run_cli("gc", vault, "--grace", 60)
    assert code == 0 and err == "", err
    code, out, err = run_cli("prune", vault, "--keep-last", 1)
    assert code == 0 and err == "", err
    code, out, err = run_cli("du", vault)
    assert code == 0 and err == "", err
    assert {rel: (vault / rel).read_bytes() for rel in junk} == junk
    assert (vault / "tmp" / OLD_TEMP).is_dir()
