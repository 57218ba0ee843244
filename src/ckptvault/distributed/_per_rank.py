"""Per-rank values: what every rank of a job keeps for itself (RNG states, data-loader positions), never one copy.

DCP keeps ONE copy of every key that is not a DTensor (it takes such values for replicated), so a value that
differs between ranks would silently become one rank's value on all. A collective save therefore finds, before DCP
plans anything, every *unit* of the state (a value that is not a dict, or a subtree a ``per_rank`` pattern names)
that is not a DTensor, digests it on every rank, and compares the digests across ranks (one ``all_gather``). A unit
that differs between ranks, is missing on some, or matches a ``per_rank`` pattern is saved per rank: at its key
path the state holds ``{PER_RANK: {"<rank>": value}}`` on each rank, so each rank's copy has a key of its own and the
manifest's tree holds the value of every rank at ``path.__per_rank__.<rank>``. A restore in the job unwraps it again:
each rank gets its own value back (:func:`wrap_targets`, :func:`unwrap_targets`).
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Iterator
from typing import Any

import blake3
import numpy as np
from torch.distributed.tensor import DTensor

from .._arrays import host_contiguous, ndarray_bytes, tensor_bytes
from .._format.records import Node
from .._tree import flatten
from ..errors import InvalidArgumentError, KeyMismatchError

#: the key under which a per-rank value's ranks are stored (and which a state's own keys may not use)
PER_RANK = "__per_rank__"
#: a key path in a nested state: the dict keys from the root
Path = tuple[Any, ...]


def dotted(path: Path) -> str:
    return ".".join(map(str, path))


def units(state: Any, patterns: tuple[str, ...], path: Path = ()) -> Iterator[tuple[Path, Any, bool]]:
    """(path, value, forced) of every unit of ``state`` that is not a DTensor: the values that are not dicts, and
    the subtrees a pattern names (``forced``). A key ``PER_RANK`` in the state is an InvalidArgumentError."""
    if path and any(fnmatch.fnmatchcase(dotted(path), p) for p in patterns):
        yield path, state, True
        return
    if isinstance(state, dict):
        for key, value in state.items():
            if key == PER_RANK:
                raise InvalidArgumentError(f"the key {PER_RANK!r} at {dotted(path) or 'the root'} is ckptvault's own "
                                           "(per-rank values); rename it")
            yield from units(value, patterns, (*path, key))
    elif not isinstance(state, DTensor) and path:
        yield path, state, False


def digest(value: Any) -> str:
    """A digest of a value's content (its JSON skeleton and the bytes of every array in it): equal values, on any
    rank, digest equally. Nothing is stored; objects that need pickle are digested through ``repr``. Arrays are
    hashed in place (the caller's thread waits for this: no copy of their bytes)."""
    tree, leaves = flatten(value, allow_pickle=True)
    hasher = blake3.blake3(json.dumps(tree, sort_keys=True).encode())
    for leaf in leaves:
        for part in _leaf_parts(leaf.kind, leaf.value):
            hasher.update(part)
    return hasher.hexdigest()


def _leaf_parts(kind: str, value: Any) -> tuple[bytes | memoryview, ...]:
    if kind == "torch":
        tensor = host_contiguous(value.detach())
        return f"{tensor.dtype}{list(tensor.shape)}".encode(), tensor_bytes(tensor)
    if kind == "numpy" and isinstance(value, np.ndarray):
        return f"{value.dtype.str}{list(value.shape)}".encode(), ndarray_bytes(value)
    return (repr(value).encode(),)


def per_rank_paths(gathered: list[dict[Path, tuple[str, bool]]]) -> set[Path]:
    """The units to keep per rank, from every rank's {path: (digest, forced)}: forced anywhere, missing on a rank, or
    with digests that differ."""
    every = set().union(*gathered)
    out = set()
    for path in every:
        seen = [ranks.get(path) for ranks in gathered]
        if any(s is None or s[1] for s in seen) or len({s[0] for s in seen if s is not None}) > 1:
            out.add(path)
    return out


def wrap(state: Any, paths: set[Path], rank: int) -> Any:
    """A copy of ``state`` (dicts rebuilt along ``paths`` only) holding ``{PER_RANK: {str(rank): value}}`` at each."""
    if not paths:
        return state
    if () in paths:
        raise InvalidArgumentError("the whole state differs between ranks; save a dict whose values differ instead")
    heads: dict[Any, set[Path]] = {}
    for path in paths:
        heads.setdefault(path[0], set()).add(path[1:])
    out = dict(state)
    for key, rest in heads.items():
        out[key] = {PER_RANK: {str(rank): state[key]}} if () in rest else wrap(state[key], rest, rank)
    return out


def saved_ranks(tree: Node, path: Path = ()) -> dict[Path, set[int]]:
    """The per-rank values of a manifest's tree: {path: the ranks whose values it holds}."""
    found: dict[Path, set[int]] = {}
    if "dict" not in tree:
        return found
    for key_node, child in tree["dict"]:
        key = next(iter(key_node.values()))
        if key == PER_RANK and "dict" in child:
            found[path] = {int(next(iter(k.values()))) for k, _ in child["dict"]}
        else:
            found.update(saved_ranks(child, (*path, key)))
    return found


def wrap_targets(into: dict[str, Any], saved: dict[Path, set[int]], rank: int, world: int,
                 strict: bool) -> list[tuple[Path, Any]]:
    """Put each per-rank target of ``into`` (in place) where the checkpoint holds this rank's value:
    ``{PER_RANK: {str(rank): target}}``. A target of a rank the checkpoint has no value for is a KeyMismatchError
    if ``strict``, else taken out of ``into`` for the load (and put back by :func:`unwrap_targets`). Returns what
    :func:`unwrap_targets` needs."""
    undo: list[tuple[Path, Any]] = []
    for path, ranks in sorted(saved.items(), key=lambda item: len(item[0]), reverse=True):
        parent = _parent(into, path)
        if parent is None or path[-1] not in parent:
            continue
        target = parent[path[-1]]
        undo.append((path, target))
        if rank in ranks:
            parent[path[-1]] = {PER_RANK: {str(rank): target}}
        elif strict:
            unwrap_targets(into, undo)
            raise KeyMismatchError(f"{dotted(path)!r} holds per-rank values of ranks {sorted(ranks)}, none of rank "
                                   f"{rank} (restoring at world size {world}): pass strict=False to leave it as it is")
        else:
            del parent[path[-1]]
    return undo


def unwrap_targets(into: dict[str, Any], undo: list[tuple[Path, Any]]) -> None:
    """Undo :func:`wrap_targets`: each rank's loaded value (or the untouched target) back at its key path."""
    for path, target in reversed(undo):
        parent = _parent(into, path)
        assert parent is not None
        wrapped = parent.get(path[-1])
        if isinstance(wrapped, dict) and set(wrapped) == {PER_RANK}:
            (value,) = wrapped[PER_RANK].values()
            parent[path[-1]] = value
        else:
            parent[path[-1]] = target


def own_values(state: Any, rank: int, strict: bool = True, path: Path = ()) -> Any:
    """``state`` (a restored whole state, changed in place) with each per-rank value replaced by this rank's. One
    that holds no value of this rank is a KeyMismatchError if ``strict``, else left out."""
    if not isinstance(state, dict):
        return state
    if set(state) == {PER_RANK}:
        values = state[PER_RANK]
        if str(rank) not in values:
            if not strict:
                return _ABSENT
            raise KeyMismatchError(f"{dotted(path)!r} holds per-rank values of ranks {sorted(map(int, values))}, "
                                   f"none of rank {rank}: pass strict=False to leave it out")
        return values[str(rank)]
    had = bool(state)
    for key, value in list(state.items()):
        mine = own_values(value, rank, strict, (*path, key))
        if mine is _ABSENT:
            del state[key]
        else:
            state[key] = mine
    return _ABSENT if had and not state and path else state  # nothing of it was this rank's


_ABSENT = object()


def _parent(state: dict[str, Any], path: Path) -> dict[Any, Any] | None:
    level: Any = state
    for key in path[:-1]:
        if not isinstance(level, dict) or key not in level:
            return None
        level = level[key]
    return level if isinstance(level, dict) else None
