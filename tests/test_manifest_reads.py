"""Reading a manifest again: the same bytes (of the same step, in a vault of the same chunk size) skip the schema
check that already passed on them, and nothing a caller gets from a manifest is shared with what a later read
returns."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptvault import CheckpointManager, DeltaOptions
from ckptvault._format import manifest as manifest_module
from ckptvault._format.manifest import decode_manifest, encode_manifest, manifest_body, manifest_key
from ckptvault._format.remembered import Remembered
from ckptvault.errors import CorruptManifestError


@pytest.fixture
def checks(monkeypatch: pytest.MonkeyPatch) -> list[int | None]:
    """The steps the schema check ran for, from an empty memory of checked manifests."""
    ran: list[int | None] = []
    real = manifest_module.check_manifest

    def counted(body: Any, what: str, step: int | None = None, chunk_size: int = manifest_module.MAX_CHUNK_SIZE) -> Any:
        ran.append(step)
        return real(body, what, step, chunk_size)

    monkeypatch.setattr(manifest_module, "check_manifest", counted)
    monkeypatch.setattr(manifest_module, "_checked", Remembered(manifest_module.CHECKED_KEPT))
    return ran


def _predicted_vault(url: Path) -> dict[int, dict[str, Any]]:
    """Two steps of AdamW on a small model, the second a predicted checkpoint (its manifest has a chain), with a
    lossy record (its manifest has a measured error); returns the states saved."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    saved = {}
    with CheckpointManager(url, async_save=False, delta=DeltaOptions(predict=True),
                           codec_rules={"extra": "bf16"}) as mgr:
        for step in (1, 2):
            model(torch.randn(8, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "extra": torch.randn(256)}
            saved[step] = copy.deepcopy(state)
            mgr.save(step, state, metrics={"loss": 1.0 / step})
    return saved


def test_the_same_manifest_bytes_are_checked_once(tmp_path: Path, checks: list[int | None]) -> None:
    _predicted_vault(tmp_path / "v")
    data = (tmp_path / "v" / manifest_key(2)).read_bytes()
    first = decode_manifest(data, "m", 2)
    again = decode_manifest(data, "m", 2)
    assert checks == [2]
    assert again == first and again.chain and any(t.is_lossy for t in again.tensors)
    assert again.tree is not first.tree and again.metrics is not first.metrics  # parsed anew: not shared


def test_other_bytes_another_step_or_another_chunk_size_are_checked_again(tmp_path: Path,
                                                                          checks: list[int | None]) -> None:
    _predicted_vault(tmp_path / "v")
    data = (tmp_path / "v" / manifest_key(2)).read_bytes()
    decode_manifest(data, "m", 2)
    with pytest.raises(CorruptManifestError, match="is 2, but the file is the manifest of step 3"):
        decode_manifest(data, "m", 3)
    with pytest.raises(CorruptManifestError, match="raw"):  # a chunk table entry is larger than such a vault's chunks
        decode_manifest(data, "m", 2, chunk_size=1024)
    body = manifest_body(data, "m")
    body["metrics"]["loss"] = 7.0
    changed = decode_manifest(encode_manifest(body), "m", 2)
    assert changed.metrics == {"loss": 7.0}
    assert checks == [2, 3, 2, 2]


def test_what_a_caller_changes_in_a_manifest_changes_no_later_read(tmp_path: Path) -> None:
    """``manifest()`` gives a copy: changing its tree, metrics, measured errors or restore chain leaves the next
    ``manifest()`` and the restore, which read the same bytes, as they were."""
    saved = _predicted_vault(tmp_path / "v")
    with CheckpointManager(tmp_path / "v") as mgr:
        before = copy.deepcopy(mgr.manifest(2))
        mine = mgr.manifest(2)
        lossy = next(t for t in mine["tensors"] if t.get("lossy", {}).get("codec", "lossless") != "lossless")
        lossy["lossy"]["error"]["max_abs"] = -1.0
        mine["chain"][0]["step"] = 99
        mine["chain"][0].setdefault("pieces", []).append([0, 0, 1])
        mine["metrics"]["loss"] = -1.0
        mine["tree"].clear()
        assert mgr.manifest(2) == before
        restored = mgr.restore(2)
    for key, value in saved[2]["model"].items():
        assert torch.equal(restored["model"][key], value), key
    assert restored["optimizer"]["state"].keys() == saved[2]["optimizer"]["state"].keys()
    for index, moments in saved[2]["optimizer"]["state"].items():
        for name, value in moments.items():
            assert torch.equal(restored["optimizer"]["state"][index][name], value), (index, name)
