"""Which chunks a save may rely on without ``touch``ing them (docs/DESIGN.md, G5).

A save protects every chunk it reuses, and every delta base it encodes
against, from a concurrent gc. The general way is ``touch`` (a fresh mtime
makes gc skip the chunk). On S3 a touch is a server-side copy of the object, so
an incremental save that touches every keyframe chunk it encodes against costs
the server a copy of the whole keyframe.

Chunks named by a committed manifest need no touch: gc never deletes them
(G1 marks them, G3 re-marks manifests committed during its run). A save
therefore notes the size and mtime of the manifests it reads at its start (the
latest checkpoint and its keyframe) and skips the touch of the chunks they
name. Right before committing, :meth:`ManifestGuard.ensure` stats those
manifests again: if all are still in place, unchanged, the chunks were live
throughout. If any changed or vanished (a concurrent prune, or an overwrite),
it touches the skipped chunks then, so they are protected as before; one that
is already gone fails the save at the existence check that follows, with
nothing committed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from .._format.chunk_object import chunk_key
from .._parallel import map_all
from ..errors import ObjectNotFoundError
from ..stores.base import Store

log = logging.getLogger(__name__)


class ManifestGuard:
    """The manifests a save relies on, as stat'ed before it read them, and the chunks they name."""

    def __init__(self, watched: dict[str, tuple[int, float]] | None = None, chunk_ids: Iterable[str] = ()) -> None:
        self.watched = dict(watched or {})  # manifest key -> (size, mtime)
        self.chunk_ids = frozenset(chunk_ids) if self.watched else frozenset()
        self.skipped: set[str] = set()
        self._lock = threading.Lock()

    def protect(self, store: Store, cid: str) -> None:
        """Protect chunk ``cid`` from gc until the commit: ``touch`` it, unless a watched manifest names it
        (then remember it for :meth:`ensure`). ObjectNotFoundError if a touched chunk is gone."""
        if cid not in self.chunk_ids:
            store.touch(chunk_key(cid))
            return
        with self._lock:
            self.skipped.add(cid)

    def unchanged(self, store: Store) -> bool:
        """True if every watched manifest is still in place with the size and mtime it had."""
        for key, seen in self.watched.items():
            try:
                info = store.stat(key)
            except ObjectNotFoundError:
                return False
            if (info.size, info.mtime) != seen:
                return False
        return True

    def ensure(self, store: Store, pool: ThreadPoolExecutor) -> None:
        """Call right before the commit's existence check: touch the skipped chunks unless the manifests held."""
        if not self.skipped or self.unchanged(store):
            return
        log.info("a manifest this save relied on changed during it: touching the %d chunks it reused untouched",
                 len(self.skipped))

        def touch(cid: str) -> None:
            try:
                store.touch(chunk_key(cid))
            except ObjectNotFoundError:
                pass  # gone: the existence check that follows fails the save cleanly

        map_all(pool, touch, sorted(self.skipped))

