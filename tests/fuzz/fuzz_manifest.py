"""Coverage-guided fuzzing of manifests with atheris (libFuzzer): ``decode_manifest`` and what ``ls`` and
``show`` do with what it accepts.

An input is a manifest body (JSON text); the harness wraps it with a valid BLAKE3 checksum, as anyone editing a
manifest can, so every input reaches the parser and the schema instead of failing the checksum. A manifest
that ``decode_manifest`` accepts is handed to ``info_from_manifest`` (the view ``ckptvault ls``/``show`` print)
and ``tree.leaf_paths`` (what restore walks first), which must then work. A finding is any other exception than
CorruptManifestError and FormatVersionError from decoding, or any exception from those consumers of an
accepted manifest.

Seeds: the body of the base manifest and of every manifest case in tests/hostile, and a packed body
(tests/golden/packed_manifest_v1.json).

Run by hand, from the repository root::

    .venv/bin/python tests/fuzz/fuzz_manifest.py -atheris_runs=100000

See fuzz_chunk_header.py for the other libFuzzer options; tests/test_fuzz.py runs this harness for a few
thousand inputs.
"""

from __future__ import annotations

import sys

import _seeds
import atheris

with atheris.instrument_imports(include=["ckptvault"]):
    from ckptvault._format.manifest import decode_manifest
    from ckptvault._tree import leaf_paths
    from ckptvault.errors import CorruptManifestError, FormatVersionError
    from ckptvault.info import info_from_manifest

from hostile.make_corpus import MANIFEST_KEY, manifest_body_bytes, wrap_manifest  # noqa: E402

#: bodies above this size are cut: the deep-nesting seeds are 200 KB, and libFuzzer's default -max_len is 4096
MAX_BODY = 1 << 20


def test_one_input(data: bytes) -> None:
    try:
        manifest = decode_manifest(wrap_manifest(data[:MAX_BODY]), MANIFEST_KEY)
    except (CorruptManifestError, FormatVersionError):
        return
    info_from_manifest(manifest)
    leaf_paths(manifest.tree)


def seeds() -> list[bytes]:
    files = [_seeds.HOSTILE / "base" / MANIFEST_KEY, *sorted((_seeds.HOSTILE / "cases").glob(f"*/{MANIFEST_KEY}")),
             _seeds.HOSTILE.parent / "golden" / "packed_manifest_v1.json"]
    return [manifest_body_bytes(p.read_bytes()) for p in files]


if __name__ == "__main__":
    _seeds.fuzz(test_one_input, seeds())
    sys.exit(0)
