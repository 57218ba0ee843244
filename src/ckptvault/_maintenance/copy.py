"""Copy checkpoints between vaults (for example local NVMe to S3), sending only the chunks the destination lacks.

Call order: :func:`plan_copy` (reads only: which steps to copy, which chunk
objects the destination lacks and their sizes), then :func:`execute_copy`.
:func:`copy_checkpoints` does both.

Per step, execute copies the missing chunk objects (byte for byte, so
deltas stay deltas, through the destination's write batch, which it
finishes before the manifest: see ``Store.write_batch``), ``touch``es the chunks the destination already holds
(protecting them from a concurrent gc there, as a save does), and only then
writes the manifest, create-if-absent: the step appears in the destination
atomically, and a copy interrupted at any moment leaves only unreferenced
chunks, which the next copy reuses and ``gc`` reclaims. Steps whose manifest
the destination already holds byte for byte are skipped, so copying again
sends nothing. Pins are not copied: they are each vault's own policy.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._format.chunk_object import CHUNKS_PREFIX, chunk_key, max_object_size, read_object
from .._format.keys import chunk_id_of_key
from .._format.manifest import manifest_key
from .._parallel import map_all
from .._reports.verify import verify_steps
from .._vault import DESCRIPTOR_KEY, Vault
from ..errors import (
    CorruptChunkError,
    CorruptDataError,
    InvalidArgumentError,
    ObjectNotFoundError,
    StepExistsError,
    StepNotFoundError,
)
from ..stores import StorageOptions, Store
from ..stores.base import WriteBatch

log = logging.getLogger(__name__)

Progress = Callable[[int], None]


@dataclass
class StepCopy:
    """One step to copy: its manifest bytes and the chunk objects it needs (delta bases included)."""

    step: int
    manifest: bytes
    chunks: list[str]


@dataclass
class CopyPlan:
    """What :func:`execute_copy` will do. ``send`` maps each chunk object to send to its stored size."""

    src: str
    dst: str
    steps: list[StepCopy] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)  # already in the destination, byte for byte
    send: dict[str, int] = field(default_factory=dict)
    reuse: int = 0  # chunk objects the copied steps need that the destination already holds

    @property
    def bytes(self) -> int:
        return sum(self.send.values())

    def to_dict(self) -> dict[str, Any]:
        return {"src": self.src, "dst": self.dst, "steps": [s.step for s in self.steps], "skipped": self.skipped,
                "chunks_to_send": len(self.send), "bytes_to_send": self.bytes, "chunks_reused": self.reuse}


@dataclass
class CopyResult:
    """What was done: steps committed in the destination, chunk objects and bytes sent."""

    copied: list[int] = field(default_factory=list)
    chunks_sent: int = 0
    bytes_sent: int = 0
    verified: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"copied": self.copied, "chunks_sent": self.chunks_sent, "bytes_sent": self.bytes_sent,
                "verified": self.verified}


def plan_copy(src: Vault, dst: Vault, steps: list[int] | None = None, *, overwrite: bool = False) -> CopyPlan:
    """Decide what to copy. Raises VaultNotFoundError (no source vault), StepNotFoundError (a step not in the
    source), StepExistsError (a step the destination holds with other content, unless ``overwrite``)."""
    src.require()
    committed = src.steps()
    chosen = committed if steps is None else sorted(set(steps))
    for step in chosen:
        if step not in committed:
            raise StepNotFoundError(step, src.url, committed)
    _check_compatible(src, dst)
    plan = CopyPlan(src.url, dst.url)
    have = _chunk_sizes(dst.store) if dst.descriptor() else {}
    sizes = _chunk_sizes(src.store)
    largest = max_object_size(src.chunk_size())
    for item in map_all(src.pool, lambda s: _step_copy(src, s), chosen):
        if _holds_same_manifest(dst, item, overwrite):
            plan.skipped.append(item.step)
            continue
        plan.steps.append(item)
        for cid in item.chunks:
            key = chunk_key(cid)
            if key in have:
                plan.reuse += 1
            elif key not in plan.send:
                if key not in sizes:
                    raise CorruptChunkError(cid, f"it is missing from the source vault {src.url}", item.step)
                if sizes[key] > largest:  # before anything is read or written
                    raise CorruptChunkError(cid, f"the object is {sizes[key]} bytes, more than a chunk object of "
                                                 f"{src.url} can be ({largest})", item.step)
                plan.send[key] = sizes[key]
    return plan


def _check_compatible(src: Vault, dst: Vault) -> None:
    """Refuse a destination whose chunk size is smaller than the source's: chunks are copied byte for byte, so
    they would be larger than the destination's readers accept."""
    if dst.descriptor() is not None and dst.chunk_size() < src.chunk_size():
        raise InvalidArgumentError(
            f"the destination {dst.url} has chunk size {dst.chunk_size()}, smaller than the source's "
            f"{src.chunk_size()}: chunks are copied byte for byte, so copy into a new vault or one whose chunk size "
            f"is at least {src.chunk_size()}")


def _chunk_sizes(store: Store) -> dict[str, int]:
    """Key -> stored size of every chunk object in ``store`` (objects not named as chunks are not chunks)."""
    return {info.key: info.size for info in store.list(CHUNKS_PREFIX) if chunk_id_of_key(info.key) is not None}


def _step_copy(src: Vault, step: int) -> StepCopy:
    manifest = src.read_manifest(step)  # verifies the checksum before anything is copied
    needed = dict.fromkeys(c.id for c in manifest.chunks)
    needed.update(dict.fromkeys(c.base for c in manifest.chunks if c.base))
    return StepCopy(step, src.store.get(manifest_key(step)), list(needed))


def _holds_same_manifest(dst: Vault, item: StepCopy, overwrite: bool) -> bool:
    try:
        existing = dst.store.get(manifest_key(item.step))
    except ObjectNotFoundError:
        return False
    if existing == item.manifest:
        return True
    if not overwrite:
        raise StepExistsError(item.step, dst.url)
    return False


def execute_copy(src: Vault, dst: Vault, plan: CopyPlan, *, overwrite: bool = False, verify: bool = False,
                 progress: Progress | None = None) -> CopyResult:
    """Copy the planned steps, in ascending order; see the module docstring for the order of writes.

    ``verify`` reads back and checks every chunk of each copied step in the
    destination (raising CorruptChunkError on damage). Safe to interrupt and run again.
    """
    result = CopyResult()
    if plan.steps and dst.descriptor() is None:
        dst.store.put_if_absent(DESCRIPTOR_KEY, src.store.get(DESCRIPTOR_KEY))  # same chunk size, codec, hash
        dst.require()
    sent: set[str] = set()
    for item in plan.steps:
        keys = [chunk_key(cid) for cid in item.chunks]
        batch = dst.store.write_batch()  # the step's new chunks become durable together, before its manifest
        try:
            outcomes = map_all(src.pool, lambda key, batch=batch: _transfer(
                src.store, dst.store, batch, key, key in plan.send and key not in sent, progress, src.chunk_size()), keys)
            batch.finish()
        except BaseException:
            batch.abandon()
            raise
        for key, size in zip(keys, outcomes, strict=True):
            if size is not None:
                sent.add(key)
                result.chunks_sent += 1
                result.bytes_sent += size
        mkey = manifest_key(item.step)
        if overwrite:
            dst.store.put(mkey, item.manifest)
        elif not dst.store.put_if_absent(mkey, item.manifest):
            if dst.store.get(mkey) != item.manifest:
                raise StepExistsError(item.step, dst.url)
        result.copied.append(item.step)
        log.info("copied step %d from %s to %s", item.step, src.url, dst.url)
    if verify and result.copied:
        report = verify_steps(dst, result.copied)
        if not report.ok:
            step, problems = next(iter(sorted(report.problems.items())))
            raise CorruptDataError(f"step {step} in {dst.url} is damaged after the copy: {'; '.join(problems)}")
        result.verified = True
    return result


def _transfer(src: Store, dst: Store, batch: WriteBatch, key: str, send: bool, progress: Progress | None,
              chunk_size: int) -> int | None:
    """Send one chunk object (of a source vault of ``chunk_size``) through ``batch`` (returns its size) or touch the
    destination's copy (returns None)."""
    if not send:
        try:
            dst.touch(key)  # the destination's gc must not take it before our manifest names it
            return None
        except ObjectNotFoundError:
            pass  # collected since the plan listed it: send it after all
    try:
        data = read_object(src, key.rsplit("/", 1)[-1], chunk_size)  # refused unread if it grew since the plan
    except ObjectNotFoundError:
        raise CorruptChunkError(key.rsplit("/", 1)[-1], f"it is missing from the source vault {src.url}") from None
    batch.put_if_absent(key, data)
    if progress is not None:
        progress(len(data))
    return len(data)


def copy_checkpoints(src: str | os.PathLike[str] | Store, dst: str | os.PathLike[str] | Store,
                     steps: list[int] | None = None, *, overwrite: bool = False, verify: bool = False,
                     dry_run: bool = False, src_options: StorageOptions | None = None,
                     dst_options: StorageOptions | None = None, workers: int | None = None,
                     progress: Progress | None = None) -> tuple[CopyPlan, CopyResult | None]:
    """Copy ``steps`` (default: all) from the vault at ``src`` to ``dst``; returns the plan and (unless ``dry_run``)
    what was done. ``progress`` is called with the size of each chunk object sent."""
    source = Vault(src, src_options, workers)
    dest = Vault(dst, dst_options, workers)
    try:
        if source.url == dest.url:
            raise InvalidArgumentError(f"source and destination are the same vault: {source.url}")
        plan = plan_copy(source, dest, steps, overwrite=overwrite)
        if dry_run:
            return plan, None
        return plan, execute_copy(source, dest, plan, overwrite=overwrite, verify=verify, progress=progress)
    finally:
        source.close()
        dest.close()
