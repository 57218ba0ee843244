"""DCP planners that never pickle: DCP's default planners with non-tensor values as ckptvault's JSON skeleton.

DCP's default planners turn every non-tensor value (an int, a list of strings, a nested dict of floats) into a
``torch.save`` stream on save and ``torch.load(weights_only=False)`` it on load: pickle, both ways. With
:class:`~ckptvault.distributed.VaultWriter` and :class:`~ckptvault.distributed.VaultReader` no byte of the vault is
ever unpickled whatever the planner (the writer takes values through ``lookup_object``; the reader hands DCP's
default load planner a stream it made itself). These planners go further and never pickle at all:

- :class:`VaultSavePlanner` hands a value to a storage writer as the UTF-8 JSON of its skeleton (``_tree.flatten``:
  exact ints, floats as hex, strings, bytes, None, bools, lists, tuples and dicts), so with any other storage
  writer a value that holds arrays or other objects is an UnsupportedObjectError naming its key.
- :class:`VaultLoadPlanner` takes values from VaultReader as they are (:meth:`VaultLoadPlanner.load_value`) and reads
  streams of other storage readers only as that JSON, never as pickle.
"""

from __future__ import annotations

import io
import json
from typing import Any

from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.planner import ReadItem, WriteItem, WriteItemType

from .._format.manifest import parse_json
from .._tree import Flattener, unflatten
from ..errors import CorruptDataError, PickleNotAllowedError, UnsupportedObjectError


class VaultSavePlanner(DefaultSavePlanner):
    """DCP's DefaultSavePlanner (same keyword arguments), but a non-tensor value becomes the JSON of its skeleton,
    never a ``torch.save`` stream. VaultWriter does not ask for the stream at all (it takes the value itself), so
    this matters for other storage writers."""

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:  # noqa: A002 - DCP's parameter name
        if write_item.type != WriteItemType.BYTE_IO:
            return super().transform_object(write_item, object)
        flattener = Flattener(allow_pickle=False)
        tree, leaves = flattener.flatten(object, write_item.index.fqn), flattener.leaves
        if leaves:
            raise UnsupportedObjectError(leaves[0].path, leaves[0].value, "Arrays inside a non-tensor value are "
                                         "stored by VaultWriter only; VaultSavePlanner gives other writers JSON.")
        return io.BytesIO(json.dumps(tree, separators=(",", ":"), ensure_ascii=False).encode())


class VaultLoadPlanner(DefaultLoadPlanner):
    """DCP's DefaultLoadPlanner (same keyword arguments) that never unpickles: VaultReader gives it values through
    :meth:`load_value`; a stream from another storage reader is read only as the JSON VaultSavePlanner writes."""

    def load_value(self, read_item: ReadItem, value: Any) -> None:
        """Put ``value`` where the state dict (nested, as given to ``dcp.load``) holds ``read_item``'s key."""
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], value)
        else:
            self.state_dict[fqn] = value

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        data = value.read()
        if data[:1] != b"{":
            raise PickleNotAllowedError(
                f"the value of {fqn!r} is not ckptvault JSON (a torch.save stream?), and VaultLoadPlanner never "
                "unpickles; load it with DCP's DefaultLoadPlanner if you trust the checkpoint")
        tree = parse_json(data, f"the value of {fqn!r}", CorruptDataError)
        try:
            loaded = unflatten(tree, {})  # no leaves: a tensor node has no array to name
        except (ValueError, KeyError, TypeError, IndexError, AttributeError, StopIteration, RecursionError):
            raise CorruptDataError(f"the value of {fqn!r} is not the JSON skeleton of a value") from None
        self.load_value(read_item, loaded)
