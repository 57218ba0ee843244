"""Making a CheckpointManager inside a one-rank torch.distributed job (gloo on loopback), in a child process so that
the test process never initialises torch.distributed."""

from __future__ import annotations

import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent("""
    import socket, sys, tempfile, torch.distributed as dist, ckptvault
    from ckptvault.errors import InvalidArgumentError
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        eval(f"ckptvault.CheckpointManager(tempfile.mkdtemp(), {sys.argv[1]})")
        print("made")
    except InvalidArgumentError as exc:
        print("refused:", exc)
    finally:
        dist.destroy_process_group()
""")


def made_in_a_job(arguments: str) -> str:
    """What ``CheckpointManager(<a new folder>, <arguments>)`` did in the job: ``"made"`` or ``"refused: <the
    InvalidArgumentError's message>"``."""
    run = subprocess.run([sys.executable, "-c", _SCRIPT, arguments], capture_output=True, text=True, timeout=120,
                         check=True)
    return run.stdout.strip()
