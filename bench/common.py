"""Shared benchmark plumbing: cold-cache timing, medians, the machine's description."""

from __future__ import annotations

import copy
import os
import platform
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def drop_caches() -> bool:
    """Write back dirty pages and drop the page cache; False if not permitted (then reads may be warm)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


@dataclass
class Timing:
    """Wall and CPU seconds of one measured operation, over several runs."""

    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def add(self, wall: float, cpu: float = float("nan")) -> None:
        self.wall.append(wall)
        self.cpu.append(cpu)

    @property
    def median(self) -> float:
        return statistics.median(self.wall)

    @property
    def cpu_median(self) -> float:
        return statistics.median(self.cpu)


def timed(fn: Callable[[], Any], timing: Timing, cold: bool) -> Any:
    """Run ``fn`` once (after dropping the page cache when ``cold``), adding its times to ``timing``."""
    if cold:
        drop_caches()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    result = fn()
    timing.wall.append(time.perf_counter() - wall0)
    timing.cpu.append(time.process_time() - cpu0)
    return result


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (Linux, ``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def copy_state(value: Any) -> Any:
    """A deep copy of a training state: tensors cloned (detached), containers rebuilt, anything else deep-copied."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return type(value)((k, copy_state(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(copy_state(v) for v in value)
    return copy.deepcopy(value)


def fresh_dir(path: Path) -> Path:
    """``path``, emptied."""
    if path.exists():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpu = "?"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import torch

    return {
        "cpus": os.cpu_count(), "cpu_model": cpu, "memory_gib": round(mem / 2**30, 1),
        "disk": _disk_of(Path(__file__).parent), "python": platform.python_version(), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "kernel": platform.release(), "code": _git_state(),
    }


def _git_state() -> str:
    """The commit measured, and whether src/ had uncommitted changes."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "src"], cwd=root, capture_output=True, text=True,
                               check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"
    return f"{head}{' + uncommitted changes in src/' if dirty else ''}"


def _disk_of(path: Path) -> str:
    try:
        out = subprocess.run(["df", "-hT", str(path)], capture_output=True, text=True, check=True).stdout.splitlines()[-1]
        dev, fstype, size = out.split()[:3]
        return f"{dev} ({fstype}, {size})"
    except (OSError, subprocess.CalledProcessError, ValueError):
        return "?"
