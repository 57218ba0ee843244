"""A DCP checkpoint's manifest, both ways: built from every rank's placements (the coordinator's ``finish``), and
DCP's ``Metadata`` rebuilt from it (readers). No pickle anywhere: the manifest's tree and records say everything
DCP's metadata does (docs/DESIGN.md section 4, "DCP checkpoints").

The tree is the nested state dict DCP flattened: a dict node per mapping (its keys as DCP's path holds them, so
``str`` keys), a list node per list DCP looked into, and at each of DCP's keys (its ``fqn``, the path joined by
``.``) either ``{"shards": [i, ...]}`` (a tensor, as the records of its boxes) or the skeleton of a value
(``_tree.flatten``: JSON scalars and containers, and records for any arrays inside). DCP's flatten mapping
(``planner_data``) is that path, so it is not stored twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from .._arrays import torch_dtype
from .._format.records import ChunkRef, Manifest, Node, Piece, TensorRecord
from .._format.shards import FEATURE, box_of
from .._save.commit import ChunkTable, new_manifest
from .._tree import scalar_value
from ..errors import InvalidArgumentError, SaveError

#: a DCP object path: mapping keys (str) and list indices (int)
KeyPath = tuple[str | int, ...]
#: the tags of tree nodes that hold records
LEAF_TAGS = ("tensor", "ndarray", "npscalar", "pickle", "shards")


@dataclass(frozen=True)
class Placement:
    """Where one WriteItem went (``WriteResult.storage_data``): its tree node, whose leaf indices index ``records``,
    and the chunks whose indices the records' pieces hold. Made by a rank's ``write_data``, merged by ``finish``;
    travels between ranks (DCP gathers it), never stored as such."""

    node: Node
    records: tuple[TensorRecord, ...]
    chunks: tuple[ChunkRef, ...]


def leaf_indices(node: Node) -> list[int]:
    """The record indices a node names, in tree order (each once)."""
    out: list[int] = []
    for tag, body in _walk(node):
        if tag == "shards":
            out.extend(body)
        elif tag in LEAF_TAGS:
            out.append(body)
    return list(dict.fromkeys(out))


def renumber(node: Node, new: dict[int, int]) -> Node:
    """A copy of ``node`` whose leaf indices ``i`` are ``new[i]``."""
    (tag, body), *_ = node.items()
    out: Node
    if tag in ("dict", "odict"):
        out = {tag: [[key, renumber(child, new)] for key, child in body]}
        if "attrs" in node:
            out["attrs"] = node["attrs"]
        return out
    if tag in ("list", "tuple"):
        return {tag: [renumber(child, new) for child in body]}
    if tag == "shards":
        return {tag: [new[i] for i in body]}
    return {tag: new[body]} if tag in LEAF_TAGS else node


def _walk(node: Node) -> Iterator[tuple[str, Any]]:
    stack = [node]
    while stack:
        (tag, body), *_ = stack.pop().items()
        yield tag, body
        if tag in ("dict", "odict"):
            stack.extend(child for _, child in reversed(body))
        elif tag in ("list", "tuple"):
            stack.extend(reversed(body))


# -- the coordinator: one manifest from every rank's placements ---------------------------------------------------

def build_manifest(step: int, placements: dict[MetadataIndex, Placement], metadata: Metadata,
                   metrics: dict[str, Any], user_metadata: dict[str, Any], keyframe_step: int | None = None,
                   since_keyframe: int = 0) -> Manifest:
    """The manifest of every rank's items: records in the state's order (the shards of a tensor by offsets),
    chunks once each, the tree nested by DCP's paths. Raises SaveError if the placements do not match
    the metadata (an item no rank wrote)."""
    table, tensors = ChunkTable(), list[TensorRecord]()
    nodes: dict[str, Node] = {}
    mapping = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    # the state's own order: DCP's flatten mapping follows it, its metadata lists the items rank by rank
    order = {fqn: i for i, fqn in enumerate(dict.fromkeys([*mapping, *metadata.state_dict_metadata]))}
    for index in sorted(placements, key=lambda i: (order.get(i.fqn, len(order)), tuple(i.offset or ()))):
        placement = placements[index]
        chunks = [table.add(c) for c in placement.chunks]
        new = {local: len(tensors) + local for local in range(len(placement.records))}
        tensors.extend(_renumbered(record, chunks, new) for record in placement.records)
        node = renumber(placement.node, new)
        if "shards" in node and index.fqn in nodes:
            nodes[index.fqn]["shards"].extend(node["shards"])
        else:
            nodes[index.fqn] = node
    missing = [fqn for fqn in metadata.state_dict_metadata if fqn not in nodes]
    if missing:
        raise SaveError(f"no rank wrote {missing[:5]} ({len(missing)} of DCP's keys); nothing was committed")
    tree = nested_tree({fqn: (tuple(mapping.get(fqn, (fqn,))), node) for fqn, node in nodes.items()})
    lossy = any(t.lossy is not None for t in tensors)
    requires = (FEATURE, *(["lossy"] if lossy else []), *(["xplanes"] if any(c.base for c in table.entries) else []))
    logical = sum(t.lossy.original_nbytes or t.nbytes if t.lossy is not None else t.nbytes
                  for t in tensors if t.kind != "part")
    return new_manifest(step, table, tuple(tensors), tree=tree, logical_bytes=logical, metrics=metrics,
                        metadata=user_metadata, pickle=any(t.kind == "pickle" for t in tensors),
                        keyframe_step=step if keyframe_step is None else keyframe_step,
                        since_keyframe=since_keyframe, requires=requires)


def _renumbered(record: TensorRecord, chunks: list[int], new: dict[int, int]) -> TensorRecord:
    """A placement's record with its chunk indices those of the manifest's table (``chunks``) and its lossy parts'
    record indices those of the manifest (``new``)."""
    def moved(pieces: tuple[Piece, ...]) -> tuple[Piece, ...]:
        return tuple(Piece(chunks[p.chunk], p.offset, p.length) for p in pieces)

    lossy = record.lossy
    if lossy is not None:
        lossy = replace(lossy, parts={name: new[i] for name, i in lossy.parts.items()},
                        base_pieces=None if lossy.base_pieces is None else moved(lossy.base_pieces))
    return replace(record, pieces=moved(record.pieces), lossy=lossy)


def nested_tree(leaves: dict[str, tuple[KeyPath, Node]]) -> Node:
    """The tree node of the nested state whose DCP paths are ``leaves`` (fqn -> (path, node)): a dict per level
    keyed by strings, a list where every key of a level is an index and they run 0..n-1 (else a dict of int keys)."""
    root: dict[Any, Any] = {}
    for fqn, (path, node) in leaves.items():
        if not path or ".".join(map(str, path)) != fqn:
            raise SaveError(f"DCP's path {list(path)} of {fqn!r} does not join to its key; nothing was committed")
        level = root
        for key in path[:-1]:
            level = level.setdefault(key, {})
            if not isinstance(level, dict):
                raise SaveError(f"{fqn!r} lies inside another key's value; nothing was committed")
        if path[-1] in level:
            raise SaveError(f"{fqn!r} is saved twice, or holds other keys; nothing was committed")
        level[path[-1]] = _Leaf(node)
    return _node_of(root)


class _Leaf:
    def __init__(self, node: Node) -> None:
        self.node = node


def _node_of(level: dict[Any, Any] | _Leaf) -> Node:
    if isinstance(level, _Leaf):
        return level.node
    keys = list(level)
    if keys and all(type(k) is int for k in keys) and sorted(keys) == list(range(len(keys))):
        return {"list": [_node_of(level[i]) for i in range(len(keys))]}
    return {"dict": [[{"str": k} if isinstance(k, str) else {"int": k}, _node_of(v)] for k, v in level.items()]}


# -- readers: DCP's metadata from a manifest ---------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    """What a reader needs of a manifest: DCP's Metadata, and per DCP key its tree node (``values``)."""

    metadata: Metadata
    values: dict[str, Node]


def dcp_layout(manifest: Manifest) -> Layout:
    """DCP's Metadata of a checkpoint: one entry per DCP key of its tree (``dcp_keys``); tensors (shards nodes, and
    the ``tensor`` leaves of checkpoints ``CheckpointManager`` saved) as boxes, everything else as bytes.
    ``storage_data`` maps a tensor box's MetadataIndex to its record index."""
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, int] = {}
    mapping: dict[str, KeyPath] = {}
    values: dict[str, Node] = {}
    for fqn, path, node in dcp_keys(manifest.tree):
        mapping[fqn], values[fqn] = path, node
        (tag, body), *_ = node.items()
        indices = body if tag == "shards" else [body] if tag == "tensor" else None
        if indices is None:
            state[fqn] = BytesStorageMetadata()
            continue
        records = [manifest.tensors[i] for i in indices]
        chunks = []
        for i, record in zip(indices, records, strict=True):
            offsets = box_of(record)[1]
            chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(record.shape)))
            storage[MetadataIndex(fqn, offsets)] = i
        state[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch_dtype(records[0].dtype)),
                                           torch.Size(box_of(records[0])[0]), chunks)
    return Layout(Metadata(state, planner_data=mapping, storage_data=storage), values)


def dcp_keys(tree: Node) -> list[tuple[str, KeyPath, Node]]:
    """(fqn, path, node) of each key DCP's flattening of this state has: mappings are looked into, lists only when
    they hold a tensor or a container DCP looks into (as ``torch.distributed.checkpoint._traverse`` does), and
    anything else is one value. Raises InvalidArgumentError if the state is not a dict."""
    if next(iter(tree)) not in ("dict", "odict"):
        raise InvalidArgumentError(f"the checkpoint holds a {next(iter(tree))} at its root; DCP loads state dicts")
    out: list[tuple[str, KeyPath, Node]] = []
    stack: list[tuple[Node, KeyPath]] = [(tree, ())]
    while stack:
        node, path = stack.pop()
        (tag, body), *_ = node.items()
        if tag in ("dict", "odict"):
            stack.extend((child, (*path, str(scalar_value(key)))) for key, child in reversed(body))
        elif tag == "list" and _looked_into(node):
            stack.extend((child, (*path, i)) for i, child in reversed(list(enumerate(body))))
        else:
            out.append((".".join(map(str, path)), path, node))
    return out


def _looked_into(node: Node) -> bool:
    """Whether DCP flattens this list node item by item (it holds a tensor, a dict, or such a list)."""
    for child in node["list"]:
        tag = next(iter(child))
        if tag in ("tensor", "shards", "dict", "odict") or (tag == "list" and _looked_into(child)):
            return True
    return False
