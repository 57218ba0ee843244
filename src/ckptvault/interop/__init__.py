"""Export checkpoints to, and import them from, the files other tools write (docs/INTEROP.md).

Modules: ``export.py`` (export_checkpoint: plan, then write), ``output.py`` (output files laid out, filled through
a shared map, renamed into place), ``fill.py`` (a checkpoint's arrays read into given tensors, batch by batch),
``importer.py`` (import_checkpoint: detect, read mapped, one synchronous save), ``sources.py`` (safetensors,
torch and Hugging Face sources as states of mapped tensors), ``dcp_source.py`` (torch.distributed.checkpoint
folders, item by item), ``safetensors_file.py`` (the safetensors header: read, check, lay out) and
``formats.py`` (which format a path is).
"""

from __future__ import annotations

from .export import ExportResult, export_checkpoint
from .importer import import_checkpoint

__all__ = ["ExportResult", "export_checkpoint", "import_checkpoint"]
