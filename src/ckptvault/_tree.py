"""Flattening a nested training state into a JSON skeleton plus array leaves.

The skeleton is plain JSON that records every container and scalar exactly, so
a state round-trips without pickle:

==============================  ==============================================
Python value                    skeleton node
==============================  ==============================================
dict / OrderedDict              ``{"dict": [[key, node], ...]}`` / ``{"odict": ...}``
other dict subclasses           as dict (an OrderedDict subclass as odict), with a warning; pickled if allowed
list / tuple                    ``{"list": [...]}`` / ``{"tuple": [...]}``
torch.Tensor                    ``{"tensor": i}``: ``i`` indexes the leaf list
numpy.ndarray / numpy scalar    ``{"ndarray": i}`` / ``{"npscalar": i}``
int, bool, None, str            ``{"int": 3}``, ``{"bool": true}``, ``{"none": null}``, ``{"str": "x"}``
float                           ``{"float": "0x1.8p+1"}`` (hex: exact, keeps nan/inf/-0.0)
bytes                           ``{"bytes": "<base64>"}``
anything else, if allowed       ``{"pickle": i}``
==============================  ==============================================

Dict keys are nodes too (``int`` keys, as in optimizer state, stay ints). The
same tensor object reached twice (tied weights) yields the same leaf index, so
a restore ties them again. A ``_metadata`` attribute on a dict (as
``nn.Module.state_dict()`` sets) is kept under ``"attrs"``.

Key paths name leaves for humans and rules: dict keys and list indices joined
by ``.``, for example ``optimizer.state.0.exp_avg``.
"""

from __future__ import annotations

import base64
import collections
import pickle
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._feedback import warn_at_caller
from ._format.schema import MAX_DEPTH
from .errors import InvalidArgumentError, PickleNotAllowedError, UnsupportedObjectError

Node = dict[str, Any]

NUMPY_KINDS = "biufc"


@dataclass
class Leaf:
    """An array-like value at ``path``: a tensor, an ndarray or pickled bytes."""

    path: str
    kind: str  # "torch" | "numpy" | "pickle"
    value: Any


def join_path(prefix: str, key: object) -> str:
    return f"{prefix}.{key}" if prefix else str(key)


def array_leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(key path, leaf) of every tensor and ndarray in a nested dict/list/tuple state, paths as manifests join them."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from array_leaves(v, join_path(path, k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from array_leaves(v, join_path(path, i))


#: the node of a value of each scalar type (exactly that type: a subclass, such as an IntEnum, is no scalar here),
#: made without a key path: a state's scalars (a random generator's 625 ints, say) outnumber its other nodes
_SCALAR_NODES: dict[type, Callable[[Any], Node]] = {
    type(None): lambda value: {"none": None}, bool: lambda value: {"bool": value}, int: lambda value: {"int": value},
    float: lambda value: {"float": value.hex()}, str: lambda value: {"str": value},
}


class Flattener:
    """Turns a state into (skeleton, leaves). One instance per state."""

    def __init__(self, allow_pickle: bool = False) -> None:
        self.allow_pickle = allow_pickle
        self.leaves: list[Leaf] = []
        self._seen_tensors: dict[tuple[Any, ...], int] = {}
        self._depth = 0

    def flatten(self, value: Any, path: str = "") -> Node:
        kind = type(value)
        if kind in (dict, collections.OrderedDict, list, tuple):
            return self._container(value, path)
        scalar = _SCALAR_NODES.get(kind)
        if scalar is not None:
            return scalar(value)
        if kind is bytes:
            return {"bytes": base64.b64encode(value).decode("ascii")}
        if isinstance(value, torch.Tensor):
            return self._tensor(value, path)
        if kind is np.ndarray:
            return self._ndarray(value, path)
        if isinstance(value, np.generic) and value.dtype.kind in NUMPY_KINDS:
            return {"npscalar": self._ndarray(np.asarray(value), path)["ndarray"]}
        if isinstance(value, dict) and not self.allow_pickle:  # defaultdict, Lightning's AttributeDict, ...
            _warn_dict_subclass(kind, path)
            return self._container(value, path)
        return self._fallback(value, path)

    def _container(self, value: Any, path: str) -> Node:
        """A dict, OrderedDict, list or tuple, at most MAX_DEPTH containers deep (readers refuse deeper trees)."""
        if self._depth >= MAX_DEPTH:
            shown = path if len(path) <= 80 else f"{path[:77]}..."
            raise InvalidArgumentError(f"the state is nested more than {MAX_DEPTH} containers deep at key path "
                                       f"{shown!r}; ckptvault stores at most {MAX_DEPTH} levels: flatten it")
        self._depth += 1
        try:
            if isinstance(value, dict):
                return self._dict(value, path)
            scalar = _SCALAR_NODES.get
            return {type(value).__name__: [node(v) if (node := scalar(type(v))) is not None
                                           else self.flatten(v, join_path(path, i)) for i, v in enumerate(value)]}
        finally:
            self._depth -= 1

    def _dict(self, value: dict[Any, Any], path: str) -> Node:
        items = []
        scalar = _SCALAR_NODES.get
        for k, v in value.items():
            key = scalar(type(k))
            if key is None:
                raise UnsupportedObjectError(join_path(path, k), k, "Dict keys must be str, int, float, bool or None.")
            made = scalar(type(v))
            items.append([key(k), made(v) if made is not None else self.flatten(v, join_path(path, k))])
        node: Node = {"odict" if isinstance(value, collections.OrderedDict) else "dict": items}
        attrs = getattr(value, "_metadata", None)
        if attrs is not None:
            try:
                node["attrs"] = {"_metadata": Flattener().flatten(attrs, path)}
            except UnsupportedObjectError:
                pass  # module metadata we cannot represent is dropped, as safetensors does
        return node

    def _tensor(self, t: torch.Tensor, path: str) -> Node:
        if t.layout != torch.strided or t.is_quantized or t.is_nested or t.is_meta:
            return self._fallback(t, path, "Only dense (strided) tensors with data are stored natively.")
        key = (t.untyped_storage().data_ptr(), t.device, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype,
               t.is_conj(), t.is_neg())  # a conj/neg view shares storage and strides but not values
        if t.numel() > 0 and key in self._seen_tensors:
            return {"tensor": self._seen_tensors[key]}
        self.leaves.append(Leaf(path, "torch", t))
        index = len(self.leaves) - 1
        if t.numel() > 0:
            self._seen_tensors[key] = index
        return {"tensor": index}

    def _ndarray(self, a: np.ndarray, path: str) -> Node:
        if a.dtype.kind not in NUMPY_KINDS:
            return self._fallback(a, path, f"numpy dtype {a.dtype} is not numeric.")
        self.leaves.append(Leaf(path, "numpy", a))
        return {"ndarray": len(self.leaves) - 1}

    def _fallback(self, value: Any, path: str, hint: str = "") -> Node:
        if not self.allow_pickle:
            raise UnsupportedObjectError(path, value, hint)
        data = pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        self.leaves.append(Leaf(path, "pickle", np.frombuffer(data, dtype=np.uint8)))
        return {"pickle": len(self.leaves) - 1}


_warned_dict_types: set[type] = set()


def _warn_dict_subclass(kind: type, path: str) -> None:
    """Once per type and process: a dict subclass is stored as its items, so it restores as a plain dict."""
    if kind in _warned_dict_types:
        return
    _warned_dict_types.add(kind)
    name = f"{kind.__module__}.{kind.__qualname__}"
    plain = "collections.OrderedDict" if issubclass(kind, collections.OrderedDict) else "dict"
    warn_at_caller(f"{name} at key path {path!r} (and any other {kind.__qualname__}) is stored as a plain {plain} of "
                   f"its items: restore gives a {plain}, without its type or attributes (a defaultdict's "
                   "default_factory, say). Convert it yourself to silence this, or pass allow_pickle=True to keep "
                   "the type (loading then needs allow_pickle=True too)", UserWarning)


def flatten(state: Any, allow_pickle: bool = False) -> tuple[Node, list[Leaf]]:
    """Return the JSON skeleton of ``state`` and its array leaves, in tree order."""
    f = Flattener(allow_pickle)
    return f.flatten(state), f.leaves


def leaf_paths(node: Node, path: str = "") -> dict[str, Node]:
    """Map every leaf key path (arrays and scalars) to its node."""
    out: dict[str, Node] = {}
    _walk_paths(node, path, out)
    return out


def _walk_paths(node: Node, path: str, out: dict[str, Node]) -> None:
    (tag, body), *_ = node.items()
    if tag in ("dict", "odict"):
        for key_node, child in body:
            _walk_paths(child, join_path(path, scalar_value(key_node)), out)
    elif tag in ("list", "tuple"):
        for i, child in enumerate(body):
            _walk_paths(child, join_path(path, i), out)
    else:
        out[path] = node


def scalar_value(node: Node) -> Any:
    """The Python value of a scalar node."""
    (tag, body), *_ = node.items()
    if tag == "float":
        return float.fromhex(body)
    if tag == "bytes":
        return base64.b64decode(body)
    if tag in ("none", "bool", "int", "str"):
        return body
    raise ValueError(f"not a scalar node: {tag}")


def unflatten(
    node: Node,
    arrays: dict[int, Any],
    selected: set[str] | None = None,
    allow_pickle: bool = False,
    path: str = "",
) -> Any:
    """Rebuild the state from its skeleton.

    ``arrays`` maps leaf index -> restored tensor/ndarray/pickled bytes. With
    ``selected``, only leaves whose key path is in it are rebuilt and empty
    containers are dropped (lists and tuples are compacted).
    """
    result = _unflatten(node, arrays, selected, allow_pickle, path)
    return None if result is _SKIP else result


_SKIP = object()


def _unflatten(node: Node, arrays: dict[int, Any], selected: set[str] | None, allow_pickle: bool, path: str) -> Any:
    tag = next(iter(node))
    body = node[tag]
    if tag in ("dict", "odict"):
        out = collections.OrderedDict() if tag == "odict" else {}
        for key_node, child in body:
            key = scalar_value(key_node)
            value = _unflatten(child, arrays, selected, allow_pickle, join_path(path, key))
            if value is not _SKIP:
                out[key] = value
        if selected is not None and not out and path not in selected:
            return _SKIP
        if "attrs" in node and isinstance(out, dict):
            meta = unflatten(node["attrs"]["_metadata"], {}, None)
            try:
                out._metadata = meta  # type: ignore[attr-defined]
            except AttributeError:
                pass
        return out
    if tag in ("list", "tuple"):
        items = [_unflatten(c, arrays, selected, allow_pickle, join_path(path, i)) for i, c in enumerate(body)]
        kept = [v for v in items if v is not _SKIP]
        if selected is not None and not kept and path not in selected:
            return _SKIP
        return tuple(kept) if tag == "tuple" else kept
    if selected is not None and path not in selected:
        return _SKIP
    if tag in ("tensor", "ndarray"):
        return arrays[body]
    if tag == "shards":  # one array stored as boxes (DCP checkpoints): the reader put it, whole, under its first record
        return arrays[body[0]]
    if tag == "npscalar":
        return arrays[body][()]
    if tag == "pickle":
        if not allow_pickle:
            raise PickleNotAllowedError(
                f"key path {path!r} was saved with pickle; pass allow_pickle=True to load it "
                "(only for checkpoints you trust: unpickling can run arbitrary code)"
            )
        return pickle.loads(bytes(arrays[body]))
    return scalar_value(node)
