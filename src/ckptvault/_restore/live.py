"""``restore(into=...)`` into live objects: modules, optimizers, LR schedulers, grad scalers, and anything else with
``state_dict()`` / ``load_state_dict()`` (docs/DESIGN.md section 8).

Each object of the target is replaced by its ``state_dict()`` and the result is mounted as a plain ``into=``
target is (:func:`~ckptvault._restore._mount_prefix`), so the same rules decide what is read and what ``strict``
requires. Then, per object:

* the tensors its state dict holds (a module's parameters and buffers, an optimizer's existing moments) are read
  in place, as for a plain state dict;
* an ``nn.Module`` whose state dict holds only tensors is then complete; any other object gets
  ``load_state_dict()`` with its whole saved subtree, in which the tensors just written in place stand for
  themselves (no second copy) and the others (a fresh optimizer's state) are new tensors.

Plain values of the target (``"step": 0``) cannot be updated in place: the saved value at their key path is in
:attr:`RestoreReport.values`. Everything is read before any live object is touched except the in-place tensors,
which are checked (presence when ``strict``, dtype and shape always) before any byte is written.
"""

from __future__ import annotations

import difflib
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .._arrays import empty_like_record, writable_bytes
from .._feedback import metered
from .._format.records import Manifest
from .._tree import Node, array_leaves, join_path, leaf_paths, scalar_value, unflatten
from .._vault import Vault
from ..errors import InvalidArgumentError, KeyMismatchError, PickleNotAllowedError
from .tensors import (
    Dest,
    LossyReads,
    Progress,
    _finish,
    _mount_prefix,
    _saved_array_paths,
    plan_into,
    read_bytes,
    read_into,
    read_sharded,
    shard_indices,
)

_ARRAY_TAGS = ("tensor", "ndarray", "npscalar", "pickle")


@dataclass(frozen=True)
class RestoredObject:
    """What ``restore(into=...)`` did to one object of the target (a value of :attr:`RestoreReport.objects`).

    ``path`` is its key path in ``into``, ``saved_path`` the saved subtree it was restored from. ``in_place``
    counts the tensors written into the object's own tensors; ``loaded`` says whether its ``load_state_dict()``
    was called (an ``nn.Module`` whose state dict holds only tensors is complete without it; an object the
    checkpoint lacks, with ``strict=False``, is neither). ``missing_keys``: keys of its ``state_dict()`` the
    saved subtree lacks (the whole object's keys if the subtree is absent); ``unexpected_keys``: saved keys its
    ``state_dict()`` does not name (a module's are not read; another object receives them and decides).
    """

    path: str
    saved_path: str
    in_place: int
    loaded: bool
    missing_keys: tuple[str, ...]
    unexpected_keys: tuple[str, ...]


@dataclass(frozen=True)
class RestoreReport:
    """What ``restore(into=...)`` restored when ``into`` holds objects with ``load_state_dict()``.

    Modelled on the ``_IncompatibleKeys`` of ``nn.Module.load_state_dict``: ``missing_keys`` and
    ``unexpected_keys`` are key paths in ``into`` (``"model.extra.weight"``, ``"scheduler"``), over every object
    and plain value. ``objects`` maps each object's key path to its :class:`RestoredObject`. ``values`` maps each
    plain value of ``into`` (``"step": 0``, ``"rng": None``: values that cannot be updated in place) to the value
    saved at its key path, restored as ``restore()`` would; a plain value the checkpoint lacks is in
    ``missing_keys`` instead. ``report["step"]`` is ``report.values["step"]``.
    """

    step: int
    objects: Mapping[str, RestoredObject]
    values: Mapping[str, Any]
    missing_keys: tuple[str, ...]
    unexpected_keys: tuple[str, ...]

    def __getitem__(self, key: str) -> Any:
        return self.values[key]


def is_live(value: Any) -> bool:
    """Whether ``value`` is an object restored through its ``state_dict()`` / ``load_state_dict()``."""
    if isinstance(value, (dict, list, tuple, torch.Tensor, np.ndarray, type)):
        return False
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def has_live_objects(into: Any) -> bool:
    """Whether ``into`` is, or holds in its dicts, lists and tuples, an object :func:`is_live` accepts."""
    if is_live(into):
        return True
    if isinstance(into, dict):
        return any(has_live_objects(v) for v in into.values())
    if isinstance(into, (list, tuple)):
        return any(has_live_objects(v) for v in into)
    return False


def restore_live(vault: Vault, manifest: Manifest, into: Any, strict: bool, allow_pickle: bool,
                 progress: Progress | None = None) -> RestoreReport:
    """Restore the objects, tensors and plain values of ``into`` (see the module docstring); returns the report."""
    if is_live(into):
        raise InvalidArgumentError(
            f"into= is a {type(into).__name__}; pass a dict naming where it was saved, such as "
            "into={'model': model, 'optimizer': optimizer}")
    step = manifest.step
    objects: dict[str, tuple[Any, Any]] = {}
    plain: dict[str, Any] = {}
    target = _split(into, "", objects, plain)
    tensors = dict(array_leaves(target))
    saved = _saved_array_paths(manifest)
    prefix = _mount_prefix(list(tensors), saved, strict, step)  # raises as a plain into= would

    def where(path: str) -> str:
        return join_path(prefix, path) if prefix else path

    in_place = plan_into(manifest, target, strict)  # checked before anything is read or written, every mismatch at once
    nodes: dict[str, Node] = {}
    _node_paths(manifest.tree, "", nodes)
    reports: dict[str, RestoredObject] = {}
    loads: list[tuple[Any, Node, str, dict[int, Any]]] = []  # (object, saved subtree, its path, its in-place tensors)
    values_at: dict[str, tuple[Node, str]] = {}
    missing: list[str] = []
    unexpected: list[str] = []
    reads: set[int] = set()
    shard_paths: set[str] = set()
    for path, (obj, state) in objects.items():
        saved_path = where(path)
        node = nodes.get(saved_path)
        own_keys = list(state) if isinstance(state, Mapping) else []
        if node is None:
            if strict:
                tops = sorted({str(s).split(".", 1)[0] for s in nodes if s})[:20]
                parent = saved_path.rpartition(".")[0]
                siblings = [s for s in nodes if s and s.rpartition(".")[0] == parent and s != saved_path]
                near = difflib.get_close_matches(saved_path, siblings, n=3, cutoff=0.6)
                raise KeyMismatchError(
                    f"into= object {path!r} ({type(obj).__name__}) is not in the checkpoint of step {step}: it holds "
                    f"nothing at {saved_path!r} (its top-level keys are {tops}"
                    f"{f'; saved keys near it: {near}' if near else ''}); pass strict=False to skip it "
                    "(it is left unchanged)")
            keys = tuple(join_path(path, k) for k in own_keys) or (path,)
            reports[path] = RestoredObject(path, saved_path, 0, False, keys, ())
            missing.extend(keys)
            continue
        tag = next(iter(node))
        if tag not in ("dict", "odict"):
            raise KeyMismatchError(
                f"{path!r}: the checkpoint of step {step} holds no state dict for a {type(obj).__name__} at "
                f"{saved_path!r}, but a {tag!r} node; restore without into= to see the saved tree")
        saved_keys = [scalar_value(key_node) for key_node, _child in node[tag]]
        own_missing = tuple(join_path(path, k) for k in own_keys if k not in saved_keys)
        own_unexpected = tuple(join_path(path, k) for k in saved_keys if k not in own_keys)
        own = {saved[where(p)]: t for p, t in array_leaves(state, path) if where(p) in saved}
        only_tensors = all(isinstance(v, (torch.Tensor, np.ndarray)) for v in _leaves(state))
        needs_load = not (isinstance(obj, torch.nn.Module) and only_tensors)
        if needs_load:
            _refuse_pickle(node, saved_path, allow_pickle)
            reads.update(_array_indices(node) - set(own))
            shard_paths.update(p for p, leaf in leaf_paths(node, saved_path).items() if "shards" in leaf)
            loads.append((obj, node, saved_path, own))
        reports[path] = RestoredObject(path, saved_path, len(own), needs_load, own_missing, own_unexpected)
        missing.extend(own_missing)
        unexpected.extend(own_unexpected)
    for path in plain:
        saved_path = where(path)
        node = nodes.get(saved_path)
        if node is None:
            missing.append(path)
            continue
        _refuse_pickle(node, saved_path, allow_pickle)
        reads.update(_array_indices(node))
        shard_paths.update(p for p, leaf in leaf_paths(node, saved_path).items() if "shards" in leaf)
        values_at[path] = (node, saved_path)

    new_reads = _new_reads(manifest, reads)
    progress = metered(progress, read_bytes(manifest, new_reads[0]) + read_bytes(manifest, in_place.dests)
                       + read_bytes(manifest, shard_indices(manifest, shard_paths) if shard_paths else []))
    new = _read_new(vault, manifest, reads, new_reads, progress)  # nothing live is touched yet
    if shard_paths:
        new.update({i: _finish(manifest.tensors[i], v) for i, v in read_sharded(vault, manifest, shard_paths, progress).items()})
    in_place.read(vault, manifest, progress)  # the tensors of the target, in place
    for obj, node, saved_path, own in loads:
        state = unflatten(node, {**new, **own}, None, allow_pickle, saved_path)
        if isinstance(obj, torch.nn.Module):
            obj.load_state_dict(state, strict=False)  # what it lacks or does not name is in the report
        else:
            obj.load_state_dict(state)
    values = {path: unflatten(node, new, None, allow_pickle, saved_path) for path, (node, saved_path) in values_at.items()}
    return RestoreReport(step, types.MappingProxyType(reports), types.MappingProxyType(values), tuple(missing),
                         tuple(unexpected))


def _split(value: Any, path: str, objects: dict[str, tuple[Any, Any]], plain: dict[str, Any]) -> Any:
    """``value`` with each live object replaced by its ``state_dict()``; records the objects and the plain
    (non-array, non-container) leaves by key path."""
    if is_live(value):
        state = value.state_dict()
        objects[path] = (value, state)
        return state
    if isinstance(value, dict):
        return {k: _split(v, join_path(path, k), objects, plain) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_split(v, join_path(path, i), objects, plain) for i, v in enumerate(value)]
    if not isinstance(value, (torch.Tensor, np.ndarray)):
        plain[path] = value
    return value


def _leaves(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [leaf for v in value.values() for leaf in _leaves(v)]
    if isinstance(value, (list, tuple)):
        return [leaf for v in value for leaf in _leaves(v)]
    return [value]


def _node_paths(node: Node, path: str, out: dict[str, Node]) -> None:
    """Every node of the skeleton (containers and leaves) by key path; the first of equal paths wins."""
    out.setdefault(path, node)
    tag = next(iter(node))
    if tag in ("dict", "odict"):
        for key_node, child in node[tag]:
            _node_paths(child, join_path(path, scalar_value(key_node)), out)
    elif tag in ("list", "tuple"):
        for i, child in enumerate(node[tag]):
            _node_paths(child, join_path(path, i), out)


def _array_indices(node: Node) -> set[int]:
    out = set()
    for leaf in leaf_paths(node).values():
        tag = next(iter(leaf))
        if tag in _ARRAY_TAGS:
            out.add(leaf[tag])
    return out


def _refuse_pickle(node: Node, path: str, allow_pickle: bool) -> None:
    if allow_pickle:
        return
    for leaf_path, leaf in leaf_paths(node, path).items():
        if "pickle" in leaf:
            raise PickleNotAllowedError(
                f"key path {leaf_path!r} was saved with pickle; pass allow_pickle=True to load it "
                "(only for checkpoints you trust: unpickling can run arbitrary code)")


NewReads = tuple[dict[Dest, memoryview | Callable[[], memoryview]], dict[int, Any], LossyReads]


def _new_reads(manifest: Manifest, indices: set[int]) -> NewReads:
    """The buffers :func:`_read_new` reads records ``indices`` into: (every dest, the plain values, the lossy)."""
    records = manifest.tensors
    lossy = LossyReads(records, [i for i in indices if records[i].is_lossy])
    values = {i: empty_like_record(records[i].kind, records[i].dtype, list(records[i].shape))
              for i in indices if i not in lossy.buffers}
    dests: dict[Dest, memoryview | Callable[[], memoryview]] = {i: writable_bytes(v) for i, v in values.items()}
    return {**dests, **lossy.dests()}, values, lossy


def _read_new(vault: Vault, manifest: Manifest, indices: set[int], planned: NewReads,
              progress: Progress | None) -> dict[int, Any]:
    """Records ``indices`` (not sharded) read into new tensors and arrays, finished as ``restore()`` returns them."""
    records = manifest.tensors
    dests, values, lossy = planned
    if dests:
        read_into(vault, manifest, dests, progress)
    values.update({i: lossy.decoded(i) for i in indices if i in lossy.buffers})
    return {i: _finish(records[i], v) for i, v in values.items()}
