"""Serving processes: requests for files the kernel reads itself, answered on every core.

In passthrough mode the kernel reads a cached file itself, and what is left for the file
system is a LOOKUP (and a FORGET) per file per dentry lifetime, and an OPEN, an IOCTL
(Python's `isatty()`) and a RELEASE per open. One Python
process answers them one at a time, whatever the number of cores. So the session can start
serving processes (`python -m cachefs.fuse.serve`), each reading its own cloned `/dev/fuse`
descriptor of the same connection (the kernel hands each request to whichever reader
waits). A serving process answers from shared memory (`ServeTable`):

  - IOCTL: ENOTTY; a write of any kind: EROFS;
  - OPEN of a node the main process published (a backing id registered for it): the
    passthrough reply with that id, counted as one open of the node in the process's own
    column of the table;
  - RELEASE of such an open (its handle carries OWN_FH): one open less in that column;
  - LOOKUP of a name the main process published (in the directory's node, until its
    deadline): the entry it published, counted as one lookup of the node in the process's
    own column; GETATTR of that node: its attributes; FORGET of it (and those entries of
    a BATCH_FORGET, the rest forwarded as a batch of their own): lookups less;

and forwards everything else, unchanged, to the main process over one datagram socket
(the message prefixed with the process's index). A request the kernel has handed to a
file system can no longer be interrupted, even by SIGKILL, until it is answered; so a
serving process reads nothing while the main process is stopped (SIGSTOP, a debugger),
and stops reading while MAX_FORWARDED of its requests wait for the main process: a hung
main process then holds a bounded number of callers, and the rest stay killable. The
main process answers a forwarded request on the serving process's descriptor (it keeps a
copy): the kernel takes a reply only on the descriptor its request was read from. Every
`REPORT_EVERY` requests (or `REPORT_AFTER` seconds idle, or as many opens as the main
process asks for while order hints are on: ServeTable.report_opens) a process reports what
it answered: counts per operation and the node ids it opened, which the main process counts
as the tiers' hits.

The table is cachefs/fuse/servetable.py. After a start from the NVMe tier's entry table,
a serving process also answers table nodes: the files of that table, one node id per
record, looked up, stat'ed, registered and opened from it without the main process (see
`Server.row_lookup`, `Server.register`; docs/design.md, "Table nodes").
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import os
import select
import socket
import stat as stat_mod
import struct
import sys
import time
from array import array
from collections.abc import Callable
from typing import Protocol

from cachefs.fuse import protocol as p
from cachefs.fuse.children import die_with_parent, parent_stopped
from cachefs.fuse.servetable import (
    _LINE,
    ANSWERED,
    FORWARDED,
    PENDING,
    RAM_REGISTERED,
    RAM_WANTED,
    REPORT_OPENS,
    REPORTS,
    ROW_FREE,
    ROW_TAKEN,
    ServeTable,
)

OWN_FH = 1 << 63          # the handle of an open of a published node: its release may be answered anywhere
REPORT = 1 << 31          # in a forwarded message's index: a serving process's report, not a request
REGISTERED = 1 << 31      # in a report's node ids: a table node this process registered a backing id for,
REGISTERED_RAM = 1 << 30  # and of RAM's copy (node ids stay below 2**25: NODE_TABLE_CAPACITY twice)
WAKE = 0xFFFFFFFF         # a forwarded message's index: the main process waking its own readers
REPORT_EVERY = 512        # requests answered between reports
REPORT_AFTER = 0.05       # seconds idle before a report of what is pending
SEND_BUFFER = 4 << 20     # the forward socket's buffer (the kernel caps it at net.core.wmem_max)

_PREFIX = struct.Struct("<I")              # a forwarded message: the serving process's index
PREFIX_SIZE = _PREFIX.size                 # what a forwarded request is longer than the request
# A report: requests answered per kind and their microseconds (the requests forwarded, with
# no time), then the node ids opened (u32)
REPORT_COUNTS = ("open", "release", "lookup", "getattr", "forget", "batch_forget", "other", "forwarded")
_OPEN, _RELEASE, _LOOKUP, _GETATTR, _FORGET, _BATCH_FORGET, _OTHER, _FORWARDED = range(len(REPORT_COUNTS))
_REPORT = struct.Struct("<" + "Q" * (2 * len(REPORT_COUNTS)))
_OPEN_REPLY = struct.Struct("<IiQQIi")    # out header + fuse_open_out
MAX_FORWARDED = 64        # requests forwarded and not answered yet, per serving process
MAIN_CHECK = 0.05         # seconds a look at whether the main process is stopped stays good


def decode_report(data: memoryview) -> tuple[dict[str, tuple[int, int]], array]:
    """A report's (count, microseconds) per kind of request, and the node ids opened."""
    values = _REPORT.unpack_from(data)
    counts = {kind: (values[2 * i], values[2 * i + 1]) for i, kind in enumerate(REPORT_COUNTS)}
    opened = array("I")
    opened.frombytes(bytes(data[_REPORT.size:_REPORT.size + (len(data) - _REPORT.size) // 4 * 4]))
    return counts, opened


class TableRows(Protocol):
    """The NVMe tier's entry table as a serving process reads it (tiers/table.py, Mapped;
    this layer knows nothing of tiers): a path's newest record, a record's fields if it
    is a whole file of one block (its 11 stat fields last), and its cached file opened
    if it is as the clean stop left it (else -1)."""

    def find_path(self, path: bytes) -> int | None: ...

    def record(self, n: int) -> tuple | None: ...

    def open_held(self, fields: tuple) -> int: ...

    def open_copy(self, fields: tuple, dir_fd: int) -> int: ...

    def close(self) -> None: ...


# -- a serving process -------------------------------------------------------------------------


class Server:
    """One serving process's loop (single-threaded: it never waits on anything but the
    kernel and, when full, the forward socket)."""

    def __init__(self, index: int, fuse_fd: int, table: ServeTable, forward: socket.socket, bufsize: int,
                 rows: TableRows | None = None, ttl: float = 0.0,
                 rows_from: Callable[[int, int], TableRows] | None = None, ram_fd: int = -1):
        self.index, self.fd, self.table, self.forward = index, fuse_fd, table, forward
        self.rows_from = rows_from  # reads a checkpoint's table (rows_published)
        # Table nodes: the NVMe tier's entry table, and how long a record's attributes are
        # good for after they were stored (--metadata-ttl)
        self.rows, self.ttl = rows if table.rows else None, ttl
        self._rows_fds: list[int] = []  # a checkpoint's table and data directory, as mapped here
        self.ram_fd = ram_fd  # the RAM tier's data directory (a table node RAM holds registers RAM's copy)
        self.valid = p.split_timeout(ttl)
        self.buf = bytearray(bufsize)
        self.prefix = _PREFIX.pack(index)
        self.opened = array("I")
        self.stats = [0] * (2 * len(REPORT_COUNTS))
        self.answered = 0
        self.main_pid: int | None = None  # whose stop holds the reading (see main_stopped)
        self._stat_fd = -1

    # Long (132 lines) for a reason: the hot loop, one function so that its names stay local
    def run(self) -> int:
        """Serve until the connection is gone (0), or fail (1)."""
        fd, buf = self.fd, self.buf
        view = memoryview(buf)
        table = self.table
        busy, step = table.busy, self.index * (_LINE // 8)
        slots, counts, capacity = table.slots, table.counts(self.index), table.capacity
        row_base = table.row_base if self.rows is not None else 0
        row_lookup, row_entry, register, row_theirs = self.row_lookup, self.row_entry, self.register, self.row_theirs
        lookups, entry_of, named, has_name = table.lookups(self.index), table.entry, table.named, table.has_name
        header = struct.Struct("<IIQQ").unpack_from  # IN_HEADER's first fields
        u64 = struct.Struct("<Q").unpack_from
        u32 = struct.Struct("<I").unpack_from
        reply_open = _OPEN_REPLY.pack
        error_reply = p.OUT_HEADER.pack
        own_flags = p.FOPEN_PASSTHROUGH | p.FOPEN_NOFLUSH
        write_flags = os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND | os.O_CREAT
        clock, now_ns, monotonic = time.perf_counter_ns, time.monotonic_ns, time.monotonic
        stats, opened = self.stats, self.opened
        forwarded, answered, pending = step + FORWARDED, step + ANSWERED, step + PENDING
        report_opens = step + REPORT_OPENS
        bufs, readv = [buf], os.readv
        OPEN, RELEASE, IOCTL, LOOKUP, FORGET, BATCH_FORGET, GETATTR = (
            p.OPEN, p.RELEASE, p.IOCTL, p.LOOKUP, p.FORGET, p.BATCH_FORGET, p.GETATTR)
        header_size = p.IN_HEADER.size

        def reply(data: bytes) -> bool:
            try:
                os.write(fd, data)
                return True
            except OSError:  # interrupted (ENOENT), or unmounted: the next read says which
                return False

        def forward(message: bytes | memoryview) -> None:
            """To the main process, this process counting idle meanwhile: forwarding reads
            no slot, and may wait for the daemon (the caller made busy even)."""
            busy[step + FORWARDED] += 1
            self.forward.sendmsg([self.prefix, message])
            stats[2 * _FORWARDED] += 1

        # EPOLLEXCLUSIVE: a request wakes one waiting serving process, not all of them (with
        # poll() every process woke for each request, and all but one found nothing)
        poller = select.epoll()
        poller.register(fd, select.EPOLLIN | select.EPOLLEXCLUSIVE)
        os.set_blocking(fd, False)  # this process's own descriptor (a clone): reads never wait
        checked, stopped = -1.0, False
        ready = False  # the last read found a request: the next is read without a poll first
        while True:
            if not ready and not poller.poll(REPORT_AFTER if self.answered else -1):
                self.report()  # idle: what is pending goes now, so stats are never stale
                continue
            now = monotonic()
            if now - checked > MAIN_CHECK:  # a request waits: is the main process there to answer?
                checked, stopped = now, self.main_stopped()
                if table.room and self.rows_published():  # a checkpoint's table nodes (or its next generation)
                    row_base = table.row_base
            if stopped or busy[forwarded] - busy[answered] >= MAX_FORWARDED:
                ready = False
                time.sleep(0.02 if stopped else 0.002)  # the request stays with the kernel, killable
                continue
            try:
                n = readv(fd, bufs)
                ready = True
            except (BlockingIOError, InterruptedError):
                ready = False
                continue
            except OSError as exc:
                if exc.errno == errno.ENOENT:  # interrupted before it was read
                    continue
                if exc.errno in (errno.ENODEV, errno.ECONNABORTED, errno.EBADF):
                    self.report()
                    return 0
                raise
            if n < header_size:
                if n == 0:  # end of file: the other side is gone (a test's fake kernel)
                    self.report()
                    return 0
                continue
            busy[step] += 1  # odd: answering (see ServeTable.quiesce)
            start = clock()
            length, opcode, unique, nodeid = header(buf)
            backing = slots[nodeid] if 0 < nodeid < capacity and length == n else 0  # read once
            kind = -1
            if not backing and opcode == OPEN and nodeid >= row_base > 0 and length == n:
                backing = register(nodeid - row_base)  # a table node's first open: registered here
            # the most frequent first: an open is an OPEN, an IOCTL and a RELEASE
            if opcode == OPEN and backing:
                if u32(buf, 40)[0] & write_flags:
                    reply(error_reply(16, -errno.EROFS, unique))
                else:
                    counts[nodeid] += 1  # before the reply: a release may follow at once
                    if reply(reply_open(32, 0, unique, OWN_FH | nodeid, own_flags, backing)):
                        opened.append(nodeid)
                    else:
                        counts[nodeid] -= 1  # interrupted: the kernel will not release it
                kind = _OPEN
            elif opcode == IOCTL:
                reply(error_reply(16, -errno.ENOTTY, unique))
                kind = _OTHER
            elif opcode == RELEASE and u64(buf, 40)[0] & OWN_FH and (backing or row_theirs(nodeid)):
                counts[nodeid] -= 1
                reply(error_reply(16, 0, unique))
                kind = _RELEASE
            elif opcode == LOOKUP and length == n:
                name = bytes(view[header_size:n - 1])
                found = entry_of(nodeid, name, now_ns())
                if found is None and row_base:
                    found = row_lookup(nodeid, name)
                if found is not None:
                    child, entry = found
                    lookups[child] += 1  # before the reply: a forget may follow at once
                    if not reply(error_reply(16 + len(entry), 0, unique) + entry):
                        lookups[child] -= 1  # interrupted: the kernel did not count it
                    kind = _LOOKUP
            elif opcode == BATCH_FORGET and length == n:
                kind, rest = self.batch_forget(view, n)
                if rest:  # the forgets of nodes not published, forwarded as a batch of their own
                    busy[step] += 1  # idle while forwarding
                    forward(rest)
                    busy[step] += 1
            elif opcode == FORGET and length == n >= 48 and has_name(nodeid):
                lookups[nodeid] -= u64(buf, 40)[0]
                kind = _FORGET
            elif opcode == GETATTR and length == n:
                known = named(nodeid, now_ns())
                if known is None and nodeid >= row_base > 0:
                    known = row_entry(nodeid - row_base)
                if known is not None:  # attr_out: the entry's attribute timeout and attributes
                    reply(error_reply(16 + 104, 0, unique) + known[24:32] + known[36:40] + bytes(4) + known[40:])
                    kind = _GETATTR
            elif opcode in p.WRITE_OPS:
                reply(error_reply(16, -errno.EROFS, unique))
                kind = _OTHER
            if kind < 0:
                busy[step] += 1  # idle again
                forward(view[:n])
                continue
            busy[step] += 1  # even: idle
            stats[2 * kind] += 1
            stats[2 * kind + 1] += (clock() - start) // 1000
            self.answered += 1
            busy[pending] = self.answered
            if self.answered >= REPORT_EVERY or (kind == _OPEN and 0 < busy[report_opens] <= len(opened)):
                self.report()

    def row_lookup(self, parent: int, name: bytes) -> tuple[int, bytes] | None:
        """The table node and packed entry_out of `name` in directory node `parent`, if the
        directory's path is published and the entry table holds the file (row_entry)."""
        directory = self.table.dir_path(parent)
        if directory is None or self.rows is None:
            return None
        n = self.rows.find_path((directory if directory != b"/" else b"") + b"/" + name)
        if n is None:
            return None
        entry = self.row_entry(n)
        return None if entry is None else (self.table.row_base + n, entry)

    def row_entry(self, n: int) -> bytes | None:
        """The packed entry_out of table node n: while the main process has not taken its name,
        its record is whole (CRC), of a regular file the NVMe tier held whole at a clean
        stop, and its attributes are within --metadata-ttl of when they were stored or of
        when the main process last found them on the source (as it answers from the index,
        see metadata.py)."""
        if self.rows is None or not 0 <= n < self.table.rows or self.table.row_state[n] == ROW_TAKEN:
            return None
        f = self.rows.record(n)
        if f is None or not f[2]:
            return None
        now = time.time()
        if f[1] + self.ttl <= now and self.table.confirmed[n] + self.ttl <= now:
            return None  # due for a check on the source, and not confirmed since (confirm_row)
        mode, nlink, uid, gid, size, atime, mtime, ctime, blocks, rdev, ino = f[11:22]
        if not stat_mod.S_ISREG(mode):
            return None
        return p.pack_entry_of(self.table.row_base + n, ino or 1, mode, nlink, uid, gid, size, atime, mtime,
                               ctime, blocks, rdev, self.valid)

    def register(self, n: int) -> int:
        """A backing id for table node n's cached file, registered by this process (under
        the node's lock: one per inode), if the node is FREE (not taken, nor an id of its
        being closed: that open is forwarded, and the main process takes the node): RAM's
        copy where the main process wants it (RAM holds the file: ServeTable.close_row) and
        it is there whole; else the NVMe tier's, if it is as the clean stop left it (its
        size, and its ctime from before that stop less the margin, or else its bytes' hash:
        the restart check's tests, see tiers/checks.py); else 0 (the open is forwarded).
        Reported with the opens (REGISTERED), for the main process's limit."""
        table, rows = self.table, self.rows
        if rows is None or not 0 <= n < table.rows:
            return 0
        nodeid = table.row_base + n
        table.row_lock(n)
        try:
            if table.row_state[n] != ROW_FREE:
                return 0
            backing = int(table.slots[nodeid])
            if backing:
                return backing
            f = rows.record(n)
            copy = table.row_copy[n]
            fd = rows.open_copy(f, self.ram_fd) if f is not None and copy & RAM_WANTED and self.ram_fd >= 0 else -1
            ram = fd >= 0
            if not ram:
                fd = -1 if f is None else rows.open_held(f)
            if fd < 0:
                return 0
            try:
                backing = self.backing_open(fd)
            except OSError:
                return 0
            finally:
                os.close(fd)
            table.slots[nodeid] = backing
            table.row_copy[n] = (copy | RAM_REGISTERED) if ram else (copy & ~RAM_REGISTERED)
            self.opened.append(nodeid | REGISTERED | (REGISTERED_RAM if ram else 0))
            return backing
        finally:
            table.row_lock(n, False)

    def rows_published(self) -> bool:
        """Whether the main process published table nodes since (a checkpoint: its entry
        table of a mount that started without one, or a next generation of it, which has
        the records before in their numbers), now mapped here from its descriptors
        (through /proc: the same user's process) in place of the generation before. If
        they cannot be mapped, the main process answers what this process cannot."""
        found = self.table.rows_published()
        if found is None or self.rows_from is None or self.main_pid is None:
            return False
        gen, count, table_fd, data_fd = found
        fds = []
        try:
            fds.append(os.open(f"/proc/{self.main_pid}/fd/{table_fd}", os.O_RDONLY | os.O_CLOEXEC))
            fds.append(os.open(f"/proc/{self.main_pid}/fd/{data_fd}", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC))
            rows = self.rows_from(fds[0], fds[1])
        except (OSError, ValueError) as exc:
            for fd in fds:
                os.close(fd)
            self.table.rows_mapped(self.index, gen, 0)
            print(f"cachefs serving process {self.index}: the checkpoint's entry table: {exc}", file=sys.stderr)
            return False
        if self.rows is not None and self._rows_fds:  # the generation before (its table unlinked:
            self.rows.close()                         # its blocks are freed once no process maps it)
            for fd in self._rows_fds:
                os.close(fd)
        self.rows, self._rows_fds = rows, fds
        self.table.rows_mapped(self.index, gen, count)
        return True

    def row_theirs(self, nodeid: int) -> bool:
        """Whether `nodeid` is a table node the serving processes answer (FREE, or CLOSING):
        a release of its own handle is answered here even when its slot is empty, as while
        the main process closes its backing id (ServeTable.close_row), or when this
        process read the slot just before that closing was undone. (Not `self.rows`: a
        process that could not map the entry table gets such releases too.)"""
        n = self.table.row_of(nodeid)
        return n >= 0 and self.table.row_theirs(n)

    def backing_open(self, fd: int) -> int:
        """Register `fd` as a backing file of this connection (as Session.backing_open: a
        backing id is the connection's, whichever of its descriptors registered it)."""
        return fcntl.ioctl(self.fd, p.DEV_IOC_BACKING_OPEN, bytearray(p.BACKING_MAP.pack(fd, 0, 0)))

    def batch_forget(self, view: memoryview, n: int) -> tuple[int, bytes]:
        """A BATCH_FORGET: the forgets of published nodes taken here (their lookups were
        counted in the table), and the rest as a batch of their own to forward. The kind
        to count (-1 when nothing was taken: the whole request is forwarded as it is)."""
        start = p.IN_HEADER.size + p.BATCH_FORGET_IN.size
        count = min(p.BATCH_FORGET_IN.unpack_from(view, p.IN_HEADER.size)[0], (n - start) // p.FORGET_ONE.size)
        lookups, has_name = self.table.lookups(self.index), self.table.has_name
        rest = []
        for i in range(count):
            nodeid, nlookup = p.FORGET_ONE.unpack_from(view, start + i * p.FORGET_ONE.size)
            if has_name(nodeid):
                lookups[nodeid] -= nlookup
            else:
                rest.append(view[start + i * p.FORGET_ONE.size:start + (i + 1) * p.FORGET_ONE.size])
        if len(rest) == count:
            return -1, b""
        if not rest:
            return _BATCH_FORGET, b""
        head = bytearray(view[:start])
        struct.pack_into("<I", head, 0, start + len(rest) * p.FORGET_ONE.size)
        p.BATCH_FORGET_IN.pack_into(head, p.IN_HEADER.size, len(rest), 0)
        return _BATCH_FORGET, bytes(head) + b"".join(rest)

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
        return parent_stopped(self.main_pid, data)

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


def main(argv: list[str] | None = None, rows_from: Callable[[int, int], TableRows] | None = None) -> int:
    """A serving process; `rows_from(table_fd, data_fd)` reads the entry table (table nodes)."""
    ap = argparse.ArgumentParser(prog="python -m cachefs.fuse.serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--fuse-fd", type=int, required=True)
    ap.add_argument("--table-fd", type=int, required=True)
    ap.add_argument("--forward-fd", type=int, required=True)
    ap.add_argument("--bufsize", type=int, default=1 << 18)
    ap.add_argument("--parent", type=int, required=True, help="the daemon's pid")
    ap.add_argument("--rows-fd", type=int, default=-1, help="the NVMe tier's entry table (table nodes)")
    ap.add_argument("--data-fd", type=int, default=-1, help="the NVMe tier's data directory")
    ap.add_argument("--ram-fd", type=int, default=-1, help="the RAM tier's data directory")
    ap.add_argument("--ttl", type=float, default=0.0, help="--metadata-ttl, seconds")
    args = ap.parse_args(argv)
    return run(args, rows_from)


def run(args: argparse.Namespace, rows_from: Callable[[int, int], TableRows] | None) -> int:
    die_with_parent()
    if os.getppid() != args.parent:
        return 0  # the daemon is gone already
    forward = socket.socket(fileno=args.forward_fd)
    table = ServeTable.attach(args.table_fd)
    rows = None
    if args.rows_fd >= 0 and table.rows and rows_from is not None:
        try:
            rows = rows_from(args.rows_fd, args.data_fd)
        except (OSError, ValueError) as exc:  # the main process answers those lookups
            print(f"cachefs serving process {args.index}: the entry table: {exc}", file=sys.stderr)
    server = Server(args.index, args.fuse_fd, table, forward, args.bufsize, rows, args.ttl, rows_from, args.ram_fd)
    server.main_pid = os.getppid()
    try:
        return server.run()
    except Exception as exc:  # logged by the daemon from our exit status and stderr
        print(f"cachefs serving process {args.index}: {exc!r}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
