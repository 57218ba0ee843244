"""Concurrency-test collector: prunes and collects garbage in a loop next to ``gc_saver.py``.

    python tests/helpers/gc_collector.py VAULT LOG SECONDS GRACE

Waits for the vault to exist, pins the first committed step it sees as ``keep-me``, then
repeats ``prune(policy())`` and ``gc(GRACE)`` for SECONDS seconds. LOG lines::

    pinned STEP
    pruned STEP...            (steps whose manifests this process deleted)
    gc DELETED_CHUNKS BYTES SKIPPED_LIVE SKIPPED_FRESH
    done ROUNDS
"""

from __future__ import annotations

import os
import sys
import time
import traceback

from gc_saver import Log, policy  # this script's folder is sys.path[0]

from ckptvault import CheckpointManager
from ckptvault.errors import StepNotFoundError


def main(vault: str, log_path: str, seconds: float, grace: float) -> None:
    log = Log(log_path)
    deadline = time.monotonic() + seconds
    while not os.path.exists(os.path.join(vault, "vault.json")):
        time.sleep(0.05)
    pinned = False
    rounds = 0
    with CheckpointManager(vault) as mgr:
        while time.monotonic() < deadline:
            if not pinned and mgr.steps():
                try:
                    mgr.pin(mgr.steps()[0], "keep-me")
                    pinned = True
                    log.line("pinned", mgr.steps()[0])
                except StepNotFoundError:
                    pass  # pruned by the saver meanwhile: try the next one
            _, pruned = mgr.prune(policy())
            if pruned is not None and pruned.deleted:
                log.line("pruned", *pruned.deleted)
            _, result = mgr.gc(grace)
            assert result is not None
            chunks = [g for g in result.deleted if g.kind == "chunk"]
            log.line("gc", len(chunks), sum(g.size for g in chunks), result.skipped_live, result.skipped_fresh)
            rounds += 1
            time.sleep(0.1)
    log.line("done", rounds)


if __name__ == "__main__":
    try:
        main(sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]))
    except BaseException:
        with open(sys.argv[2], "a") as f:
            f.write("error " + traceback.format_exc().replace("\n", " | ") + "\n")
        raise
