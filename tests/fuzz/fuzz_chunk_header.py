"""Coverage-guided fuzzing of chunk objects with atheris (libFuzzer): ``parse_object`` + ``decode_payload``.

An input is either a whole chunk object, decoded as the corpus base's chunk 0 (its fixed prefix, header
length included, is fuzzed too), or ``b"H"`` followed by header JSON, which is put in front of chunk 0's real
payload with a correct prefix (so libFuzzer can work on the JSON without keeping the length field right).
A finding is any exception other than CorruptChunkError and FormatVersionError, or a decode that returns
other bytes than the chunk's name promises.

Seeds: every chunk object of tests/hostile (the base vault's and the chunk cases'), whole and as header JSON.

Run by hand, from the repository root::

    .venv/bin/python tests/fuzz/fuzz_chunk_header.py -atheris_runs=100000

Other libFuzzer options work too (``-max_total_time=600``, ``-jobs=2``, a corpus folder to keep what it finds);
a finding is written to ``crash-<sha1>`` in the current folder (``-artifact_prefix=DIR/`` to change that) and
replayed with ``.venv/bin/python tests/fuzz/fuzz_chunk_header.py crash-<sha1>``. tests/test_fuzz.py runs this
harness for a few thousand inputs.
"""

from __future__ import annotations

import sys

import _seeds
import atheris

with atheris.instrument_imports(include=["ckptvault"]):
    from ckptvault._format.chunk_object import chunk_id, decode_payload, parse_object
    from ckptvault.errors import CorruptChunkError, FormatVersionError

from hostile.make_corpus import join_chunk, split_chunk  # noqa: E402 - after the instrumented imports

BASE = _seeds.HOSTILE / "base" / "chunks"
OBJECTS = sorted(p.read_bytes() for p in BASE.rglob("*") if p.is_file())
CASE_OBJECTS = sorted(p.read_bytes() for p in (_seeds.HOSTILE / "cases").glob("*/chunks/*/*"))
PACK = next(p for p in BASE.rglob("*") if p.is_file() and p.name.startswith("ef"))  # chunk 0 of the manifest
CID = PACK.name
PAYLOAD = split_chunk(PACK.read_bytes())[2]


def object_of(data: bytes) -> bytes:
    if data.startswith(b"H"):
        return join_chunk(data[1:65536], PAYLOAD)
    return data


def test_one_input(data: bytes) -> None:
    obj = object_of(data)
    try:
        header, payload = parse_object(CID, obj)
        raw = decode_payload(CID, header, payload, None)
    except (CorruptChunkError, FormatVersionError):
        return
    if chunk_id(raw) != CID:
        raise AssertionError("decode_payload returned bytes whose hash is not the chunk's name")


def seeds() -> list[bytes]:
    out = [*OBJECTS, *CASE_OBJECTS]
    out += [b"H" + split_chunk(obj)[1] for obj in out if len(obj) >= 8]
    return out


if __name__ == "__main__":
    _seeds.fuzz(test_one_input, seeds())
    sys.exit(0)
