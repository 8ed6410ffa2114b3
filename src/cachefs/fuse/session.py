"""A FUSE session: the INIT negotiation, the request loop in several threads, replies,
notifications and passthrough backing files. It speaks the kernel protocol on a /dev/fuse
descriptor (or anything that delivers one message per read, as the tests' fake kernel
does) and knows nothing of caching: a file system is an `Operations` object.

Every request is parsed defensively: a short, malformed or unknown request gets an errno
reply (never a dead daemon), and an exception in a handler becomes EIO. Replies to
requests the kernel has given up on (interrupted, or the file system unmounted) fail with
ENOENT on write, which is expected and ignored.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import select
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

from cachefs.fuse import protocol as p
from cachefs.fuse.children import child_env
from cachefs.fuse.ops import (
    Buffer,
    Connection,
    DirHandle,
    FuseError,
    Handlers,
    Operations,
    Request,
)
from cachefs.fuse.serve import PREFIX_SIZE, REPORT, SEND_BUFFER, WAKE
from cachefs.fuse.servetable import ANSWERED, PENDING, REPORTS, ServeTable, TableNodes

log = logging.getLogger(__name__)

# Requests no reply is sent for.
_NO_REPLY = frozenset({p.FORGET, p.BATCH_FORGET, p.INTERRUPT})

# A reply of this many parts or more is joined into one buffer before it is written:
# writev takes at most IOV_MAX (1,024) vectors, and joining a few hundred small records
# costs less than passing them one by one.
MAX_REPLY_PARTS = 16


SERVE_MAIN = "from cachefs.fuse.serve import main; raise SystemExit(main())"  # a serving process


class Session(Handlers):
    """Serves one mounted FUSE connection until it is unmounted.

    Threads: `readers` of them read and answer requests. CPython runs one thread at a time,
    and more threads answering quick requests only fight over it: measured on 2,000 cached
    files with 8 reader processes, 1 thread cost 0.08 ms of CPU per file, 4 threads 0.15,
    8 threads 0.2. But a request that waits on a slow source must not stop the others, so
    a handler that is about to block says so (`with session.blocking():`) and another
    thread takes its place as a reader, up to `max_threads`; threads that come back from
    blocking park until a reader is needed again.
    """

    def __init__(self, fd: int, ops: Operations, *, readers: int = 2, max_threads: int = 64,
                 max_read: int = 1 << 20, max_background: int = 64,
                 observer: Callable[[str, float, int], None] | None = None, clone: bool = True,
                 on_reply_failed: Callable[[str, int], None] | None = None):
        self.fd = fd
        self.ops = ops
        self.readers = max(1, readers)
        self.max_threads = max(self.readers, max_threads)
        self.max_read = max_read
        self.max_write = 128 << 10   # read-only: only the kernel's minimum read buffer depends on it
        self.max_background = max_background
        self.observer = observer
        # Called with (operation, errno) when the kernel refused a reply: the caller then
        # got an error although the file system answered. Counted and logged by the owner.
        self.on_reply_failed = on_reply_failed
        self.reply_failures = 0
        self.busy_refusals = 0  # waits refused because max_threads were waiting (see blocking)
        self.trace = False  # log every request, its caller and its outcome (--debug-fuse)
        self.conn = Connection(max_read=max_read)
        self._clone = clone
        self._dirs: dict[int, DirHandle] = {}   # readdir snapshots per directory handle
        self._dirs_lock = threading.Lock()
        self._next_dir_fh = 1
        self._workers: list[threading.Thread] = []
        self._fds: list[int] = []
        self._stopped = threading.Event()
        self._cond = threading.Condition()
        self._active = 0    # threads reading or answering a request without blocking
        self._parked = 0    # threads waiting for a reader's place
        self._local = threading.local()
        self.initialized = threading.Event()
        self.destroyed = False
        self._handlers = self.handler_table()
        self._bufsize = max(8192, p.IN_HEADER.size + 80 + self.max_write, 256 << 10)
        # Serving processes (start_servers): their descriptors (our copies, for replies to
        # what they forward), the socket they forward on, and whether each is alive.
        self.table: ServeTable | None = None
        self.servers: list[subprocess.Popen[bytes]] = []
        self.servers_alive: list[bool] = []
        self._server_fds: list[int] = []
        self.reports_done: list[int] = []  # per serving process: its reports counted
        self._answered: list[int] = []  # per serving process: its forwarded requests answered
        self._answer_lock = threading.Lock()
        self._forwarding = False
        self._rx: socket.socket | None = None
        self._tx: socket.socket | None = None

    # -- life cycle --------------------------------------------------------------------------

    def negotiate(self) -> None:
        """Read and answer the kernel's INIT (the first request), then call ops.init()."""
        buf = bytearray(self._bufsize)
        while True:
            n = self._read_request(self.fd, buf)
            if n is None:
                raise OSError(errno.ENODEV, "the file system was unmounted before INIT")
            if n < p.IN_HEADER.size:
                continue
            length, opcode, unique, *_ = p.IN_HEADER.unpack_from(buf)
            if opcode != p.INIT:
                self._reply_error(self.fd, unique, errno.EIO)  # nothing is valid before INIT
                continue
            if self._init(unique, memoryview(buf)[p.IN_HEADER.size:min(n, length)]):
                break
        self.initialized.set()

    def _init(self, unique: int, payload: memoryview) -> bool:
        if len(payload) < p.INIT_IN.size:
            self._reply_error(self.fd, unique, errno.EINVAL)
            return False
        major, minor, max_readahead, flags = p.INIT_IN.unpack_from(payload)
        if major > p.KERNEL_VERSION:  # ask for a new INIT in our major version
            self._reply(self.fd, unique, [p.INIT_OUT.pack(p.KERNEL_VERSION, p.KERNEL_MINOR, *([0] * 11))[:8]])
            return False
        if major < p.KERNEL_VERSION or minor < p.MIN_MINOR:
            log.error("the kernel speaks FUSE %d.%d; cachefs needs 7.%d or newer", major, minor, p.MIN_MINOR)
            self._reply_error(self.fd, unique, errno.EPROTO)
            raise OSError(errno.EPROTO, f"kernel FUSE protocol {major}.{minor} is too old (need 7.{p.MIN_MINOR})")
        kernel = flags
        if flags & p.INIT_EXT and len(payload) >= p.INIT_IN.size + 4:
            kernel |= p.INIT_IN_FLAGS2.unpack_from(payload, p.INIT_IN.size)[0] << 32
        want = (p.ASYNC_READ | p.AUTO_INVAL_DATA | p.PARALLEL_DIROPS | p.MAX_PAGES | p.CACHE_SYMLINKS
                | p.ABORT_ERROR | p.INIT_EXT | p.NO_EXPORT_SUPPORT | p.BIG_WRITES)
        if self.ops.want_readdirplus:
            want |= p.DO_READDIRPLUS | p.READDIRPLUS_AUTO
        if self.ops.want_no_open:
            want |= p.NO_OPEN_SUPPORT
        if self.ops.want_passthrough:
            want |= p.PASSTHROUGH
        granted = want & kernel
        conn = self.conn
        conn.minor = min(minor, p.KERNEL_MINOR)
        conn.kernel_flags, conn.flags = kernel, granted
        conn.max_readahead = min(max_readahead, self.max_read)
        conn.passthrough = bool(granted & p.PASSTHROUGH)
        conn.no_open = bool(granted & p.NO_OPEN_SUPPORT)
        max_pages = max(1, self.max_read // 4096)
        out = p.INIT_OUT.pack(p.KERNEL_VERSION, conn.minor, conn.max_readahead, granted & 0xFFFFFFFF,
                              self.max_background, self.max_background * 3 // 4, self.max_write, 1,
                              max_pages, 0, granted >> 32, 1 if conn.passthrough else 0, 0)
        self.ops.init(conn, self)
        self._reply(self.fd, unique, [out], p.INIT, strict=True)
        return True

    def start(self) -> None:
        """Start the request threads (after negotiate())."""
        for _ in range(self.readers):
            self._spawn()

    def _spawn(self) -> None:
        fd = self.fd if not self._workers or self._forwarding else self._clone_fd()
        self._fds.append(fd)
        t = threading.Thread(target=self._loop, args=(fd,), name=f"cachefs-fuse-{len(self._workers)}",
                             daemon=True)
        self._workers.append(t)
        t.start()

    @contextlib.contextmanager
    def blocking(self, refusable: bool = True) -> Iterator[None]:
        """Around work that may wait (a source request): another thread reads meanwhile.
        A no-op outside the session's own threads. When `max_threads` wait already and this
        is one of the last `readers`, the wait is refused (FuseError EAGAIN, counted in
        `busy_refusals`) instead: a wait of any kind never stops the session from reading,
        so the requests that need no wait (cached files) are still answered. A wait that must
        not fail (a release: the kernel ignores its error) is `refusable=False`."""
        if not getattr(self._local, "serving", False):
            yield
            return
        with self._cond:
            if (refusable and self._active - 1 < self.readers and not self._parked
                    and len(self._workers) >= self.max_threads and not self._stopped.is_set()):
                self.busy_refusals += 1
                if self.busy_refusals == 1 or self.busy_refusals % 1000 == 0:
                    log.warning("%d requests wait on the source at once; more that would wait are refused "
                                "with EAGAIN until some finish (%d so far)", self.max_threads, self.busy_refusals)
                raise FuseError(errno.EAGAIN)
            self._active -= 1
            if self._active < self.readers and not self._stopped.is_set():
                if self._parked:
                    self._cond.notify()
                elif len(self._workers) < self.max_threads:
                    self._spawn()
        try:
            yield
        finally:
            with self._cond:
                self._active += 1

    def _clone_fd(self) -> int:
        """A descriptor of its own for a thread (FUSE_DEV_IOC_CLONE): requests spread over
        per-descriptor queues. Where cloning fails, the threads share the first one."""
        if not self._clone:
            return self.fd
        try:
            fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
        except OSError:
            self._clone = False
            return self.fd
        try:
            fcntl.ioctl(fd, p.DEV_IOC_CLONE, bytearray(p.U32.pack(self.fd)))
        except OSError as exc:
            os.close(fd)
            log.debug("FUSE_DEV_IOC_CLONE failed (%s): the threads share one descriptor", exc)
            self._clone = False
            return self.fd
        return fd

    def start_servers(self, count: int, capacity: int, names: int = 0, rows: TableNodes | None = None,
                      main: str = SERVE_MAIN, room: int = 0, ttl: float = 0.0,
                      ram_fd: int = -1) -> ServeTable | None:
        """Start `count` serving processes (cachefs/fuse/serve.py) before start(): each reads
        a cloned descriptor of this connection and answers the lookups, opens and releases
        of the names and nodes published in the returned table (room for `names` names),
        and with `rows`, of the files of the NVMe tier's entry table (table nodes); this
        process's threads then answer what they forward instead of reading /dev/fuse.
        `main`: the code each runs (python -c; with `rows`, one that reads the table).
        Without `rows`, `room` for the table nodes of a checkpoint published later
        (ServeTable.publish_rows; `ttl`: --metadata-ttl, as TableNodes.ttl). `ram_fd`: the
        RAM tier's data directory, where they open RAM's copy of a table node RAM holds
        (ServeTable.close_row). None (and nothing started) where the descriptor cannot be
        cloned."""
        if count <= 0 or not self._clone:
            return None
        fds: list[int] = []
        for _ in range(count):
            fd = self._clone_fd()
            if fd == self.fd:  # cloning failed: the threads share the first descriptor
                for f in fds:
                    os.close(f)
                return None
            fds.append(fd)
        self._rx, self._tx = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        for sock, opt in ((self._rx, socket.SO_RCVBUF), (self._tx, socket.SO_SNDBUF)):
            sock.setsockopt(socket.SOL_SOCKET, opt, SEND_BUFFER)
        table = ServeTable.create(capacity, count, names, rows.records if rows is not None else 0, room)
        env = child_env()
        extra = ["--ttl", repr(rows.ttl if rows is not None else ttl)]
        shared = [table.fd, self._tx.fileno()]
        if rows is not None:
            extra += ["--rows-fd", str(rows.table_fd), "--data-fd", str(rows.data_fd)]
            shared += [rows.table_fd, rows.data_fd]
        if ram_fd >= 0:
            extra += ["--ram-fd", str(ram_fd)]
            shared.append(ram_fd)
        for index, fd in enumerate(fds):
            # (not `-m cachefs.fuse.serve`: this package imports that module first, and runpy
            # then ran it a second time as __main__, with a RuntimeWarning in the log at
            # every start)
            cmd = [sys.executable, "-c", main, "--index", str(index), "--fuse-fd", str(fd),
                   "--table-fd", str(table.fd), "--forward-fd", str(self._tx.fileno()),
                   "--bufsize", str(self._bufsize), "--parent", str(os.getpid()), *extra]
            proc = subprocess.Popen(cmd, pass_fds=[fd, *shared], stdin=subprocess.DEVNULL, env=env)
            self.servers.append(proc)
            self.servers_alive.append(True)
            self._server_fds.append(fd)
            self.reports_done.append(0)
            self._answered.append(0)
            threading.Thread(target=self._watch_server, args=(index,), name=f"cachefs-serve-watch-{index}",
                             daemon=True).start()
        self.table = table
        self._forwarding = True
        return table

    def _watch_server(self, index: int) -> None:
        """When a serving process ends: at an unmount, the session stops; otherwise it is
        logged, its requests in flight end with an error (its descriptor is closed; the
        kernel then fails them with ECONNABORTED rather than leave callers waiting), and
        when none is left this process reads /dev/fuse itself again."""
        proc = self.servers[index]
        code = proc.wait()
        if self._stopped.is_set():
            return
        if self._connection_gone():
            self.stop()
            return
        log.warning("serving process %d ended (exit status %s); its requests in flight failed, and the "
                    "others (or this process) answer from now on", index, code)
        self.servers_alive[index] = False
        null = os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.dup2(null, self._server_fds[index])  # a reply still on its way goes nowhere
        finally:
            os.close(null)
        if not any(self.servers_alive):
            self._forwarding = False
            self._wake(len(self._workers))

    def settle(self, timeout: float = 1.0) -> bool:
        """Wait until everything the serving processes answered so far is reported and
        counted (their reports come every REPORT_EVERY requests or REPORT_AFTER seconds
        idle): a stats reader then sees every open. False after `timeout`."""
        table = self.table
        if table is None:
            return True
        deadline = time.monotonic() + timeout
        with self.blocking(refusable=False):  # another thread reads the reports meanwhile
            while True:
                if all(not alive or (table.line(k, PENDING) == 0 and table.line(k, REPORTS) == self.reports_done[k])
                       for k, alive in enumerate(self.servers_alive)):
                    return True
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.005)

    def _connection_gone(self) -> bool:
        """Whether the kernel ended the connection (unmounted or aborted): POLLERR on the
        descriptor, without reading a request."""
        poller = select.poll()
        poller.register(self.fd, 0)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))

    def _wake(self, count: int) -> None:
        """Wake `count` threads waiting for a forwarded request (to stop or to switch)."""
        if self._tx is None:
            return
        for _ in range(count):
            try:
                self._tx.send(WAKE.to_bytes(4, "little"))
            except OSError:
                return

    def wait(self, poll: float = 0.5) -> None:
        """Block until every request thread has ended (the file system was unmounted). The
        main thread waits in short slices, so signal handlers keep running."""
        while not self._stopped.wait(poll):
            pass
        with self._cond:
            self._cond.notify_all()
        for t in list(self._workers):
            while t.is_alive():
                t.join(poll)

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def stop(self) -> None:
        """Stop reading requests (the threads leave once their current request is done)."""
        with self._cond:
            self._stopped.set()
            self._cond.notify_all()
        self._wake(len(self._workers))

    def run(self) -> None:
        self.negotiate()
        self.start()
        self.wait()

    def close(self) -> None:
        for proc in self.servers:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        for fd in (set(self._fds) | set(self._server_fds)) - {self.fd}:
            try:
                os.close(fd)
            except OSError:
                pass
        self._fds.clear()
        self._server_fds.clear()
        for sock in (self._rx, self._tx):
            if sock is not None:
                sock.close()
        if self.table is not None:
            self.table.close()
            self.table = None

    # -- the request loop -------------------------------------------------------------------

    def _read_request(self, fd: int, buf: bytearray) -> int | None:
        """One request into `buf`: its length, or None once the connection is gone."""
        while True:
            try:
                n = os.readv(fd, [buf])
                return n if n > 0 else None  # end of file: the other side is gone
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno == errno.ENOENT:   # the request was interrupted before we read it
                    continue
                if exc.errno in (errno.ENODEV, errno.ECONNABORTED, errno.EBADF):
                    return None
                raise

    def _loop(self, fd: int) -> None:
        self._local.serving = True
        buf = bytearray(self._bufsize + PREFIX_SIZE)  # a request as big as the kernel makes, forwarded
        view = memoryview(buf)
        cond = self._cond
        stopped = self._stopped
        handle = self.handle
        serving = False  # whether this thread counts in _active
        try:
            while True:
                with cond:  # once per request: leave the count, and take a place again
                    if serving:
                        self._active -= 1
                        serving = False
                    while self._active >= self.readers and not stopped.is_set():
                        self._parked += 1
                        cond.wait()
                        self._parked -= 1
                    if stopped.is_set():
                        break
                    self._active += 1
                    serving = True
                if self._forwarding:
                    self._forwarded(buf, view)
                    continue
                n = self._read_request(fd, buf)
                if n is None:
                    break
                handle(fd, view[:n])
        except OSError as exc:
            log.error("reading /dev/fuse failed: %s", exc)
        finally:
            with cond:
                if serving:
                    self._active -= 1
                stopped.set()
                cond.notify_all()

    def _forwarded(self, buf: bytearray, view: memoryview) -> None:
        """One message from the serving processes: a request to answer on the descriptor it
        was read from, or a report of what they answered."""
        assert self._rx is not None
        n = self._read_request(self._rx.fileno(), buf)
        if n is None or n < 4:
            return
        index = int.from_bytes(buf[:4], "little")
        if index & REPORT and index != WAKE:
            try:
                self.ops.served(view[4:n])
            finally:
                with self._cond:
                    self.reports_done[index & ~REPORT] += 1
        elif index < len(self._server_fds) and self.servers_alive[index]:
            try:
                self.handle(self._server_fds[index], view[4:n])
            finally:
                with self._answer_lock:  # the serving process reads on while few wait (MAX_FORWARDED)
                    self._answered[index] += 1
                    if self.table is not None:
                        self.table.set_line(index, ANSWERED, self._answered[index])

    def handle(self, fd: int, message: memoryview) -> None:
        """Answer one request (a whole message as the kernel wrote it)."""
        if len(message) < p.IN_HEADER.size:
            log.debug("ignoring a %d-byte message shorter than a request header", len(message))
            return
        length, opcode, unique, nodeid, uid, gid, pid, extlen, _ = p.IN_HEADER.unpack_from(message)
        if opcode == p.IOCTL:
            # Python's open() asks isatty() of every file, which the kernel forwards as an
            # ioctl each time (it remembers no refusal): answered here, before any other work.
            self._reply_error(fd, unique, errno.ENOTTY)
            return
        if length != len(message) or length < p.IN_HEADER.size + extlen * 8:
            if opcode not in _NO_REPLY:
                self._reply_error(fd, unique, errno.EINVAL)
            return
        payload = message[p.IN_HEADER.size:length - extlen * 8]
        req = Request(unique, nodeid, uid, gid, pid)
        start = time.perf_counter()
        code = 0
        try:
            if opcode in p.WRITE_OPS:
                raise FuseError(errno.EROFS)
            handler = self._handlers.get(opcode)
            if handler is None:
                raise FuseError(errno.ENOSYS)
            out = handler(req, payload)
            if out is not None and opcode not in _NO_REPLY:
                self._reply(fd, unique, out, opcode)
        except FuseError as exc:
            code = exc.errno
        except OSError as exc:
            code = exc.errno if isinstance(exc.errno, int) and exc.errno > 0 else errno.EIO
        except (struct.error, ValueError, IndexError, UnicodeError) as exc:   # a request we could not parse
            log.debug("malformed %s request: %s", p.OPCODE_NAMES.get(opcode, opcode), exc)
            code = errno.EINVAL
        except Exception:
            log.exception("%s request failed", p.OPCODE_NAMES.get(opcode, opcode))
            code = errno.EIO
        if code and opcode not in _NO_REPLY:
            self._reply_error(fd, unique, code, opcode)
        if self.observer is not None:
            self.observer(p.OPCODE_NAMES.get(opcode, "unknown"), time.perf_counter() - start, code)
        if self.trace:
            log.info("%s unique=%d node=%d pid=%d: %s in %.0f us", p.OPCODE_NAMES.get(opcode, opcode), unique, nodeid,
                     pid, errno.errorcode.get(code, code) if code else "ok", (time.perf_counter() - start) * 1e6)

    def _reply(self, fd: int, unique: int, parts: list[Buffer], opcode: int = 0, strict: bool = False) -> None:
        """Write one reply. A reply of many parts (a directory listing holds one per entry)
        is joined into one buffer first: writev takes at most IOV_MAX (1,024) vectors and
        fails with EINVAL past that, which the kernel would pass to the reader."""
        length = p.OUT_HEADER.size
        for x in parts:
            length += len(x)
        header = p.OUT_HEADER.pack(length, 0, unique)
        if len(parts) >= MAX_REPLY_PARTS:
            vectors: list[Buffer] = [header + b"".join(parts)]
        else:
            vectors = [header, *parts]
        try:
            os.writev(fd, vectors)
        except OSError as exc:
            if strict:  # INIT: a connection that cannot take it is no connection
                raise
            if self._reply_failed(opcode, unique, exc):
                self._reply_error(fd, unique, errno.EIO, opcode)  # the caller must not wait forever

    def _reply_error(self, fd: int, unique: int, code: int, opcode: int = 0) -> None:
        try:
            os.write(fd, p.OUT_HEADER.pack(p.OUT_HEADER.size, -abs(code), unique))
        except OSError as exc:
            self._reply_failed(opcode, unique, exc)

    def _reply_failed(self, opcode: int, unique: int, exc: OSError) -> bool:
        """The kernel did not take a reply. ENOENT: the request was interrupted and the
        caller is gone (nothing lost); ENODEV: unmounted. Anything else means a caller got
        an error for a request the file system answered: counted and logged as a warning."""
        code = exc.errno or errno.EIO
        name = p.OPCODE_NAMES.get(opcode, str(opcode))
        if code in (errno.ENOENT, errno.ENODEV):
            log.debug("the reply to %s %d was not delivered: %s", name, unique, exc.strerror)
            return False
        self.reply_failures += 1
        log.warning("the kernel refused the reply to a %s request: %s (errno %s)", name,
                    exc.strerror, errno.errorcode.get(code, code))
        if self.on_reply_failed is not None:
            self.on_reply_failed(name, code)
        return True

    # -- notifications and backing files ---------------------------------------------------

    def notify_inval_entry(self, parent: int, name: bytes) -> bool:
        """Make the kernel forget the name `name` in directory `parent`."""
        return self._notify(p.NOTIFY_INVAL_ENTRY, [p.NOTIFY_INVAL_ENTRY_OUT.pack(parent, len(name), 0), name, b"\0"])

    def _notify(self, code: int, parts: list[Buffer]) -> bool:
        length = p.OUT_HEADER.size + sum(len(x) for x in parts)
        try:
            os.writev(self.fd, [p.OUT_HEADER.pack(length, code, 0), *parts])
            return True
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR, errno.ENODEV, errno.EBADF):
                return False
            raise

    def backing_open(self, fd: int) -> int:
        """Register `fd` as a backing file (FUSE_DEV_IOC_BACKING_OPEN); return its backing id.
        OSError: EPERM without CAP_SYS_ADMIN, EINVAL/ELOOP for a file that cannot back one."""
        return fcntl.ioctl(self.fd, p.DEV_IOC_BACKING_OPEN, bytearray(p.BACKING_MAP.pack(fd, 0, 0)))

    def backing_close(self, backing_id: int) -> None:
        fcntl.ioctl(self.fd, p.DEV_IOC_BACKING_CLOSE, bytearray(p.U32.pack(backing_id)))
