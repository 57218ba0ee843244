"""The ``ckptvault`` command line: ``main`` is the click group; each command lives in its own module.

To add a command, define it in a module of this package (use the helpers in
``common.py``) and register it below with ``main.add_command(...)``. Library
errors raised by any registered command are reported by :class:`VaultGroup`.
"""

from __future__ import annotations

import click

from .._version import __version__
from .common import VaultGroup, configure_logging, parse_options
from .copy import cp
from .demo import demo
from .diff import diff
from .inspect import du, ls, show
from .interop import export_command, import_command
from .maintenance import COMMANDS as MAINTENANCE_COMMANDS
from .plot import plot
from .presets import presets
from .remove import rm
from .verify import verify

HELP = """Inspect and maintain ckptvault checkpoint vaults.

A vault is a directory (or URL) that ckptvault.CheckpointManager saves
checkpoints into. Run `ckptvault COMMAND --help` for the details of a command;
every command takes --json for scripts.

\b
Examples:
  ckptvault ls ./ckpts                      list checkpoints: sizes, compression, pins, metrics
  ckptvault show ./ckpts                    tensors of the latest checkpoint
  ckptvault show ./ckpts 200 -k 'model.*'   tensors of step 200 under "model"
  ckptvault show ./ckpts 200 --manifest     the manifest body of step 200 as JSON
  ckptvault verify ./ckpts                  read and check every chunk
  ckptvault du ./ckpts                      logical vs stored bytes, dedup and compression savings
  ckptvault plot ./ckpts -o ckpts.png       a PNG of storage over steps vs torch.save, and metrics
  ckptvault diff ./ckpts 100 200            what changed per tensor between two steps, and what it cost
  ckptvault rm ./ckpts 100 200              delete two checkpoints (then `ckptvault gc`)
  ckptvault prune ./ckpts --keep-last 5     keep the 5 newest (+ latest, pinned); then `ckptvault gc`
  ckptvault gc ./ckpts                      free chunks no checkpoint uses (safe next to training)
  ckptvault pins ./ckpts                    pinned checkpoints by tag (`ckptvault pin ./ckpts 200 best`)
  ckptvault cp ./ckpts s3://bucket/run1     copy to object storage, sending only missing chunks
  ckptvault ls ./ckpts --json | jq '.checkpoints[].step'
  ckptvault export ./ckpts 200 w.pt         step 200 as a torch file (w.safetensors: safetensors; -k 'model.*')
  ckptvault import ./hf ./ckpts --step 0    a Hugging Face folder (or a DCP folder, a torch or safetensors file)
  ckptvault presets                         named codec rule sets (lossy compression), e.g. moments-compact
  ckptvault demo                            train a small GPT into ./demo-vault, restore it, compare with torch.save

\b
Exit status:
  0  success
  1  damage found (verify, or a damaged manifest or chunk met by any command)
  2  usage error: bad arguments, no vault at URL, step not committed
  3  other failure: storage error, unsupported format version
"""


@click.group(cls=VaultGroup, help=HELP, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, "-V", "--version", prog_name="ckptvault", message="%(prog)s %(version)s")
@click.option("-v", "--verbose", count=True, help="Log what ckptvault does on stderr (-vv for debug detail).")
@click.option("--storage-option", "storage_options", multiple=True, metavar="KEY=VALUE",
              help="A storage option for the vault the command opens (s3://: endpoint_url, addressing_style, profile, "
                   "region_name, ...; a path: drop_behind, direct_io, external_links); repeatable. cp takes "
                   "--src-option/--dst-option.")
@click.pass_context
def main(ctx: click.Context, verbose: int, storage_options: tuple[str, ...]) -> None:
    configure_logging(verbose)
    ctx.obj = {"storage_options": parse_options(storage_options, "--storage-option")}


main.add_command(ls)
main.add_command(show)
main.add_command(verify)
main.add_command(du)
main.add_command(rm)
main.add_command(demo)
main.add_command(diff)
main.add_command(presets)
main.add_command(cp)
main.add_command(export_command)
main.add_command(import_command)
main.add_command(plot)
for _command in MAINTENANCE_COMMANDS:  # prune, gc, pin, unpin, pins
    main.add_command(_command)
