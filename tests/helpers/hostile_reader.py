"""Restore and verify hostile chunks in a fresh process and report how much its peak memory grew
(tests/test_bounded_decode.py).

Usage: ``hostile_reader.py VAULT LIMIT KEY [KEY ...]``. Step 0 of VAULT is intact, step 1 holds the hostile
chunks. The script first restores and verifies step 0 (so the worker pool, the codecs and numba's kernels are
loaded and in the baseline), takes the peak RSS, then restores each KEY from step 1 and verifies step 1. It
prints one JSON object: ``errors`` (key -> [exception type, message]), ``verify`` (the problems verify listed for
step 1) and ``grown`` (bytes the peak RSS grew past the baseline). It stops early once the peak grew past LIMIT
bytes: a reader without bounds would take gigabytes per key.
"""

from __future__ import annotations

import json
import resource
import sys

import ckptvault


def peak_rss() -> int:
    """Peak resident memory of this process so far, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(root: str, limit: int, keys: list[str]) -> dict[str, object]:
    errors: dict[str, list[str] | None] = {}
    problems: list[str] | None = None
    with ckptvault.CheckpointManager(root) as mgr:
        mgr.restore(0)
        assert mgr.verify(0).ok
        baseline = peak_rss()
        for key in keys:
            try:
                mgr.restore(1, keys=[key])
                errors[key] = None
            except Exception as exc:  # the test checks the type: everything must be a typed CorruptChunkError
                errors[key] = [type(exc).__name__, str(exc)]
            if peak_rss() - baseline > limit:
                break
        else:
            problems = mgr.verify(1).problems.get(1, [])
    return {"errors": errors, "verify": problems, "grown": peak_rss() - baseline}

if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])))
