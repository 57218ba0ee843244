"""Kill-test gc runner: a fork server that runs one garbage collection per request.

    python tests/helpers/gc_killee.py serve

Imports ckptvault once, prints ``serving``, then for each stdin line:

* ``run VAULT GRACE``: forks a child that runs ``collect(Vault(VAULT), GRACE)`` and exits 0
  (1 with a traceback on stderr on error); answers the child's pid;
* ``wait PID``: reaps it and answers ``signal N`` or ``exit N``;
* ``quit``.

The test SIGKILLs the child at random moments. Forking keeps each trial fast (no torch import).
"""

from __future__ import annotations

import os
import sys
import traceback

from ckptvault._maintenance.gc import collect
from ckptvault._vault import Vault


def _child(vault: str, grace: float) -> None:
    code = 0
    try:
        sys.stdin.close()
        v = Vault(vault)
        try:
            collect(v, grace)
        finally:
            v.close()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


def serve() -> None:
    print("serving", flush=True)
    for raw in sys.stdin:
        words = raw.split()
        if not words:
            continue
        if words[0] == "run":
            pid = os.fork()
            if pid == 0:
                _child(words[1], float(words[2]))
            print(pid, flush=True)
        elif words[0] == "wait":
            _, status = os.waitpid(int(words[1]), 0)
            sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0
            print(f"signal {sig}" if sig else f"exit {os.WEXITSTATUS(status)}", flush=True)
        elif words[0] == "quit":
            return


if __name__ == "__main__":
    serve()
