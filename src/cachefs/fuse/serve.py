"""Serving processes: requests for files the kernel reads itself, answered on every core.

In passthrough mode the kernel reads a cached file itself, and what is left for the file
system is an OPEN, an IOCTL (Python's `isatty()`) and a RELEASE per open. One Python
process answers them one at a time, whatever the number of cores. So the session can start
serving processes (`python -m cachefs.fuse.serve`), each reading its own cloned `/dev/fuse`
descriptor of the same connection (the kernel hands each request to whichever reader
waits). A serving process answers from shared memory (`OpenTable`):

  - IOCTL: ENOTTY; a write of any kind: EROFS;
  - OPEN of a node the main process published (a backing id registered for it): the
    passthrough reply with that id, counted as one open of the node in the process's own
    column of the table;
  - RELEASE of such an open (its handle carries OWN_FH): one open less in that column;

and forwards everything else, unchanged, to the main process over one datagram socket
(the message prefixed with the process's index). A request the kernel has handed to a
file system can no longer be interrupted, even by SIGKILL, until it is answered; so a
serving process reads nothing while the main process is stopped (SIGSTOP, a debugger),
and stops reading while MAX_FORWARDED of its requests wait for the main process: a hung
main process then holds a bounded number of callers, and the rest stay killable. The main process answers a forwarded
request on the serving process's descriptor (it keeps a copy): the kernel takes a reply
only on the descriptor its request was read from. Every `REPORT_EVERY` requests (or
`REPORT_AFTER` seconds idle) a process reports what it answered: counts per operation and
the node ids it opened, which the main process counts as the tiers' hits.

The table, one shared memory file (memfd), holds per node a backing id (0: ask the main
process) and, per serving process, a busy counter and a count of open handles per node
(releases may come to any process, so a column may go negative; the sum is what counts).
The main process unpublishes a node (forgotten by the kernel, or its entry dropped by a
tier) by clearing its slot, then waits until every serving process has been idle or
finished a request since (`quiesce`), then folds the columns' counts into its own.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import mmap
import os
import select
import signal
import socket
import struct
import sys
import time
from array import array

from cachefs.fuse import protocol as p

OWN_FH = 1 << 63          # the handle of an open of a published node: its release may be answered anywhere
REPORT = 1 << 31          # in a forwarded message's index: a serving process's report, not a request
WAKE = 0xFFFFFFFF         # a forwarded message's index: the main process waking its own readers
REPORT_EVERY = 512        # requests answered between reports
REPORT_AFTER = 0.05       # seconds idle before a report of what is pending
SEND_BUFFER = 4 << 20     # the forward socket's buffer (the kernel caps it at net.core.wmem_max)
PR_SET_PDEATHSIG = 1

_MAGIC = b"cfsopen1"
_HEADER = struct.Struct("<8sQI")          # magic, capacity, processes
_PREFIX = struct.Struct("<I")              # a forwarded message: the serving process's index
# A report: requests answered per kind and their microseconds (the requests forwarded, with
# no time), then the node ids opened (u32)
REPORT_COUNTS = ("open", "release", "other", "forwarded")
_REPORT = struct.Struct("<" + "Q" * (2 * len(REPORT_COUNTS)))
_OPEN_REPLY = struct.Struct("<IiQQIi")    # out header + fuse_open_out
_LINE = 64                                 # each process's busy counter on a cache line of its own


# A serving process's cache line in the table: u64 counters at these indices (the main
# process writes ANSWERED, the serving process the others)
BUSY, PENDING, REPORTS, FORWARDED, ANSWERED = 0, 1, 2, 3, 4
MAX_FORWARDED = 64        # requests forwarded and not answered yet, per serving process
MAIN_CHECK = 0.05         # seconds a look at whether the main process is stopped stays good


class OpenTable:
    """The shared memory of the main process and its serving processes (see the module
    docstring). Layout: header, one cache line per process (its busy counter, requests
    answered but not reported yet, reports sent), then a u32 backing id per node, then per
    serving process an i32 open count per node. The file is sparse: pages are touched only
    for the node ids in use."""

    def __init__(self, fd: int, capacity: int, processes: int):
        self.fd, self.capacity, self.processes = fd, capacity, processes
        size = self.size(capacity, processes)
        self._map = mmap.mmap(fd, size)
        view = memoryview(self._map)
        base = _LINE * (1 + processes)
        self.busy = view[_LINE:base].cast("Q")  # index k * (_LINE // 8): process k's counter
        self.slots = view[base:base + 4 * capacity].cast("I")
        self._counts = [view[base + 4 * capacity * (1 + k):base + 4 * capacity * (2 + k)].cast("i")
                        for k in range(processes)]

    @staticmethod
    def size(capacity: int, processes: int) -> int:
        return _LINE * (1 + processes) + 4 * capacity * (1 + processes)

    @classmethod
    def create(cls, capacity: int, processes: int) -> OpenTable:
        """A new table in a memfd (inherited by the serving processes)."""
        fd = os.memfd_create("cachefs-open-table", 0)  # not CLOEXEC: passed to the children
        os.ftruncate(fd, cls.size(capacity, processes))
        os.pwrite(fd, _HEADER.pack(_MAGIC, capacity, processes), 0)
        return cls(fd, capacity, processes)

    @classmethod
    def attach(cls, fd: int) -> OpenTable:
        magic, capacity, processes = _HEADER.unpack(os.pread(fd, _HEADER.size, 0))
        if magic != _MAGIC:
            raise ValueError("not a cachefs open table")
        return cls(fd, capacity, processes)

    def counts(self, index: int) -> memoryview:
        """Serving process `index`'s open counts (index 0 is the first serving process)."""
        return self._counts[index]

    # -- the main process's side ---------------------------------------------------------

    def publish(self, nodeid: int, backing_id: int) -> bool:
        """Opens of `nodeid` may be answered with `backing_id` by any process. False when the
        node id is beyond the table (its opens go to the main process)."""
        if not 0 < nodeid < self.capacity or backing_id <= 0:
            return False
        self.slots[nodeid] = backing_id
        return True

    def unpublish(self, nodeid: int) -> None:
        if 0 < nodeid < self.capacity:
            self.slots[nodeid] = 0

    def quiesce(self, alive: list[bool], timeout: float = 5.0) -> bool:
        """Wait until every live serving process is idle or has finished the request it was
        answering when this was called: after an unpublish, none still uses the old slot.
        A process counts busy (odd) from the moment it has read a request until it has
        answered it. The first sleep lets stores in flight on other cores land (the slot
        cleared, theirs to their counters) before the counters are read."""
        step = _LINE // 8
        time.sleep(0.002)
        before = [self.busy[k * step] for k in range(self.processes)]
        deadline = time.monotonic() + timeout
        for k, seen in enumerate(before):
            if not alive[k]:
                continue
            while seen & 1 and self.busy[k * step] == seen:
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.001)
        return True

    def line(self, index: int, field: int) -> int:
        """Serving process `index`'s counter `field` (BUSY, PENDING, REPORTS)."""
        return int(self.busy[index * (_LINE // 8) + field])

    def set_line(self, index: int, field: int, value: int) -> None:
        self.busy[index * (_LINE // 8) + field] = value

    def take_counts(self, nodeid: int) -> int:
        """The serving processes' open counts of `nodeid`, summed and zeroed (after
        unpublish and quiesce, when no process changes them)."""
        if not 0 < nodeid < self.capacity:
            return 0
        total = 0
        for column in self._counts:
            total += column[nodeid]
            column[nodeid] = 0
        return total

    def close(self) -> None:
        for v in (self.busy, self.slots, *self._counts):
            v.release()
        self._counts = []
        try:
            self._map.close()
        except BufferError:
            pass
        os.close(self.fd)


def decode_report(data: memoryview) -> tuple[dict[str, tuple[int, int]], array]:
    """A report's (count, microseconds) per kind of request, and the node ids opened."""
    values = _REPORT.unpack_from(data)
    counts = {kind: (values[2 * i], values[2 * i + 1]) for i, kind in enumerate(REPORT_COUNTS)}
    opened = array("I")
    opened.frombytes(bytes(data[_REPORT.size:_REPORT.size + (len(data) - _REPORT.size) // 4 * 4]))
    return counts, opened


# -- a serving process -------------------------------------------------------------------------


class Server:
    """One serving process's loop (single-threaded: it never waits on anything but the
    kernel and, when full, the forward socket)."""

    def __init__(self, index: int, fuse_fd: int, table: OpenTable, forward: socket.socket, bufsize: int):
        self.index, self.fd, self.table, self.forward = index, fuse_fd, table, forward
        self.buf = bytearray(bufsize)
        self.prefix = _PREFIX.pack(index)
        self.opened = array("I")
        self.stats = [0] * (2 * len(REPORT_COUNTS))
        self.answered = 0
        self.main_pid: int | None = None  # whose stop holds the reading (see main_stopped)
        self._stat_fd = -1

    # Long (92 lines) for a reason: the hot loop, one function so that its names stay local
    def run(self) -> int:
        """Serve until the connection is gone (0), or fail (1)."""
        fd, buf = self.fd, self.buf
        view = memoryview(buf)
        table = self.table
        busy, step = table.busy, self.index * (_LINE // 8)
        slots, counts, capacity = table.slots, table.counts(self.index), table.capacity
        header = p.IN_HEADER.unpack_from
        u64 = struct.Struct("<Q").unpack_from
        u32 = struct.Struct("<I").unpack_from
        reply_open = _OPEN_REPLY.pack
        error_reply = p.OUT_HEADER.pack
        own_flags = p.FOPEN_PASSTHROUGH | p.FOPEN_NOFLUSH
        write_flags = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT
        clock = time.perf_counter
        stats, opened = self.stats, self.opened

        def reply(data: bytes) -> bool:
            try:
                os.write(fd, data)
                return True
            except OSError:  # interrupted (ENOENT), or unmounted: the next read says which
                return False

        poller = select.poll()
        poller.register(fd, select.POLLIN)
        checked, stopped = -1.0, False
        while True:
            if not poller.poll(REPORT_AFTER * 1000 if self.answered else None):
                self.report()  # idle: what is pending goes now, so stats are never stale
                continue
            now = time.monotonic()
            if now - checked > MAIN_CHECK:  # a request waits: is the main process there to answer?
                checked, stopped = now, self.main_stopped()
            if stopped or busy[step + FORWARDED] - busy[step + ANSWERED] >= MAX_FORWARDED:
                time.sleep(0.02 if stopped else 0.002)  # the request stays with the kernel, killable
                continue
            try:
                n = os.readv(fd, [buf])
            except InterruptedError:
                continue
            except OSError as exc:
                if exc.errno == errno.ENOENT:  # interrupted before it was read
                    continue
                if exc.errno in (errno.ENODEV, errno.ECONNABORTED, errno.EBADF):
                    self.report()
                    return 0
                raise
            if n < p.IN_HEADER.size:
                if n == 0:  # end of file: the other side is gone (a test's fake kernel)
                    self.report()
                    return 0
                continue
            busy[step] += 1  # odd: answering (see OpenTable.quiesce)
            start = clock()
            length, opcode, unique, nodeid = header(buf)[:4]
            backing = slots[nodeid] if 0 < nodeid < capacity and length == n else 0  # read once
            kind = -1
            if opcode == p.IOCTL:
                reply(error_reply(16, -errno.ENOTTY, unique))
                kind = 2
            elif opcode == p.OPEN and backing:
                if u32(buf, 40)[0] & write_flags:
                    reply(error_reply(16, -errno.EROFS, unique))
                else:
                    counts[nodeid] += 1  # before the reply: a release may follow at once
                    if reply(reply_open(32, 0, unique, OWN_FH | nodeid, own_flags, backing)):
                        opened.append(nodeid)
                    else:
                        counts[nodeid] -= 1  # interrupted: the kernel will not release it
                kind = 0
            elif opcode == p.RELEASE and backing and u64(buf, 40)[0] & OWN_FH:
                counts[nodeid] -= 1
                reply(error_reply(16, 0, unique))
                kind = 1
            elif opcode in p.WRITE_OPS:
                reply(error_reply(16, -errno.EROFS, unique))
                kind = 2
            else:
                busy[step] += 1  # idle again: forwarding reads no slot, and may wait for the daemon
                busy[step + FORWARDED] += 1
                self.forward.sendmsg([self.prefix, view[:n]])
                stats[6] += 1
                continue
            busy[step] += 1  # even: idle
            if kind >= 0:
                stats[2 * kind] += 1
                stats[2 * kind + 1] += int((clock() - start) * 1e6)
                self.answered += 1
                busy[step + PENDING] = self.answered
                if self.answered >= REPORT_EVERY:
                    self.report()

    def main_stopped(self) -> bool:
        """Whether the main process is stopped (its state in /proc: T, or t under a
        debugger). Looked at when a request waits, at most every MAIN_CHECK seconds: an
        idle serving process wakes for nothing."""
        if self.main_pid is None:
            return False
        try:
            if self._stat_fd < 0:
                self._stat_fd = os.open(f"/proc/{self.main_pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
            data = os.pread(self._stat_fd, 1024, 0)
        except OSError:
            return False  # gone: the kernel ends the connection, and this process with it
        end = data.rfind(b")")
        return data[end + 2:end + 3] in (b"T", b"t")

    def report(self) -> None:
        if not self.answered:
            return
        message = [_PREFIX.pack(REPORT | self.index), _REPORT.pack(*self.stats), self.opened.tobytes()]
        self.stats[:] = [0] * len(self.stats)
        del self.opened[:]
        self.answered = 0
        line = self.index * (_LINE // 8)
        try:
            self.forward.sendmsg(message)
        except OSError:
            pass  # the main process is gone: so is the connection soon
        else:
            self.table.busy[line + REPORTS] += 1
        self.table.busy[line + PENDING] = 0


def child_env() -> dict[str, str]:
    """The environment of a child process that imports this package as its parent does,
    wherever it is installed (a serving process; the fetch processes)."""
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def die_with_parent() -> None:
    """In a child process: ignore the terminal's Ctrl-C (it is for the daemon), and die
    with the parent (PR_SET_PDEATHSIG). The caller then checks that the parent is still
    the one it was started by."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cachefs.fuse.serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--fuse-fd", type=int, required=True)
    ap.add_argument("--table-fd", type=int, required=True)
    ap.add_argument("--forward-fd", type=int, required=True)
    ap.add_argument("--bufsize", type=int, default=1 << 18)
    ap.add_argument("--parent", type=int, required=True, help="the daemon's pid")
    args = ap.parse_args(argv)
    die_with_parent()
    if os.getppid() != args.parent:
        return 0  # the daemon is gone already
    forward = socket.socket(fileno=args.forward_fd)
    table = OpenTable.attach(args.table_fd)
    server = Server(args.index, args.fuse_fd, table, forward, args.bufsize)
    server.main_pid = os.getppid()
    try:
        return server.run()
    except Exception as exc:  # logged by the daemon from our exit status and stderr
        print(f"cachefs serving process {args.index}: {exc!r}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
