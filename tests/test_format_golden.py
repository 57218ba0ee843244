"""Golden-byte tests that freeze the on-storage format (format version 1).

What is frozen, against files committed in ``tests/golden/``:

* ``chunk_none.bin``: the exact bytes (fixed prefix, JSON header, payload) of a chunk object written
  by a save with ``codec="none"``, and its name (the BLAKE3 of its raw bytes).
* ``chunk_zstd_header.bin``: the exact prefix + JSON header of a compressed chunk (default codec). Its
  payload is checked by decoding, not byte for byte: compressor output may change between zstd releases
  without a format change.
* ``manifest.json`` and ``vault.json``: a manifest and descriptor written by a save, byte for byte, after
  pinning the fields that legitimately vary (``time``, ``writer``, ``created``); the manifest file must also
  be exactly what re-encoding its parsed body gives, so nothing else can vary.
* ``vault_v1/``: a whole vault written by the first writer of format 1 (two steps, the second an incremental one
  with whole-chunk XOR deltas, several codecs, every kind of value). Future versions must keep restoring it exactly
  and verifying it.
* ``vault_v1_xplanes/``: the same states written since deltas are plane deltas (the ``xplanes`` stage). It is the
  newest golden vault, the only one ``--regen-goldens`` rewrites.
* ``vault_v1_predicted_inline/`` and ``vault_v1_predicted_diff/``: predicted checkpoints, as written when restore
  chains were held inline with XOR residuals, and as written with chain levels in chunks and residuals stored as
  differences; each with the digests of what every step must restore to. Written once, never regenerated.

Regenerating them is a deliberate format change: bump the format version if old readers cannot read the new
files, then run ``.venv/bin/pytest tests/test_format_golden.py --regen-goldens`` and commit ``tests/golden/``
with a note in docs/DESIGN.md. Never regenerate ``vault_v1/`` to make a reading test pass: add a
``vault_v2/`` next to it instead, so that every format ever written stays readable.
"""

from __future__ import annotations

import collections
import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import ckptvault
from ckptvault._format.chunk_object import chunk_id, decode_object, header_length
from ckptvault._format.manifest import decode_manifest, encode_manifest
from conftest import GOLDEN_DIR, assert_same_state, chunk_files, manifest_files

PINNED = {"time": 1700000000.0, "writer": "ckptvault golden"}
GOLDEN_VAULT = GOLDEN_DIR / "vault_v1"
NEWEST_VAULT = GOLDEN_DIR / "vault_v1_xplanes"  # the only golden vault --regen-goldens writes
GOLDEN_VAULTS = [GOLDEN_VAULT, NEWEST_VAULT]


def _bytes_ramp(n: int, start: int = 0) -> torch.Tensor:
    return (torch.arange(start, start + n, dtype=torch.int64) % 251).to(torch.uint8)


def manifest_state() -> dict[str, Any]:
    """Small, fixed, and stored without compression, so stored sizes do not depend on the compressor."""
    gen = torch.Generator().manual_seed(7)
    return {
        "model": collections.OrderedDict([("w", torch.arange(12, dtype=torch.float32).reshape(3, 4)),
                                          ("b", torch.tensor([1, -1], dtype=torch.int16))]),
        "noise": torch.randint(0, 256, (300,), dtype=torch.uint8, generator=gen),  # incompressible: stored raw
        "opt": {"state": {0: {"step": torch.tensor(3.0)}}, "groups": [{"lr": 0.5, "betas": (0.9, 0.999)}]},
        "step": 3, "name": "golden", "flag": True, "none": None, "raw": b"\x00\x01",
    }


def vault_state(step: int) -> dict[str, Any]:
    """The state of each step in ``vault_v1/``; step 2 changes a few elements of step 1."""
    big = torch.linspace(-1.0, 1.0, 40_000, dtype=torch.float32)  # 160 KB: three 64 KiB chunks
    if step == 2:
        big = big.clone()
        big[::997] += 0.5
    tied = torch.tensor([[1.5, -2.0], [0.0, 3.25]], dtype=torch.float64)
    return {
        "model": {"big": big, "bf16": torch.tensor([1.0, -0.5, 3.0e38], dtype=torch.bfloat16),
                  "embed": tied, "head": tied, "mask": torch.tensor([True, False, True]),
                  "z": torch.tensor([1 + 2j, -3j], dtype=torch.complex64), "scalar": torch.tensor(step, dtype=torch.int64),
                  "empty": torch.empty(0, 3, dtype=torch.float16)},
        "optimizer": {"state": {0: {"exp_avg": torch.full((5,), 0.25 * step)}},
                      "param_groups": [{"lr": 1e-3 / step, "betas": (0.9, 0.95), "params": [0]}]},
        "np": {"be": np.arange(6, dtype=">i4").reshape(2, 3), "f16": np.array([0.5, -0.0], dtype="<f2"),
               "scalar": np.float64(2.5), "u8": np.frombuffer(bytes(range(10)), dtype=np.uint8).copy()},
        "rng": collections.OrderedDict([("python", (3, tuple(range(5)), None)), ("seed", 2**70 + step)]),
        "floats": [float("inf"), -0.0, 1e-310], "text": "żółw ✓", "blob": b"\xff\x00golden", "step": step,
    }


# -- writing today's format -----------------------------------------------------------------------------

def _write(path: Path, data: bytes, regen: bool) -> None:
    if regen:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    assert path.exists(), f"{path} is missing: run pytest tests/test_format_golden.py --regen-goldens"


def test_chunk_object_bytes_none(tmp_path: Path, regen_goldens: bool) -> None:
    url = str(tmp_path / "v")
    raw = _bytes_ramp(1000)
    ckptvault.save({"x": raw}, url, step=1, codec="none")
    (path,) = chunk_files(url)
    data = path.read_bytes()
    golden = GOLDEN_DIR / "chunk_none.bin"
    _write(golden, data, regen_goldens)
    assert data == golden.read_bytes()
    # chunks are named by BLAKE3-256 of their raw bytes: a different hash is a new format
    assert path.name == chunk_id(raw.numpy().tobytes()) == "b43670a52d1af24abdac5d2c3ed19ff4e62b60a618e823ad555888b1b0b91cff"
    assert data[:4] == b"CKVC" and data[4] == 1 and data[5] == 0
    assert data[header_length(data):] == raw.numpy().tobytes()  # codec none: the payload is the raw bytes
    assert path.relative_to(url).as_posix() == f"chunks/{path.name[:2]}/{path.name}"


def test_chunk_object_header_compressed(tmp_path: Path, regen_goldens: bool) -> None:
    url = str(tmp_path / "v")
    raw = torch.arange(50_000, dtype=torch.float32)
    ckptvault.save({"x": raw}, url, step=1)
    (path,) = chunk_files(url)
    data = path.read_bytes()
    head = data[: header_length(data)]
    golden = GOLDEN_DIR / "chunk_zstd_header.bin"
    _write(golden, head, regen_goldens)
    assert head == golden.read_bytes()
    assert bytes(decode_object(path.name, data)) == raw.numpy().tobytes()
    assert len(data) < raw.nbytes / 2


def test_manifest_and_descriptor_bytes(tmp_path: Path, regen_goldens: bool) -> None:
    url = str(tmp_path / "v")
    with ckptvault.CheckpointManager(url, codec="none", codec_rules={"noise": "zstd", "model.b": "fast"}) as mgr:
        mgr.save(3, manifest_state(), metrics={"loss": 0.125, "acc": 1}, metadata={"run": "golden", "tags": ["a"]}).wait()
    (path,) = manifest_files(url)
    data = path.read_bytes()
    body = decode_manifest(data, "golden")
    assert encode_manifest(body) == data  # canonical: re-encoding the parsed manifest gives the file back
    body = body.to_json()
    assert set(PINNED) <= set(body)
    pinned = encode_manifest({k: PINNED.get(k, v) for k, v in body.items()})
    golden = GOLDEN_DIR / "manifest.json"
    _write(golden, pinned, regen_goldens)
    assert pinned == golden.read_bytes(), _first_difference(pinned, golden.read_bytes())

    desc = json.loads((Path(url) / "vault.json").read_text())
    assert isinstance(desc.pop("created"), float)
    golden_desc = GOLDEN_DIR / "vault.json"
    _write(golden_desc, json.dumps(desc, indent=1, sort_keys=True).encode(), regen_goldens)
    assert desc == json.loads(golden_desc.read_text())


def _first_difference(a: bytes, b: bytes) -> str:
    index = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"first difference at byte {index}: new {a[index - 40 : index + 40]!r} vs golden {b[index - 40 : index + 40]!r}"


# -- reading yesterday's vault --------------------------------------------------------------------------

def _write_golden_vault(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
    rules = {"optimizer.*": "lz4", "np.*": "none"}
    with ckptvault.CheckpointManager(root, chunk_size=64 << 10, codec_rules=rules) as mgr:
        for step in (1, 2):
            mgr.save(step, vault_state(step), metrics={"loss": 1.0 / step}, metadata={"golden": True}).wait()
    for leftover in (root / "tmp",):
        shutil.rmtree(leftover, ignore_errors=True)


def _delta_codecs(root: Path) -> set[str]:
    """The first codec stage id of every delta chunk object of a vault ("" for a raw XOR delta)."""
    found = set()
    for path in chunk_files(str(root)):
        header = json.loads(path.read_bytes()[8 : header_length(path.read_bytes())])
        if header["base"]:
            found.add(header["codec"][0]["id"] if header["codec"] else "")
    return found


def test_golden_vaults_hold_both_kinds_of_delta() -> None:
    assert _delta_codecs(GOLDEN_VAULT) == {"planes", ""}  # whole-chunk XOR deltas: compressed and raw
    assert _delta_codecs(NEWEST_VAULT) == {"xplanes"}
    manifest = decode_manifest((NEWEST_VAULT / "manifests" / f"{2:020d}.json").read_bytes(), "golden").to_json()
    assert manifest["requires"] == ["xplanes"]


@pytest.mark.parametrize("vault", GOLDEN_VAULTS, ids=lambda p: p.name)
def test_golden_vault_restores_exactly(vault: Path, regen_goldens: bool, tmp_path: Path) -> None:
    if regen_goldens and vault == NEWEST_VAULT:
        _write_golden_vault(vault)
    assert (vault / "vault.json").exists(), "run pytest tests/test_format_golden.py --regen-goldens"
    copy = tmp_path / "vault"
    shutil.copytree(vault, copy)  # read a copy: the committed files must never be touched
    with ckptvault.CheckpointManager(copy) as mgr:
        assert mgr.steps() == [1, 2]
        for step in (1, 2):
            restored = mgr.restore(step)
            assert_same_state(vault_state(step), restored)
            assert restored["model"]["embed"] is restored["model"]["head"]
            info = mgr.info(step)
            assert info.metrics == {"loss": 1.0 / step} and info.metadata == {"golden": True}
        report = mgr.verify()
        assert report.ok and report.checked == [1, 2], report.problems
        target = {k: torch.zeros_like(v) for k, v in vault_state(2)["model"].items() if k != "head"}
        mgr.restore(2, into=target, strict=False)
        assert torch.equal(target["big"], vault_state(2)["model"]["big"])
    assert sorted(p.relative_to(copy).as_posix() for p in copy.rglob("*") if p.is_file()) == \
        sorted(p.relative_to(vault).as_posix() for p in vault.rglob("*") if p.is_file())  # reads wrote nothing


def test_golden_vault_covers_the_format() -> None:
    """The committed vault exercises what readers must keep handling: several codecs, packing, multi-chunk tensors."""
    manifest = decode_manifest((GOLDEN_VAULT / "manifests" / f"{1:020d}.json").read_bytes(), "golden").to_json()
    codecs = {t["codec"] for t in manifest["tensors"]}
    assert codecs == {"zstd", "lz4", "none"}
    assert any(len(t["pieces"]) >= 3 for t in manifest["tensors"])  # a tensor over several chunks
    assert any(len([t for t in manifest["tensors"] if t["pieces"] and t["pieces"][0][0] == c]) > 1
               for c in range(len(manifest["chunks"])))  # a chunk shared by several small tensors


#: a vault of predicted checkpoints as ckptvault wrote them before chain levels were stored in chunks: each
#: manifest holds its restore chain's records inline. Three AdamW steps of a small MLP (chunk size 64 KiB, so the
#: first layer's arrays are cut into chunks of their own and stream), the digests of what each step restored to
#: when it was written beside it.
PREDICTED_INLINE = GOLDEN_DIR / "vault_v1_predicted_inline"


def _tensor_digests(tree: Any, path: str = "") -> dict[str, str]:
    if isinstance(tree, torch.Tensor):
        data = tree.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return {path: f"{hashlib.sha256(data).hexdigest()}:{tree.dtype}:{list(tree.shape)}"}
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items()
                for k, v in _tensor_digests(value, f"{path}.{key}" if path else str(key)).items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for n, value in enumerate(tree) for k, v in _tensor_digests(value, f"{path}.{n}").items()}
    return {path: repr(tree)}


def _restores_as_written(vault: Path, tmp_path: Path, check_latest: Callable[[dict[str, Any]], None]) -> None:
    """A copy of predicted golden ``vault`` (steps 1-3, a chain of one more level each) restores every step to the
    digests written beside it and verifies; ``check_latest`` checks step 3's manifest body."""
    copy = tmp_path / "vault"
    shutil.copytree(vault, copy)
    expected = json.loads(vault.with_name(vault.name + ".expected.json").read_text())
    with ckptvault.CheckpointManager(copy) as mgr:
        assert mgr.steps() == [1, 2, 3]
        assert [len(mgr.manifest(s).get("chain", [])) for s in (1, 2, 3)] == [0, 1, 2]
        check_latest(mgr.manifest(3))
        for step in (1, 2, 3):
            assert _tensor_digests(mgr.restore(step)) == expected[str(step)]
        assert mgr.verify().ok


def test_golden_predicted_vault_with_its_chain_inline_restores_exactly(tmp_path: Path) -> None:
    def inline(body: dict[str, Any]) -> None:
        assert all("tensors" in level for level in body["chain"]) and "chain-chunks" not in body["requires"]
        assert all("residual" not in t["predict"] for t in body["tensors"] if "predict" in t)  # XORs

    _restores_as_written(PREDICTED_INLINE, tmp_path, inline)


#: a vault of predicted checkpoints whose records store the zigzag-coded difference from their prediction
#: (``"residual": "diff"``), as ckptvault writes them now, chain levels in chunks: three AdamW steps of a small MLP
#: with weight decay and a warm-up schedule (chunk size 64 KiB: the first layer's arrays span two chunks and stream),
#: and the digests of what each step restored to when it was written. A change to how a difference is coded or undone
#: fails here even if it round-trips.
PREDICTED_DIFF = GOLDEN_DIR / "vault_v1_predicted_diff"


def test_golden_predicted_vault_with_differences_restores_exactly(tmp_path: Path) -> None:
    def differences(body: dict[str, Any]) -> None:
        assert body["requires"] == ["predicted", "chain-chunks", "residual-diff"]
        predicted = [t for t in body["tensors"] if "predict" in t]
        assert len(predicted) == 12 and {t["predict"]["residual"] for t in predicted} == {"diff"}
        assert max(len(t["pieces"]) for t in predicted) == 2

    _restores_as_written(PREDICTED_DIFF, tmp_path, differences)
