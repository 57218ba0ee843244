"""Which format a file or folder is: export targets from their suffix, import sources by what they hold.

Export formats: ``safetensors`` (``.safetensors``) and ``torch`` (``.pt``, ``.pth``, ``.bin``, ``.ckpt``).
Import formats: those two (a file, recognised by its first bytes, whatever its name), ``dcp`` (a folder with a
``.metadata`` file: torch.distributed.checkpoint) and ``hf`` (a Hugging Face folder with ``model.safetensors`` or
``model.safetensors.index.json``).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from ..errors import InvalidArgumentError, SourceNotFoundError

EXPORT_FORMATS = ("safetensors", "torch")
IMPORT_FORMATS = ("safetensors", "torch", "dcp", "hf")
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
HF_WEIGHTS = "model.safetensors"
HF_INDEX = "model.safetensors.index.json"
DCP_METADATA = ".metadata"
_ZIP_MAGIC = b"PK\x03\x04"
_PICKLE_PROTOCOL2 = b"\x80\x02"  # a legacy (not zip) torch.save file starts with a pickle of protocol 2


def _check(name: str, value: str | None, allowed: tuple[str, ...]) -> str | None:
    if value is not None and value not in allowed:
        raise InvalidArgumentError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
    return value


def export_format(path: Path, format: str | None) -> str:
    """The format to write ``path`` in: ``format`` if given, else from the suffix."""
    if _check("format", format, EXPORT_FORMATS):
        return format  # type: ignore[return-value]
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        return "safetensors"
    if suffix in TORCH_SUFFIXES:
        return "torch"
    raise InvalidArgumentError(f"cannot tell the format of {path.name!r} from its suffix: name it *.safetensors or "
                               f"*{', *'.join(TORCH_SUFFIXES)}, or pass format= (--format) {' or '.join(EXPORT_FORMATS)}")


def source_format(path: Path, format: str | None) -> str:
    """The format of the import source ``path`` (``format`` if given, checked against what the path is)."""
    _check("format", format, IMPORT_FORMATS)
    if not path.exists():
        raise SourceNotFoundError(f"nothing to import at {path}: no such file or folder")
    if path.is_dir():
        found = _folder_format(path)
        if format in ("safetensors", "torch"):
            raise InvalidArgumentError(f"{path} is a folder; format {format!r} reads a file")
        if format is None and found is None:
            raise InvalidArgumentError(
                f"cannot tell what the folder {path} holds: it has neither {DCP_METADATA} (a torch.distributed."
                f"checkpoint folder) nor {HF_WEIGHTS} or {HF_INDEX} (a Hugging Face checkpoint); for a single file "
                "inside it, import that file")
        return format or found  # type: ignore[return-value]
    if format in ("dcp", "hf"):
        raise InvalidArgumentError(f"{path} is a file; format {format!r} reads a folder")
    if format is not None:
        return format
    found = _file_format(path)
    if found is None:
        raise InvalidArgumentError(f"cannot tell the format of {path}: it is neither a safetensors file nor a "
                                   "torch.save file; pass format= (--format) to say which")
    return found


def _folder_format(path: Path) -> str | None:
    if (path / DCP_METADATA).is_file():
        return "dcp"
    if (path / HF_WEIGHTS).is_file() or (path / HF_INDEX).is_file():
        return "hf"
    return None


def _file_format(path: Path) -> str | None:
    """By the first bytes: a zip or protocol-2 pickle is torch.save's; a plausible length then ``{`` is safetensors."""
    with open(path, "rb") as f:
        head = f.read(9)
    if head.startswith(_ZIP_MAGIC) or head.startswith(_PICKLE_PROTOCOL2):
        return "torch"
    if len(head) == 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] <= path.stat().st_size - 8:
        return "safetensors"
    return None


def read_json(path: Path) -> object:
    """The JSON document at ``path``; InvalidArgumentError naming the file if it is not JSON."""
    try:
        return json.loads(path.read_text())
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidArgumentError(f"{path} is not valid JSON: {exc}") from None
