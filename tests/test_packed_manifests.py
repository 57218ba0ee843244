"""Packed manifests: a body of ``PACK_FROM`` bytes or more is stored zstd-compressed, in base64, inside a small body
that requires the ``packed`` feature (docs/DESIGN.md section 4). Smaller bodies stay plain JSON; a reader that does
not know the feature refuses a packed one with FormatVersionError; a damaged or hostile packed body is a
CorruptManifestError naming the file, and never inflates past ``MAX_UNPACKED``."""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path
from typing import Any

import blake3
import pytest
import torch
import zstandard

from ckptvault import CheckpointManager, DeltaOptions
from ckptvault._format import manifest as manifest_module
from ckptvault._format.manifest import PACK_FROM, decode_manifest, encode_manifest, manifest_body, manifest_key
from ckptvault._format.schema import check_manifest
from ckptvault.errors import CorruptManifestError, FormatVersionError
from conftest import assert_same_state

GOLDEN = Path(__file__).parent / "golden"


def _wrap(body: bytes) -> bytes:
    """A manifest file around ``body`` with a valid checksum: what anyone can write."""
    return b'{"blake3":"' + blake3.blake3(body).hexdigest().encode() + b'","manifest":' + body + b"}"


def _packed(inner: bytes, **changes: Any) -> bytes:
    """A manifest file whose packed body holds ``inner`` (a zstd frame of it, with its content size), with
    ``changes`` to the packed body's fields."""
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(inner)
    body = {"format": "ckptvault.manifest", "version": 1, "requires": ["packed"],
            "packed": base64.b64encode(frame).decode(), **changes}
    return _wrap(json.dumps(body, separators=(",", ":")).encode())


def _plain_body(data: bytes) -> bytes:
    return data[88:-1]


def _training(url: Path, steps: int = 3) -> dict[int, dict[str, Any]]:
    """AdamW on a model of 24 parameter tensors, saved with predicted deltas: manifests of about 30 KB."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(12)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    saved = {}
    with CheckpointManager(url, async_save=False, delta=DeltaOptions(predict=True)) as mgr:
        for step in range(1, steps + 1):
            model(torch.randn(4, 16)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            saved[step] = copy.deepcopy({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step})
            mgr.save(step, saved[step], metrics={"loss": 1.0 / step})
    return saved


def test_a_large_manifest_is_stored_packed_and_reads_as_its_body(tmp_path: Path) -> None:
    saved = _training(tmp_path / "v")
    data = (tmp_path / "v" / manifest_key(3)).read_bytes()
    outer = json.loads(_plain_body(data))
    assert set(outer) == {"format", "version", "requires", "packed"} and outer["requires"] == ["packed"]
    body = manifest_body(data, "m")
    plain = json.dumps(body, separators=(",", ":")).encode()
    assert len(plain) >= PACK_FROM and len(data) * 3 < len(plain), (len(data), len(plain))
    with CheckpointManager(tmp_path / "v") as mgr:
        assert mgr.manifest(3) == body and body["requires"] == ["predicted", "chain-chunks", "residual-diff"]
        for step, state in saved.items():
            assert_same_state(mgr.restore(step), state)
        assert mgr.verify().ok
    assert decode_manifest(data, "m", 3) == decode_manifest(_wrap(plain), "m", 3)  # the same manifest either way


def test_a_small_manifest_stays_plain_json(tmp_path: Path) -> None:
    with CheckpointManager(tmp_path / "v", async_save=False) as mgr:
        mgr.save(1, {"w": torch.ones(4)})
    data = (tmp_path / "v" / manifest_key(1)).read_bytes()
    assert len(data) < PACK_FROM and json.loads(data)["manifest"]["tensors"][0]["path"] == "w"


def test_encoding_packs_from_pack_from_bytes_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _training(tmp_path / "v", steps=1)
    body = manifest_body((tmp_path / "v" / manifest_key(1)).read_bytes(), "m")
    size = len(json.dumps(body, separators=(",", ":")).encode())
    monkeypatch.setattr(manifest_module, "PACK_FROM", size + 1)
    assert json.loads(encode_manifest(body))["manifest"] == body
    monkeypatch.setattr(manifest_module, "PACK_FROM", size)
    assert json.loads(encode_manifest(body))["manifest"]["requires"] == ["packed"]
    assert manifest_body(encode_manifest(body), "m") == body


def test_a_reader_without_the_packed_feature_refuses_it_as_a_newer_format(tmp_path: Path) -> None:
    """What every earlier ckptvault does with a packed body: check it as a manifest, whose ``requires`` names a
    feature it does not know."""
    _training(tmp_path / "v", steps=1)
    outer = json.loads(_plain_body((tmp_path / "v" / manifest_key(1)).read_bytes()))
    with pytest.raises(FormatVersionError, match=r"m: field requires names features \['packed'\] this ckptvault "
                                                 r"does not know: upgrade ckptvault"):
        check_manifest(outer, "m")


def test_a_frozen_packed_manifest_reads_as_its_plain_twin() -> None:
    """Golden bytes: the predicted manifest of ``vault_v1_predicted_inline`` step 2, packed (zstd level 1)."""
    plain = (GOLDEN / "vault_v1_predicted_inline" / manifest_key(2)).read_bytes()
    packed = (GOLDEN / "packed_manifest_v1.json").read_bytes()
    assert json.loads(_plain_body(packed))["requires"] == ["packed"]
    assert decode_manifest(packed, "golden", 2) == decode_manifest(plain, "golden", 2)


INNER = b'{"format":"ckptvault.manifest","version":1}'


@pytest.mark.parametrize(("data", "error", "match"), [
    (_packed(INNER, packed="not base64!"), CorruptManifestError,
     r"manifest m: its packed body does not unpack \(Error: "),
    (_packed(INNER, packed="\u00e9t\u00e9"), CorruptManifestError,
     r"manifest m: its packed body does not unpack \(ValueError: string argument should contain only ASCII"),
    (_wrap(b'{"format":"ckptvault.manifest","version":1,"requires":["packed"],"packed":"'
           + base64.b64encode(b"not a zstd frame") + b'"}'), CorruptManifestError,
     r"manifest m: its packed body does not unpack \(ZstdError: "),
    (_wrap(b'{"format":"ckptvault.manifest","version":1,"requires":["packed"],"packed":"'
           + base64.b64encode(zstandard.ZstdCompressor(write_content_size=False).compress(INNER)) + b'"}'),
     CorruptManifestError, r"its packed body does not unpack \(ZstdError: its frame of \d+ bytes claims -1 \(-1: unknown\)"),
    (_wrap(b'{"format":"ckptvault.manifest","version":1,"requires":["packed"],"packed":"'
           + base64.b64encode(zstandard.ZstdCompressor(write_content_size=True).compress(INNER) + b"junk") + b'"}'),
     CorruptManifestError, r"its packed body does not unpack \(ZstdError: it is not exactly one complete zstd frame"),
    (_packed(b"[1, 2]"), CorruptManifestError, r"manifest m: its packed body must hold a manifest body, not list"),
    (_packed(b"{not json"), CorruptManifestError, r"manifest m \(unpacked\) is not valid JSON"),
    (_packed(_plain_body(_packed(INNER))), CorruptManifestError,
     r"manifest m: its packed body must hold a manifest body, not another packed one"),
    (_packed(INNER, extra=1), CorruptManifestError,
     r"manifest m: field requires names 'packed', but the body is not a packed one: it must hold exactly the fields "
     r"\['format', 'packed', 'requires', 'version'\], and requires only 'packed'"),
    (_packed(INNER, requires=["packed", "lossy"]), CorruptManifestError, r"and requires only 'packed'"),
    (_packed(INNER, packed=7), CorruptManifestError, r"manifest m: field packed must be a string, not"),
    (_packed(INNER, format="other"), CorruptManifestError, r"manifest m: field format is 'other'"),
    (_packed(INNER, version=2), FormatVersionError,
     r"manifest m: field version is 2: this manifest uses a newer format than this ckptvault reads"),
])
def test_a_damaged_or_hostile_packed_body_is_refused(data: bytes, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        decode_manifest(data, "m")


def test_a_packed_body_claiming_too_much_is_not_inflated(monkeypatch: pytest.MonkeyPatch) -> None:
    """More than MAX_RATIO times its frame's size, or than MAX_UNPACKED: refused from the frame's header."""
    padded = b" " * 20000 + INNER
    frame = zstandard.ZstdCompressor(write_content_size=True).compress(padded)
    assert len(padded) > 256 * len(frame)
    with pytest.raises(CorruptManifestError, match=rf"its frame of {len(frame)} bytes claims {len(padded)} \(-1: "
                                                   rf"unknown\), not 0\.\.{256 * len(frame)}\)"):
        decode_manifest(_packed(padded), "m")
    monkeypatch.setattr(manifest_module, "MAX_UNPACKED", len(INNER) - 1)
    with pytest.raises(CorruptManifestError, match=rf"claims {len(INNER)} \(-1: unknown\), not 0\.\.{len(INNER) - 1}\)"):
        decode_manifest(_packed(INNER), "m")


def test_a_hostile_packed_manifest_in_a_vault_fails_restore_and_verify_naming_the_file(tmp_path: Path) -> None:
    _training(tmp_path / "v", steps=1)
    (tmp_path / "v" / manifest_key(1)).write_bytes(_packed(b"[]"))
    with CheckpointManager(tmp_path / "v") as mgr:
        with pytest.raises(CorruptManifestError, match=r"manifests/00000000000000000001\.json .*its packed body must "
                                                       r"hold a manifest body, not list"):
            mgr.restore(1)
        report = mgr.verify()
        assert not report.ok and "its packed body must hold a manifest body" in str(report)


def test_the_cli_prints_a_packed_manifests_body(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from ckptvault.cli import main

    _training(tmp_path / "v")
    shown = CliRunner().invoke(main, ["show", str(tmp_path / "v"), "3", "--manifest"])
    assert shown.exit_code == 0, shown.output
    with CheckpointManager(tmp_path / "v") as mgr:
        assert json.loads(shown.output) == mgr.manifest(3) and mgr.manifest(3)["step"] == 3
    refused = CliRunner().invoke(main, ["show", str(tmp_path / "v"), "--manifest", "-k", "model"])
    assert refused.exit_code == 2 and "--manifest prints the whole manifest body; leave out --keys" in refused.output
