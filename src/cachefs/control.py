"""The control channel of a mount: a Unix socket for requests that need more than a read.

Stats stay an extended attribute of the mount root (user.cachefs.stats), readable with
getfattr. Commands that stream (`cachefs warm`'s progress) or carry data go over a socket
in the abstract namespace: nothing on disk to clean up after a crash, and its name is
published in user.cachefs.info, so a client finds it from the mount point alone. The
daemon serves only its own user and root (SO_PEERCRED).

Protocol: the client sends one JSON object on one line and reads JSON lines back until
one has "final": true (or "error"). A streaming request (order hints) keeps sending lines
after the first; the connection's end is the end of the request.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

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
    def __init__(self, address: str, handlers: dict[str, Handler], owner: int | None = None,
                 streams: dict[str, StreamHandler] | None = None):
        self.address = address
        self.handlers = handlers
        self.streams = streams or {}
        self.owner = os.getuid() if owner is None else owner
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.address)
        sock.listen(16)
        self._sock = sock
        self._thread = threading.Thread(target=self._accept_loop, args=(sock,), name="cachefs-control", daemon=True)
        self._thread.start()

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

    def _accept_loop(self, sock: socket.socket) -> None:
        while self._sock is sock:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            _pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            reader = conn.makefile("rb")

            def send(obj: dict) -> None:
                conn.sendall(json.dumps(obj).encode() + b"\n")

            try:
                # Read the request before answering, even a refusal: closing a socket with
                # unread data resets it, and the client then sees a broken pipe instead of
                # the reason.
                line = reader.readline(1 << 20)
                if uid not in (self.owner, 0):
                    send({"error": "permission denied: this mount belongs to another user", "final": True})
                    return
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
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client went away (Ctrl-C); its handler saw that as a failed send
            except (ValueError, KeyError, TypeError) as exc:
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
