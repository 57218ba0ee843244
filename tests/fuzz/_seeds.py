"""Shared set-up of the atheris harnesses in this folder: the import path, seed corpora from tests/hostile, and
libFuzzer's arguments.

A harness calls :func:`fuzz` with its ``TestOneInput`` and its seeds. Positional arguments on the command line
are libFuzzer corpus folders (new inputs go to the first); a temporary folder holding the seeds is always added
after them, so without any, libFuzzer writes new inputs to that temporary folder and the repository stays clean.
A ``-dict=`` is added (json.dict beside this file) unless one is given.
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
HOSTILE = TESTS / "hostile"
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))


def fuzz(test_one_input: Callable[[bytes], None], seeds: Iterable[bytes]) -> None:
    import atheris

    seed_dir = tempfile.mkdtemp(prefix="ckptvault-fuzz-seeds-")
    for i, seed in enumerate(seeds):
        Path(seed_dir, f"seed-{i:04d}").write_bytes(seed)
    argv = list(sys.argv)
    if not any(a.startswith("-dict=") for a in argv[1:]):
        argv.append(f"-dict={HERE / 'json.dict'}")
    argv.append(seed_dir)
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()
