"""Reading import sources as states whose tensors are memory-mapped, not loaded.

Each reader returns a :class:`Source`: the state to save (tensors over memory maps of the source files, so a
synchronous save reads them page by page from the page cache), the manifest metadata and metrics to record, and a
``close`` that drops the maps. A safetensors file or a Hugging Face folder's weights are mapped here
(``safetensors_file.py``); a torch file through ``torch.load(mmap=True, weights_only=True)``; a
torch.distributed.checkpoint folder in ``dcp_source.py``.
"""

from __future__ import annotations

import base64
import json
import logging
import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import InvalidArgumentError, PickleNotAllowedError
from .formats import HF_INDEX, HF_WEIGHTS, read_json
from .safetensors_file import Header, map_tensors, read_header

log = logging.getLogger(__name__)

#: the safetensors ``__metadata__`` entry ckptvault's export writes: {"step", "metrics", "metadata", "values"}
EXPORT_KEY = "ckptvault"
#: files of a Hugging Face Trainer checkpoint folder imported besides the weights, and their key in the state
HF_EXTRAS = {"optimizer.pt": "optimizer", "scheduler.pt": "scheduler", "trainer_state.json": "trainer_state"}


@dataclass
class Source:
    """A source read for import: the state (tensors memory-mapped), what to record in the manifest, and the
    files it came from."""

    state: Any
    metadata: dict[str, Any]
    metrics: dict[str, Any] = field(default_factory=dict)
    close: Callable[[], None] = lambda: None


def pickle_refused(path: Path, exc: Exception) -> PickleNotAllowedError:
    """The error for a source that needs pickle beyond what ``weights_only`` loads, with torch's reason."""
    return PickleNotAllowedError(
        f"{path} holds objects that torch.load(weights_only=True) refuses ({_reason(exc)}); pass --allow-pickle "
        "(allow_pickle=True) to load it with pickle, only for a file you trust: unpickling can run arbitrary code")


def load_torch(path: Path, allow_pickle: bool) -> Any:
    """``torch.load`` of ``path`` memory-mapped (``weights_only`` unless ``allow_pickle``); a legacy (not zip) file,
    which cannot be mapped, is loaded whole. PickleNotAllowedError if it needs pickle; InvalidArgumentError if it
    is not a torch.save file."""
    try:
        try:
            return torch.load(path, map_location="cpu", mmap=True, weights_only=not allow_pickle)
        except RuntimeError as exc:
            if "mmap can only be used" not in str(exc):
                raise
            value = torch.load(path, map_location="cpu", weights_only=not allow_pickle)
            log.warning("%s is a legacy torch.save file, which cannot be memory-mapped: it was loaded whole", path)
            return value
    except pickle.UnpicklingError as exc:
        if "Weights only load failed" in str(exc) and "Unsupported operand" not in str(exc):
            raise pickle_refused(path, exc) from None
        raise _not_torch(path, exc) from None
    except Exception as exc:  # noqa: BLE001 - torch.load of bytes that are no torch.save file raises anything
        raise _not_torch(path, exc) from None


def _reason(exc: Exception) -> str:
    """The one line of a torch.load error that says what is wrong (after its advice on weights_only)."""
    text = str(exc)
    marker = "WeightsUnpickler error:"
    reason = text.split(marker, 1)[1].strip() if marker in text else text.strip()
    return (reason.splitlines() or [type(exc).__name__])[0].split(". ")[0][:200]


def _not_torch(path: Path, exc: Exception) -> InvalidArgumentError:
    return InvalidArgumentError(f"{path} is not a readable torch.save file ({type(exc).__name__}: {_reason(exc)})")


def read_torch(path: Path, allow_pickle: bool) -> Source:
    """A torch.save file: its object as the state, as it is."""
    return Source(load_torch(path, allow_pickle), {"imported_from": str(path.resolve()), "import_format": "torch"})


def read_safetensors(path: Path) -> Source:
    """A safetensors file: a flat state ``{name: tensor}`` in file order. Where ckptvault's export wrote the file,
    the plain values it put in ``__metadata__`` come back as leaves and its metrics and metadata as the
    checkpoint's; any other ``__metadata__`` is kept as the manifest's ``safetensors_metadata``."""
    header = read_header(path)
    state: dict[str, Any] = dict(map_tensors(path, header))
    metadata: dict[str, Any] = {"imported_from": str(path.resolve()), "import_format": "safetensors"}
    foreign, metrics = dict(header.metadata), {}
    exported = _exported(path, header)
    if exported is not None:
        del foreign[EXPORT_KEY]
        for key in exported["values"]:
            state[key] = decode_value(path, key, foreign.pop(key))
        metrics = exported["metrics"]
        metadata = {**exported["metadata"], **metadata, "exported_step": exported["step"]}
    foreign.pop("format", None)  # "pt": the safetensors library's own marker
    if foreign:
        metadata["safetensors_metadata"] = foreign
    return Source(state, metadata, metrics)


def _exported(path: Path, header: Header) -> dict[str, Any] | None:
    """The entry ckptvault's export wrote, checked, or None for a file written by anything else."""
    text = header.metadata.get(EXPORT_KEY)
    if text is None:
        return None
    try:
        entry = json.loads(text)
    except ValueError:
        return None
    if not (isinstance(entry, dict) and isinstance(entry.get("values"), list)
            and all(isinstance(k, str) and k in header.metadata for k in entry["values"])
            and isinstance(entry.get("metrics"), dict) and isinstance(entry.get("metadata"), dict)):
        log.warning("%s: ignoring a malformed %r metadata entry", path, EXPORT_KEY)
        return None
    return entry


def encode_value(value: Any) -> str:
    """A plain value as the JSON text of a safetensors metadata string (bytes as ``{"bytes": base64}``)."""
    if isinstance(value, bytes):
        return json.dumps({"bytes": base64.b64encode(value).decode("ascii")})
    return json.dumps(value)


def decode_value(path: Path, key: str, text: str) -> Any:
    """The inverse of :func:`encode_value`."""
    try:
        value = json.loads(text)
    except ValueError:
        raise InvalidArgumentError(f"{path}: the metadata value of {key!r} is not JSON: {text[:80]!r}") from None
    if isinstance(value, dict):
        return base64.b64decode(value["bytes"])
    return value


def read_hf(path: Path, allow_pickle: bool) -> Source:
    """A Hugging Face folder: ``{"model": weights}`` from ``model.safetensors`` or the shards its index names,
    plus ``optimizer``, ``scheduler`` (torch files) and ``trainer_state`` (JSON) where the folder has them."""
    state: dict[str, Any] = {"model": _hf_weights(path)}
    for name, key in HF_EXTRAS.items():
        if (path / name).is_file():
            state[key] = read_json(path / name) if name.endswith(".json") else load_torch(path / name, allow_pickle)
    skipped = sorted(p.name for p in path.iterdir() if p.name not in HF_EXTRAS and not p.name.startswith("model"))
    if skipped:
        log.info("%s: not imported (not checkpoint state this import reads): %s", path, ", ".join(skipped))
    return Source(state, {"imported_from": str(path.resolve()), "import_format": "hf"})


def _hf_weights(path: Path) -> dict[str, torch.Tensor]:
    """The weights of a Hugging Face folder: the shards named by the index, in index order, or the single file."""
    index_path = path / HF_INDEX
    if not index_path.is_file():
        return map_tensors(path / HF_WEIGHTS, read_header(path / HF_WEIGHTS))
    index = read_json(index_path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise InvalidArgumentError(f"{index_path} has no weight_map of tensor names to shard files")
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for name in dict.fromkeys(weight_map.values()):
        shard = path / name
        if Path(name).name != name or not shard.is_file():
            raise InvalidArgumentError(f"{index_path} names the shard {name!r}, which is not a file in {path}")
        shards[name] = map_tensors(shard, read_header(shard))
    missing = sorted(t for t, shard in weight_map.items() if t not in shards[shard])
    if missing:
        raise InvalidArgumentError(f"{index_path} places tensors in shards that do not hold them: {missing[:5]}")
    out = {t: shards[shard][t] for t, shard in weight_map.items()}
    for shard_tensors in shards.values():  # tensors a shard holds that the index does not name: kept too, last
        out.update((t, v) for t, v in shard_tensors.items() if t not in out)
    return out
