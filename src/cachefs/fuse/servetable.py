"""The shared memory of the daemon and its serving processes (cachefs/fuse/serve.py).

One memory file (memfd) holds per node a backing id (0: ask the main process) and a record
(its published name and entry, under a sequence counter; for a directory, its path), the
names' hash buckets, per serving process a busy counter and a count of open handles and of
lookups per node (a release or a forget may come to any process, so a column may go
negative; the sum is what counts), and per table node (a record of the NVMe tier's entry
table, after a start from it) a state byte, a lock and when the main process last found
its file unchanged on the source. The main process unpublishes a node
or a name by clearing its slot or record, then waits until every serving process has been
idle or finished a request since (`quiesce`), then folds the columns' counts into its own.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import struct
import time
from collections.abc import Iterable
from typing import NamedTuple

import xxhash

_MAGIC = b"cfsserv6"
# magic, capacity, processes, buckets, row base, room for table nodes, table nodes, their
# generation (1: the table nodes of a start's table or of a checkpoint; 0: none yet), the
# table's and the data directory's descriptors in the main process (a checkpoint's: the
# serving processes open them through /proc)
_HEADER = struct.Struct("<8sQIQQQQIii")
_ROWS_AT = 44                              # the header's table nodes field, then the rest
_ROWS = struct.Struct("<QIii")
# A node's record: seq (odd while the main process writes it), parent, deadline (monotonic
# ns), name length (0: not published), entry length; the packed entry_out; the name
_RECORD_HEAD = struct.Struct("<IIqHH4x")
_SEQ = struct.Struct("<I")
_ENTRY = _RECORD_HEAD.size
_NAME = _ENTRY + 128
RECORD = 256
NAME_MAX = RECORD - _NAME                  # longer names are looked up by the main process
DIR_PATH = 0xFFFF                          # a record's entry length: the record holds a directory's path
DIR_PATH_MAX = RECORD - _ENTRY             # (at _ENTRY); a longer path's files are the main process's
# A table node's state: the serving processes' (FREE); the main process's (TAKEN); or the
# serving processes' while the main process closes the backing id one of them registered
# (CLOSING: they register none and answer its releases; see close_row)
ROW_FREE, ROW_TAKEN, ROW_CLOSING = 0, 1, 2
# A table node's copy byte: the main process wants RAM's copy registered for it (RAM holds
# the file: RAM_WANTED), and the slot's backing id (or the one being closed) is RAM's copy
# (RAM_REGISTERED, written with the slot by whoever registers it). See close_row.
RAM_WANTED, RAM_REGISTERED = 1, 2
_LOCK_AT = 1 << 40                         # table node n's lock: byte _LOCK_AT + n of the table (fcntl)
_FLOCK = struct.Struct("hh4xqqi4x")        # struct flock: type, whence, start, len, pid
_LINE = 64                                 # each process's busy counter on a cache line of its own


# A serving process's cache line in the table: u64 counters at these indices (the main
# process writes ANSWERED and REPORT_OPENS, the serving process the others; MAPPED: the
# generation of table nodes it maps; REPORT_OPENS: report after this many opens, 0 for
# REPORT_EVERY requests, see ServeTable.report_opens)
BUSY, PENDING, REPORTS, FORWARDED, ANSWERED, MAPPED, REPORT_OPENS = 0, 1, 2, 3, 4, 5, 6
F_OFD_SETLKW = 38         # (fcntl.F_OFD_SETLKW where Python has it; Linux 3.15)


class TableNodes(NamedTuple):
    """What the serving processes answer table nodes from: the NVMe tier's entry table
    (`records` of them; a descriptor each process maps), the tier's data directory (a
    descriptor: cache files opened beneath it) and --metadata-ttl."""

    records: int
    table_fd: int
    data_fd: int
    ttl: float


class ServeTable:
    """The shared memory of the main process and its serving processes (see the module
    docstring). Layout: a header line, one cache line per process (its busy counter,
    requests answered but not reported yet, reports sent...), then per node id a u32
    backing id, per serving process an i32 open count and an i64 lookup count per node,
    the names' hash buckets (u64 key, u64 node id), a RECORD per node (its published
    name and entry), then per table node its state byte, its copy byte (close_row) and
    (8-byte aligned) a u32 of when its file was last confirmed on the source (confirm_row). The file is sparse:
    pages are touched only for the node ids in use (they are given out densely, see
    Nodes.recycle) and the buckets' pages."""

    def __init__(self, fd: int, capacity: int, processes: int, buckets: int, row_base: int = 0, rows: int = 0,
                 room: int = 0):
        self.fd, self.capacity, self.processes, self.buckets = fd, capacity, processes, buckets
        room = max(room, rows)
        self.row_base, self.rows, self.room = row_base, rows, room  # table nodes, and room for them
        self.rows_gen = 1 if rows else 0
        self._map = mmap.mmap(fd, self.size(capacity, processes, buckets, room))
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
        base += RECORD * capacity
        self.row_state = view[base:base + room]  # per table node: ROW_FREE, ROW_TAKEN or ROW_CLOSING
        base += _aligned(room)
        self.row_copy = view[base:base + room]  # per table node: RAM_WANTED | RAM_REGISTERED
        base += _aligned(room)
        self.confirmed = view[base:base + 4 * room].cast("I")  # per table node: see confirm_row
        self._live = 0  # names in the buckets (the main process's count)
        # This process's own open file description of the table: the rows' locks (fcntl
        # OFD locks) are held per description, and an inherited descriptor shares one
        self._lock_fd = os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC) if room else -1

    @staticmethod
    def size(capacity: int, processes: int, buckets: int, room: int = 0) -> int:
        return (_LINE * (1 + processes) + 4 * capacity * (1 + processes) + 8 * capacity * processes
                + 16 * buckets + RECORD * capacity + 2 * _aligned(room) + 4 * room)

    @classmethod
    def create(cls, capacity: int, processes: int, names: int = 0, rows: int = 0, room: int = 0) -> ServeTable:
        """A new table in a memfd (inherited by the serving processes), with room for
        `names` published names (hash buckets at most half full), and for `rows` table
        nodes (the records of the NVMe tier's entry table, see Server.row_lookup), or
        `room` for as many that a checkpoint publishes later (publish_rows): node ids
        `capacity` to `capacity + max(rows, room)`. (The file is sparse: room costs
        nothing until it is used.)"""
        buckets = 1 << max(4, (2 * max(names, 1) - 1).bit_length())
        fd = os.memfd_create("cachefs-serve-table", 0)  # not CLOEXEC: passed to the children
        room = max(room, rows)
        row_base = capacity if room else 0
        capacity += room
        os.ftruncate(fd, cls.size(capacity, processes, buckets, room))
        head = _HEADER.pack(_MAGIC, capacity, processes, buckets, row_base, room, rows, int(rows > 0), -1, -1)
        os.pwrite(fd, head, 0)
        return cls(fd, capacity, processes, buckets, row_base, rows, room)

    @classmethod
    def attach(cls, fd: int) -> ServeTable:
        magic, capacity, processes, buckets, row_base, room, rows, gen, _, _ = _HEADER.unpack(
            os.pread(fd, _HEADER.size, 0))
        if magic != _MAGIC:
            raise ValueError("not a cachefs serving table")
        table = cls(fd, capacity, processes, buckets, row_base, rows, room)
        table.rows_gen = gen
        return table

    # -- a checkpoint's table nodes (both sides) --------------------------------------------

    def publish_rows(self, rows: int, table_fd: int, data_fd: int) -> None:
        """(The main process) the `rows` records of a checkpoint's entry table are table
        nodes from now on: the serving processes open the table and the data directory
        through these descriptors of the main process's (rows_published), and answer them.
        A next generation has more rows, the ones before it in their numbers: the ids of
        table nodes stay their records'."""
        assert self.rows <= rows <= self.room and rows > 0
        self.rows, self.rows_gen = rows, self.rows_gen + 1
        _ROWS.pack_into(self._map, _ROWS_AT, rows, 0, table_fd, data_fd)
        _SEQ.pack_into(self._map, _ROWS_AT + 8, self.rows_gen)  # the generation last

    def rows_published(self) -> tuple[int, int, int, int] | None:
        """(A serving process) (generation, rows, the main process's descriptors of the
        table and of the data directory) if it published table nodes since this process
        last looked; else None. One read of shared memory. The process takes them
        (rows_mapped) once it has mapped the table."""
        gen = _SEQ.unpack_from(self._map, _ROWS_AT + 8)[0]  # the generation first: written last
        if gen == self.rows_gen or not gen:
            return None
        rows, _, table_fd, data_fd = _ROWS.unpack_from(self._map, _ROWS_AT)
        return gen, min(rows, self.room), table_fd, data_fd

    def rows_mapped(self, index: int, gen: int, rows: int) -> None:
        """(Serving process `index`) it answers `rows` table nodes of generation `gen`
        from now on (or, with `rows` 0, none: it could not map them, and does not try
        that generation again)."""
        self.rows_gen = gen
        if rows:
            self.rows = rows
            self.set_line(index, MAPPED, gen)

    def rows_everywhere(self, alive: list[bool]) -> bool:
        """(The main process) whether every live serving process maps the newest table
        nodes' generation (the tables before it are mapped nowhere then)."""
        return all(self.line(k, MAPPED) >= self.rows_gen for k in range(self.processes) if alive[k])

    # -- table nodes (both sides) ---------------------------------------------------------

    def row_of(self, nodeid: int) -> int:
        """The table record a node id stands for, or -1 (not a table node)."""
        n = nodeid - self.row_base
        return n if self.row_base and 0 <= n < self.rows else -1

    def row_lock(self, n: int, lock: bool = True) -> None:
        """Take (or give back) table node n's lock, across processes: the check that no
        backing id is registered for it and the registration are one step, and so are the
        main process's taking it and reading its backing id. One registration per inode:
        two make the kernel fail an open (EIO)."""
        fcntl.fcntl(self._lock_fd, F_OFD_SETLKW,
                    _FLOCK.pack(fcntl.F_WRLCK if lock else fcntl.F_UNLCK, os.SEEK_SET, _LOCK_AT + n, 1, 0))

    def confirm_row(self, n: int, when: float) -> None:
        """(The main process) table node n's file was found on the source as its record
        has it at wall time `when` (a second, rounded down): the serving processes answer
        it for --metadata-ttl from then, as from when the record was stored
        (Server.row_entry). One aligned store, read without a lock; the record never
        changes under its number (a checkpoint's next generation keeps it there)."""
        if 0 <= n < self.room:
            self.confirmed[n] = max(self.confirmed[n], min(int(when), 0xFFFFFFFF))

    def take_row(self, n: int) -> int:
        """The main process takes table node n (its requests go to it from now on, once
        quiesced): the backing id a serving process registered for it (0 if none; RAM's copy
        if row_copy says so), its slot cleared. -1 if it had it already. (Callers in the
        main process serialize the takings of one node, and wait out its closing: the lock
        is per process.)"""
        self.row_lock(n)
        try:
            state = self.row_state[n]
            assert state != ROW_CLOSING, "a table node is taken while its backing id is being closed"
            if state == ROW_TAKEN:
                return -1
            self.row_state[n] = ROW_TAKEN
            nodeid = self.row_base + n
            backing_id = int(self.slots[nodeid])
            self.slots[nodeid] = 0
            return backing_id
        finally:
            self.row_lock(n, False)

    def row_theirs(self, n: int) -> bool:
        """Whether the serving processes answer table node n (FREE, or CLOSING)."""
        return self.row_state[n] in (ROW_FREE, ROW_CLOSING)

    def close_row(self, n: int, ram: bool | None = None) -> int:
        """Close the backing id a serving process registered for table node n without taking
        the node, in two steps with a quiesce between them; this is the first. A FREE
        node's slot is cleared and the node is CLOSING: no serving process registers an id
        for it, and they answer its releases still (without the slot). The id, or 0 (not
        FREE, or nothing registered). With `ram` (a switch): the node's opens are to pass
        RAM's copy through (RAM holds the file) or, False, the NVMe tier's (RAM let it go),
        and the serving process that registers its next id opens that copy; the id is
        closed only if it is the other copy's."""
        nodeid = self.row_base + n
        self.row_lock(n)
        try:
            copy = self.row_copy[n]
            if ram is not None:
                self.row_copy[n] = (copy | RAM_WANTED) if ram else (copy & ~RAM_WANTED)
                if bool(copy & RAM_REGISTERED) == ram:
                    return 0
            if self.row_state[n] != ROW_FREE or not self.slots[nodeid]:
                return 0
            self.row_state[n] = ROW_CLOSING
            backing_id = int(self.slots[nodeid])
            self.slots[nodeid] = 0
            return backing_id
        finally:
            self.row_lock(n, False)

    def want_ram(self, rows: Iterable[int]) -> None:
        """(The main process) table nodes not published yet whose files RAM holds: a serving
        process's first registration of one opens RAM's copy (see close_row)."""
        copy = self.row_copy
        for n in rows:
            copy[n] |= RAM_WANTED

    def row_closed(self, n: int, backing_id: int) -> bool:
        """close_row's second step, after a quiesce: the node is FREE again. With nothing
        open (the serving processes' open counts sum to 0) its slot stays empty and the id
        is the caller's to close, True; else the slot holds the id again (its opens use it:
        one backing file per inode), False."""
        nodeid = self.row_base + n
        self.row_lock(n)
        try:
            assert self.row_state[n] == ROW_CLOSING
            self.row_state[n] = ROW_FREE
            if sum(column[nodeid] for column in self._counts):
                self.slots[nodeid] = backing_id
                return False
            self.row_copy[n] &= ~RAM_REGISTERED
            return True
        finally:
            self.row_lock(n, False)

    def publish_dir(self, nodeid: int, path: bytes) -> bool:
        """Directory node `nodeid` is `path`: the serving processes look its files up in the
        entry table. False if the path or the id does not fit (its files' lookups stay the
        main process's). The node's record holds no name (a directory's name is never
        published)."""
        if not self.rows or not 0 < nodeid < self.capacity or len(path) > DIR_PATH_MAX:
            return False
        records, off = self.records, nodeid * RECORD
        seq = _SEQ.unpack_from(records, off)[0]
        _SEQ.pack_into(records, off, seq + 1)
        _RECORD_HEAD.pack_into(records, off, seq + 1, 0, 0, len(path), DIR_PATH)
        records[off + _ENTRY:off + _ENTRY + len(path)] = path
        _SEQ.pack_into(records, off, seq + 2)
        return True

    def dir_path(self, nodeid: int) -> bytes | None:
        """The path published for directory node `nodeid` (publish_dir), or None."""
        if not 0 < nodeid < self.capacity:
            return None
        records, off = self.records, nodeid * RECORD
        seq, _, _, length, kind = _RECORD_HEAD.unpack_from(records, off)
        if seq & 1 or kind != DIR_PATH:
            return None
        path = bytes(records[off + _ENTRY:off + _ENTRY + length])
        return path if _SEQ.unpack_from(records, off)[0] == seq else None

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
        the table): a record not being written, with a name; or a table node whose name the
        main process has not taken."""
        if not 0 < nodeid < self.capacity:
            return False
        n = nodeid - self.row_base
        if self.row_base and 0 <= n < self.rows and self.row_state[n] != ROW_TAKEN:
            return True
        seq, _, _, namelen, kind = _RECORD_HEAD.unpack_from(self.records, nodeid * RECORD)
        return not seq & 1 and namelen > 0 and kind != DIR_PATH

    def named(self, nodeid: int, now_ns: int = 0) -> bytes | None:
        """The entry_out of a node whose name is published (valid at `now_ns` if given),
        else None."""
        if not 0 < nodeid < self.capacity:
            return None
        off = nodeid * RECORD
        seq, _, deadline, namelen, entrylen = _RECORD_HEAD.unpack_from(self.records, off)
        if seq & 1 or not namelen or deadline <= now_ns or entrylen == DIR_PATH:
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
        seq, parent, _, namelen, entrylen = _RECORD_HEAD.unpack_from(records, off)
        if not namelen or entrylen == DIR_PATH:
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

    def report_opens(self, every: int) -> None:
        """Ask every serving process to report after `every` opens (0: after REPORT_EVERY
        requests, the default): while a job's order hints hold files pinned in RAM, each
        pin goes when the daemon hears of the file's open, and a report of 512 requests
        held the reads of a hundred files or more pinned, a window's worth."""
        for k in range(self.processes):
            self.set_line(k, REPORT_OPENS, every)

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
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
        for v in (self.busy, self.slots, self.bucket, self.records, self.row_state, self.row_copy, self.confirmed,
                  *self._counts, *self._lookups):
            v.release()
        self._counts, self._lookups = [], []
        try:
            self._map.close()
        except BufferError:
            pass
        os.close(self.fd)


def _aligned(size: int) -> int:
    return (size + 7) & ~7


def name_key(parent: int, name: bytes) -> int:
    """The hash key of a name in a directory (never 0: an empty bucket)."""
    return xxhash.xxh3_64_intdigest(name, seed=parent) | 1
