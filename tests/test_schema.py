"""The manifest and vault.json schema (_format/schema.py): every field a hostile or damaged file can get wrong.

Each case edits a real manifest (or descriptor) and re-wraps it with a valid checksum, as anyone can, then
checks the error type and that the message names the file and the field. A few cases go through the public
API and the CLI, which must print one ``error:`` line and exit with status 1 for damage.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import ckptvault
from ckptvault._format.manifest import decode_manifest, encode_manifest, manifest_key
from ckptvault._format.schema import MAX_DEPTH, check_descriptor, check_manifest
from ckptvault.cli import main
from ckptvault.errors import CorruptManifestError, FormatVersionError, InvalidArgumentError

KEY = manifest_key(1)
WHAT = f"manifest {KEY}"
CHUNK_SIZE = 65536


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {"model": {"w": torch.randn(64, 64), "b": torch.zeros(3, dtype=torch.int16)},
            "opt": {"m": torch.randn(40000)}, "np": np.arange(6, dtype=">f8"), "scalar": np.float32(2.5),
            "step": 1, "name": "run", "tags": ["a", {"b": None}]}


@pytest.fixture(scope="module")
def vault(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """A local vault holding step 1, with an int8-block record (and its scale part); returns (url, body, state)."""
    url = str(tmp_path_factory.mktemp("schema") / "vault")
    state = _state()
    with ckptvault.CheckpointManager(url, chunk_size=CHUNK_SIZE, codec_rules={"opt.*": "int8-block"}) as mgr:
        mgr.save(1, state, metadata={"run": "schema"}).wait()
        body = mgr.manifest(1)
    return url, body, state


def _index(body: dict[str, Any], path: str) -> int:
    return next(i for i, t in enumerate(body["tensors"]) if t["path"] == path)


def _nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def _tree_nested(depth: int) -> dict[str, Any]:
    node: dict[str, Any] = {"int": 0}
    for _ in range(depth):
        node = {"list": [node]}
    return node


Edit = Callable[[dict[str, Any]], Any]


def _set(path: list[Any], value: Any) -> Edit:
    def edit(body: dict[str, Any]) -> None:
        target = body
        for key in path[:-1]:
            target = target[key] if not callable(key) else target[key(body)]
        last = path[-1]
        target[last if not callable(last) else last(body)] = value
    return edit


def _delete(name: str) -> Edit:
    def edit(body: dict[str, Any]) -> None:
        del body[name]
    return edit


def _w(body: dict[str, Any]) -> int:
    return _index(body, "model.w")


def _m(body: dict[str, Any]) -> int:
    return _index(body, "opt.m")


# (id, edit, error type, fragments the message must hold besides the file)
CASES: list[tuple[str, Edit, type[Exception], list[str]]] = [
    ("body-is-a-list", lambda body: [body], CorruptManifestError, ["must be a JSON object"]),
    ("no-chunks", _delete("chunks"), CorruptManifestError, ["field chunks is missing"]),
    ("no-tensors", _delete("tensors"), CorruptManifestError, ["field tensors is missing"]),
    ("no-tree", _delete("tree"), CorruptManifestError, ["field tree is missing"]),
    ("no-time", _delete("time"), CorruptManifestError, ["field time is missing"]),
    ("no-step", _delete("step"), CorruptManifestError, ["field step is missing"]),
    ("format", _set(["format"], "zip"), CorruptManifestError, ["field format", "'zip'"]),
    ("version-abc", _set(["version"], "abc"), CorruptManifestError, ["field version must be an integer"]),
    ("version-list", _set(["version"], [1]), CorruptManifestError, ["field version must be an integer"]),
    ("version-bool", _set(["version"], True), CorruptManifestError, ["field version must be an integer"]),
    ("version-2", _set(["version"], 2), FormatVersionError, ["field version is 2", "upgrade ckptvault"]),
    ("requires-unknown", _set(["requires"], ["sparse-v9"]), FormatVersionError, ["field requires", "sparse-v9"]),
    ("requires-not-list", _set(["requires"], "lossy"), CorruptManifestError, ["field requires must be a JSON list"]),
    ("time-inf", _set(["time"], math.inf), CorruptManifestError, ["field time must be a finite number"]),
    ("time-string", _set(["time"], "x"), CorruptManifestError, ["field time must be a finite number"]),
    ("step-other", _set(["step"], 7), CorruptManifestError, ["field step is 7", "manifest of step 1"]),
    ("step-negative", _set(["step"], -1), CorruptManifestError, ["field step is -1"]),
    ("hash", _set(["hash"], "sha256"), CorruptManifestError, ["field hash", "'blake3'"]),
    ("sizes", _set(["stored_bytes"], "big"), CorruptManifestError, ["field stored_bytes must be an integer"]),
    ("metrics-list", _set(["metrics"], [1]), CorruptManifestError, ["field metrics must be a JSON object"]),
    ("metadata-deep", _set(["metadata"], {"x": _nested(MAX_DEPTH + 5)}), CorruptManifestError,
     ["field metadata is nested more than"]),
    ("chunk-id-nul", _set(["chunks", 0, "id"], "\x00" * 64), CorruptManifestError,
     ["field chunks[0].id", "64 lowercase hex"]),
    ("chunk-id-number", _set(["chunks", 0, "id"], 5), CorruptManifestError, ["field chunks[0].id"]),
    ("chunk-id-upper", _set(["chunks", 0, "id"], "A" * 64), CorruptManifestError, ["field chunks[0].id"]),
    ("chunk-raw-above-size", _set(["chunks", 0, "raw"], CHUNK_SIZE + 64), CorruptManifestError,
     ["field chunks[0].raw", f"outside 1..{CHUNK_SIZE}"]),
    ("chunk-base-self", lambda b: b["chunks"][0].update(base=b["chunks"][0]["id"]), CorruptManifestError,
     ["field chunks[0].base names the chunk itself"]),
    ("shape-negative", _set(["tensors", _w, "shape"], [-1]), CorruptManifestError,
     ["field tensors[", "].shape dimension 0 is -1"]),
    ("shape-overflow", _set(["tensors", _w, "shape"], [2**64]), CorruptManifestError, ["].shape dimension 0"]),
    ("shape-not-list", _set(["tensors", _w, "shape"], 5), CorruptManifestError, ["].shape must be a JSON list"]),
    ("shape-huge", _set(["tensors", _w, "shape"], [2**28]), CorruptManifestError,
     ["].shape [268435456] of float32 is 1073741824 bytes, but the pieces hold 16384"]),
    ("shape-half", _set(["tensors", _w, "shape"], [16, 16]), CorruptManifestError, ["is 1024 bytes, but the pieces hold 16384"]),
    ("nbytes", _set(["tensors", _w, "nbytes"], 8), CorruptManifestError,
     ["].pieces hold 16384 bytes, but the record's nbytes is 8"]),
    ("piece-beyond-chunk", _set(["tensors", _w, "pieces"], [[0, 10**9, 4]]), CorruptManifestError,
     ["].pieces[0] bytes 1000000000..1000000004 lie outside chunk 0"]),
    ("piece-chunk-99", _set(["tensors", _w, "pieces"], [[99, 0, 4]]), CorruptManifestError,
     ["].pieces[0] names chunk 99"]),
    ("piece-shape", _set(["tensors", _w, "pieces"], [[0, 0]]), CorruptManifestError,
     ["].pieces[0] must be [chunk index, offset, length]"]),
    ("piece-negative", _set(["tensors", _w, "pieces"], [[0, -4, 8]]), CorruptManifestError, ["lie outside chunk 0"]),
    ("kind", _set(["tensors", _w, "kind"], "evil"), CorruptManifestError, ["].kind is 'evil'"]),
    ("dtype-unknown", _set(["tensors", _w, "dtype"], "float128"), FormatVersionError,
     ["].dtype 'float128' is not a torch dtype"]),
    ("dtype-quantized", _set(["tensors", _w, "dtype"], "qint8"), FormatVersionError, ["].dtype 'qint8'"]),
    ("numpy-object", _set(["tensors", lambda b: _index(b, "np"), "dtype"], "|O"), CorruptManifestError,
     ["].dtype '|O' is not a numeric numpy dtype"]),
    ("numpy-garbage", _set(["tensors", lambda b: _index(b, "np"), "dtype"], "evil"), CorruptManifestError,
     ["].dtype 'evil' is not a numpy dtype"]),
    ("tree-index-999", _set(["tree", "dict", 0, 1, "dict", 0, 1], {"tensor": 999}), CorruptManifestError,
     ["field tree.dict[0][1].dict[0][1].tensor is 999"]),
    ("tree-kind-mismatch", _set(["tree", "dict", 0, 1, "dict", 0, 1], {"ndarray": 0}), CorruptManifestError,
     ["tree.dict[0][1].dict[0][1].ndarray names tensors[0] of kind 'torch'"]),
    ("tree-unknown-tag", _set(["tree", "dict", 0, 1], {"evil": 1}), CorruptManifestError,
     ["tree.dict[0][1] has unknown node tag"]),
    ("tree-two-tags", _set(["tree", "dict", 0, 1], {"int": 1, "str": "x"}), CorruptManifestError,
     ["tree.dict[0][1] must be a node with one tag"]),
    ("tree-deep", _set(["tree", "dict", 0, 1], _tree_nested(MAX_DEPTH + 5)), CorruptManifestError,
     ["field tree is nested more than"]),
    ("tree-bad-float", _set(["tree", "dict", 0, 1], {"float": "pi"}), CorruptManifestError, ["is not a hexadecimal float"]),
    ("tree-bad-key", _set(["tree", "dict", 0, 0], {"list": []}), CorruptManifestError, ["a dict key must be"]),
    ("tree-not-pair", _set(["tree", "dict", 0], [1, 2, 3]), CorruptManifestError, ["must be a [key node, value node] pair"]),
    ("lossy-scale-index", _set(["tensors", _m, "lossy", "parts", "scale"], 0), CorruptManifestError,
     ["].lossy.parts.scale names tensors[0], which is not a float32 part record"]),
    ("lossy-block", _set(["tensors", _m, "lossy", "block"], 0), CorruptManifestError, ["].lossy.block is 0"]),
    ("lossy-codec", _set(["tensors", _m, "lossy", "codec"], "int3"), CorruptManifestError, ["].lossy.codec is 'int3'"]),
    ("lossy-stored-shape", _set(["tensors", _m, "lossy", "stored_shape"], [5]), CorruptManifestError,
     ["].lossy.stored_shape [5] of int8"]),
    ("lossy-error", _set(["tensors", _m, "lossy", "error", "max_abs"], "big"), CorruptManifestError,
     ["].lossy.error.max_abs must be a number"]),
]


@pytest.mark.parametrize(("edit", "error", "fragments"), [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_manifest_field_errors(vault: tuple[str, dict[str, Any], Any], edit: Edit, error: type[Exception],
                               fragments: list[str]) -> None:
    body = copy.deepcopy(vault[1])
    edited = edit(body)
    with pytest.raises(error) as info:
        check_manifest(body if edited is None else edited, WHAT, 1, CHUNK_SIZE)
    assert str(info.value).startswith(f"{WHAT}: ")
    for fragment in fragments:
        assert fragment in str(info.value)


def test_the_saved_manifest_parses_to_a_typed_manifest_that_gives_the_body_back(
        vault: tuple[str, dict[str, Any], Any]) -> None:
    manifest = check_manifest(copy.deepcopy(vault[1]), WHAT, 1, CHUNK_SIZE)
    assert manifest.to_json() == vault[1]
    record = next(t for t in manifest.tensors if t.path == "opt.m")
    assert record.is_lossy and record.lossy is not None and record.lossy.codec == "int8-block"
    assert record.shape == (40000,) and record.dtype == "float32" and record.lossy.stored_dtype == "int8"
    assert manifest.tensors[record.lossy.parts["scale"]].kind == "part"
    assert all(p.offset + p.length <= manifest.chunks[p.chunk].raw for t in manifest.tensors for p in t.pieces)


@pytest.mark.parametrize(("text", "fragment"), [
    (b'{"format": NaN}', "NaN is not a JSON number"),
    (b'{"time": Infinity}', "Infinity is not a JSON number"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"a": "\xff"}', "is not valid JSON"),
])
def test_json_level_damage(text: bytes, fragment: str) -> None:
    data = encode_manifest({}).replace(b'"manifest":{}', b'"manifest":' + text)
    import blake3

    data = data[:11] + blake3.blake3(text).hexdigest().encode() + data[75:]
    with pytest.raises(CorruptManifestError, match=fragment):
        decode_manifest(data, KEY)


# -- through the API and the CLI ------------------------------------------------

def _rewrite(url: str, edit: Edit, step: int = 1) -> None:
    path = Path(url) / manifest_key(step)
    body = decode_manifest(path.read_bytes(), "test").to_json()
    edited = edit(body)
    path.write_bytes(encode_manifest(body if edited is None else edited))


@pytest.fixture
def damaged(vault: tuple[str, dict[str, Any], Any], tmp_path: Path) -> Callable[[Edit], str]:
    """A copy of the module's vault with its manifest edited."""
    import shutil

    def make(edit: Edit) -> str:
        url = str(tmp_path / "copy")
        shutil.copytree(vault[0], url)
        _rewrite(url, edit)
        return url
    return make


def test_restore_refuses_a_shape_the_pieces_do_not_hold(damaged: Callable[[Edit], str]) -> None:
    url = damaged(_set(["tensors", _w, "shape"], [2**28]))
    with ckptvault.CheckpointManager(url) as mgr, pytest.raises(CorruptManifestError, match=r"tensors\[\d+\]\.shape"):
        mgr.restore(1)


@pytest.mark.parametrize(("command", "code", "first_line"), [
    (["show", "{url}", "1"], 1, "error: "),
    (["diff", "{url}", "1", "1"], 1, "error: "),
    (["cp", "{url}", "{url}-copy"], 1, "error: "),
    (["gc", "--dry-run", "{url}"], 3, "error: refusing to collect garbage"),  # MaintenanceRefusedError
    (["ls", "{url}"], 1, "warning: step 1: "),  # ls lists the rest and marks the step DAMAGED
    (["du", "{url}"], 1, "warning: step 1 left out: "),
])
def test_cli_names_the_field_in_one_line(damaged: Callable[[Edit], str], command: list[str], code: int,
                                         first_line: str) -> None:
    url = damaged(_set(["tensors", _w, "pieces"], [[99, 0, 4]]))
    result = CliRunner().invoke(main, [a.format(url=url) for a in command])
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == code, result.output
    assert len(lines) == 1 and lines[0].startswith(first_line), result.stderr
    assert "pieces[0] names chunk 99" in lines[0] and "Traceback" not in result.output


def test_cli_verify_reports_the_damaged_step(damaged: Callable[[Edit], str]) -> None:
    url = damaged(_set(["tensors", _w, "pieces"], [[99, 0, 4]]))
    result = CliRunner().invoke(main, ["verify", url])
    assert result.exit_code == 1
    assert result.stdout.startswith("step 1: DAMAGED\n") and "pieces[0] names chunk 99" in result.stdout


# -- vault.json -----------------------------------------------------------------

DESCRIPTOR = {"format": "ckptvault.vault", "version": 1, "chunk_size": 4 << 20, "codec": "zstd", "hash": "blake3",
              "created": 1.0}


@pytest.mark.parametrize(("field", "value", "error", "fragment"), [
    ("chunk_size", -65536, CorruptManifestError, "field chunk_size is -65536, outside 65536..268435456"),
    ("chunk_size", 1000, CorruptManifestError, "field chunk_size is 1000"),
    ("chunk_size", 2**50, CorruptManifestError, "field chunk_size is 1125899906842624"),
    ("chunk_size", 65600 + 1, CorruptManifestError, "not a multiple of 64"),
    ("chunk_size", "4M", CorruptManifestError, "field chunk_size must be an integer"),
    ("hash", "sha256", CorruptManifestError, "field hash is 'sha256'"),
    ("version", "abc", CorruptManifestError, "field version must be an integer"),
    ("version", [1], CorruptManifestError, "field version must be an integer"),
    ("version", 2, FormatVersionError, "field version is 2"),
    ("codec", "brotli", CorruptManifestError, "field codec 'brotli' is not a codec"),
    ("format", None, CorruptManifestError, "field format is None"),
    ("created", "yesterday", CorruptManifestError, "field created must be a finite number"),
])
def test_descriptor_field_errors(field: str, value: Any, error: type[Exception], fragment: str) -> None:
    desc = {**DESCRIPTOR, field: value}
    with pytest.raises(error) as info:
        check_descriptor(desc, "vault.json in /v")
    assert str(info.value).startswith("vault.json in /v: ") and fragment in str(info.value)


def test_an_oversized_descriptor_is_refused_unread(tmp_path: Path) -> None:
    url = str(tmp_path / "v")
    ckptvault.save({"x": torch.ones(4)}, url, step=1)
    with open(Path(url) / "vault.json", "r+b") as f:
        f.truncate(1 << 30)  # sparse: cheap to make, a gigabyte to read
    with pytest.raises(CorruptManifestError, match=r"vault.json in .* is 1073741824 bytes, more than a vault descriptor"):
        ckptvault.load(url)


def test_descriptor_that_is_not_an_object() -> None:
    with pytest.raises(CorruptManifestError, match="vault.json in /v: must be a JSON object, not a list"):
        check_descriptor([DESCRIPTOR], "vault.json in /v")


def test_a_vault_with_a_bad_chunk_size_refuses_to_save(tmp_path: Path) -> None:
    """A negative chunk size is refused: it would make every save commit a manifest without chunks."""
    url = str(tmp_path / "v")
    ckptvault.save({"x": torch.ones(4)}, url, step=1)
    path = Path(url) / "vault.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "chunk_size": -65536}))
    with pytest.raises(CorruptManifestError, match="vault.json in .*field chunk_size is -65536"):
        ckptvault.save({"x": torch.ones(4)}, url, step=2)
    assert sorted(p.name for p in (Path(url) / "manifests").iterdir()) == [Path(manifest_key(1)).name]
    result = CliRunner().invoke(main, ["ls", url])
    assert result.exit_code == 1 and result.stderr.startswith("error: vault.json in ")


# -- what a save refuses, so that readers never meet it -------------------------------

def test_save_refuses_a_state_nested_deeper_than_readers_accept(tmp_path: Path) -> None:
    deep: dict[str, Any] = {}
    node = deep
    for _ in range(MAX_DEPTH + 1):
        node["a"] = {}
        node = node["a"]
    with pytest.raises(InvalidArgumentError, match=f"nested more than {MAX_DEPTH} containers deep"):
        ckptvault.save(deep, str(tmp_path / "v"), step=1)
    assert not (tmp_path / "v" / "manifests").exists()


def test_save_refuses_metadata_nested_deeper_than_readers_accept(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match=f"metadata is nested more than {MAX_DEPTH} levels deep"):
        ckptvault.save({"x": 1}, str(tmp_path / "v"), step=1, metadata={"m": _nested(MAX_DEPTH + 1)})


def test_the_deepest_state_a_save_accepts_restores(tmp_path: Path) -> None:
    deep: list[Any] = []
    node = deep
    for _ in range(MAX_DEPTH - 2):
        child: list[Any] = []
        node.append(child)
        node = child
    url = str(tmp_path / "v")
    ckptvault.save({"x": deep}, url, step=1, metadata={"m": _nested(MAX_DEPTH - 1)})
    assert ckptvault.load(url)["x"] == deep
