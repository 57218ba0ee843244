"""Finding optimizer states in a snapshot, and which model array each optimizer parameter updates.

A torch optimizer's ``state_dict()`` is a dict ``{"state": {param_id: {...}}, "param_groups": [{"params": [ids],
hyperparameters...}]}``; it lies anywhere in the saved state, under any key. The ids are ints, or the parameters'
names (fully qualified, as ``model.state_dict()`` keys them) in the form
``torch.distributed.checkpoint.state_dict.get_state_dict`` returns. The supported optimizers, told apart
by their hyperparameters: Adam and AdamW (a group with ``amsgrad``; moments ``exp_avg``, ``exp_avg_sq``,
``max_exp_avg_sq``, a ``step`` count) and SGD (``momentum``, ``dampening``, ``nesterov``; ``momentum_buffer``).
Groups with ``maximize``, ``capturable`` or ``differentiable`` set, or tensor hyperparameters, are left out.

The parameters themselves are not in the optimizer's state: they are the model's arrays. Each optimizer
parameter, in id order, is paired with the next unused array of the same dtype and shape in the state's order
outside any optimizer (``model.parameters()`` follows ``state_dict()`` order, buffers interleaved), or under the
subtree a user names; a named parameter tries the arrays of its name first (a path that is the name or ends with
``.`` and the name). Where several arrays fit, the save tries its prediction on each (``predict.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._format.predicted import PREDICTED_DTYPES
from .._tree import join_path, scalar_value

Node = dict[str, Any]
#: a parameter's slot: (its optimizer's key path, its id in that optimizer's state, an int or a name)
SlotKey = tuple[str, int | str]
MOMENTS = {"adam": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"), "sgd": ("momentum_buffer",)}
_REFUSED_FLAGS = ("maximize", "capturable", "differentiable")


@dataclass(frozen=True)
class _Leaf:
    index: int


@dataclass
class ParamSlot:
    """One optimizer parameter: its optimizer's key path, id, kind (``adam`` | ``sgd``), group hyperparameters,
    step count (Adam), the record indices of its moments, the model array state order pairs it with, and every
    model array that could be its parameter (same dtype and shape), that one first."""

    optimizer: str
    pid: int | str
    kind: str
    group: dict[str, Any]
    step: float | None
    moments: dict[str, int] = field(default_factory=dict)
    param: int | None = None
    candidates: list[int] = field(default_factory=list)


def find_slots(tree: Node, records: list[Any], views: list[memoryview], pairs: Mapping[str, str] | None = None
               ) -> dict[SlotKey, ParamSlot]:
    """Every supported optimizer parameter of the snapshot, by (optimizer key path, param id), paired where a
    model array fits. ``records``/``views``: the snapshot's; ``pairs``: optimizer key path -> model subtree."""
    slots: dict[SlotKey, ParamSlot] = {}
    optimizers = [(path, _python(node)) for path, node in _optimizers(tree, "")]
    inside = tuple(path + "." for path, _ in optimizers)
    for path, opt in optimizers:
        if pairs is not None and path not in pairs:
            continue
        found = _slots(path, opt, views, records)
        prefix = None if pairs is None else pairs[path]
        _pair(found, records, inside, prefix)
        slots.update({(s.optimizer, s.pid): s for s in found})
    return slots


def _python(node: Node) -> Any:
    """The skeleton as Python values, array leaves as :class:`_Leaf`."""
    tag, body = next(iter(node.items()))
    if tag in ("dict", "odict"):
        return {scalar_value(k): _python(v) for k, v in body}
    if tag in ("list", "tuple"):
        return [_python(v) for v in body]
    if tag in ("tensor", "ndarray", "npscalar", "pickle"):
        return _Leaf(body)
    if tag == "shards":
        return _Leaf(body[0])
    return scalar_value(node)


_DICTS = ("dict", "odict")
_LISTS = ("list", "tuple")
_CONTAINERS = _DICTS + _LISTS


def _optimizers(node: Node, path: str, found: list[tuple[str, Node]] | None = None) -> list[tuple[str, Node]]:
    """(key path, skeleton node) of every optimizer ``state_dict()`` in the skeleton: a dict whose ``state`` is a
    dict and whose ``param_groups`` is a list of dicts. Only these are turned into Python values (:func:`_python`):
    the rest of the state is walked, never converted, and only its containers are entered."""
    found = [] if found is None else found
    tag, body = next(iter(node.items()))
    if tag in _DICTS:
        if _is_optimizer(body):
            found.append((path, node))
            return found
        for key, child in body:
            if next(iter(child)) in _CONTAINERS:
                _optimizers(child, join_path(path, scalar_value(key)), found)
    elif tag in _LISTS:
        for k, child in enumerate(body):
            if next(iter(child)) in _CONTAINERS:
                _optimizers(child, join_path(path, k), found)
    return found


def _is_optimizer(items: list[list[Node]]) -> bool:
    """Whether a dict node's ``items`` hold a ``state`` dict and a ``param_groups`` list of dicts."""
    state = groups = None
    for key, child in items:
        name = key.get("str")  # a key node: {"str": ...}, {"int": ...}...
        if name == "state":
            state = child
        elif name == "param_groups":
            groups = child
    return (state is not None and next(iter(state)) in _DICTS and groups is not None
            and next(iter(groups)) in _LISTS and all(next(iter(g)) in _DICTS for g in next(iter(groups.values()))))


def _kind(group: dict[str, Any]) -> str | None:
    if any(group.get(flag) for flag in _REFUSED_FLAGS) or isinstance(group.get("lr"), _Leaf):
        return None
    if "amsgrad" in group and "betas" in group and "eps" in group and "momentum_decay" not in group:
        betas = group["betas"]
        return "adam" if all(isinstance(b, float) for b in betas) else None
    if {"momentum", "dampening", "nesterov"} <= set(group) and isinstance(group["momentum"], (int, float)):
        return "sgd"
    return None


def _slots(path: str, opt: dict[str, Any], views: list[memoryview], records: list[Any]) -> list[ParamSlot]:
    out = []
    for group in opt["param_groups"]:
        kind = _kind(group)
        for pid in group.get("params", []):
            entry = opt["state"].get(pid)
            if kind is None or not isinstance(entry, dict) or not isinstance(pid, (int, str)) or isinstance(pid, bool):
                continue
            moments = {name: entry[name].index for name in MOMENTS[kind] if isinstance(entry.get(name), _Leaf)}
            if not moments or any(records[i].dtype not in PREDICTED_DTYPES or records[i].kind != "torch"
                                  for i in moments.values()):
                continue
            hyper = {k: v for k, v in group.items() if k != "params"}
            out.append(ParamSlot(path, pid, kind, hyper, _step(entry.get("step"), views, records), moments))
    return out


def _step(value: Any, views: list[memoryview], records: list[Any]) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, _Leaf) and records[value.index].kind == "torch" and records[value.index].shape == []:
        dtype = {"float32": np.float32, "float64": np.float64, "int64": np.int64}.get(records[value.index].dtype)
        if dtype is not None:
            return float(np.frombuffer(views[value.index], dtype=dtype)[0])
    return None


def _pair(slots: list[ParamSlot], records: list[Any], inside: tuple[str, ...], prefix: str | None) -> None:
    """Give each slot the model arrays of its first moment's dtype and shape as candidates, the one state order
    suggests first: the next unused one after the previous slot's (parameter groups may reorder parameters, so
    an earlier unused one comes next); for a parameter named by its name, unused arrays of that name before all."""
    by_form: dict[tuple[str, tuple[int, ...]], list[int]] = {}  # model arrays by dtype and shape, in state order
    for i, r in enumerate(records):
        if (r.kind == "torch" and r.dtype in PREDICTED_DTYPES and not r.path.startswith(inside)
                and (not prefix or r.path.startswith(prefix + "."))):
            by_form.setdefault((r.dtype, tuple(r.shape)), []).append(i)
    used: set[int] = set()
    last = -1
    for slot in slots:
        moment = records[next(iter(slot.moments.values()))]
        fitting = by_form.get((moment.dtype, tuple(moment.shape)), [])
        unused = [i for i in fitting if i not in used]
        preferred = [i for i in unused if i > last] + [i for i in unused if i <= last]
        if isinstance(slot.pid, str):
            named = [i for i in preferred if _named(records[i].path, slot.pid)]
            preferred = named + [i for i in preferred if i not in named]
        slot.candidates = preferred + [i for i in fitting if i in used]
        if preferred:
            slot.param = last = preferred[0]
            used.add(last)


def _named(path: str, name: str) -> bool:
    """Whether the array at key path ``path`` can be the parameter called ``name`` (a ``state_dict()`` key)."""
    return path == name or path.endswith("." + name)
