"""Export and import (ckptvault.export_checkpoint / import_checkpoint, ``ckptvault export`` / ``import``).

Real files and vaults throughout: safetensors files read back by ``safetensors.torch.load_file`` itself, torch
files by ``torch.load(weights_only=True)``, a DCP folder written by ``torch.distributed.checkpoint.save``, a
Hugging Face folder written by ``transformers``' ``save_pretrained`` (sharded, with its index), a vault saved by 2
real gloo ranks through VaultWriter (exported whole), and a 208 MiB state exported and imported in a subprocess
whose anonymous memory stays under 96 MiB (tests/helpers/interop_memory.py says what is measured and why).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.torch
import torch
from click.testing import CliRunner
from safetensors import safe_open

import ckptvault
from ckptvault._tree import join_path
from ckptvault.cli import main
from ckptvault.errors import (
    CorruptChunkError,
    InvalidArgumentError,
    KeyMismatchError,
    PickleNotAllowedError,
    SourceNotFoundError,
    StepExistsError,
    StepNotFoundError,
)
from conftest import assert_same_state, assert_same_tensor
from helpers import dcp_worker, interop_ranks

HELPERS = Path(__file__).resolve().parent / "helpers"


def _tensors() -> dict[str, torch.Tensor]:
    """Every dtype the tests name, a 0-d tensor and an empty one."""
    g = torch.Generator().manual_seed(0)
    return {
        "fp32": torch.randn(33, 17, generator=g),
        "bf16": torch.randn(40, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(3, 5, generator=g).to(torch.float16),
        "int64": torch.randint(-(2**62), 2**62, (9,), generator=g),
        "bool": torch.rand(11, generator=g) > 0.5,
        "scalar": torch.tensor(2.5, dtype=torch.float64),
        "empty": torch.empty(0, 4, dtype=torch.bfloat16),
        "nan": torch.tensor([float("nan"), float("-inf"), -0.0]),
    }


def _state() -> dict[str, Any]:
    model = _tensors()
    model["tied"] = model["fp32"]  # one tensor at two key paths
    return {"model": model, "optimizer": {"state": {0: {"exp_avg": torch.ones(4)}}, "param_groups": [{"lr": 0.1}]},
            "step": 7, "name": "run-a", "lr": 1e-3, "flag": True, "none": None, "raw": b"\x00\xff"}


def _flat(state: Any, path: str = "") -> dict[str, Any]:
    """Key path -> leaf, as the manifest names leaves."""
    if isinstance(state, dict):
        return {k: v for key, item in state.items() for k, v in _flat(item, join_path(path, key)).items()}
    if isinstance(state, (list, tuple)):
        return {k: v for i, item in enumerate(state) for k, v in _flat(item, join_path(path, i)).items()}
    return {path: state}


def _vault(tmp_path: Path, state: Any | None = None, step: int = 7, **options: Any) -> Path:
    url = tmp_path / "vault"
    ckptvault.save(_state() if state is None else state, url, step=step, metrics={"loss": 0.5},
                   metadata={"run": "a"}, **options)
    return url


def _cli(*args: object) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args])


# -- safetensors ------------------------------------------------------------------------------------------------
def test_safetensors_export_reads_back_bit_exact_with_the_safetensors_library(tmp_path: Path) -> None:
    state = _state()
    result = ckptvault.export_checkpoint(_vault(tmp_path), 7, tmp_path / "out.safetensors")
    assert (result.format, result.step, result.tensors, result.values) == ("safetensors", 7, 10, 7)
    loaded = safetensors.torch.load_file(tmp_path / "out.safetensors")
    expected = {k: v for k, v in _flat(state).items() if isinstance(v, torch.Tensor)}
    assert sorted(loaded) == sorted(expected)  # flat names: the key paths, a tied tensor under each of its paths
    for key, tensor in expected.items():
        assert_same_tensor(tensor, loaded[key], key)
    with safe_open(tmp_path / "out.safetensors", "pt") as f:
        metadata = f.metadata()
    assert metadata["step"] == "7" and metadata["name"] == '"run-a"' and metadata["none"] == "null"
    assert metadata["format"] == "pt"
    assert json.loads(metadata["ckptvault"]) == {"step": 7, "metrics": {"loss": 0.5}, "metadata": {"run": "a"},
                                                 "values": ["optimizer.param_groups.0.lr", "step", "name", "lr", "flag",
                                                            "none", "raw"]}
    assert result.nbytes == sum(t.numel() * t.element_size() for t in expected.values())
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_safetensors_round_trip_brings_tensors_values_metrics_back(tmp_path: Path) -> None:
    ckptvault.export_checkpoint(_vault(tmp_path), None, tmp_path / "out.safetensors")
    info = ckptvault.import_checkpoint(tmp_path / "out.safetensors", tmp_path / "v2", 3)
    assert info.step == 3 and info.metrics == {"loss": 0.5}
    assert info.metadata["run"] == "a" and info.metadata["exported_step"] == 7
    assert info.metadata["import_format"] == "safetensors"
    back = ckptvault.load(tmp_path / "v2", 3)
    expected = _flat(_state())
    assert sorted(back) == sorted(expected)  # a flat state: one key path per entry
    for key, value in expected.items():
        assert_same_state(value, back[key], key)


def test_safetensors_file_written_elsewhere_keeps_its_metadata(tmp_path: Path) -> None:
    tensors = _tensors()
    safetensors.torch.save_file(tensors, tmp_path / "w.safetensors", metadata={"format": "pt", "author": "me"})
    info = ckptvault.import_checkpoint(tmp_path / "w.safetensors", tmp_path / "v", 1)
    assert info.metadata["safetensors_metadata"] == {"author": "me"}
    assert_same_state(dict(sorted(tensors.items())), dict(sorted(ckptvault.load(tmp_path / "v", 1).items())))


def test_export_selects_keys_resolves_pins_and_latest(tmp_path: Path) -> None:
    url = _vault(tmp_path)
    ckptvault.save({"model": {"w": torch.zeros(2)}}, url, step=9)
    with ckptvault.CheckpointManager(url) as mgr:
        mgr.pin(7, "best")
    result = ckptvault.export_checkpoint(url, "best", tmp_path / "m.safetensors", keys=["model.fp*", "step"])
    assert result.step == 7
    loaded = safetensors.torch.load_file(tmp_path / "m.safetensors")
    assert sorted(loaded) == ["model.fp16", "model.fp32"]
    with safe_open(tmp_path / "m.safetensors", "pt") as f:
        assert json.loads(f.metadata()["ckptvault"])["values"] == ["step"]
    latest = ckptvault.export_checkpoint(url, None, tmp_path / "latest.pt")
    assert latest.step == 9
    assert_same_state({"model": {"w": torch.zeros(2)}}, torch.load(tmp_path / "latest.pt", weights_only=True))


def test_sharded_multi_rank_vault_exports_whole_tensors(tmp_path: Path) -> None:
    url, out = tmp_path / "vault", tmp_path / "ranks"
    out.mkdir()
    dcp_worker.spawn(interop_ranks.save_sharded, 2, (str(url), str(out)), out)
    assert ckptvault.CheckpointManager(url).info(1).sharded
    expected = {k: v for k, v in _flat(torch.load(out / "expected.pt", weights_only=True)).items()
                if isinstance(v, torch.Tensor)}
    ckptvault.export_checkpoint(url, 1, tmp_path / "whole.safetensors")
    loaded = safetensors.torch.load_file(tmp_path / "whole.safetensors")
    assert sorted(loaded) == sorted(expected)
    for key, tensor in expected.items():
        assert_same_tensor(tensor, loaded[key], key)  # one tensor of the global shape, not a rank's shard
    ckptvault.export_checkpoint(url, 1, tmp_path / "whole.pt")
    as_torch = _flat(torch.load(tmp_path / "whole.pt", weights_only=True))
    for key, tensor in expected.items():
        assert_same_tensor(tensor, as_torch[key], key)
    assert as_torch["extra.run.name"] == "dcp-test" and as_torch["extra.step"] == 1


# -- torch files ------------------------------------------------------------------------------------------------
def test_torch_export_is_the_restored_state_for_weights_only_load(tmp_path: Path) -> None:
    url = _vault(tmp_path)
    result = ckptvault.export_checkpoint(url, 7, tmp_path / "out.pt")
    assert (result.format, result.tensors) == ("torch", 10)
    loaded = torch.load(tmp_path / "out.pt", weights_only=True)
    assert_same_state(ckptvault.load(url, 7), loaded)
    tied, fp32 = loaded["model"]["tied"], loaded["model"]["fp32"]
    assert tied.untyped_storage().data_ptr() == fp32.untyped_storage().data_ptr()  # still one tensor


def test_torch_round_trip_through_import(tmp_path: Path) -> None:
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)).to(torch.bfloat16)
    state = {**_state(), "module": module.state_dict()}
    torch.save(state, tmp_path / "src.pt")
    info = ckptvault.import_checkpoint(tmp_path / "src.pt", tmp_path / "v", 5)
    assert info.metadata["import_format"] == "torch"
    back = ckptvault.load(tmp_path / "v", 5)
    assert_same_state(state, back)
    ckptvault.export_checkpoint(tmp_path / "v", 5, tmp_path / "again.pth")
    assert_same_state(state, torch.load(tmp_path / "again.pth", weights_only=True))
    torch.save(state, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)  # cannot be mapped: loaded whole
    ckptvault.import_checkpoint(tmp_path / "legacy.pt", tmp_path / "v", 6)
    assert_same_state(state, ckptvault.load(tmp_path / "v", 6))


def test_numpy_leaves_export_as_tensors_and_numbers(tmp_path: Path) -> None:
    state = {"rng": np.arange(6, dtype=">f4").reshape(2, 3), "count": np.int64(5), "u16": np.arange(3, dtype=np.uint16)}
    url = _vault(tmp_path, state)
    ckptvault.export_checkpoint(url, 7, tmp_path / "np.pt")
    loaded = torch.load(tmp_path / "np.pt", weights_only=True)
    assert_same_tensor(torch.arange(6, dtype=torch.float32).reshape(2, 3), loaded["rng"])
    assert_same_tensor(torch.tensor([0, 1, 2], dtype=torch.uint16), loaded["u16"])
    assert loaded["count"] == 5 and type(loaded["count"]) is int
    ckptvault.export_checkpoint(url, 7, tmp_path / "np.safetensors")
    assert_same_tensor(torch.arange(6, dtype=torch.float32).reshape(2, 3),
                       safetensors.torch.load_file(tmp_path / "np.safetensors")["rng"])


def test_lossy_records_export_as_restored(tmp_path: Path) -> None:
    url = _vault(tmp_path, {"w": torch.randn(64, 64)}, codec_rules={"w": "bf16"})
    ckptvault.export_checkpoint(url, 7, tmp_path / "lossy.safetensors")
    assert_same_tensor(ckptvault.load(url, 7)["w"], safetensors.torch.load_file(tmp_path / "lossy.safetensors")["w"])


def test_pickled_torch_file_is_refused_unless_allowed(tmp_path: Path) -> None:
    torch.save({"w": torch.ones(3), "ratio": Fraction(1, 3)}, tmp_path / "pickled.pt")
    with pytest.raises(PickleNotAllowedError, match=r"weights_only=True.*--allow-pickle \(allow_pickle=True\)"):
        ckptvault.import_checkpoint(tmp_path / "pickled.pt", tmp_path / "v", 1)
    assert ckptvault.CheckpointManager(tmp_path / "v").steps() == []  # nothing committed
    ckptvault.import_checkpoint(tmp_path / "pickled.pt", tmp_path / "v", 1, allow_pickle=True)
    back = ckptvault.load(tmp_path / "v", 1, allow_pickle=True)
    assert back["ratio"] == Fraction(1, 3) and torch.equal(back["w"], torch.ones(3))
    with pytest.raises(PickleNotAllowedError, match="'ratio' was saved with pickle.*keys="):
        ckptvault.export_checkpoint(tmp_path / "v", 1, tmp_path / "out.pt")
    ckptvault.export_checkpoint(tmp_path / "v", 1, tmp_path / "out.pt", keys="w")
    assert list(torch.load(tmp_path / "out.pt", weights_only=True)) == ["w"]


# -- DCP and Hugging Face folders --------------------------------------------------------------------------------
def test_dcp_folder_written_by_dcp_save_imports_nested(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint as dcp

    state = {"model": _tensors(), "extra": {"step": 3, "name": "dcp", "tags": ["a", "b"]}}
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(state, checkpoint_id=tmp_path / "dcp", no_dist=True)
    spill = tmp_path / "tmp"
    spill.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spill))  # where the spill file goes (TMPDIR)
    info = ckptvault.import_checkpoint(tmp_path / "dcp", tmp_path / "v", 4)
    assert info.metadata["import_format"] == "dcp"
    assert_same_state(state, ckptvault.load(tmp_path / "v", 4))
    assert list(spill.iterdir()) == []  # the spill folder is removed
    with pytest.warns(UserWarning, match="single process"):  # a value that needs pickle
        dcp.save({"w": torch.ones(2), "ratio": Fraction(1, 3)}, checkpoint_id=tmp_path / "dcp2", no_dist=True)
    with pytest.raises(PickleNotAllowedError, match="Unsupported global: GLOBAL fractions.Fraction.*--allow-pickle"):
        ckptvault.import_checkpoint(tmp_path / "dcp2", tmp_path / "v", 5)
    assert list(spill.iterdir()) == [] and ckptvault.CheckpointManager(tmp_path / "v").steps() == [4]
    ckptvault.import_checkpoint(tmp_path / "dcp2", tmp_path / "v", 5, allow_pickle=True)
    assert ckptvault.load(tmp_path / "v", 5, allow_pickle=True)["ratio"] == Fraction(1, 3)


def test_hugging_face_sharded_folder_with_index(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    folder = tmp_path / "hf"
    model.save_pretrained(folder, max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("model-*.safetensors"))) > 1
    opt = torch.optim.AdamW(model.parameters())
    model(torch.arange(8)[None], labels=torch.arange(8)[None]).loss.backward()
    opt.step()
    torch.save(opt.state_dict(), folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 10, "log_history": [{"loss": 1.5}]}))
    ckptvault.import_checkpoint(folder, tmp_path / "v", 10)
    back = ckptvault.load(tmp_path / "v", 10)
    assert sorted(back) == ["model", "optimizer", "trainer_state"]
    on_disk = {}
    for shard in folder.glob("model-*.safetensors"):
        on_disk.update(safetensors.torch.load_file(shard))
    assert sorted(back["model"]) == sorted(on_disk)
    for key, tensor in on_disk.items():
        assert_same_tensor(tensor, back["model"][key], key)
    assert_same_state(opt.state_dict(), back["optimizer"])
    assert back["trainer_state"] == {"global_step": 10, "log_history": [{"loss": 1.5}]}
    fresh = transformers.GPT2LMHeadModel(config)  # other weights: the import must replace them
    ckptvault.CheckpointManager(tmp_path / "v").restore(10, into={"model": fresh}, strict=False)  # lm_head: tied
    for key, tensor in on_disk.items():
        assert_same_tensor(tensor, fresh.state_dict()[key], key)


# -- bad input ---------------------------------------------------------------------------------------------------
def test_bad_sources_raise_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(SourceNotFoundError, match=r"nothing to import at .*missing\.pt: no such file or folder"):
        ckptvault.import_checkpoint(tmp_path / "missing.pt", tmp_path / "v", 1)
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(InvalidArgumentError, match="neither a safetensors file nor a torch.save file; pass format="):
        ckptvault.import_checkpoint(tmp_path / "notes.txt", tmp_path / "v", 1)
    with pytest.raises(InvalidArgumentError, match="format must be one of safetensors, torch, dcp, hf, got 'onnx'"):
        ckptvault.import_checkpoint(tmp_path / "notes.txt", tmp_path / "v", 1, format="onnx")
    with pytest.raises(InvalidArgumentError, match="cannot tell what the folder"):
        ckptvault.import_checkpoint(tmp_path, tmp_path / "v", 1)
    with pytest.raises(InvalidArgumentError, match="is a file; format 'dcp' reads a folder"):
        ckptvault.import_checkpoint(tmp_path / "notes.txt", tmp_path / "v", 1, format="dcp")
    with pytest.raises(InvalidArgumentError, match=r"notes.txt is not a readable torch.save file \(KeyError"):
        ckptvault.import_checkpoint(tmp_path / "notes.txt", tmp_path / "v", 1, format="torch")
    (tmp_path / "bad.safetensors").write_bytes((10).to_bytes(8, "little") + b'{"w": 1}  ')
    with pytest.raises(InvalidArgumentError, match="bad.safetensors is not a valid safetensors file: tensor 'w' needs"):
        ckptvault.import_checkpoint(tmp_path / "bad.safetensors", tmp_path / "v", 1)
    with pytest.raises(InvalidArgumentError, match="async_save"):
        ckptvault.import_checkpoint(tmp_path / "bad.safetensors", tmp_path / "v", 1, async_save=True)
    assert not (tmp_path / "v").exists() or ckptvault.CheckpointManager(tmp_path / "v").steps() == []


def _header(body: object) -> bytes:
    text = json.dumps(body).encode()
    return len(text).to_bytes(8, "little") + text


@pytest.mark.parametrize(("content", "why"), [
    (b"\x01\x02", "it is 2 bytes, shorter than the 8-byte header length"),
    ((1 << 40).to_bytes(8, "little") + b"{}", "the header length 1099511627776 exceeds the file"),
    ((3).to_bytes(8, "little") + b"{x}", "the header is not JSON"),
    (_header([1]), "the header is not a JSON object"),
    (_header({"__metadata__": {"a": 1}}), "__metadata__ must map strings to strings"),
    (_header({"w": {"dtype": "F7", "shape": [1], "data_offsets": [0, 4]}}), "tensor 'w' has dtype 'F7'; known: F64"),
    (_header({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}), "tensor 'w' has shape \\[-1\\]"),
    (_header({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}), "tensor 'w' has data_offsets \\[0, 4\\] outside"),
    (_header({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 0]}}),
     "tensor 'w' of dtype F32 and shape \\[2\\] needs 8 bytes, its data_offsets hold 0"),
])
def test_malformed_safetensors_headers_are_refused(tmp_path: Path, content: bytes, why: str) -> None:
    (tmp_path / "bad.safetensors").write_bytes(content)
    with pytest.raises(InvalidArgumentError, match=f"bad.safetensors is not a valid safetensors file: {why}"):
        ckptvault.import_checkpoint(tmp_path / "bad.safetensors", tmp_path / "v", 1, format="safetensors")


def test_bad_folders_raise_typed_errors(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    hf.mkdir()
    safetensors.torch.save_file({"a": torch.ones(2)}, hf / "model-00001-of-00002.safetensors")
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                                                                "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(InvalidArgumentError, match="names the shard 'model-00002-of-00002.safetensors', which is not a file"):
        ckptvault.import_checkpoint(hf, tmp_path / "v", 1)
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"b": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(InvalidArgumentError, match=r"places tensors in shards that do not hold them: \['b'\]"):
        ckptvault.import_checkpoint(hf, tmp_path / "v", 1)
    (hf / "model.safetensors.index.json").write_text("{")
    with pytest.raises(InvalidArgumentError, match="model.safetensors.index.json is not valid JSON"):
        ckptvault.import_checkpoint(hf, tmp_path / "v", 1)
    (hf / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(InvalidArgumentError, match="has no weight_map of tensor names to shard files"):
        ckptvault.import_checkpoint(hf, tmp_path / "v", 1)
    with pytest.raises(InvalidArgumentError, match="is a folder; format 'safetensors' reads a file"):
        ckptvault.import_checkpoint(hf, tmp_path / "v", 1, format="safetensors")
    dcp_dir = tmp_path / "dcp"
    dcp_dir.mkdir()
    (dcp_dir / ".metadata").write_bytes(b"not a pickle")
    with pytest.raises(InvalidArgumentError, match="is not a readable torch.distributed.checkpoint folder"):
        ckptvault.import_checkpoint(dcp_dir, tmp_path / "v", 1)
    assert not (tmp_path / "v").exists() or ckptvault.CheckpointManager(tmp_path / "v").steps() == []


def test_import_refuses_a_committed_step_unless_overwrite(tmp_path: Path) -> None:
    url = _vault(tmp_path)
    safetensors.torch.save_file({"w": torch.ones(2)}, tmp_path / "w.safetensors")
    with pytest.raises(StepExistsError, match="step 7 is already committed"):
        ckptvault.import_checkpoint(tmp_path / "w.safetensors", url, 7)
    assert ckptvault.load(url, 7)["step"] == 7  # untouched
    ckptvault.import_checkpoint(tmp_path / "w.safetensors", url, 7, overwrite=True)
    assert list(ckptvault.load(url, 7)) == ["w"]


def test_bad_exports_raise_typed_errors_and_write_nothing(tmp_path: Path) -> None:
    url = _vault(tmp_path)
    with pytest.raises(InvalidArgumentError, match=r"cannot tell the format of 'out.onnx' from its suffix"):
        ckptvault.export_checkpoint(url, 7, tmp_path / "out.onnx")
    with pytest.raises(InvalidArgumentError, match="format must be one of safetensors, torch, got 'dcp'"):
        ckptvault.export_checkpoint(url, 7, tmp_path / "out.pt", format="dcp")
    with pytest.raises(KeyMismatchError, match=r"no key path matches \['decoder.\*'\]; top-level keys are"):
        ckptvault.export_checkpoint(url, 7, tmp_path / "out.pt", keys=["decoder.*"])
    with pytest.raises(StepNotFoundError, match="step 8 has no committed checkpoint"):
        ckptvault.export_checkpoint(url, 8, tmp_path / "out.pt")
    with pytest.raises(InvalidArgumentError, match="the folder .*nowhere does not exist"):
        ckptvault.export_checkpoint(url, 7, tmp_path / "nowhere" / "out.pt")
    with pytest.raises(InvalidArgumentError, match="cannot write .*vault: it is a folder; name a file"):
        ckptvault.export_checkpoint(url, 7, url, format="torch")
    clash = _vault(tmp_path / "k", {"ckptvault": 1, "w": torch.ones(1)})
    with pytest.raises(InvalidArgumentError, match="the key path 'ckptvault' is the name safetensors export gives"):
        ckptvault.export_checkpoint(clash, 7, tmp_path / "k.safetensors")
    url2 = _vault(tmp_path / "c", {"c": torch.zeros(4, dtype=torch.complex128)})
    with pytest.raises(InvalidArgumentError, match=r"safetensors has no dtype for 'c' \(torch.complex128\).*torch format"):
        ckptvault.export_checkpoint(url2, 7, tmp_path / "c.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "k", "vault"]


def test_failed_export_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    url = _vault(tmp_path, {"w": torch.randn(1 << 16)})
    (tmp_path / "out.safetensors").write_bytes(b"old")
    for chunk in (url / "chunks").rglob("*"):
        if chunk.is_file():
            chunk.write_bytes(chunk.read_bytes()[:-1] + bytes([chunk.read_bytes()[-1] ^ 1]))
    with pytest.raises(CorruptChunkError, match="tensor 'w'"):
        ckptvault.export_checkpoint(url, 7, tmp_path / "out.safetensors")
    assert (tmp_path / "out.safetensors").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.safetensors", "vault"]


# -- memory bound ------------------------------------------------------------------------------------------------
def test_export_and_import_stream_a_state_larger_than_their_memory(tmp_path: Path) -> None:
    """A 208 MiB state (13 tensors of 16 MiB): every phase stays under 96 MiB of anonymous memory."""
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(0)  # random bytes: nothing compresses or deduplicates
    tensors = {f"layers.{i}.weight": torch.randint(0, 256, (2048, 8192), dtype=torch.uint8, generator=g).view(torch.float32)
               for i in range(13)}
    safetensors.torch.save_file(tensors, tmp_path / "src.safetensors")
    with pytest.warns(UserWarning, match="single process"):
        dcp.save(tensors, checkpoint_id=tmp_path / "dcp", no_dist=True)
    work = tmp_path / "work"
    work.mkdir()
    run = subprocess.run([sys.executable, "-W", "ignore", str(HELPERS / "interop_memory.py"),
                          str(tmp_path / "src.safetensors"), str(tmp_path / "dcp"), str(work)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    phases = json.loads(run.stdout)
    assert set(phases) == {"import_safetensors", "export_safetensors", "export_torch", "import_torch", "import_dcp"}
    state_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    assert state_bytes == 208 << 20
    over = {name: p["peak"] >> 20 for name, p in phases.items() if p["peak"] > 96 << 20}
    assert not over, f"MiB of anonymous memory above the start, for a {state_bytes >> 20} MiB state: {over}"
    exported = safetensors.torch.load_file(work / "out.safetensors")
    as_torch = torch.load(work / "out.pt", weights_only=True, mmap=True)
    with ckptvault.CheckpointManager(work / "vault") as mgr:
        for key, tensor in tensors.items():
            assert_same_tensor(tensor, exported[key], key)
            assert_same_tensor(tensor, as_torch[key], key)
        assert mgr.steps() == [1, 2, 3]
        assert_same_tensor(tensors["layers.12.weight"], mgr.restore(3, keys=["layers.12.weight"])["layers.12.weight"])


# -- command line ------------------------------------------------------------------------------------------------
def test_cli_export_and_import(tmp_path: Path) -> None:
    url = _vault(tmp_path)
    done = _cli("export", url, "latest", tmp_path / "m.bin", "--format", "safetensors", "-k", "model.fp32", "-k", "step")
    assert done.exit_code == 0, done.output
    assert done.output == f"exported step 7 to {tmp_path / 'm.bin'} (safetensors): 1 tensors (2.19 KiB), 1 values\n"
    assert list(safetensors.torch.load_file(tmp_path / "m.bin")) == ["model.fp32"]
    done = _cli("export", url, "7", tmp_path / "all.pt", "--json")
    assert done.exit_code == 0, done.output
    assert json.loads(done.output) | {"nbytes": 0} == {"path": str(tmp_path / "all.pt"), "format": "torch", "step": 7,
                                                      "tensors": 10, "values": 7, "nbytes": 0}
    done = _cli("import", tmp_path / "m.bin", tmp_path / "v", "--step", "2")
    assert done.exit_code == 0, done.output
    assert done.output.startswith(f"imported {tmp_path / 'm.bin'} as step 2 of {tmp_path / 'v'}: 1 tensors")
    again = _cli("import", tmp_path / "all.pt", tmp_path / "v", "--step", "2")
    assert again.exit_code == 2 and "step 2 is already committed" in again.output
    done = _cli("import", tmp_path / "all.pt", tmp_path / "v", "--step", "2", "--overwrite", "--json")
    assert done.exit_code == 0, done.output
    assert json.loads(done.output)["step"] == 2 and json.loads(done.output)["metadata"]["import_format"] == "torch"
    missing = _cli("import", tmp_path / "nope", tmp_path / "v", "--step", "3")
    assert missing.exit_code == 2 and "nothing to import at" in missing.output
    torch.save({"f": Fraction(1, 2)}, tmp_path / "p.pt")
    refused = _cli("import", tmp_path / "p.pt", tmp_path / "v", "--step", "3")
    assert refused.exit_code == 2 and "pass --allow-pickle" in refused.output
    assert _cli("import", tmp_path / "p.pt", tmp_path / "v", "--step", "3", "--allow-pickle").exit_code == 0
    nothing = _cli("export", url, "7", tmp_path / "x.pt", "-k", "nope")
    assert nothing.exit_code == 2 and "no key path matches ['nope']" in nothing.output
    assert "ckptvault export" in _cli("--help").output and "ckptvault import" in _cli("--help").output
