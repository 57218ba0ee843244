"""Reading one chunk of a manifest for a restore, verified, with errors that name the checkpoint and the record."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from .._format.records import Manifest
from .._vault import Vault
from ..errors import CorruptChunkError, ObjectNotFoundError


def read_verified(vault: Vault, manifest: Manifest, chunk: int, path: str, into: memoryview | None = None,
                  verify: bool = True) -> memoryview:
    """The raw bytes of chunk ``chunk`` of ``manifest``'s table, checked against its name (C3; ``verify=False``: by
    the caller, as ``Vault.read_chunk`` says), in ``into`` if given. A missing or damaged chunk is a
    CorruptChunkError naming the step and ``path`` (a record that needs it)."""
    ref = manifest.chunks[chunk]
    with _named(manifest, chunk, path):
        return memoryview(vault.read_chunk(ref.id, expected_raw=ref.raw, into=into, verify=verify)).cast("B")


def read_verified_into_parts(vault: Vault, manifest: Manifest, chunk: int, path: str, parts: list[memoryview]) -> None:
    """:func:`read_verified`, the chunk's raw bytes written across ``parts`` (``Vault.read_chunk_into_parts``)."""
    ref = manifest.chunks[chunk]
    with _named(manifest, chunk, path):
        vault.read_chunk_into_parts(ref.id, parts, expected_raw=ref.raw)


@contextmanager
def _named(manifest: Manifest, chunk: int, path: str) -> Iterator[None]:
    """A missing or damaged chunk as a CorruptChunkError naming the step and ``path``."""
    ref = manifest.chunks[chunk]
    try:
        yield
    except ObjectNotFoundError:
        raise CorruptChunkError(ref.id, "the chunk object is missing", manifest.step, path) from None
    except CorruptChunkError as exc:
        raise CorruptChunkError(ref.id, exc.reason, manifest.step, path) from None
