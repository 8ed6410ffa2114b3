"""The control channel of a mount: a Unix socket for requests that need more than a read.

Stats stay an extended attribute of the mount root (user.cachefs.stats), readable with
getfattr. Commands that stream (`cachefs warm`'s progress) or carry data go over a socket
in the abstract namespace: nothing on disk to clean up after a crash, and its name is
published in user.cachefs.info, so a client finds it from the mount point alone. The
daemon serves only its own user and root (SO_PEERCRED), and bounds what any connection
costs (see ControlServer).

Protocol: the client sends one JSON object on one line and reads JSON lines back until
one has "final": true (or "error"). A streaming request (order hints) keeps sending lines
after the first; the connection's end is the end of the request.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from cachefs.config import (
    ACCEPT_RETRY,
    MAX_CONNECTIONS,
    REFUSAL_READ,
    REFUSAL_TIMEOUT,
    REFUSALS_QUEUED,
    REQUEST_MAX,
    REQUEST_TIMEOUT,
)

log = logging.getLogger(__name__)

Handler = Callable[[dict, Callable[[dict], None]], dict]
# A streaming handler also reads the client's further lines: receive() -> dict, None at EOF.
StreamHandler = Callable[[dict, Callable[[dict], None], Callable[[], "dict | None"]], dict]


def address_for(mountpoint: str) -> str:
    """An abstract-namespace socket name (leading NUL), unique per mount and daemon."""
    import xxhash

    digest = xxhash.xxh64_hexdigest(mountpoint.encode("utf-8", "surrogateescape"))
    return f"\0cachefs-{os.getuid()}-{digest}-{os.getpid()}"




class ControlServer:
    """Serves the control socket. Whoever connects is checked (SO_PEERCRED) in the accept
    thread, before anything is spent on them: another user's connection gets no thread and
    no unbounded read (one refusal thread answers them, a bounded queue of them at a time,
    each within REFUSAL_TIMEOUT and REFUSAL_READ; past the queue they are closed at once).
    The owner's connections get a thread each, MAX_CONNECTIONS at most, and REQUEST_TIMEOUT
    to send a request line of at most REQUEST_MAX bytes. A failing accept() (out of
    descriptors) is logged and retried: the channel never dies while the mount lives."""

    def __init__(self, address: str, handlers: dict[str, Handler], owner: int | None = None,
                 streams: dict[str, StreamHandler] | None = None, max_connections: int = MAX_CONNECTIONS,
                 request_timeout: float = REQUEST_TIMEOUT):
        self.address = address
        self.handlers = handlers
        self.streams = streams or {}
        self.owner = os.getuid() if owner is None else owner
        self.max_connections = max_connections
        self.request_timeout = request_timeout
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._serving = 0
        self._lock = threading.Lock()
        self._refusals: queue.Queue[socket.socket | None] = queue.Queue(REFUSALS_QUEUED)
        self._accept_warned = 0.0

    def start(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.address)
        sock.listen(64)
        self._sock = sock
        self._thread = threading.Thread(target=self._accept_loop, args=(sock,), name="cachefs-control", daemon=True)
        self._thread.start()
        threading.Thread(target=self._refuse_loop, name="cachefs-control-refuse", daemon=True).start()

    def close(self) -> None:
        """Stop listening and free the name before returning. An accept() blocked in the
        other thread holds the socket open in the kernel until shutdown() wakes it, so the
        name stays taken until that thread has left accept(): join it first."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        sock.close()
        try:
            self._refusals.put_nowait(None)
        except queue.Full:
            pass

    @property
    def serving(self) -> int:
        """The owner's connections being served now."""
        return self._serving

    def _accept_loop(self, sock: socket.socket) -> None:
        while self._sock is sock:
            try:
                conn, _ = sock.accept()
            except OSError as exc:
                if self._sock is not sock:
                    return  # closed
                now = time.monotonic()
                if now - self._accept_warned > 60:
                    self._accept_warned = now
                    log.warning("control socket: accept failed (%s); retrying", exc.strerror or exc)
                time.sleep(ACCEPT_RETRY)
                continue
            try:
                _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            except OSError:
                conn.close()
                continue
            if uid not in (self.owner, 0):
                try:
                    self._refusals.put_nowait(conn)
                except queue.Full:
                    conn.close()
                continue
            with self._lock:
                busy = self._serving >= self.max_connections
                if not busy:
                    self._serving += 1
            if busy:
                self._refuse(conn, f"busy: {self.max_connections} control requests are in progress; try again")
                continue
            try:
                threading.Thread(target=self._serve, args=(conn,), name="cachefs-control-request", daemon=True).start()
            except RuntimeError:  # no thread to be had
                with self._lock:
                    self._serving -= 1
                conn.close()

    def _refuse_loop(self) -> None:
        while self._sock is not None:
            try:
                conn = self._refusals.get(timeout=1.0)
            except queue.Empty:
                continue
            if conn is None:
                break
            self._refuse(conn, "permission denied: this mount belongs to another user")
        while True:  # closed: what is still queued is closed unanswered
            try:
                left = self._refusals.get_nowait()
            except queue.Empty:
                return
            if left is not None:
                left.close()

    def _refuse(self, conn: socket.socket, reason: str) -> None:
        """Answer `reason` and close, after reading (within the bounds) what the client sent:
        closing a socket with unread data resets it, and the client would see a broken pipe
        instead of the reason."""
        with conn:
            try:
                deadline = time.monotonic() + REFUSAL_TIMEOUT  # for the whole connection, not per recv
                got = b""
                while b"\n" not in got and len(got) < REFUSAL_READ:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    conn.settimeout(left)
                    chunk = conn.recv(REFUSAL_READ - len(got))
                    if not chunk:
                        break
                    got += chunk
                conn.sendall(json.dumps({"error": reason, "final": True}).encode() + b"\n")
            except OSError:
                pass

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                self._answer(conn)
        finally:
            with self._lock:
                self._serving -= 1

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(self.request_timeout)
        reader = conn.makefile("rb")

        def send(obj: dict) -> None:
            conn.sendall(json.dumps(obj).encode() + b"\n")

        try:
            line = reader.readline(REQUEST_MAX)
            if not line.endswith(b"\n"):
                send({"error": f"bad request: no complete line within {REQUEST_MAX} bytes", "final": True})
                return
            conn.settimeout(None)  # the owner's own client: a stream may stay open for an epoch
            request = json.loads(line)
            op = request.get("op")
            if op in self.streams:
                def receive() -> dict | None:
                    more = reader.readline(1 << 24)
                    return json.loads(more) if more else None

                reply = self.streams[op](request, send, receive)
            else:
                handler = self.handlers.get(op)
                if handler is None:
                    send({"error": f"unknown request {op!r}", "final": True})
                    return
                reply = handler(request, send)
            send(dict(reply, final=True))
        except TimeoutError:
            pass  # no request within the timeout: closed
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away (Ctrl-C); its handler saw that as a failed send
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            try:
                send({"error": f"bad request: {exc}", "final": True})
            except OSError:
                pass
        except Exception as exc:  # never let one request kill the control thread
            log.warning("control request failed: %s", exc)
            try:
                send({"error": str(exc), "final": True})
            except OSError:
                pass


def request(address: str, obj: dict[str, Any], timeout: float | None = None) -> Iterator[dict]:
    """Send one request and yield the reply lines, the last one marked "final"."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    if timeout is not None:
        sock.settimeout(timeout)
    with sock:
        sock.connect(address)
        sock.sendall(json.dumps(obj).encode() + b"\n")
        reader = sock.makefile("rb")
        for line in reader:
            reply = json.loads(line)
            yield reply
            if reply.get("final") or "error" in reply:
                return


def follow(job_progress: Callable[[], dict], is_done: Callable[[], bool], send: Callable[[dict], None],
           interval: float = 0.5) -> None:
    """Stream a job's progress to a client until it is done; a failed send raises."""
    while not is_done():
        send(job_progress())
        deadline = time.monotonic() + interval
        while time.monotonic() < deadline and not is_done():
            time.sleep(0.02)
