"""Golden bytes of the sharded manifest form (docs/DESIGN.md section 4, "DCP checkpoints"), as
tests/test_format_golden.py freezes the rest of format version 1.

``tests/golden/manifest_sharded.json``: the manifest VaultWriter commits for two ranks (``tests/helpers/dcp_ranks.py``:
a tensor cut along rows, one cut along columns, a replicated scalar tensor, values), with ``codec="none"`` so stored
sizes do not depend on the compressor, after pinning ``time`` and ``writer``. Regenerate only for a deliberate format
change: ``.venv/bin/pytest tests/test_format_golden_dcp.py --regen-goldens``.
"""

from __future__ import annotations

from pathlib import Path

import ckptvault
from ckptvault._format.manifest import decode_manifest, encode_manifest
from conftest import GOLDEN_DIR, assert_same_state, manifest_files
from helpers.dcp_ranks import golden_ranks, golden_whole, save_as_ranks
from test_format_golden import PINNED, _first_difference, _write

GOLDEN = GOLDEN_DIR / "manifest_sharded.json"


def test_sharded_manifest_bytes(tmp_path: Path, regen_goldens: bool) -> None:
    url = str(tmp_path / "v")
    save_as_ranks(url, 5, golden_ranks(), codec="none", chunk_size=64 << 10, metadata={"golden": True})
    (path,) = manifest_files(url)
    data = path.read_bytes()
    manifest = decode_manifest(data, "golden")
    assert encode_manifest(manifest) == data  # canonical: re-encoding the parsed manifest gives the file back
    body = manifest.to_json()
    assert body["requires"] == ["sharded"] and body["pickle"] is False
    pinned = encode_manifest({k: PINNED.get(k, v) for k, v in body.items()})
    _write(GOLDEN, pinned, regen_goldens)
    assert pinned == GOLDEN.read_bytes(), _first_difference(pinned, GOLDEN.read_bytes())


def test_the_golden_sharded_manifest_still_reads_as_its_state(tmp_path: Path) -> None:
    """The committed golden manifest parses; with the chunks a save of the same state writes, it restores whole."""
    url = str(tmp_path / "v")
    save_as_ranks(url, 5, golden_ranks(), codec="none", chunk_size=64 << 10, metadata={"golden": True})
    (path,) = manifest_files(url)
    golden = decode_manifest(GOLDEN.read_bytes(), "golden", step=5)
    assert [t.to_json() for t in golden.tensors] == [t.to_json() for t in decode_manifest(path.read_bytes(), "new").tensors]
    path.write_bytes(GOLDEN.read_bytes())  # the golden manifest itself, read with today's chunks
    with ckptvault.CheckpointManager(url) as mgr:
        assert_same_state(golden_whole(), mgr.restore(5))
        assert mgr.verify().ok
