"""``ckptvault rm``: delete checkpoints (their manifests); gc reclaims the chunks."""

from __future__ import annotations

import click

from .._format.chunk_object import chunk_key
from .._reports.usage import referenced_chunks
from .._vault import Vault
from ..errors import ObjectNotFoundError
from .common import emit_json, fail, json_option, open_manager, require_steps, step_argument, url_argument
from .render import human_bytes


@click.command("rm", short_help="Delete checkpoints; `ckptvault gc` reclaims chunks.")
@url_argument
@step_argument(required=True, nargs=-1)
@click.option("--dry-run", "-n", is_flag=True, help="Only say what would be deleted.")
@click.option("--force", is_flag=True, help="Also delete pinned checkpoints (and their pins).")
@json_option
def rm(url: str, step: tuple[int, ...], dry_run: bool, force: bool, as_json: bool) -> None:
    """Delete the checkpoints STEP... from the vault at URL.

    Each checkpoint disappears atomically when its manifest is deleted. Chunks
    that only the deleted checkpoints used stay in the store until
    `ckptvault gc` reclaims them; chunks other checkpoints share are kept.
    If any STEP is not committed, or is pinned (see `ckptvault pin`) and
    --force is not given, nothing is deleted and the exit status is 2.

    \b
    JSON: {"url", "deleted", "remaining", "dry_run",
    "reclaimable_chunks", "reclaimable_bytes", "unreadable", "unpinned"} (reclaimable:
    chunk objects, delta bases included, that only the deleted checkpoints
    need, and their stored bytes; unreadable: deleted steps whose damaged
    manifest could not be read; unpinned: step -> pin tags --force removed)
    """
    steps = sorted(set(step))
    with open_manager(url) as mgr:
        require_steps(mgr, steps)
        pinned = {s: sorted(tags) for s, tags in mgr.pins().items() if s in steps and tags}
        if pinned and not force:
            first, tags = next(iter(sorted(pinned.items())))
            fail(f"step {first} is pinned as {', '.join(map(repr, tags))}; nothing was deleted: unpin it first "
                 f"(ckptvault unpin {mgr.url} {first} {tags[0]}) or pass --force")
        remaining = [s for s in mgr.steps() if s not in steps]
        kept = referenced_chunks(mgr.vault, remaining)
        doomed = referenced_chunks(mgr.vault, steps)
        freed = doomed.ids - kept.ids
        freed_bytes = _stored_size(mgr.vault, freed)
        if not dry_run:
            for s in steps:
                for tag in pinned.get(s, ()):
                    mgr.unpin(s, tag)
                mgr.delete(s)
    if as_json:
        emit_json({"url": mgr.url, "deleted": steps, "remaining": remaining, "dry_run": dry_run,
                   "reclaimable_chunks": len(freed), "reclaimable_bytes": freed_bytes,
                   "unreadable": sorted(doomed.unreadable),
                   "unpinned": {str(s): tags for s, tags in pinned.items()}})
        return
    verb = "would delete" if dry_run else "deleted"
    click.echo(f"{verb} step(s) {', '.join(map(str, steps))}; {len(remaining)} checkpoint(s) remain")
    for s, tags in sorted(pinned.items()):
        click.echo(f"{'would remove' if dry_run else 'removed'} the pins of step {s}: {', '.join(tags)}")
    click.echo(f"chunks no remaining checkpoint uses: {len(freed)} ({human_bytes(freed_bytes)}); "
               f"`ckptvault gc` reclaims them{' after the deletion' if dry_run else ''}")
    if doomed.unreadable:
        click.echo(f"note: the manifest of step(s) {', '.join(map(str, sorted(doomed.unreadable)))} was damaged; "
                   "the chunks it used are not counted above", err=True)
    if kept.unreadable:
        click.echo(f"note: the manifest of remaining step(s) {', '.join(map(str, sorted(kept.unreadable)))} is damaged; "
                   "some chunks counted above may still be in use", err=True)


def _stored_size(vault: Vault, chunk_ids: set[str]) -> int:
    """Stored bytes of the chunk objects ``chunk_ids`` that exist."""
    total = 0
    for cid in chunk_ids:
        try:
            total += vault.store.stat(chunk_key(cid)).size
        except ObjectNotFoundError:
            pass
    return total
