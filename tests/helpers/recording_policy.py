"""A retention policy that writes the pid of every process that applies it to a file: a saver process can unpickle
it only where its ``PYTHONPATH`` names ``tests/`` (``tests/test_saver_process.py``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from ckptvault import RetentionInfo


@dataclass(frozen=True)
class RecordingKeepLast:
    """Keep the newest ``n`` checkpoints, appending this process's pid to ``log`` each time; ``fail``: raise instead."""

    n: int
    log: str
    fail: bool = False

    def keeps(self, infos: Sequence[RetentionInfo], now: float) -> dict[int, str]:
        with open(self.log, "a") as out:
            out.write(f"{os.getpid()}\n")
        if self.fail:
            raise ZeroDivisionError("no")
        return {info.step: "recorded last" for info in sorted(infos, key=lambda i: i.step)[-self.n:]}
