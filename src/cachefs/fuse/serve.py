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
copy): the kernel takes a reply only on the descriptor its request was read from. Every `REPORT_EVERY` requests (or
`REPORT_AFTER` seconds idle) a process reports what it answered: counts per operation and
the node ids it opened, which the main process counts as the tiers' hits.

The table, one shared memory file (memfd), holds per node a backing id (0: ask the main
process) and a record (its published name and entry, under a sequence counter), the
names' hash buckets, and per serving process a busy counter and a count of open handles
and of lookups per node (a release or a forget may come to any process, so a column may
go negative; the sum is what counts). The main process unpublishes a node or a name by
clearing its slot or record, then waits until every serving process has been idle or
finished a request since (`quiesce`), then folds the columns' counts into its own.
"""

from __future__ import annotations

import argparse
import errno
import mmap
import os
import select
import socket
import struct
import sys
import time
from array import array

import xxhash

from cachefs.fuse import protocol as p
from cachefs.fuse.children import die_with_parent, parent_stopped

OWN_FH = 1 << 63          # the handle of an open of a published node: its release may be answered anywhere
REPORT = 1 << 31          # in a forwarded message's index: a serving process's report, not a request
WAKE = 0xFFFFFFFF         # a forwarded message's index: the main process waking its own readers
REPORT_EVERY = 512        # requests answered between reports
REPORT_AFTER = 0.05       # seconds idle before a report of what is pending
SEND_BUFFER = 4 << 20     # the forward socket's buffer (the kernel caps it at net.core.wmem_max)

_MAGIC = b"cfsserv2"
_HEADER = struct.Struct("<8sQIQ")         # magic, capacity, processes, buckets
# A node's record: seq (odd while the main process writes it), parent, deadline (monotonic
# ns), name length (0: not published), entry length; the packed entry_out; the name
_RECORD_HEAD = struct.Struct("<IIqHH4x")
_SEQ = struct.Struct("<I")
_ENTRY = _RECORD_HEAD.size
_NAME = _ENTRY + 128
RECORD = 256
NAME_MAX = RECORD - _NAME                  # longer names are looked up by the main process
_PREFIX = struct.Struct("<I")              # a forwarded message: the serving process's index
PREFIX_SIZE = _PREFIX.size                 # what a forwarded request is longer than the request
# A report: requests answered per kind and their microseconds (the requests forwarded, with
# no time), then the node ids opened (u32)
REPORT_COUNTS = ("open", "release", "lookup", "getattr", "forget", "batch_forget", "other", "forwarded")
_OPEN, _RELEASE, _LOOKUP, _GETATTR, _FORGET, _BATCH_FORGET, _OTHER, _FORWARDED = range(len(REPORT_COUNTS))
_REPORT = struct.Struct("<" + "Q" * (2 * len(REPORT_COUNTS)))
_OPEN_REPLY = struct.Struct("<IiQQIi")    # out header + fuse_open_out
_LINE = 64                                 # each process's busy counter on a cache line of its own


# A serving process's cache line in the table: u64 counters at these indices (the main
# process writes ANSWERED, the serving process the others)
BUSY, PENDING, REPORTS, FORWARDED, ANSWERED = 0, 1, 2, 3, 4
MAX_FORWARDED = 64        # requests forwarded and not answered yet, per serving process
MAIN_CHECK = 0.05         # seconds a look at whether the main process is stopped stays good


class ServeTable:
    """The shared memory of the main process and its serving processes (see the module
    docstring). Layout: a header line, one cache line per process (its busy counter,
    requests answered but not reported yet, reports sent...), then per node id a u32
    backing id, per serving process an i32 open count and an i64 lookup count per node,
    the names' hash buckets (u64 key, u64 node id), and a RECORD per node (its published
    name and entry). The file is sparse: pages are touched only for the node ids in use
    (they are given out densely, see Nodes.recycle) and the buckets' pages."""

    def __init__(self, fd: int, capacity: int, processes: int, buckets: int):
        self.fd, self.capacity, self.processes, self.buckets = fd, capacity, processes, buckets
        self._map = mmap.mmap(fd, self.size(capacity, processes, buckets))
        view = memoryview(self._map)
        base = _LINE * (1 + processes)
        self.busy = view[_LINE:base].cast("Q")  # index k * (_LINE // 8): process k's counter
        self.slots = view[base:base + 4 * capacity].cast("I")
        base += 4 * capacity
        self._counts = [view[base + 4 * capacity * k:base + 4 * capacity * (k + 1)].cast("i")
                        for k in range(processes)]
        base += 4 * capacity * processes
        self._lookups = [view[base + 8 * capacity * k:base + 8 * capacity * (k + 1)].cast("q")
                         for k in range(processes)]
        base += 8 * capacity * processes
        self.bucket = view[base:base + 16 * buckets].cast("Q")  # [2i]: key, [2i + 1]: node id
        base += 16 * buckets
        self.records = view[base:base + RECORD * capacity]
        self._live = 0  # names in the buckets (the main process's count)

    @staticmethod
    def size(capacity: int, processes: int, buckets: int) -> int:
        return (_LINE * (1 + processes) + 4 * capacity * (1 + processes) + 8 * capacity * processes
                + 16 * buckets + RECORD * capacity)

    @classmethod
    def create(cls, capacity: int, processes: int, names: int = 0) -> ServeTable:
        """A new table in a memfd (inherited by the serving processes), with room for
        `names` published names (hash buckets at most half full)."""
        buckets = 1 << max(4, (2 * max(names, 1) - 1).bit_length())
        fd = os.memfd_create("cachefs-serve-table", 0)  # not CLOEXEC: passed to the children
        os.ftruncate(fd, cls.size(capacity, processes, buckets))
        os.pwrite(fd, _HEADER.pack(_MAGIC, capacity, processes, buckets), 0)
        return cls(fd, capacity, processes, buckets)

    @classmethod
    def attach(cls, fd: int) -> ServeTable:
        magic, capacity, processes, buckets = _HEADER.unpack(os.pread(fd, _HEADER.size, 0))
        if magic != _MAGIC:
            raise ValueError("not a cachefs serving table")
        return cls(fd, capacity, processes, buckets)

    def counts(self, index: int) -> memoryview:
        """Serving process `index`'s open counts (index 0 is the first serving process)."""
        return self._counts[index]

    def lookups(self, index: int) -> memoryview:
        """Serving process `index`'s lookup counts (lookups answered less forgets taken)."""
        return self._lookups[index]

    # -- names (both sides) ---------------------------------------------------------------

    def entry(self, parent: int, name: bytes, now_ns: int) -> tuple[int, bytes] | None:
        """The node and packed entry_out published for `name` in directory `parent`, if
        any and still valid at `now_ns` (CLOCK_MONOTONIC). A record being written, or a
        bucket seen half written, is a miss: the main process answers."""
        key = name_key(parent, name)
        bucket, records, mask = self.bucket, self.records, self.buckets - 1
        i = key & mask
        while True:
            found = bucket[2 * i]
            if not found:
                return None
            if found == key:
                nodeid = bucket[2 * i + 1]
                if 0 < nodeid < self.capacity:
                    off = nodeid * RECORD
                    seq, rparent, deadline, namelen, entrylen = _RECORD_HEAD.unpack_from(records, off)
                    if (not seq & 1 and rparent == parent and namelen == len(name) and deadline > now_ns
                            and records[off + _NAME:off + _NAME + namelen] == name):
                        entry = bytes(records[off + _ENTRY:off + _ENTRY + entrylen])
                        if _SEQ.unpack_from(records, off)[0] == seq:
                            return nodeid, entry
                        return None
            i = (i + 1) & mask

    def find(self, parent: int, name: bytes) -> int | None:
        """The node published for `name` in directory `parent`, whatever its deadline."""
        found = self.entry(parent, name, -1 << 62)
        return None if found is None else found[0]

    def has_name(self, nodeid: int) -> bool:
        """Whether the node's name is published (its lookups and forgets are counted in
        the table): a record not being written, with a name."""
        if not 0 < nodeid < self.capacity:
            return False
        seq, _, _, namelen, _ = _RECORD_HEAD.unpack_from(self.records, nodeid * RECORD)
        return not seq & 1 and namelen > 0

    def named(self, nodeid: int, now_ns: int = 0) -> bytes | None:
        """The entry_out of a node whose name is published (valid at `now_ns` if given),
        else None."""
        if not 0 < nodeid < self.capacity:
            return None
        off = nodeid * RECORD
        seq, _, deadline, namelen, entrylen = _RECORD_HEAD.unpack_from(self.records, off)
        if seq & 1 or not namelen or deadline <= now_ns:
            return None
        entry = bytes(self.records[off + _ENTRY:off + _ENTRY + entrylen])
        return entry if _SEQ.unpack_from(self.records, off)[0] == seq else None

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

    def publish_name(self, nodeid: int, parent: int, name: bytes, entry: bytes, deadline_ns: int) -> bool:
        """Lookups of `name` in `parent` may be answered with `entry` (node `nodeid`) by any
        process until `deadline_ns`; a node published already under this name has its
        entry and deadline replaced. One writer at a time (the caller's lock). False when
        the name or the node id does not fit."""
        if not 0 < nodeid < self.capacity or not 0 < len(name) <= NAME_MAX or len(entry) > _NAME - _ENTRY:
            return False
        records, off = self.records, nodeid * RECORD
        seq, rparent, _, namelen, _ = _RECORD_HEAD.unpack_from(records, off)
        known = namelen and rparent == parent and records[off + _NAME:off + _NAME + namelen] == name
        if namelen and not known:
            self.unpublish_name(nodeid)  # published under another name: its bucket goes
            seq += 2
        _SEQ.pack_into(records, off, seq + 1)  # odd: being written (a reader forwards)
        _RECORD_HEAD.pack_into(records, off, seq + 1, parent, deadline_ns, len(name), len(entry))
        records[off + _ENTRY:off + _ENTRY + len(entry)] = entry
        records[off + _NAME:off + _NAME + len(name)] = name
        if not known and not self._insert(name_key(parent, name), nodeid):
            _RECORD_HEAD.pack_into(records, off, seq + 1, 0, 0, 0, 0)  # no room: not published
            _SEQ.pack_into(records, off, seq + 2)
            return False
        _SEQ.pack_into(records, off, seq + 2)
        return True

    def unpublish_name(self, nodeid: int) -> None:
        """Lookups of the node's name go to the main process from now on (a serving process
        may still be answering one: see quiesce)."""
        if not 0 < nodeid < self.capacity:
            return
        records, off = self.records, nodeid * RECORD
        seq, parent, _, namelen, _ = _RECORD_HEAD.unpack_from(records, off)
        if not namelen:
            return
        name = bytes(records[off + _NAME:off + _NAME + namelen])
        _SEQ.pack_into(records, off, seq + 1)
        _RECORD_HEAD.pack_into(records, off, seq + 1, 0, 0, 0, 0)
        _SEQ.pack_into(records, off, seq + 2)
        key, mask, bucket = name_key(parent, name), self.buckets - 1, self.bucket
        i = key & mask
        while bucket[2 * i] != key or bucket[2 * i + 1] != nodeid:
            if not bucket[2 * i]:
                return  # not in the buckets (it did not fit)
            i = (i + 1) & mask
        self._live -= 1
        # Backward-shift deletion (linear probing keeps no tombstones): each later bucket of
        # the run whose home is not between the hole and it moves into the hole. A reader
        # probing meanwhile may miss its name (the lookup goes to the main process), and
        # never pairs a key with another's node: the record is compared in full.
        j = i
        while True:
            j = (j + 1) & mask
            moving = bucket[2 * j]
            if not moving:
                break
            if 0 < ((moving & mask) - i) & mask <= (j - i) & mask:
                continue  # its home is in (i, j]: it stays
            bucket[2 * i + 1] = 0
            bucket[2 * i] = moving
            bucket[2 * i + 1] = bucket[2 * j + 1]
            i = j
        bucket[2 * i + 1] = 0
        bucket[2 * i] = 0

    def _insert(self, key: int, nodeid: int) -> bool:
        if self._live + 1 > self.buckets * 3 // 4:
            return False  # never, with at most half as many names as buckets (create)
        bucket, mask = self.bucket, self.buckets - 1
        i = key & mask
        while bucket[2 * i]:
            i = (i + 1) & mask
        bucket[2 * i + 1] = nodeid
        bucket[2 * i] = key  # the key last: a reader never pairs it with another's node id
        self._live += 1
        return True

    def take_lookups(self, nodeid: int) -> int:
        """The serving processes' lookup counts of `nodeid`, summed and zeroed (after
        unpublish_name and quiesce, when no process changes them)."""
        return self._take(self._lookups, nodeid)

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
        return self._take(self._counts, nodeid)

    def _take(self, columns: list[memoryview], nodeid: int) -> int:
        if not 0 < nodeid < self.capacity:
            return 0
        total = 0
        for column in columns:
            total += column[nodeid]
            column[nodeid] = 0
        return total

    def close(self) -> None:
        for v in (self.busy, self.slots, self.bucket, self.records, *self._counts, *self._lookups):
            v.release()
        self._counts, self._lookups = [], []
        try:
            self._map.close()
        except BufferError:
            pass
        os.close(self.fd)


def name_key(parent: int, name: bytes) -> int:
    """The hash key of a name in a directory (never 0: an empty bucket)."""
    return xxhash.xxh3_64_intdigest(name, seed=parent) | 1


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

    def __init__(self, index: int, fuse_fd: int, table: ServeTable, forward: socket.socket, bufsize: int):
        self.index, self.fd, self.table, self.forward = index, fuse_fd, table, forward
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
            elif opcode == RELEASE and backing and u64(buf, 40)[0] & OWN_FH:
                counts[nodeid] -= 1
                reply(error_reply(16, 0, unique))
                kind = _RELEASE
            elif opcode == LOOKUP and length == n:
                found = entry_of(nodeid, bytes(view[header_size:n - 1]), now_ns())
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
            if self.answered >= REPORT_EVERY:
                self.report()

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
    table = ServeTable.attach(args.table_fd)
    server = Server(args.index, args.fuse_fd, table, forward, args.bufsize)
    server.main_pid = os.getppid()
    try:
        return server.run()
    except Exception as exc:  # logged by the daemon from our exit status and stderr
        print(f"cachefs serving process {args.index}: {exc!r}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
