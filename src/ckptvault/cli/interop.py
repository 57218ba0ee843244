"""``export`` and ``import``: a checkpoint to a safetensors or torch file, and a file or folder other tools wrote
into a vault (docs/INTEROP.md). Both call the library's export_checkpoint / import_checkpoint."""

from __future__ import annotations

import click

from ..errors import SourceNotFoundError
from ..interop import export_checkpoint, import_checkpoint
from ..interop.formats import EXPORT_FORMATS, IMPORT_FORMATS
from .common import emit_json, fail, group_storage_options, json_option, progress_bar, progress_option, url_argument
from .inspect import info_json
from .render import human_bytes


def parse_step(value: str) -> int | str | None:
    """STEP as export takes it: digits are a step, ``latest`` the latest step, anything else a pin tag."""
    if value.isdigit():
        return int(value)
    return None if value == "latest" else value


@click.command("export", short_help="Write a checkpoint to a safetensors or torch file.")
@url_argument
@click.argument("step", metavar="STEP")
@click.argument("file", metavar="FILE", type=click.Path(dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(EXPORT_FORMATS), default=None,
              help="The file's format [default: from FILE's suffix: .safetensors, or .pt/.pth/.bin/.ckpt for torch].")
@click.option("--keys", "-k", "patterns", multiple=True, metavar="PATTERN",
              help="Only key paths matching PATTERN (shell-style, e.g. 'model.*'; a bare prefix such as 'model' "
                   "matches its subtree). Repeatable.")
@json_option
def export_command(url: str, step: str, file: str, fmt: str | None, patterns: tuple[str, ...], as_json: bool) -> None:
    """Write checkpoint STEP (a step, a pin tag or `latest`) of the vault at URL to FILE.

    safetensors: one tensor per array, named by its key path as `ckptvault show` prints it (model.fc.weight);
    plain values (step counters, strings) go to the file's __metadata__ as JSON text, with the checkpoint's step,
    metrics and metadata under "ckptvault". torch: the state as restore() returns it, for
    torch.load(FILE, weights_only=True). Arrays saved as shards by several ranks are written whole. FILE is
    written under a temporary name and renamed when complete.

    \b
    JSON: {"path", "format", "step", "tensors", "values", "nbytes"}
    """
    result = export_checkpoint(url, parse_step(step), file, format=fmt, keys=list(patterns) or None,
                               storage_options=group_storage_options())
    if as_json:
        emit_json({"path": str(result.path), "format": result.format, "step": result.step, "tensors": result.tensors,
                   "values": result.values, "nbytes": result.nbytes})
        return
    click.echo(f"exported step {result.step} to {result.path} ({result.format}): {result.tensors} tensors "
               f"({human_bytes(result.nbytes)}), {result.values} values")


@click.command("import", short_help="Save a safetensors, torch, DCP or Hugging Face checkpoint into a vault.")
@click.argument("source", metavar="SRC", type=click.Path())
@url_argument
@click.option("--step", "step", type=click.IntRange(min=0), required=True, help="The step to save it as.")
@click.option("--format", "fmt", type=click.Choice(IMPORT_FORMATS), default=None,
              help="What SRC is [default: detected: a safetensors or torch file, a DCP folder (.metadata), a "
                   "Hugging Face folder (model.safetensors or its index)].")
@click.option("--allow-pickle", is_flag=True,
              help="Load objects torch.load(weights_only=True) refuses (only for files you trust: unpickling can "
                   "run code); they are stored pickled.")
@click.option("--overwrite", is_flag=True, help="Replace the checkpoint if STEP is already committed.")
@progress_option
@json_option
def import_command(source: str, url: str, step: int, fmt: str | None, allow_pickle: bool, overwrite: bool,
                   progress: bool | None, as_json: bool) -> None:
    """Save the checkpoint at SRC as STEP of the vault at URL (created if absent).

    SRC is a safetensors file (its tensor names become key paths; values an export put in its metadata come
    back), a torch.save file (its object as it is), a torch.distributed.checkpoint folder (nested as saved, shards
    joined) or a Hugging Face folder (weights under "model"; optimizer.pt, scheduler.pt and trainer_state.json
    under "optimizer", "scheduler" and "trainer_state" when present). Tensors are read memory-mapped and saved
    in place, so memory stays small whatever their size.

    \b
    JSON: the `ls` fields of the new checkpoint: {"step", "logical_bytes", "stored_bytes", "added_bytes", ...}
    """
    try:
        with progress_bar(None, f"import {step}", progress) as update:
            info = import_checkpoint(source, url, step, format=fmt, allow_pickle=allow_pickle, overwrite=overwrite,
                                     progress=update, storage_options=group_storage_options())
    except SourceNotFoundError as exc:
        fail(str(exc))  # a usage error (exit 2), as a missing vault is
    if as_json:
        emit_json(info_json(info))
        return
    click.echo(f"imported {source} as step {info.step} of {url}: {len(info.tensors)} tensors, "
               f"{human_bytes(info.logical_bytes)} (stored {human_bytes(info.stored_bytes)})")
