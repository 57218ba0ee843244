"""Bit-exact comparison of training states, and the fresh process that restores and checks one.

:func:`state_digests` maps every key path of a nested state to a digest of its
type, dtype, shape and raw bytes (containers to their type and keys), so two
states compare equal exactly when they are bit for bit the same, structure and
Python types included. The saving process writes the digests of what it saved;
``python -m ckptvault.demo.check`` restores the checkpoint in a new
interpreter, digests the result and compares, then times restores against
``torch.load`` of the same state. It writes one JSON object to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import blake3
import numpy as np
import torch

from .._arrays import host_contiguous, ndarray_bytes, tensor_bytes

DIGESTS_FILE = "digests.json"
TORCH_FILE = "state.pt"
#: JSON storage_options for the vault URL, passed by the environment (they may hold credentials)
STORAGE_OPTIONS_ENV = "CKPTVAULT_DEMO_STORAGE_OPTIONS"


def state_digests(state: Any) -> dict[str, str]:
    """Digest of every container and leaf of ``state``, keyed by key path (``""`` is the root)."""
    out: dict[str, str] = {}
    _digest(state, "", out)
    return out


def _digest(value: Any, path: str, out: dict[str, str]) -> None:
    kind = type(value).__name__
    if isinstance(value, dict):
        out[path] = f"{kind}{[f'{type(k).__name__}:{k!r}' for k in value]}"
        for k, v in value.items():
            _digest(v, f"{path}.{k}" if path else str(k), out)
    elif isinstance(value, (list, tuple)):
        out[path] = f"{kind}[{len(value)}]"
        for i, v in enumerate(value):
            _digest(v, f"{path}.{i}" if path else str(i), out)
    elif isinstance(value, torch.Tensor):
        t = host_contiguous(value)
        out[path] = f"tensor {t.dtype} {tuple(t.shape)} {blake3.blake3(tensor_bytes(t)).hexdigest()}"
    elif isinstance(value, np.ndarray):
        out[path] = f"ndarray {value.dtype.str} {value.shape} {blake3.blake3(ndarray_bytes(value)).hexdigest()}"
    elif isinstance(value, np.generic):
        out[path] = f"npscalar {value.dtype.str} {value.tobytes().hex()}"
    elif isinstance(value, float):
        out[path] = f"float {value.hex()}"
    else:
        out[path] = f"{kind} {value!r}"


def diff_digests(expected: dict[str, str], actual: dict[str, str]) -> list[str]:
    """Key paths whose digests differ, are missing or are extra, in a stable order ([] when equal)."""
    paths = list(expected) + [p for p in actual if p not in expected]
    return [p for p in paths if expected.get(p) != actual.get(p)]


def write_reference(state: Any, folder: Path) -> tuple[float, int]:
    """Save ``state`` into ``folder``: its digests and a ``torch.save`` file, written and fsynced.

    Returns (seconds torch.save took, fsync included; size of its file).
    """
    folder.mkdir(parents=True, exist_ok=True)
    (folder / DIGESTS_FILE).write_text(json.dumps(state_digests(state)))
    path = folder / TORCH_FILE
    start = time.perf_counter()
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - start, path.stat().st_size


def check_restore(vault: str, step: int, reference: Path, repeat: int) -> dict[str, Any]:
    """Restore ``step`` from ``vault``, compare it with the reference digests and time both loaders."""
    from ..manager import CheckpointManager

    expected = json.loads((reference / DIGESTS_FILE).read_text())
    restore_s: list[float] = []
    load_s: list[float] = []
    mismatches: list[str] = []
    options = json.loads(os.environ.get(STORAGE_OPTIONS_ENV) or "{}") or None
    with CheckpointManager(vault, storage_options=options) as mgr:
        lossy = lossy_errors(mgr.manifest(step))
        for i in range(max(1, repeat)):
            start = time.perf_counter()
            state = mgr.restore(step)
            restore_s.append(time.perf_counter() - start)
            if i == 0:
                actual = state_digests(state)
                lossy_paths = _aliases(state, set(lossy))  # a tied tensor is lossy under each of its paths
                mismatches = [p for p in diff_digests(expected, actual)
                              if not _same_lossy(p, expected, actual, lossy_paths)]
            del state
            start = time.perf_counter()
            # the full unpickler: the weights-only default refuses the numpy arrays of the RNG states
            loaded = torch.load(reference / TORCH_FILE, weights_only=False)
            load_s.append(time.perf_counter() - start)
            del loaded
    return {"step": step, "ok": not mismatches, "entries": len(expected), "mismatches": mismatches[:20],
            "lossy": len(lossy), "lossy_max_rel_l2": max((e.get("rel_l2", 0.0) for e in lossy.values()), default=0.0),
            "num_mismatches": len(mismatches), "restore_s": restore_s, "torch_load_s": load_s,
            "restore_median_s": statistics.median(restore_s), "torch_load_median_s": statistics.median(load_s)}


def lossy_errors(manifest: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Key path -> measured error of every tensor the manifest stores with a lossy codec (by its codec rules)."""
    return {t["path"]: t["lossy"].get("error", {}) for t in manifest["tensors"]
            if t.get("lossy", {}).get("codec", "lossless") != "lossless"}


def _aliases(state: Any, paths: set[str]) -> set[str]:
    """``paths`` plus every other key path of ``state`` that reaches the same tensor storage as one of them."""
    tensors: dict[str, torch.Tensor] = {}
    _collect_tensors(state, "", tensors)
    storages = {tensors[p].untyped_storage().data_ptr() for p in paths if p in tensors}
    return paths | {p for p, t in tensors.items() if t.untyped_storage().data_ptr() in storages}


def _collect_tensors(value: Any, path: str, out: dict[str, torch.Tensor]) -> None:
    if isinstance(value, dict):
        items: Any = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        if isinstance(value, torch.Tensor) and value.numel():
            out[path] = value
        return
    for k, v in items:
        _collect_tensors(v, f"{path}.{k}" if path else str(k), out)


def _same_lossy(path: str, expected: dict[str, str], actual: dict[str, str], lossy: set[str]) -> bool:
    """A lossy tensor matches when type, dtype and shape do (its bytes differ by the recorded, measured error)."""
    if path not in lossy or path not in expected or path not in actual:
        return False
    return expected[path].rsplit(" ", 1)[0] == actual[path].rsplit(" ", 1)[0]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the fresh process: exit 0 when the restore is bit-exact, 1 when it is not."""
    parser = argparse.ArgumentParser(prog="python -m ckptvault.demo.check", description=__doc__.splitlines()[0])
    parser.add_argument("--vault", required=True)
    parser.add_argument("--step", type=int, required=True)
    parser.add_argument("--reference", type=Path, required=True, help=f"folder with {DIGESTS_FILE} and {TORCH_FILE}")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    result = check_restore(args.vault, args.step, args.reference, args.repeat)
    sys.stdout.write(json.dumps(result) + "\n")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
