"""Fetch processes: source reads and cache writes outside the serving process.

A cold epoch in passthrough mode is mostly directory read-ahead: small files fetched whole
from the source and written to the NVMe tier, then handed to the kernel. In the serving
process every one of those system calls (open, fstat, read and close on the source; open,
write and close in the cache) gives up and takes back the interpreter lock, while the FUSE
threads want it too; on a 2-core machine a third of the daemon's CPU went to those
handovers (docs/design.md, "Fetch processes"). Here a few child processes do that work:
the daemon sends a path over a socket and gets back the file's attributes and the xxh3 of
what was written; it keeps every decision (single flight, admission, the index, the
stats), and the file becomes an entry only when the daemon adopts it.

Protocol, one request at a time per channel (a socket pair; a length-prefixed marshal
tuple each way): a `Fill` request gets a `Filled` reply, whose `kind` says what happened:

    STORED     written to the entry's file (created, O_EXCL); `hash` its xxh3. `shared`:
               its bytes came from the shared tier (`attr` None: the file was not visited).
               `in_ram`: written to the RAM tier's entry file too, as the request asked
               (`ram`: the daemon holds the room), so that RAM takes it at once
    EXISTS     that file already exists: someone else has it
    LARGE      larger than the request's `limit`: nothing read
    CHANGED    not the expected version, or changed while read
    ERROR      the source refused (`errno`, `message`)
    UNSTORED   read, but the cache write failed (`errno`, `message`)

A batch of Fills gets a `FilledBatch`: with a shared tier (--shared-cache) the worker asks
it for every expected file in one request per server, reads the rest from the source,
stores those in the shared tier in one request per server, and `counts` are the shared.*
counters it added, for the daemon's stats. The entry files are written with the store's
own layout and write loop (cachefs/tiers/layout.py).

A worker runs one thread per channel; it exits when the daemon closes its end (or dies:
PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import argparse
import errno
import logging
import marshal
import os
import queue
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

from cachefs.blocks import entry_id
from cachefs.config import BATCH_THREADS
from cachefs.errors import NotSent, SourceChanged
from cachefs.fuse.children import child_env, die_with_parent
from cachefs.identity import Attr, FileId
from cachefs.source import open_source
from cachefs.stats import Stats
from cachefs.tiers.layout import block_hash, create_exclusive, entry_file, write_all

log = logging.getLogger(__name__)

_LEN = struct.Struct("<I")

STORED, EXISTS, LARGE, CHANGED, ERROR, UNSTORED = "stored", "exists", "large", "changed", "error", "unstored"
# Kinds the daemon makes itself: a fill done in its own threads (READ, with the bytes), or
# found in its own shared tier (SHARED).
READ, SHARED = "read", "shared"
_MANY = "many"


class Fill(NamedTuple):
    """A request: fetch the small file `path` whole, if it is at most `limit` bytes and
    (when `expect` is given) still that version; with `ram`, write a RAM copy too."""

    path: str
    limit: int
    expect: FileId | None = None
    ram: bool = False

    def wire(self) -> tuple[Any, ...]:
        return self.path, self.limit, None if self.expect is None else tuple(self.expect[1:]), self.ram

    @classmethod
    def from_wire(cls, t: tuple[Any, ...]) -> Fill:
        path, limit, expect, ram = t
        return cls(path, limit, FileId(path, *expect) if expect is not None else None, ram)


class Filled(NamedTuple):
    """A reply (see the module's protocol). `data`: the bytes, only for the daemon's own
    READ and SHARED; never sent."""

    kind: str
    attr: Attr | None = None
    hash: int = 0
    errno: int = 0
    message: str = ""
    shared: bool = False
    data: bytes | None = None
    in_ram: bool = False

    def wire(self) -> tuple[Any, ...]:
        return (self.kind, None if self.attr is None else tuple(self.attr), self.hash, self.errno,
                self.message, self.shared, self.in_ram)

    @classmethod
    def from_wire(cls, t: tuple[Any, ...]) -> Filled:
        kind, attr, h, code, message, shared, in_ram = t
        return cls(kind, None if attr is None else Attr(*attr), h, code, message, shared, None, in_ram)

    @classmethod
    def failed(cls, kind: str, exc: OSError) -> Filled:
        return cls(kind, errno=exc.errno or errno.EIO, message=exc.strerror or str(exc))


class FilledBatch(NamedTuple):
    replies: list[Filled]
    counts: dict[str, int]  # the shared.* counters the worker added
    servers: dict[str, tuple[int, int]]  # hits and misses it added, per shared-tier server


def _send(sock: socket.socket, obj: tuple) -> None:  # type: ignore[type-arg]
    data = marshal.dumps(obj)
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _recv(sock: socket.socket) -> object:
    """One message; replies and requests are small, so one recv() nearly always has it."""
    head = sock.recv(4096)
    if len(head) < _LEN.size:
        if not head:
            raise EOFError
        head += _recv_exact(sock, _LEN.size - len(head))
    (n,) = _LEN.unpack_from(head)
    body = head[_LEN.size:]
    if len(body) < n:
        body += _recv_exact(sock, n - len(body))
    return marshal.loads(body)


# -- the worker ----------------------------------------------------------------------------

class _Worker:
    def __init__(self, root: str, data_dir: str, namespace: bytes, block_size: int, root_fd: int = -1,
                 shared: str | None = None, shared_namespace: str | None = None, ram_dir: str | None = None):
        self.source = open_source(root, root_fd)
        self.data_dir = data_dir
        self.ram_dir = ram_dir
        self.namespace = namespace
        self.block_size = block_size
        self.stats = Stats()
        self._pool = ThreadPoolExecutor(BATCH_THREADS, thread_name_prefix="cachefs-fetch")
        self.shared = None
        if shared:
            from cachefs.tiers.build import shared_tier

            self.shared = shared_tier(shared, shared_namespace or "", block_size, self.stats)
            self.shared.check()

    def fill(self, request: Fill) -> Filled:
        return self._fill(request)[0]

    def _fill(self, request: Fill) -> tuple[Filled, bytes | None]:
        """(reply, the bytes read or None)."""
        path = request.path
        try:
            attr, data = self.source.read_whole(path, request.limit, request.expect)
        except SourceChanged:
            return Filled(CHANGED), None
        except OSError as exc:
            return Filled.failed(ERROR, exc), None
        if data is None:
            return Filled(LARGE, attr), None
        return self._write(FileId.of(path, attr), data, attr, request.ram), data

    def fill_many(self, requests: list[Fill]) -> FilledBatch:
        """A batch: from the shared tier what it has, the rest from the source (then
        shared); see the module's protocol."""
        before = self.stats.thread_counts()
        servers_before = self.shared.server_counts(this_thread=True) if self.shared is not None else {}
        replies: list[Filled | None] = [None] * len(requests)
        if self.shared is not None:
            wanted = [(i, r.expect) for i, r in enumerate(requests)
                      if r.expect is not None and 0 < r.expect.size <= r.limit]
            found = self.shared.get_many([(fid, 0, fid.size) for _, fid in wanted])
            for (i, fid), data in zip(wanted, found, strict=True):
                if data is not None:
                    replies[i] = self._write(fid, data, None, requests[i].ram)
        to_share = []
        todo = [i for i in range(len(requests)) if replies[i] is None]
        # the rest from the source, in parallel: a batch waits for one source visit, not one each
        results = self._pool.map(lambda i: self._fill(requests[i]), todo) if len(todo) > 1 else \
            [self._fill(requests[i]) for i in todo]
        for i, (reply, data) in zip(todo, results, strict=True):
            replies[i] = reply
            if self.shared is not None and data is not None and reply.kind in (STORED, EXISTS):
                assert reply.attr is not None
                to_share.append((FileId.of(requests[i].path, reply.attr), 0, data))
        if to_share:
            assert self.shared is not None
            self.shared.store_many(to_share)
        after = self.stats.thread_counts()
        counts = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
        servers = {}
        if self.shared is not None:
            for name, (hits, misses) in self.shared.server_counts(this_thread=True).items():
                h0, m0 = servers_before.get(name, (0, 0))
                if (hits, misses) != (h0, m0):
                    servers[name] = (hits - h0, misses - m0)
        return FilledBatch([r for r in replies if r is not None], counts, servers)

    def _write(self, fid: FileId, data: bytes, attr: Attr | None, ram: bool = False) -> Filled:
        """Write a file version's bytes to its entry's file, and with `ram` to the RAM
        tier's too; the reply for it (`attr` None: the bytes came from the shared tier)."""
        name = _entry_id(self.namespace, fid, self.block_size).hex()
        try:
            if not _write_new(entry_file(self.data_dir, name), data):
                return Filled(EXISTS, attr, shared=attr is None)
        except OSError as exc:
            return Filled.failed(UNSTORED, exc)._replace(attr=attr, shared=attr is None)
        in_ram = False
        if ram and self.ram_dir is not None:
            try:  # (not there: a read's fill or a promotion is writing it; RAM's room is the daemon's)
                in_ram = _write_new(entry_file(self.ram_dir, name), data)
            except OSError:
                pass
        return Filled(STORED, attr, block_hash(data), shared=attr is None, in_ram=in_ram)

    def serve(self, sock: socket.socket) -> None:
        while True:
            try:
                request = _recv(sock)
            except (EOFError, OSError):
                return
            reply: tuple[Any, ...]
            try:
                assert isinstance(request, tuple)
                if request[0] == _MANY:
                    batch = self.fill_many([Fill.from_wire(r) for r in request[1]])
                    reply = (_MANY, [r.wire() for r in batch.replies], batch.counts, batch.servers)
                else:
                    reply = self.fill(Fill.from_wire(request)).wire()
            except Exception as exc:  # never leave the daemon waiting
                reply = Filled(ERROR, errno=errno.EIO, message=f"fetch process: {exc!r}").wire()
            try:
                _send(sock, reply)
            except OSError:
                return


# The ids without the daemon's memo (cachefs.blocks.entry_id): a fetch process computes
# each file's id once, and the memo (of 65,536 then) had held 40 MB at 200,000 files
# (its keys' ids, paths and attributes), never hit.
_entry_id = entry_id.__wrapped__


def _write_new(dest: str, data: bytes) -> bool:
    """Create the entry file `dest` with `data`: False if it exists (someone else's);
    OSError, with nothing left behind, if it cannot be written."""
    try:
        fd = create_exclusive(dest)
    except FileExistsError:
        return False
    try:
        write_all(fd, data)
    except OSError:
        os.close(fd)
        try:
            os.unlink(dest)
        except OSError:
            pass
        raise
    os.close(fd)
    return True


def worker_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cachefs.fetcher")
    p.add_argument("--root", required=True)
    p.add_argument("--root-fd", type=int, default=-1, help="the daemon's descriptor of the root")
    p.add_argument("--data", required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--block-size", type=int, required=True)
    p.add_argument("--fds", required=True, help="comma-separated channel descriptors")
    p.add_argument("--shared", help="the shared tier's servers (memcached://...)")
    p.add_argument("--shared-namespace", default="")
    p.add_argument("--ram-data", help="the RAM tier's data directory (fills asked to write a RAM copy)")
    p.add_argument("--parent", type=int, required=True, help="the daemon's pid")
    args = p.parse_args(argv)
    die_with_parent()
    if os.getppid() != args.parent:
        return 0  # the daemon is already gone (pid 1 is no sign of it: a daemon may be pid 1, in a container)
    worker = _Worker(args.root, args.data, args.namespace.encode(), args.block_size, args.root_fd,
                     args.shared, args.shared_namespace, args.ram_data)
    threads = []
    for fd in (int(x) for x in args.fds.split(",")):
        sock = socket.socket(fileno=fd)
        t = threading.Thread(target=worker.serve, args=(sock,), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return 0


# -- the daemon's side ---------------------------------------------------------------------

class FetchUnavailable(Exception):
    """No fetch process can take this request (they died, or the pool is shut): the caller
    does the work itself."""


class NoFetchProcess(FetchUnavailable, NotSent):
    """FetchUnavailable before the request was sent (none left, or the pool is shut): the
    source was not asked. (One whose process died with the request may have asked it.)"""


class Fetchers:
    """A pool of channels to `processes` worker processes. fill() may be called from any
    thread; it holds a channel for one request. Each process has a thread of the daemon's
    waiting for it (blocked in wait(): no CPU): a process that dies is reaped at once, never
    left a zombie, and started again (at most once per RESTART_EVERY seconds per process,
    so that one that cannot start does not spin); its channels are replaced."""

    RESTART_EVERY = 10.0

    def __init__(self, root: str, data_dir: str, namespace: bytes, block_size: int, processes: int,
                 channels: int, root_fd: int = -1, shared: str | None = None, shared_namespace: str = "",
                 ram_dir: str | None = None):
        self.shared = bool(shared)  # the workers ask the shared tier themselves (fill_many)
        self.ram = ram_dir is not None  # the workers can write RAM copies (Fill.ram)
        self.processes: list[subprocess.Popen[bytes]] = []
        self._free: queue.SimpleQueue[socket.socket] = queue.SimpleQueue()
        self._all: list[socket.socket] = []
        self._closed = False
        self._lock = threading.Lock()
        self._timeouts: dict[int, float | None] = {}
        self.restarts = 0
        self._restarting = 0  # processes that ended and are to be started again
        # told of each reply that came after its caller stopped waiting (its timeout): the
        # request and the reply (a batch's, one call per file)
        self.on_late: Callable[[Fill, Filled], None] | None = None
        self._per = max(1, -(-channels // processes))
        self._cmd = [sys.executable, "-m", "cachefs.fetcher", "--root", root, "--data", data_dir,
                     "--namespace", namespace.decode(), "--block-size", str(block_size), "--root-fd", str(root_fd),
                     "--parent", str(os.getpid())]
        if shared:
            self._cmd += ["--shared", shared, "--shared-namespace", shared_namespace]
        if ram_dir is not None:
            self._cmd += ["--ram-data", ram_dir]
        self._root_fd = root_fd
        for slot in range(processes):
            self.processes.append(self._spawn())
            threading.Thread(target=self._watch, args=(slot,), name=f"cachefs-fetcher-watch-{slot}",
                             daemon=True).start()

    def _spawn(self) -> subprocess.Popen[bytes]:
        ours, theirs = [], []
        for _ in range(self._per):
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            ours.append(a)
            theirs.append(b)
        cmd = [*self._cmd, "--fds", ",".join(str(s.fileno()) for s in theirs)]
        try:
            inherit = [s.fileno() for s in theirs] + ([self._root_fd] if self._root_fd >= 0 else [])
            proc = subprocess.Popen(cmd, pass_fds=inherit, stdin=subprocess.DEVNULL, env=child_env())
        except BaseException:
            for s in ours:
                s.close()
            raise
        finally:
            for s in theirs:
                s.close()
        with self._lock:
            self._all.extend(ours)
        for s in ours:
            self._free.put(s)
        return proc

    def _watch(self, slot: int) -> None:
        """Reap the slot's process when it ends, and start another unless closing."""
        while True:
            proc = self.processes[slot]
            started = time.monotonic()
            code = proc.wait()  # reaps it: no zombie
            if self._closed:
                return
            log.warning("fetch process %d ended (exit status %s); starting another", proc.pid, code)
            # its channels fail (EOF) when next used and are set aside then (_lose)
            with self._lock:
                self._restarting += 1
            try:
                time.sleep(max(0.0, self.RESTART_EVERY - (time.monotonic() - started)))
                if self._closed:
                    return
                self.processes[slot] = self._spawn()
            except OSError as exc:
                log.warning("a fetch process could not be started (%s); the daemon fetches its share itself",
                            exc.strerror or exc)
                return
            finally:
                with self._lock:
                    self._restarting -= 1
            with self._lock:
                self.restarts += 1

    @property
    def channels(self) -> int:
        """Channels that serve, or will once a process that ended has been started again."""
        return len(self._all) + self._restarting * self._per

    def fill(self, path: str, limit: int, expect: FileId | None, timeout: float | None, ram: bool = False) -> Filled:
        """One request (see the module's protocol). Raises OSError(ETIMEDOUT) after
        `timeout` (the channel is set aside until its late reply arrives), and
        FetchUnavailable when no process can answer."""
        return Filled.from_wire(self._call(Fill(path, limit, expect, ram).wire(), timeout, path))

    def fill_for_reader(self, path: str, limit: int, expect: FileId, timeout: float | None,
                        ram: bool = False) -> Filled:
        """fill() for a reader waiting on it: the source's error raised as the OSError it
        was (SourceChanged for a file that is no longer `expect`), for the source guard to
        account as a reader's request."""
        reply = self.fill(path, limit, expect, timeout, ram)
        if reply.kind == CHANGED:
            raise SourceChanged(path)
        if reply.kind == ERROR:
            code = reply.errno or errno.EIO
            raise OSError(code, reply.message or os.strerror(code), path)
        return reply

    @property
    def idle(self) -> bool:
        """Whether a channel is free now (one that is not may free up, or be a hung file's)."""
        return not self._free.empty()

    def fill_many(self, requests: list[Fill], timeout: float | None) -> FilledBatch:
        """A batch of requests on one channel."""
        reply = self._call((_MANY, [r.wire() for r in requests]), timeout, requests[0].path if requests else "")
        if reply[0] != _MANY:  # the worker failed as a whole: every file failed
            failed = Filled.from_wire(reply)
            return FilledBatch([failed] * len(requests), {}, {})
        return FilledBatch([Filled.from_wire(r) for r in reply[1]], reply[2], reply[3])

    def _call(self, message: tuple, timeout: float | None, subject: str) -> tuple:  # type: ignore[type-arg]
        """One request and its reply, within `timeout` in all: the wait for a free channel,
        the request sent, the reply received (a caller relies on it: SourceGuard's
        `bounded`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:  # a free channel; none at all while a process that ended is started again
            if self._closed or not self._all:
                raise NoFetchProcess
            wait = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            try:
                if wait <= 0:
                    raise OSError(errno.ETIMEDOUT, "source did not answer in time (every fetch channel busy)",
                                  subject)
                sock = self._free.get(timeout=wait)
                break
            except queue.Empty:
                continue
        limit = timeout
        if deadline is not None and timeout is not None:
            left = deadline - time.monotonic()
            if left < 0.9 * timeout:
                limit = max(0.001, left)  # the wait for a channel took its share of the timeout
        try:
            if limit != self._timeouts.get(sock.fileno()):
                _set_timeout(sock, limit)
                self._timeouts[sock.fileno()] = limit
            _send(sock, message)
            reply = _recv(sock)
        except BlockingIOError:  # SO_RCVTIMEO ran out
            threading.Thread(target=self._drain, args=(sock, message), daemon=True).start()
            raise OSError(errno.ETIMEDOUT, "source did not answer in time (fetch process)", subject) from None
        except (EOFError, OSError):
            self._lose(sock)
            raise FetchUnavailable from None
        self._free.put(sock)
        return reply  # type: ignore[return-value]

    def _drain(self, sock: socket.socket, message: tuple) -> None:  # type: ignore[type-arg]
        """A late reply to `message`: read it, the channel serves again, and on_late is
        told of it (a fill's files are written, and nobody adopted them)."""
        try:
            _set_timeout(sock, None)
            self._timeouts[sock.fileno()] = None
            reply = _recv(sock)
        except (EOFError, OSError):
            self._lose(sock)
            return
        self._free.put(sock)
        late = self.on_late
        if late is None or not isinstance(reply, tuple) or not reply:
            return
        try:
            if message[0] == _MANY:
                if reply[0] == _MANY:
                    for request, filled in zip(message[1], reply[1], strict=True):
                        late(Fill.from_wire(request), Filled.from_wire(filled))
            else:
                late(Fill.from_wire(message), Filled.from_wire(reply))
        except Exception:  # (a late reply's bookkeeping; the channel is back already)
            log.exception("a late reply of a fetch process could not be taken")

    def _lose(self, sock: socket.socket) -> None:
        with self._lock:
            if sock in self._all:
                self._all.remove(sock)
        try:
            self._timeouts.pop(sock.fileno(), None)  # a new channel may get the same number
        except OSError:
            pass
        try:
            sock.close()
        except OSError:
            pass

    def close(self, timeout: float = 5.0) -> None:
        self._closed = True
        with self._lock:
            channels = list(self._all)
        for s in channels:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        for proc in self.processes:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _set_timeout(sock: socket.socket, seconds: float | None) -> None:
    """A timeout kept by the kernel (SO_RCVTIMEO, SO_SNDTIMEO), not by Python: a Python
    socket timeout costs a poll() before every send and recv."""
    usec = 0 if not seconds else max(1, int(seconds * 1e6))
    tv = struct.pack("ll", usec // 1_000_000, usec % 1_000_000)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)



if __name__ == "__main__":
    sys.exit(worker_main())
