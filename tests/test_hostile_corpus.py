"""The hostile-vault corpus (tests/hostile/): every command it lists, against every case, with the outcome it lists.

A case is the pristine vault ``tests/hostile/base`` with one file swapped for a hostile version
(``tests/hostile/cases/<name>/<key>``); ``tests/hostile/cases.json`` says what was done and, for each command
(library restore with and without ``keys=``/``into=``, info, verify, gc plan; ``ckptvault verify``, ``ls``,
``show``, ``gc --dry-run``, ``cp``), what must happen. ``tests/hostile/make_corpus.py`` rebuilds the corpus.

Checked for every (case, command) pair:

* the outcome: an error of a listed class whose message holds every listed fragment (the file and the field),
  a verify report naming the damage, or success (a restore then equals the base state, or its ``keys=`` part);
* for a ``ckptvault`` command: exactly one stderr line ``error: ...`` holding the fragments, nothing on
  stdout, no traceback, the listed exit status (1 for damage, 3 for a newer format or a refused gc);
* nothing outside the vault folder was written or removed (its siblings, the bait file a traversing id
  points at; only ``cp`` writes, into its destination), and the vault's files are byte for byte unchanged;
* the command raised the worker's peak memory by less than :data:`MAX_GROWTH_MIB`.

Commands run in a worker process (``tests/hostile/worker.py``) whose address space is capped, so an
unbounded allocation shows up as a MemoryError instead of exhausting the machine; CLI commands run there
through click's test runner. :func:`test_real_entry_point` checks a few cases through ``python -m ckptvault``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from helpers.statedigest import state_digest
from hostile.make_corpus import BASE_DIR, CASES_DIR, CASES_JSON, base_state
from hostile.worker import Worker

CORPUS = json.loads(CASES_JSON.read_text())
STEP = CORPUS["step"]
BAIT = b"bait: a file beside the vault that no command may read as a chunk or touch\n"
#: the most a command may raise the worker's peak RSS (the corpus vault holds 17 KB of arrays)
MAX_GROWTH_MIB = 64
KEYS = {"restore_keys_big": "model.big", "restore_keys_w": "model.w"}

CASE_PARAMS = [pytest.param(case, command, id=f"{case['name']}-{command['id']}")
               for case in CORPUS["cases"] for command in case["commands"]]


@pytest.fixture(scope="module")
def reference(worker: Worker, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Digest of what each restore command returns from the pristine base vault."""
    vault = shutil.copytree(BASE_DIR, tmp_path_factory.mktemp("reference") / "vault")
    out = {}
    for command in ("restore", "restore_keys_big", "restore_keys_w", "restore_into"):
        op, params = request(command, vault, vault.parent / "dst")
        reply = worker.call(op, **params)
        assert reply["status"] == "ok", reply
        out[command] = reply["value"]["digest"]
    return out


# -- running a command --------------------------------------------------------------------------------------------

def request(command: str, vault: Path, dst: Path) -> tuple[str, dict[str, Any]]:
    """The worker request that runs ``command`` (a name from cases.json "commands") on ``vault``."""
    v = str(vault)
    if command.startswith("restore"):
        return "restore", {"vault": v, "step": STEP, "keys": KEYS.get(command), "into": command == "restore_into",
                           "reference": str(BASE_DIR)}  # a full restore's reply then says which bytes were never read
    if command in ("info", "gc_plan"):
        return command, {"vault": v}
    if command == "verify":
        return "verify", {"vault": v, "step": STEP}
    args = {"cli_verify": ["verify", v], "cli_ls": ["ls", v], "cli_show": ["show", v, str(STEP)],
            "cli_gc": ["gc", v, "--dry-run"], "cli_cp": ["cp", v, str(dst)],
            "cli_cp_verify": ["cp", "--verify", v, str(dst)]}[command]
    return "cli", {"args": args}


def install(case: dict[str, Any], root: Path) -> Path:
    """The case's vault at ``root/vault`` (the base with its one file replaced), and the bait file beside it."""
    vault = Path(shutil.copytree(BASE_DIR, root / "vault"))
    shutil.copyfile(CASES_DIR / case["name"] / case["key"], vault / case["key"])
    (root / CORPUS["bait"]).write_bytes(BAIT)
    return vault


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under ``root``: folders, links (with their target) and files (with their SHA-256)."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[rel] = "link:" + os.readlink(path)
        elif path.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


def changes(before: dict[str, str], after: dict[str, str]) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))


# -- checking an outcome ------------------------------------------------------------------------------------------

def missing_fragments(text: str, fragments: list[str | list[str]]) -> list[str | list[str]]:
    """The fragments ``text`` lacks (a list fragment: any one of its strings will do)."""
    return [f for f in fragments if not (any(s in text for s in f) if isinstance(f, list) else f in text)]


def check_api(spec: dict[str, Any], reply: dict[str, Any], expected_digest: str | None) -> None:
    expect, status = spec["expect"], reply["status"]
    if status == "raised":
        error = reply["error"]
        shown = f"{error['type']}: {error['message']}"
        if "VaultError" not in error["mro"]:  # an untyped error: where it came from matters
            shown += "\n" + error["traceback"]
        assert expect in ("raises", "raises_or_reports"), f"expected {expect}, but it raised {shown}"
        assert set(spec["errors"]) & set(error["mro"]), f"expected one of {spec['errors']}, got {shown}"
        lacking = missing_fragments(error["message"], spec["fragments"])
        assert not lacking, f"the message lacks {lacking}: {shown}"
        return
    value = reply["value"]
    if expect == "ok":
        if expected_digest is not None:
            assert value["digest"] == expected_digest, "the restore returned a state other than the base vault's"
        if "ok" in value:  # a verify report
            assert value["ok"], f"verify found problems in an intact checkpoint: {value['problems']}"
        return
    if expect in ("reports", "raises_or_reports") and "ok" in value:
        assert not value["ok"], "verify reported the damaged checkpoint as intact"
        problems = " | ".join(value["problems"].get(str(STEP), []))
        lacking = missing_fragments(problems, spec["fragments"])
        assert not lacking, f"the verify report lacks {lacking}: {problems}"
        return
    unread = f"; {value['unread']}" if value.get("unread") else ""
    raise AssertionError(f"expected {expect} {spec.get('errors', '')}, but it succeeded{unread}: {json.dumps(value)[:300]}")


def check_cli(spec: dict[str, Any], value: dict[str, Any]) -> None:
    escaped = value["exception"]
    assert escaped is None, f"a traceback: {escaped['type']}: {escaped['message']}\n{escaped['traceback']}"
    code, out, err = value["exit_code"], value["stdout"], value["stderr"]
    shown = f"exit {code}\nstdout: {out[-1500:]!r}\nstderr: {err[-1500:]!r}"
    assert "Traceback" not in err, shown
    expect = spec["expect"]
    if expect == "ok":
        assert code == 0, shown
        return
    lines = err.strip().splitlines()
    as_error = out == "" and len(lines) == 1 and lines[0].startswith("error: ")
    if expect == "raises" or (expect == "raises_or_reports" and as_error):
        assert code in spec["exit"], f"expected exit status {spec['exit']}: {shown}"
        assert len(lines) == 1 and lines[0].startswith("error: "), f"expected one 'error: ...' line: {shown}"
        assert out == "", shown
        lacking = missing_fragments(lines[0], spec["fragments"])
        assert not lacking, f"the error line lacks {lacking}: {shown}"
        return
    assert code == 1, f"expected exit status 1 (damage reported): {shown}"
    lacking = missing_fragments(out + err, spec["fragments"])
    assert not lacking, f"the report lacks {lacking}: {shown}"


# -- the tests ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("case", "command"), CASE_PARAMS)
def test_hostile_case(case: dict[str, Any], command: dict[str, Any], tmp_path: Path, worker: Worker,
                      reference: dict[str, str]) -> None:
    vault = install(case, tmp_path)
    dst = tmp_path / "dst"
    before = snapshot(tmp_path)
    op, params = request(command["id"], vault, dst)
    reply = worker.call(op, **params)
    problems = []
    try:
        assert reply["status"] in ("ok", "raised"), f"{reply['status']}: {reply['detail']}"
        if op == "cli":
            check_cli(command, reply["value"])
        else:
            check_api(command, reply, reference.get(command["id"]))
        assert reply["maxrss_growth_mib"] < MAX_GROWTH_MIB, (
            f"the command raised peak memory by {reply['maxrss_growth_mib']:.0f} MiB on a vault of a few KB")
    except AssertionError as exc:
        problems.append(str(exc))
    after = snapshot(tmp_path)
    touched = [k for k in changes(before, after) if not k.startswith("dst")]
    outside = [k for k in touched if not k.startswith("vault/")]
    if outside or worker.stray_files():
        problems.append(f"written or removed outside the vault: {outside or worker.stray_files()}")
    vault_files = [k for k in touched if "dir" not in (before.get(k), after.get(k))]  # folders may come and go
    if vault_files:
        problems.append(f"vault files changed by a read-only command: {vault_files}")
    failed_copy = op == "cli" and reply["status"] == "ok" and reply["value"]["exit_code"] != 0
    if command.get("commits_nothing") and failed_copy and dst.exists():
        committed = [p.relative_to(dst).as_posix() for p in dst.rglob("*")
                     if p.is_file() and (p.name == "vault.json" or p.parent.name == "manifests")]
        if committed:
            problems.append(f"the failed copy left a vault or checkpoints in its destination: {committed}")
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)

def test_base_vault_is_intact(reference: dict[str, str], worker: Worker, tmp_path: Path) -> None:
    """The corpus means something only if its base is a healthy vault of base_state()."""
    assert reference["restore"] == state_digest(base_state())
    assert reference["restore_into"] == state_digest(base_state())
    vault = shutil.copytree(BASE_DIR, tmp_path / "vault")
    reply = worker.call("verify", vault=str(vault), step=STEP)
    assert reply == {"status": "ok", "value": {"ok": True, "problems": {}}, "maxrss_growth_mib": reply["maxrss_growth_mib"]}
    reply = worker.call("restore", vault=str(vault), step=STEP, reference=str(BASE_DIR))
    assert reply["status"] == "ok" and reply["value"]["unread"] is None, reply


def test_corpus_files_match_the_table() -> None:
    """Every case folder holds exactly the one file cases.json names, and that file differs from the base's."""
    names = [c["name"] for c in CORPUS["cases"]]
    assert len(names) == len(set(names))
    assert sorted(p.name for p in CASES_DIR.iterdir()) == sorted(names)
    for case in CORPUS["cases"]:
        files = [p.relative_to(CASES_DIR / case["name"]).as_posix()
                 for p in (CASES_DIR / case["name"]).rglob("*") if p.is_file()]
        assert files == [case["key"]], case["name"]
        assert (BASE_DIR / case["key"]).is_file(), f"{case['name']} replaces {case['key']}, which the base lacks"
        assert (CASES_DIR / case["name"] / case["key"]).read_bytes() != (BASE_DIR / case["key"]).read_bytes()
        assert {c["id"] for c in case["commands"]} <= set(CORPUS["commands"]), case["name"]
        assert case["what"], case["name"]


REAL_CLI = [("vault_version_2", "cli_show"), ("shape_negative", "cli_show"), ("chunk_header_raw_negative", "cli_verify")]


@pytest.mark.parametrize(("name", "command_id"), REAL_CLI, ids=[f"{n}-{c}" for n, c in REAL_CLI])
def test_real_entry_point(name: str, command_id: str, tmp_path: Path) -> None:
    """A few cases through ``python -m ckptvault`` in a fresh process: the same outcome as in the worker."""
    case = next(c for c in CORPUS["cases"] if c["name"] == name)
    command = next(c for c in case["commands"] if c["id"] == command_id)
    vault = install(case, tmp_path)
    _, params = request(command_id, vault, tmp_path / "dst")
    env = {k: v for k, v in os.environ.items() if not k.startswith("TQDM_")}
    proc = subprocess.run([sys.executable, "-m", "ckptvault", *params["args"]], capture_output=True, text=True,
                          timeout=120, env=env)
    escaped = None
    if "Traceback" in proc.stderr:
        escaped = {"type": "uncaught exception", "message": proc.stderr.strip().splitlines()[-1], "traceback": proc.stderr}
    check_cli(command, {"exit_code": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr, "exception": escaped})
