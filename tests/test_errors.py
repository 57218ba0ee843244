"""Every deliberate error: its type (and the builtin it also is) and a message that says what and where."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckptvault
from ckptvault._format.chunk_object import ChunkHeader, encode_object
from ckptvault._format.manifest import decode_manifest, encode_manifest
from ckptvault._maintenance.retention import KeepLast
from ckptvault.errors import (
    CorruptChunkError,
    CorruptManifestError,
    FormatVersionError,
    InvalidArgumentError,
    KeyMismatchError,
    PickleNotAllowedError,
    StepExistsError,
    StepNotFoundError,
    UnsupportedObjectError,
    VaultError,
    VaultNotFoundError,
)
from conftest import assert_same_state


def _state() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(256, 256, generator=gen), "b": torch.zeros(4)}, "step": 5}


@pytest.fixture
def saved(local_url: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """A local vault with step 5; returns (url, state, manifest)."""
    state = _state()
    with ckptvault.CheckpointManager(local_url, chunk_size=64 << 10) as mgr:
        mgr.save(5, state).wait()
        return local_url, state, mgr.manifest(5)


def _chunk_path(url: str, manifest: dict[str, Any], tensor: str, piece: int = 0) -> tuple[str, Path]:
    entry = next(t for t in manifest["tensors"] if t["path"] == tensor)
    cid = manifest["chunks"][entry["pieces"][piece][0]]["id"]
    return cid, Path(url) / "chunks" / cid[:2] / cid


def _manifest_path(url: str, step: int) -> Path:
    return Path(url) / "manifests" / f"{step:020d}.json"


# -- damaged data -------------------------------------------------------------------------------

@pytest.mark.parametrize("where", ["header", "payload", "last"])
def test_flipped_chunk_byte_names_step_tensor_and_chunk(saved: tuple[str, Any, Any], where: str) -> None:
    """A flipped byte anywhere in a chunk object fails its hash check before the bytes reach the caller (DESIGN C3)."""
    url, _state_, manifest = saved
    cid, path = _chunk_path(url, manifest, "model.w", piece=2)
    data = bytearray(path.read_bytes())
    index = {"header": 10, "payload": len(data) // 2, "last": len(data) - 1}[where]
    data[index] ^= 0x01
    path.write_bytes(bytes(data))
    with ckptvault.CheckpointManager(url) as mgr, pytest.raises(CorruptChunkError) as info:
        mgr.restore(5)
    message = str(info.value)
    assert f"chunk {cid} is corrupt (needed by step 5, tensor 'model.w')" in message
    assert isinstance(info.value, ValueError) and isinstance(info.value, VaultError)
    assert (info.value.step, info.value.tensor, info.value.chunk) == (5, "model.w", cid)
    with ckptvault.CheckpointManager(url) as mgr:
        report = mgr.verify()
        assert not report.ok and cid in " ".join(report.problems[5])
        assert_same_state({"model": {"b": torch.zeros(4)}, "step": 5}, mgr.restore(5, keys=["model.b", "step"]))


def test_missing_chunk_names_step_tensor_and_chunk(saved: tuple[str, Any, Any]) -> None:
    url, _state_, manifest = saved
    cid, path = _chunk_path(url, manifest, "model.w")
    path.unlink()
    expected = f"chunk {cid} is corrupt (needed by step 5, tensor 'model.w'): the chunk object is missing"
    with ckptvault.CheckpointManager(url) as mgr, pytest.raises(CorruptChunkError, match=re.escape(expected)):
        mgr.restore(5)


def test_truncated_chunk_object(saved: tuple[str, Any, Any]) -> None:
    url, _state_, manifest = saved
    cid, path = _chunk_path(url, manifest, "model.w")
    path.write_bytes(path.read_bytes()[:5])
    with ckptvault.CheckpointManager(url) as mgr, pytest.raises(CorruptChunkError, match="shorter than its fixed header"):
        mgr.restore(5)


@pytest.mark.parametrize("cut", [0, 10, 100, -1, -50])
def test_truncated_manifest(saved: tuple[str, Any, Any], cut: int) -> None:
    url = saved[0]
    path = _manifest_path(url, 5)
    path.write_bytes(path.read_bytes()[:cut])
    with ckptvault.CheckpointManager(url) as mgr, pytest.raises(CorruptManifestError, match=r"manifest manifests/0+5\.json in .* "
                                                                                           r"(is truncated|fails its BLAKE3)"):
        mgr.restore(5)


@pytest.mark.parametrize("position", ["checksum", "body", "end"])
def test_flipped_manifest_byte(saved: tuple[str, Any, Any], position: str) -> None:
    url = saved[0]
    path = _manifest_path(url, 5)
    data = bytearray(path.read_bytes())
    index = {"checksum": 20, "body": len(data) // 2, "end": len(data) - 2}[position]
    data[index] = ord("0") if data[index] != ord("0") else ord("1")
    path.write_bytes(bytes(data))
    with ckptvault.CheckpointManager(url) as mgr:
        with pytest.raises(CorruptManifestError, match="fails its BLAKE3 checksum: it was damaged after writing") as info:
            mgr.restore(5)
        assert isinstance(info.value, ValueError)
        with pytest.raises(CorruptManifestError):
            mgr.info(5)
        assert not mgr.verify().ok


def test_manifest_naming_another_step(saved: tuple[str, Any, Any]) -> None:
    url = saved[0]
    _manifest_path(url, 5).rename(_manifest_path(url, 6))
    with ckptvault.CheckpointManager(url) as mgr, pytest.raises(
            CorruptManifestError, match=r"field step is 5, but the file is the manifest of step 6"):
        mgr.restore(6)


# -- format versions ----------------------------------------------------------------------------------

def test_future_vault_descriptor(saved: tuple[str, Any, Any]) -> None:
    url = saved[0]
    path = Path(url) / "vault.json"
    desc = json.loads(path.read_text())
    desc["version"] = 99
    path.write_text(json.dumps(desc))
    for action in (lambda m: m.restore(5), lambda m: m.save(6, {"x": 1}).wait()):
        with ckptvault.CheckpointManager(url) as mgr, pytest.raises(FormatVersionError,
                                                                    match=r"vault.json .*field version is 99: this vault uses a "
                                                                          r"newer format .*upgrade"):
            action(mgr)


def test_future_manifest_version(saved: tuple[str, Any, Any]) -> None:
    url = saved[0]
    path = _manifest_path(url, 5)
    body = decode_manifest(path.read_bytes(), "test").to_json()
    body["version"] = 7
    path.write_bytes(encode_manifest(body))  # valid checksum: only the version is new
    with ckptvault.CheckpointManager(url) as mgr, pytest.raises(
            FormatVersionError, match=r"manifest .* field version is 7: this manifest uses a newer format"):
        mgr.restore(5)


def test_future_chunk_version(saved: tuple[str, Any, Any]) -> None:
    url, _state_, manifest = saved
    cid, path = _chunk_path(url, manifest, "model.w")
    data = bytearray(path.read_bytes())
    data[4] = 2  # the format version byte
    path.write_bytes(bytes(data))
    with ckptvault.CheckpointManager(url) as mgr, pytest.raises(FormatVersionError,
                                                                match=f"chunk {cid} uses chunk format version 2"):
        mgr.restore(5)


def test_unknown_codec_stage(saved: tuple[str, Any, Any]) -> None:
    url, _state_, manifest = saved
    cid, path = _chunk_path(url, manifest, "model.w")
    path.write_bytes(encode_object(ChunkHeader(codec=[{"id": "brotli-9000"}], raw=64 << 10), b"\x00" * 10))
    with ckptvault.CheckpointManager(url) as mgr, pytest.raises(FormatVersionError, match="unknown codec stage 'brotli-9000'"):
        mgr.restore(5)


# -- steps and vaults -------------------------------------------------------------------------------

def test_step_exists_unless_overwrite(vault_url: str) -> None:
    with ckptvault.CheckpointManager(vault_url) as mgr:
        mgr.save(3, {"x": torch.ones(2)}).wait()
        with pytest.raises(StepExistsError, match=r"step 3 is already committed in .*; pass overwrite=True") as info:
            mgr.save(3, {"x": torch.zeros(2)}).wait()
        assert isinstance(info.value, FileExistsError) and info.value.step == 3
        assert_same_state({"x": torch.ones(2)}, mgr.restore(3))
        mgr.save(3, {"x": torch.zeros(2), "y": "new"}, overwrite=True, metrics={"v": 2}).wait()
        assert_same_state({"x": torch.zeros(2), "y": "new"}, mgr.restore(3))
        assert mgr.steps() == [3] and mgr.info(3).metrics == {"v": 2}


def test_step_not_found_lists_available_steps(vault_url: str) -> None:
    with ckptvault.CheckpointManager(vault_url) as mgr:
        for step in (10, 20, 30):
            mgr.save(step, {"s": step}).wait()
        expected = r"step 15 has no committed checkpoint in .*; committed steps: 10, 20, 30"
        with pytest.raises(StepNotFoundError, match=expected) as info:
            mgr.restore(15)
        assert isinstance(info.value, FileNotFoundError) and info.value.step == 15
        with pytest.raises(StepNotFoundError, match="step 99"):
            mgr.info(99)
        with pytest.raises(StepNotFoundError, match="step 99"):
            mgr.delete(99)
    with pytest.raises(StepNotFoundError, match="committed steps: 10, 20, 30"):
        ckptvault.load(vault_url, 7)


def test_vault_not_found(tmp_path: Path, memory_url: str) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    for url in (str(empty), str(tmp_path / "does-not-exist"), memory_url):
        with pytest.raises(VaultNotFoundError, match="no ckptvault vault at") as info:
            ckptvault.load(url)
        assert isinstance(info.value, FileNotFoundError)
        with pytest.raises(VaultNotFoundError):
            ckptvault.load(url, 3)
        with ckptvault.CheckpointManager(url) as mgr:
            assert mgr.steps() == [] and mgr.latest_step() is None
    assert list(empty.iterdir()) == []  # reading created nothing


# -- unsupported values and pickle ---------------------------------------------------------------------

class _Custom:
    pass


@pytest.mark.parametrize(("state", "path", "kind"), [
    ({"a": {"b": {1, 2}}}, "a.b", "builtins.set"),
    ({"opt": [0, _Custom()]}, "opt.1", "test_errors._Custom"),
    ({"arr": np.array(["x", None], dtype=object)}, "arr", "numpy.ndarray"),
    ({"strs": np.array(["ab", "c"])}, "strs", "numpy.ndarray"),
    ({"k": {(1, 2): 3}}, "k.(1, 2)", "builtins.tuple"),
    ({"sparse": torch.eye(3).to_sparse()}, "sparse", "torch.Tensor"),
    ({"f": lambda: 1}, "f", "builtins.function"),
])
def test_unsupported_object_names_key_path(memory_url: str, state: dict[str, Any], path: str, kind: str) -> None:
    with ckptvault.CheckpointManager(memory_url) as mgr:
        with pytest.raises(UnsupportedObjectError) as info:
            mgr.save(1, state).wait()
        assert f"cannot store {kind} at key path {path!r}" in str(info.value)
        assert "allow_pickle=True" in str(info.value)
        assert isinstance(info.value, TypeError) and info.value.path == path
        assert mgr.steps() == []  # nothing committed


def test_pickle_not_allowed(memory_url: str) -> None:
    with ckptvault.CheckpointManager(memory_url) as mgr:
        mgr.save(1, {"cfg": {"tags": {"a"}}, "w": torch.ones(1)}, allow_pickle=True).wait()
        with pytest.raises(PickleNotAllowedError, match=r"key path 'cfg.tags' was saved with pickle; pass allow_pickle=True"):
            mgr.restore(1)
        with pytest.raises(PickleNotAllowedError):
            mgr.restore(1, keys=["cfg"])


@pytest.mark.parametrize("flag", ["no", "false", 0, None])
def test_allow_pickle_must_be_a_bool_or_a_string_would_allow_unpickling(memory_url: str, flag: Any) -> None:
    with ckptvault.CheckpointManager(memory_url, async_save=False) as mgr:
        mgr.save(1, {"cfg": {"tags": {"a"}}, "w": torch.ones(1)}, allow_pickle=True).wait()
        with pytest.raises(InvalidArgumentError, match=f"allow_pickle must be true/false, got {re.escape(repr(flag))}"):
            mgr.restore(1, allow_pickle=flag)
        with pytest.raises(InvalidArgumentError, match="allow_pickle must be true/false"):
            mgr.save(2, {"cfg": {"tags": {"b"}}}, allow_pickle=flag)
        assert mgr.steps() == [1]


@pytest.mark.parametrize(("call", "message"), [
    (lambda m: m.restore(1, keys=5), r"keys must be a key path pattern or a list of them .*, got 5"),
    (lambda m: m.restore(1, keys=["w", 1]), r"keys must be a key path pattern or a list of them .*, got \['w', 1\]"),
    (lambda m: m.restore(1, progress=5), "progress must be a callable taking a byte count, or None, got 5"),
    (lambda m: m.save(2, {"w": torch.zeros(1)}, progress="bar"), "progress must be a callable .* got 'bar'"),
    (lambda m: m.verify(1, progress=True), "progress must be a callable .* got True"),
])
def test_keys_and_progress_of_the_wrong_kind_are_refused_before_any_work(memory_url: str, call: Any, message: str) -> None:
    with ckptvault.CheckpointManager(memory_url, async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(1)}).wait()
        with pytest.raises(InvalidArgumentError, match=message):
            call(mgr)
        assert mgr.steps() == [1]


@pytest.mark.parametrize(("call", "message"), [
    (lambda m: m.save(1, {"w": torch.zeros(1)}, overwrite="yes"), r"overwrite must be true/false, got 'yes'"),
    (lambda m: m.restore(1, into={"w": torch.zeros(1)}, strict="no"), r"strict must be true/false, got 'no'"),
])
def test_save_and_restore_flags_must_be_bools(memory_url: str, call: Any, message: str) -> None:
    with ckptvault.CheckpointManager(memory_url, async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(1)}).wait()
        with pytest.raises(InvalidArgumentError, match=message):
            call(mgr)
        assert torch.equal(mgr.restore(1)["w"], torch.ones(1))


# -- restore arguments ---------------------------------------------------------------------------------

def test_into_shape_and_dtype_mismatch(memory_url: str) -> None:
    with ckptvault.CheckpointManager(memory_url) as mgr:
        mgr.save(1, {"model": {"w": torch.ones(2, 3), "b": torch.ones(3)}}).wait()
        with pytest.raises(KeyMismatchError, match=re.escape("'w': saved float32[2, 3], target is float32[3, 2]")) as info:
            mgr.restore(1, into={"w": torch.zeros(3, 2), "b": torch.zeros(3)})
        assert isinstance(info.value, KeyError)
        with pytest.raises(KeyMismatchError, match=re.escape("'b': saved float32[3], target is float64[3]")):
            mgr.restore(1, into={"w": torch.zeros(2, 3), "b": torch.zeros(3, dtype=torch.float64)})


def test_into_unknown_and_missing_keys(memory_url: str) -> None:
    with ckptvault.CheckpointManager(memory_url) as mgr:
        mgr.save(1, {"model": {"w": torch.ones(2), "b": torch.ones(1)}}).wait()
        with pytest.raises(KeyMismatchError, match=r"into= tensors \['nope'\] are not in the checkpoint"):
            mgr.restore(1, into={"nope": torch.zeros(2)})
        target = {"w": torch.zeros(2)}  # model.b, a sibling the target does not name, is not read and not an error
        mgr.restore(1, into=target)
        assert torch.equal(target["w"], torch.ones(2))
        with pytest.raises(KeyMismatchError, match=r"into= holds 1 tensors the checkpoint of step 1 does not \(under 'model'\): "
                                                    r"\['c'\]; remove them from into=, or pass strict=False"):
            mgr.restore(1, into={"w": torch.zeros(2), "c": torch.zeros(1)})
        target = {"w": torch.zeros(2), "c": torch.full((1,), 5.0)}
        mgr.restore(1, into=target, strict=False)
        assert torch.equal(target["w"], torch.ones(2)) and torch.equal(target["c"], torch.full((1,), 5.0))
        with pytest.raises(KeyMismatchError, match=r"no key path matches \['opt.\*'\]; top-level keys are \['model'\]"):
            mgr.restore(1, keys=["opt.*"])


# -- bad arguments ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("step", [-1, "3", 2.0, None, True, 10**20])  # 10**20: a manifest key has 20 digits
def test_bad_step(memory_url: str, step: Any) -> None:
    with ckptvault.CheckpointManager(memory_url) as mgr:
        with pytest.raises(InvalidArgumentError, match=f"step must be an int from 0 to {10**20 - 1} "
                                                       f"\\(20 digits\\), got {re.escape(repr(step))}") as info:
            mgr.save(step, {"x": 1}).wait()
        assert isinstance(info.value, ValueError)
        if step is not None:  # None means "latest" on restore
            with pytest.raises(InvalidArgumentError, match="step must be an int from 0"):
                mgr.restore(step)


@pytest.mark.parametrize("codec", ["brotli", "zstd-99", "zstd-0", "ZSTD"])
def test_bad_codec(memory_url: str, codec: str) -> None:
    with pytest.raises(InvalidArgumentError, match=f"(unknown codec {codec!r}|zstd level must be 1..22)"):
        ckptvault.CheckpointManager(memory_url, codec=codec)
    with pytest.raises(InvalidArgumentError, match="unknown codec|zstd level"):
        ckptvault.CheckpointManager(memory_url, codec_rules={"optimizer.*": codec})


@pytest.mark.parametrize("chunk_size", [1000, 0, 32 << 10, 1 << 30])
def test_bad_chunk_size(memory_url: str, chunk_size: int) -> None:
    with ckptvault.CheckpointManager(memory_url, chunk_size=chunk_size) as mgr:
        expected = f"chunk_size must be a multiple of 64 between 65536 and 268435456, got {chunk_size}"
        with pytest.raises(InvalidArgumentError, match=expected):
            mgr.save(1, {"x": torch.ones(1)}).wait()
        assert mgr.steps() == []


@pytest.mark.parametrize(("setting", "message"), [
    ({"chunk_size": "4MB"}, r"chunk_size must be an integer, got '4MB' \(str\)"),
    ({"chunk_size": True}, r"chunk_size must be an integer, got True \(bool\)"),
])
def test_a_chunk_size_that_is_not_an_integer_fails_the_save_and_commits_nothing(
        memory_url: str, setting: dict[str, Any], message: str) -> None:
    with ckptvault.CheckpointManager(memory_url, **setting) as mgr:
        with pytest.raises(InvalidArgumentError, match=message):
            mgr.save(1, {"x": torch.ones(1)}).wait()
        assert mgr.steps() == []


@pytest.mark.parametrize(("setting", "message"), [
    # a string or number where a flag belongs: "no" would be taken as true
    ({"async_save": "yes"}, r"async_save must be true/false, got 'yes' \(str\)"),
    ({"incremental": 1}, r"incremental must be true/false, got 1 \(int\)"),
    ({"cache_keyframe": "no"}, r"cache_keyframe must be true/false or None, got 'no' \(str\)"),
    # text where a number belongs: it failed as a TypeError inside the first save
    ({"keyframe_every": "3"}, r"keyframe_every must be an integer, got '3' \(str\)"),
    ({"keyframe_every": 2.5}, r"keyframe_every must be an integer, got 2.5 \(float\)"),
    ({"keyframe_growth": "x"}, r"keyframe_growth must be a number, got 'x' \(str\)"),
    ({"max_flushed": "0.1"}, r"max_flushed must be a number, got '0.1' \(str\)"),
    ({"workers": "2"}, r"workers must be an integer or None, got '2' \(str\)"),
    ({"max_staging_bytes": "1GB"}, r"max_staging_bytes must be an integer or None, got '1GB' \(str\)"),
    # out of range: workers=0 meant the default, a negative cap staged nothing
    ({"workers": 0}, r"workers must be at least 1 \(None: the default\), got 0"),
    ({"max_staging_bytes": -1}, r"max_staging_bytes must be at least 0 \(None: no cap\), got -1"),
    # a string or a number is not a retention policy (a string iterated its letters)
    ({"retention": "last:3"}, r"retention takes a Retention, a policy or a list of policies, not 'last:3'"),
    ({"retention": 3}, r"retention takes a Retention, a policy or a list of policies, not 3"),
])
def test_manager_settings_of_the_wrong_type_or_range_are_refused_at_once(
        memory_url: str, setting: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        ckptvault.CheckpointManager(memory_url, **setting)


def test_manager_settings_at_the_edges_of_their_ranges_are_taken(memory_url: str) -> None:
    with ckptvault.CheckpointManager(memory_url, workers=1, max_staging_bytes=0, keyframe_every=1, keyframe_growth=2,
                                     max_flushed=0, cache_keyframe=None, async_save=False, incremental=False,
                                     chunk_size=1 << 16) as mgr:
        assert mgr.save(1, {"x": torch.ones(1)}).wait().step == 1


def test_numpy_numbers_are_taken_where_numbers_belong(memory_url: str) -> None:
    with ckptvault.CheckpointManager(memory_url, workers=np.int64(2), keyframe_every=np.int32(3),
                                     keyframe_growth=np.float32(0.5), max_flushed=np.float64(0.1),
                                     max_staging_bytes=np.int64(1 << 20), chunk_size=np.int64(1 << 16)) as mgr:
        mgr.save(1, {"x": torch.ones(4)}).wait()
        assert mgr.info(1).step == 1
        assert json.loads(mgr.vault.store.get("vault.json"))["chunk_size"] == 1 << 16


@pytest.mark.parametrize(("call", "message"), [
    (lambda m: m.gc(grace="1h", dry_run=True), r"grace must be a number, got '1h' \(str\)"),
    (lambda m: m.gc(dry_run="no"), r"dry_run must be true/false, got 'no' \(str\)"),  # "no" was a dry run
    (lambda m: m.prune(KeepLast(1), dry_run=0), r"dry_run must be true/false, got 0 \(int\)"),
    # was a ValueError from a format string:
    (lambda m: m.verify("1"), r"step must be an int from 0 to \d+ \(20 digits\), got '1'"),
])
def test_maintenance_arguments_of_the_wrong_type_are_refused_and_delete_nothing(
        memory_url: str, call: Any, message: str) -> None:
    with ckptvault.CheckpointManager(memory_url, async_save=False) as mgr:
        for step in (1, 2):
            mgr.save(step, {"x": torch.full((3,), float(step))}).wait()
        with pytest.raises(InvalidArgumentError, match=message):
            call(mgr)
        assert mgr.steps() == [1, 2]
        assert mgr.verify().ok


@pytest.mark.parametrize(("metrics", "detail"), [  # non-finite numbers are stored: tests/test_no_silent_noops.py
    ({"obj": object()}, "not JSON serializable"),
    ({1: 2.0}, "must be a dict with str keys"),
])
def test_bad_metrics(memory_url: str, metrics: Any, detail: str) -> None:
    """Each failed save reports its own error once: the next save is not failed by the previous one's error."""
    with ckptvault.CheckpointManager(memory_url) as mgr:
        with pytest.raises(InvalidArgumentError, match=f"metrics .*{detail}"):
            mgr.save(1, {"x": torch.ones(1)}, metrics=metrics).wait()
        with pytest.raises(InvalidArgumentError, match="metadata"):
            mgr.save(1, {"x": torch.ones(1)}, metadata={"when": {1, 2}}).wait()
        assert mgr.steps() == []
        info = mgr.save(1, {"x": torch.ones(1)}, metrics={"loss": np.float32(0.5), "t": torch.tensor(2.0)}).wait()
        assert info.metrics == {"loss": 0.5, "t": 2.0}  # numpy / 0-d torch scalars become floats


def test_bad_url_scheme() -> None:
    with pytest.raises(InvalidArgumentError, match="unsupported vault URL scheme 'gopher'"):  # ftp:// is fsspec's now
        ckptvault.CheckpointManager("gopher://host/vault")


def test_manifest_requiring_an_unknown_feature_is_refused(tmp_path: Path) -> None:
    """A manifest that declares a feature this reader lacks must be refused, never misread."""
    url = str(tmp_path / "v")
    ckptvault.save({"w": torch.arange(10.0)}, url, step=1)
    path = tmp_path / "v" / "manifests" / f"{1:020d}.json"
    body = decode_manifest(path.read_bytes(), "test").to_json()
    body["requires"] = ["lossy", "sparse-v9"]
    path.write_bytes(encode_manifest(body))
    with pytest.raises(FormatVersionError, match=r"field requires names features \['sparse-v9'\].*upgrade ckptvault"):
        ckptvault.load(url)


def test_lossy_manifest_declares_the_lossy_feature(tmp_path: Path) -> None:
    url = str(tmp_path / "v")
    ckptvault.save({"w": torch.linspace(-1, 1, 4096), "n": torch.arange(5)}, url, step=1, codec_rules={"w": "bf16"})
    ckptvault.save({"w": torch.linspace(-1, 1, 4096)}, url, step=2)
    with ckptvault.CheckpointManager(url) as mgr:
        assert mgr.manifest(1)["requires"] == ["lossy"]
        assert "requires" not in mgr.manifest(2)
