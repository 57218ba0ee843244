"""Fault injection for tests: a Store wrapper, and a TCP proxy that breaks HTTP connections to an S3 server.

:class:`FaultyStore` wraps any Store and makes a share of calls fail (raise a
storage error before the call reaches the inner store) or stall (sleep, then
go on). It tests what the vault does when a store call fails after the store's
own retries gave up: a save must fail cleanly with nothing committed.

:class:`FaultProxy` sits on 127.0.0.1 between an S3 client and a real server
and, per TCP connection, resets it, answers ``503 SlowDown``, stalls without
answering, or forwards it and (optionally) cuts it after a random number of
response bytes. It tests the S3 store's own retries (botocore's plus ours for
torn bodies) against real sockets.

Both draw from a seeded random generator, so a run can be repeated, and count
what they injected in ``counts``.
"""

from __future__ import annotations

import builtins
import random
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

from ..errors import RetryableStorageError, StorageError
from ..stores.base import ObjectInfo, Store

#: response bytes a scripted "cut-body" lets through: more than any S3 response head
CUT_BODY_AT = 4096
WRITE_METHODS = ("put", "put_if_absent", "delete", "touch")
READ_METHODS = ("get", "get_range", "exists", "stat", "list")


class FaultyStore(Store):
    """``inner`` with a share ``fail`` of calls raising ``error`` and a share ``stall`` sleeping ``stall_s`` first.

    ``methods`` limits the faults to those Store methods (default: all);
    ``keys`` to keys starting with one of those prefixes. ``enabled`` may be
    switched off and on while the store is in use. Thread-safe.
    """

    def __init__(self, inner: Store, *, fail: float = 0.0, stall: float = 0.0, stall_s: float = 0.2, seed: int = 0,
                 methods: tuple[str, ...] = WRITE_METHODS + READ_METHODS, keys: tuple[str, ...] = ("",),
                 error: type[StorageError] = RetryableStorageError) -> None:
        self.inner, self.fail, self.stall, self.stall_s = inner, fail, stall, stall_s
        self.methods, self.keys, self.error = set(methods), keys, error
        self.url, self.cheap_stat = inner.url, inner.cheap_stat  # saves probe it as they would probe ``inner``
        self.preferred_workers, self.preferred_chunk_size = inner.preferred_workers, inner.preferred_chunk_size
        self.enabled = True
        self.counts: Counter[str] = Counter()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def _maybe_fault(self, method: str, key: str) -> None:
        if not self.enabled or method not in self.methods or not key.startswith(self.keys):
            return
        with self._lock:
            roll = self._rng.random()
        if roll < self.fail:
            self.counts[f"fail:{method}"] += 1
            raise self.error(f"injected fault: {method}({key!r}) on {self.url}")
        if roll < self.fail + self.stall:
            self.counts[f"stall:{method}"] += 1
            time.sleep(self.stall_s)

    def get(self, key: str, max_size: int | None = None) -> bytes:
        self._maybe_fault("get", key)
        return self.inner.get(key, max_size)

    def get_range(self, key: str, start: int, length: int) -> bytes:
        self._maybe_fault("get_range", key)
        return self.inner.get_range(key, start, length)

    def put(self, key: str, data: bytes | memoryview) -> None:
        self._maybe_fault("put", key)
        self.inner.put(key, data)

    def put_if_absent(self, key: str, data: bytes | memoryview) -> bool:
        self._maybe_fault("put_if_absent", key)
        return self.inner.put_if_absent(key, data)

    def exists(self, key: str) -> bool:
        self._maybe_fault("exists", key)
        return self.inner.exists(key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        self._maybe_fault("list", prefix)
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self._maybe_fault("delete", key)
        self.inner.delete(key)

    def stat(self, key: str) -> ObjectInfo:
        self._maybe_fault("stat", key)
        return self.inner.stat(key)

    def touch(self, key: str) -> None:
        self._maybe_fault("touch", key)
        self.inner.touch(key)

    def temp_files(self) -> builtins.list[ObjectInfo]:  # builtins.: in the class body, ``list`` is the method above
        return self.inner.temp_files()

    def close(self) -> None:
        self.inner.close()


_SLOW_DOWN = (b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\nConnection: close\r\nContent-Length: %d\r\n\r\n")
_SLOW_DOWN_BODY = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
                   b"<Message>injected by FaultProxy</Message></Error>")


class FaultProxy:
    """A TCP proxy on 127.0.0.1 in front of ``upstream`` (host, port) that breaks a share of connections.

    Per accepted connection, one of: ``reset`` (read the request head, then
    close with RST), ``error`` (answer 503 SlowDown and close), ``stall``
    (read the request, answer nothing for ``stall_s``, close), or forward it;
    a forwarded connection is, with probability ``cut``, reset after a random
    number (< ``cut_within`` bytes) of response bytes. Use as a context manager
    or call :meth:`start` / :meth:`stop`. ``endpoint`` is the URL to give the client.
    """

    def __init__(self, upstream: tuple[str, int], *, reset: float = 0.0, error: float = 0.0, stall: float = 0.0,
                 cut: float = 0.0, stall_s: float = 3.0, cut_within: int = 1 << 20, seed: int = 0) -> None:
        self.upstream = upstream
        self.reset, self.error, self.stall, self.cut = reset, error, stall, cut
        self.stall_s, self.cut_within = stall_s, cut_within
        self.counts: Counter[str] = Counter()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._script: list[str] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._accept_loop, name="fault-proxy", daemon=True)

    def start(self) -> FaultProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            for sock in list(self._sockets):
                _close(sock)
        self._thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def then(self, *kinds: str) -> None:
        """Force the outcome of the next connections, in order: "reset", "error", "stall", "cut" (reset before the
        first response byte reaches the client, after the server acted on the request), "cut-body" (reset after
        ``CUT_BODY_AT`` response bytes: past the headers, inside a body) or "pass"."""
        for kind in kinds:
            if kind not in ("reset", "error", "stall", "cut", "cut-body", "pass"):
                raise ValueError(f"unknown fault {kind!r}")
        with self._lock:
            self._script.extend(kinds)

    def set_rates(self, **rates: float) -> None:
        """Change ``reset``/``error``/``stall``/``cut`` for connections accepted from now on."""
        with self._lock:
            for name, value in rates.items():
                if name not in ("reset", "error", "stall", "cut"):
                    raise ValueError(f"unknown fault rate {name!r}")
                setattr(self, name, value)

    # -- internals ------------------------------------------------------------------
    def _track(self, sock: socket.socket) -> socket.socket:
        with self._lock:
            self._sockets.add(sock)
        return sock

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(self._track(client),), daemon=True).start()

    def _choose(self) -> tuple[str, int]:
        with self._lock:
            if self._script:
                kind = self._script.pop(0)
                self.counts[kind] += 1
                return ("cut", CUT_BODY_AT) if kind == "cut-body" else (kind, 0)
            roll, cut_roll, cut_at = self._rng.random(), self._rng.random(), self._rng.randrange(max(1, self.cut_within))
            kinds = (("reset", self.reset), ("error", self.error), ("stall", self.stall))
            edge = 0.0
            for kind, share in kinds:
                edge += share
                if roll < edge:
                    self.counts[kind] += 1
                    return kind, 0
            if cut_roll < self.cut:
                self.counts["cut"] += 1
                return "cut", cut_at
            self.counts["pass"] += 1
            return "pass", 0

    def _serve(self, client: socket.socket) -> None:
        kind, cut_at = self._choose()
        try:
            if kind == "pass" or kind == "cut":
                self._pipe(client, cut_at if kind == "cut" else None)
                return
            head = _read_head(client)
            if kind == "error":
                _drain_body(client, head)  # so that closing does not reset the connection before the answer is read
            if kind == "reset":
                _reset(client)
            elif kind == "error":
                client.sendall(_SLOW_DOWN % len(_SLOW_DOWN_BODY) + _SLOW_DOWN_BODY)
            else:
                self._stop.wait(self.stall_s)
        except OSError:
            pass
        finally:
            _close(client)
            with self._lock:
                self._sockets.discard(client)

    def _pipe(self, client: socket.socket, cut_at: int | None) -> None:
        """Forward both directions until either side closes; with ``cut_at``, reset both after that many response bytes."""
        upstream = self._track(socket.create_connection(self.upstream, timeout=30))
        sent = 0
        try:
            upstream.settimeout(None)
            pump = threading.Thread(target=_copy, args=(client, upstream), daemon=True)
            pump.start()
            while True:
                data = upstream.recv(65536)
                if not data:
                    break
                if cut_at is not None and sent + len(data) > cut_at:
                    client.sendall(data[: cut_at - sent])
                    _reset(client)
                    _reset(upstream)
                    return
                client.sendall(data)
                sent += len(data)
        except OSError:
            pass
        finally:
            _close(upstream)
            with self._lock:
                self._sockets.discard(upstream)


def _copy(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _read_head(sock: socket.socket, limit: int = 65536) -> bytes:
    """Read until the end of the HTTP request head (or EOF, or ``limit`` bytes)."""
    sock.settimeout(10)
    head = b""
    while b"\r\n\r\n" not in head and len(head) < limit:
        data = sock.recv(4096)
        if not data:
            break
        head += data
    return head


def _drain_body(sock: socket.socket, head: bytes) -> None:
    """Read the rest of a request body of known Content-Length (unless the client waits for 100-continue)."""
    header, _, body = head.partition(b"\r\n\r\n")
    fields = dict(line.split(b":", 1) for line in header.split(b"\r\n")[1:] if b":" in line)
    fields = {k.strip().lower(): v.strip() for k, v in fields.items()}
    if fields.get(b"expect", b"").lower() == b"100-continue":
        return
    remaining = int(fields.get(b"content-length", b"0") or 0) - len(body)
    while remaining > 0:
        data = sock.recv(min(remaining, 65536))
        if not data:
            return
        remaining -= len(data)


def _reset(sock: socket.socket) -> None:
    """Close with a TCP RST (SO_LINGER 0) instead of an orderly FIN."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    _close(sock)


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass
