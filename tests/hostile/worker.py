"""A separate process that runs ckptvault operations against hostile vaults, for tests/test_hostile_corpus.py
and tests/test_fuzz.py.

Why a process of its own: a hostile vault may make a reader allocate without bound, recurse until the
interpreter gives up, hang, or crash. The worker imports torch and ckptvault once, warms up (kernels, thread
pools, the CLI), then limits its address space (``RLIMIT_AS``) to its size at that point plus
:data:`HEADROOM`, so an unbounded allocation fails as a MemoryError (or torch's "can't allocate memory")
that the test sees, instead of swapping the machine. Each reply carries how far the request raised the
process's peak resident memory (``ru_maxrss``). A crash or a hang costs only the worker: :class:`Worker`
(the client the tests use) starts a new one.

Protocol: one JSON request per line on stdin, one JSON reply per line on the pipe that was the worker's
stdout (fd 1 is then pointed at stderr, so stray prints cannot corrupt replies). Requests are
``{"op": NAME, ...parameters}``; a reply is ``{"status": "ok", "value": ...}`` or ``{"status": "raised",
"error": {"type", "mro", "message", "traceback"}}``, plus ``maxrss_growth_mib``. The client adds
``{"status": "crashed" | "timeout", "detail": ...}``.

Operations (``OPS``): ``restore`` (optionally ``keys``, ``into``, and ``reference``: a pristine vault whose
chunk bytes let the reply say whether every restored array holds exactly the bytes its record's pieces
name), ``info`` (steps + info of each: what ``ckptvault ls`` reads), ``verify``, ``gc_plan``, ``manifest``
(the body ``read_manifest`` accepted), ``cli`` (a ``ckptvault`` command through click's test runner, in
process) and ``battery`` (several requests, one reply each).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
#: address space the worker may add after warming up
HEADROOM = 1 << 30
#: a request that raises peak RSS by more than this gets the worker replaced (so the next one measures afresh)
RESTART_GROWTH_MIB = 128


# -- the client ------------------------------------------------------------------------------------------------

class Worker:
    """A lazily started worker process; :meth:`call` sends one request and waits ``timeout`` seconds at most."""

    def __init__(self, timeout: float = 120.0) -> None:
        self.timeout = timeout
        self.proc: subprocess.Popen[bytes] | None = None
        self.log: Any = None
        self.starts = 0
        self.cwd = tempfile.mkdtemp(prefix="ckptvault-worker-")  # where a stray relative write would land

    def stray_files(self) -> list[str]:
        """Whatever appeared in the worker's working folder (nothing should)."""
        return sorted(str(p.relative_to(self.cwd)) for p in Path(self.cwd).rglob("*"))

    def start(self) -> None:
        self.log = tempfile.TemporaryFile()
        env = {k: v for k, v in os.environ.items() if not k.startswith("TQDM_")}
        env.update(MALLOC_ARENA_MAX="2", OMP_NUM_THREADS="1", OMP_WAIT_POLICY="PASSIVE")
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve())], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=env, cwd=self.cwd)
        self.starts += 1
        ready = self._read(300.0)
        if ready.get("status") != "ready":
            raise RuntimeError(f"the hostile-vault worker did not start: {ready}")

    def call(self, op: str, **params: Any) -> dict[str, Any]:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, **params}).encode() + b"\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died; _read reports how
        reply = self._read(self.timeout)
        if reply["status"] in ("crashed", "timeout") or reply.get("maxrss_growth_mib", 0) > RESTART_GROWTH_MIB:
            self.stop()
        return reply

    def _read(self, timeout: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.stop()
            return {"status": "timeout", "detail": f"no reply within {timeout:.0f} s; worker log: {self._log_tail()}"}
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            return {"status": "crashed", "detail": f"the worker exited with status {code}; log: {self._log_tail()}"}
        return json.loads(line)

    def _log_tail(self, limit: int = 3000) -> str:
        if self.log is None:
            return ""
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-limit:]

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.proc = None

    def close(self) -> None:
        self.stop()
        if self.log is not None:
            self.log.close()
            self.log = None
        shutil.rmtree(self.cwd, ignore_errors=True)


# -- the server ------------------------------------------------------------------------------------------------

def _serve() -> None:  # pragma: no cover - runs in the worker process
    import resource

    sys.path[:0] = [str(TESTS)]
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    ops = _ops()
    _warm_up(ops)
    limit = _vm_size() + HEADROOM
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    proto.write(json.dumps({"status": "ready", "rlimit_as": limit}) + "\n")
    proto.flush()
    for line in sys.stdin:
        request = json.loads(line)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        reply = _handle(ops, request)
        reply["maxrss_growth_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
        proto.write(json.dumps(reply, default=repr) + "\n")
        proto.flush()


def _vm_size() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmSize:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


def _handle(ops: dict[str, Any], request: dict[str, Any]) -> dict[str, Any]:
    op = request.pop("op")
    if op == "battery":
        return {"status": "ok", "value": [_handle(ops, dict(r)) for r in request["requests"]]}
    try:
        return {"status": "ok", "value": ops[op](**request)}
    except BaseException as exc:  # noqa: BLE001 - reporting what escaped is the point
        return {"status": "raised", "error": describe(exc)}


def describe(exc: BaseException) -> dict[str, Any]:
    """A JSON-able account of an exception: its class, the names of its classes, message and traceback."""
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return {"type": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__], "message": str(exc)[:4000],
            "traceback": text[-6000:]}


def _warm_up(ops: dict[str, Any]) -> None:
    """Run every operation once on the pristine base vault, so lazy set-up happens before the memory limit."""
    with tempfile.TemporaryDirectory() as tmp:
        vault = shutil.copytree(HERE / "base", Path(tmp) / "vault")
        ops["restore"](str(vault), 3, reference=str(vault))
        ops["restore"](str(vault), 3, into=True)
        ops["info"](str(vault))
        ops["verify"](str(vault), 3)
        ops["gc_plan"](str(vault))
        ops["cli"](["ls", str(vault)])
        ops["cli"](["cp", "--verify", str(vault), str(Path(tmp) / "dst")])


def _ops() -> dict[str, Any]:  # pragma: no cover - runs in the worker process
    import logging

    import numpy as np
    import torch
    from click.testing import CliRunner

    import ckptvault
    from ckptvault._maintenance.gc import plan_gc
    from ckptvault._tree import scalar_value
    from ckptvault._vault import Vault
    from ckptvault.cli import main
    from helpers.statedigest import state_digest
    from hostile.make_corpus import base_state, zeroed

    raws_cache: dict[str, dict[str, bytes]] = {}

    def reference_raws(reference: str) -> dict[str, bytes]:
        """id -> raw bytes of every chunk of the pristine vault at ``reference``."""
        if reference not in raws_cache:
            vault = Vault(reference)
            try:
                steps = vault.steps()
                ids = {c.id for s in steps for c in vault.read_manifest(s).chunks}
                raws_cache[reference] = {cid: bytes(vault.read_chunk(cid)) for cid in ids}
            finally:
                vault.close()
        return raws_cache[reference]

    def restore(vault: str, step: int, keys: str | list[str] | None = None, into: bool = False,
                reference: str | None = None) -> dict[str, Any]:
        with ckptvault.CheckpointManager(vault) as mgr:
            if into:
                state = mgr.restore(step, into=zeroed(base_state()))
            else:
                state = mgr.restore(step, keys=keys)
            out: dict[str, Any] = {"digest": state_digest(state)}
            if reference is not None and keys is None and not into:
                out["unread"] = unread_bytes(mgr.manifest(step), state, reference_raws(reference))
        return out

    def info(vault: str) -> dict[str, Any]:
        with ckptvault.CheckpointManager(vault) as mgr:
            steps = mgr.steps()
            infos = [mgr.info(s) for s in steps]
        return {"steps": steps, "tensors": [len(i.tensors) for i in infos]}

    def verify(vault: str, step: int | None = None) -> dict[str, Any]:
        with ckptvault.CheckpointManager(vault) as mgr:
            report = mgr.verify(step)
        return {"ok": report.ok, "problems": {str(k): v for k, v in report.problems.items()}}

    def gc_plan(vault: str) -> dict[str, Any]:
        v = Vault(vault)
        try:
            plan = plan_gc(v)
        finally:
            v.close()
        return {"candidates": len(plan.candidates), "live": len(plan.live)}

    def manifest(vault: str, step: int) -> dict[str, Any]:
        with ckptvault.CheckpointManager(vault) as mgr:
            return {"manifest": mgr.manifest(step)}

    def cli(args: list[str]) -> dict[str, Any]:
        logging.root.handlers.clear()  # configure_logging binds a handler to the stderr of the first invocation
        result = CliRunner().invoke(main, args)
        exc = result.exception
        escaped = None if exc is None or isinstance(exc, SystemExit) else describe(exc)
        return {"exit_code": result.exit_code, "stdout": result.stdout, "stderr": result.stderr, "exception": escaped}

    def array_bytes(value: Any) -> bytes:
        if isinstance(value, torch.Tensor):
            t = value.detach().contiguous().reshape(-1)
            return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        a = np.asarray(value)
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        return np.ascontiguousarray(a).tobytes()

    def unread_bytes(body: dict[str, Any], restored: Any, raws: dict[str, bytes]) -> str | None:
        """None if every array leaf of ``restored`` holds exactly the bytes the pieces of its record name (in the
        manifest ``body`` the restore used, over the pristine chunk bytes ``raws``); else what differs."""
        tensors, chunks = body["tensors"], body["chunks"]
        problems: list[str] = []

        def walk(node: dict[str, Any], value: Any, path: str) -> None:
            tag = next(iter(node))
            inner = node[tag]
            if tag in ("dict", "odict"):
                children = {}
                for key_node, child in inner:
                    children[scalar_value(key_node)] = child  # a repeated key keeps its last value, as restore does
                for key, child in children.items():
                    walk(child, value[key], f"{path}.{key}")
            elif tag in ("list", "tuple"):
                for i, child in enumerate(inner):
                    walk(child, value[i], f"{path}.{i}")
            elif tag in ("tensor", "ndarray", "npscalar"):
                record = tensors[inner]
                if record.get("lossy"):
                    return
                want = b"".join(raws[chunks[c]["id"]][off : off + length] for c, off, length in record["pieces"])
                got = array_bytes(value)
                if got != want:
                    problems.append(f"{path or '<root>'} (record {inner}): restored {len(got)} bytes, its pieces hold "
                                    f"{len(want)} bytes{'' if len(got) != len(want) else ' of other values'}")

        try:
            walk(body["tree"], restored, "")
        except Exception as exc:  # noqa: BLE001 - the restored state does not have the shape its tree says
            problems.append(f"the restored state does not follow its tree ({type(exc).__name__}: {exc})")
        return "; ".join(problems) or None

    return {"restore": restore, "info": info, "verify": verify, "gc_plan": gc_plan, "manifest": manifest, "cli": cli}


if __name__ == "__main__":
    _serve()
