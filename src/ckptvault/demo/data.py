"""Training text made locally: the Python standard library's own sources, as bytes."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch


def stdlib_bytes(limit: int = 8 << 20) -> torch.Tensor:
    """Up to ``limit`` bytes of ``.py`` sources from the standard library, in a fixed order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts: list[bytes] = []
    total = 0
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        parts.append(data)
        total += len(data)
        if total >= limit:
            break
    if total < 1 << 16:
        raise RuntimeError(f"found only {total} bytes of Python sources under {root}")
    return torch.frombuffer(bytearray(b"".join(parts)[:limit]), dtype=torch.uint8).long()


def batch(data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows of ``seq_len`` tokens and the next-token targets."""
    starts = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=generator)
    x = torch.stack([data[s : s + seq_len] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + seq_len + 1] for s in starts.tolist()])
    return x, y
