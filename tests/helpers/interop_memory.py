"""Run as ``python interop_memory.py SRC.safetensors DCP_DIR WORKDIR``: import a large safetensors file, a torch
file and a DCP folder into a vault and export a checkpoint as safetensors and torch, printing one JSON object
{phase: {"peak": anonymous memory in bytes above the phase's start, "seconds"}}.

What is measured: ``RssAnon`` of /proc/self/status (anonymous resident pages: the heap, malloc'd and torch-allocated
buffers, decoded chunks), sampled every millisecond by a thread, maximum over the phase minus its value at the
start. Not counted: ``RssFile``, the pages of memory-mapped source and output files, which are page cache the
kernel writes back and reclaims under pressure, as it does for any file read or written. A warm-up round on a
tiny state first loads everything imported lazily (numba kernels, DCP, fake tensors), so a phase measures only
what it holds for the data.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import ckptvault


def rss_anon() -> int:
    """Anonymous resident bytes of this process."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def peak_during(work: Callable[[], Any]) -> dict[str, float]:
    """``{"peak": bytes, "seconds": s}``: the peak of :func:`rss_anon` while ``work`` runs, above its value at the
    start, and how long it ran."""
    start, began = rss_anon(), time.perf_counter()
    peak = [start]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        work()
    finally:
        done.set()
        sampler.join()
    return {"peak": max(peak[0], rss_anon()) - start, "seconds": time.perf_counter() - began}


def run(src: Path, dcp_dir: Path, work: Path, vault: Path, options: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Every phase once: import safetensors as step 1, export it (safetensors, torch), import the torch file as
    step 2 and the DCP folder as step 3."""
    return {
        "import_safetensors": peak_during(lambda: ckptvault.import_checkpoint(src, vault, 1, **options)),
        "export_safetensors": peak_during(lambda: ckptvault.export_checkpoint(vault, 1, work / "out.safetensors",
                                                                             **options)),
        "export_torch": peak_during(lambda: ckptvault.export_checkpoint(vault, 1, work / "out.pt", **options)),
        "import_torch": peak_during(lambda: ckptvault.import_checkpoint(work / "out.pt", vault, 2, **options)),
        "import_dcp": peak_during(lambda: ckptvault.import_checkpoint(dcp_dir, vault, 3, **options)),
    }


def warm_up(work: Path, options: dict[str, Any]) -> None:
    """The same phases on a tiny state, so lazy imports and first-use allocations are not measured."""
    import safetensors.torch
    import torch.distributed.checkpoint as dcp

    tiny = {"w": torch.randn(64, 64)}
    safetensors.torch.save_file(tiny, work / "tiny.safetensors")
    dcp.save(tiny, checkpoint_id=work / "tiny-dcp", no_dist=True)
    run(work / "tiny.safetensors", work / "tiny-dcp", work / "tiny", work / "tiny-vault", options)


def main() -> None:
    src, dcp_dir, work = (Path(a) for a in sys.argv[1:4])
    options = {"workers": 4}  # the bound scales with the workers: each holds about two chunks
    (work / "tiny").mkdir(parents=True)
    warm_up(work, options)
    print(json.dumps(run(src, dcp_dir, work, work / "vault", options)))


if __name__ == "__main__":
    main()
