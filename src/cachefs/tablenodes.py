"""Table nodes: after a start from the NVMe tier's entry table (a clean stop's), each of its
records is a node id of its own (ServeTable.row_base + the record's number), which the
serving processes answer from the table itself (cachefs/fuse/serve.py, cachefs/serving.py):
a cached file's first lookup, its getattrs, forgets and opens, the first open registering
the file. This is the file system's side: the directories' paths published, a table node
known here when a request for it comes here, taken from the serving processes when they
must stop answering it, and their registrations bounded. A mixin of CachefsFS
(cachefs/fs.py) beside Published (cachefs/published.py), whose reaper folds what they
counted. docs/design.md, "Table nodes"."""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import queue
import threading
import time
from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING

from cachefs.config import SWITCH_RETRY, SWITCH_RETRY_MAX
from cachefs.fuse import protocol as p
from cachefs.fuse.serve import REGISTERED, REGISTERED_RAM
from cachefs.fuse.servetable import RAM_REGISTERED, RAM_WANTED, ROW_FREE, ROW_TAKEN, ServeTable, TableNodes
from cachefs.identity import FS_ENCODING, FS_ERRORS, Attr, FileId
from cachefs.nodes import Backings, NodeOpen, Nodes, version_of
from cachefs.tiers.multilevel import TableFile

if TYPE_CHECKING:
    from cachefs.config import Config
    from cachefs.core import Core
    from cachefs.fuse.session import Session

log = logging.getLogger(__name__)

class TableNodeOwner:
    """The file system's table nodes (see the module docstring)."""

    core: Core
    config: Config
    nodes: Nodes
    session: Session | None
    _table: ServeTable | None
    _ttl: float
    _backings: Backings | None
    _opens: dict[int, NodeOpen]
    _opens_lock: threading.Lock
    _published: dict[bytes, int]
    _unpublished: queue.SimpleQueue[tuple]
    _node_lock: Callable[..., contextlib.AbstractContextManager[None]]
    _forgotten: Callable[[int], None]
    _take_back: Callable[[ServeTable, int, NodeOpen, bool], None]
    _take_name: Callable[[int], None]
    _publish_known: Callable[..., bool]
    _named: collections.OrderedDict[int, int]
    _names_lock: threading.Lock
    _name_limit: int
    _changed: queue.Queue[str | array]

    _rows: bool  # table nodes are on
    _dirs_published: set[int]
    _row_order: array  # table nodes the serving processes registered, oldest first (from _row_head)
    _row_head: int
    _rows_registered: int  # of them, still theirs (the backing limit counts them)
    _backing_limit: int  # backing ids registered, this process's and theirs, at most (--backing-files)
    _rows_cv: threading.Condition  # the counts above, and the nodes whose backing id is being closed:
    _rows_closing: set[int]        # a taking waits those out (see _close_rows)
    _rows_switching: set[int]  # table nodes whose registration is of the copy not wanted (the reaper's)
    _switch_retry: list[int]  # of them, those to try again (something was open)
    _switch_wait: float  # seconds before that (SWITCH_RETRY, doubled while the tries close nothing)
    _init_checkpoints: Callable[[], None]

    def _init_table_nodes(self) -> None:
        """Whether table nodes are on, directories whose path is published, what the
        serving processes registered, and a checkpoint's thread and descriptors
        (cachefs/checkpointing.py)."""
        self._rows = False
        self._dirs_published = set()
        self._row_order = array("I")
        self._row_head = 0
        self._rows_registered = 0
        self._rows_cv = threading.Condition()
        self._rows_closing = set()
        self._rows_switching, self._switch_retry, self._switch_wait = set(), [], SWITCH_RETRY
        self._init_checkpoints()

    def _start_rows(self, count: int, checkpoint: tuple[int, int] | None = None) -> None:
        """The serving processes answer `count` table nodes: those of the entry table
        start_serving found, or of a `checkpoint` (its table's and data directory's
        descriptors, published to them here, once this process is ready for their nodes)."""
        table = self._table
        assert table is not None and 0 < count <= table.room
        self._rows = True
        self.nodes.reserve(table.row_base, table.row_base + table.room)
        self.nodes.resolve = self._resolve_row
        self.core.cache.on_unpathed(lambda n: self._unpublished.put(("retire", n)))
        if checkpoint is not None:
            table.publish_rows(count, *checkpoint)  # (Server.rows_published maps it)
        self._publish_dir_path(p.ROOT_ID, "/")
        log.info("serving processes answer the %d files of the %s", count,
                 "checkpoint's entry table" if checkpoint is not None else "entry table")

    def _publish_dir_path(self, nodeid: int, path: str) -> None:
        """A directory looked up: the serving processes look its files up in the entry table
        (under its path, in the node's record; the node pinned for good, so that its id
        stays this path's)."""
        table = self._table
        with self._names_lock:  # one writer of the records at a time (and of this node's once)
            if table is None or nodeid in self._dirs_published or not self.nodes.pin(nodeid):
                return
            if not table.publish_dir(nodeid, path.encode(FS_ENCODING, FS_ERRORS)):
                self.nodes.unpin(nodeid)
                return
            self._dirs_published.add(nodeid)
        self.core.rows_serving(path)

    def _free_row(self, path: str, a: Attr) -> tuple[int, TableFile] | None:
        """The table node and record of `path` as `a` describes it, if the serving processes
        answer it."""
        assert self._table is not None
        n = self.core.cache.table_record_of(path)
        if n is None or n >= self._table.rows or not self._table.row_theirs(n):
            return None  # (or a checkpoint's next generation, not published yet)
        row = self.core.cache.table_file(n)
        if row is None or version_of(row.attr) != version_of(a):
            return None
        return self._table.row_base + n, row

    def _row_confirmed(self, eid: bytes, n: int = -1) -> None:
        """KernelHooks.on_confirmed: the source has the cached file version `eid` still (in
        record `n` of the entry table, if known: a search by its id was as costly as the
        confirmation, in a directory's check after a restart). If
        a table node stands for it, the serving processes answer the node for
        --metadata-ttl from now (ServeTable.confirm_row), as this process answers from its
        index: past the TTL of when the files were fetched, an epoch's lookups go to the
        daemon until a stat or its directory's listing confirms them, not for the rest of
        the mount."""
        table = self._table
        if table is None or not self._rows:
            return
        found = n if n >= 0 else self.core.cache.table_record_of_entry(eid)
        if found is not None and found < table.rows:
            table.confirm_row(found, time.time())

    def _resolve_row(self, nodeid: int) -> bool:
        """Nodes.resolve: a request for a table node the serving processes forwarded (one
        they do not answer, an extended attribute, a getattr after --metadata-ttl): the
        node is known here from its record from now on, as the version it stands for."""
        table = self._table
        n = -1 if table is None or not self._rows else table.row_of(nodeid)
        if n < 0 or table is None or not table.row_theirs(n):
            return False  # taken, and forgotten since: the kernel no longer holds it
        row = self.core.cache.table_file(n)
        if row is None:
            return False
        self.nodes.adopt(nodeid, row.path, row.attr)
        return True

    def _take_row(self, n: int) -> None:
        """Table node n becomes this process's: the serving processes answer none of its
        requests from now on (its lookups, forgets and opens are forwarded once they
        quiesce), a backing id one of them registered is this process's (closed at its last
        close), and the reaper folds their counts into its own (_row_taken). A taken node
        is this process's for the rest of the mount; after the kernel forgets it, its file
        gets a node of this process's numbering. (RAM taking the file does not take it:
        _switch_row_of.)"""
        table = self._table
        assert table is not None and self._rows
        nodeid = table.row_base + n
        if table.row_state[n] == ROW_TAKEN:
            return
        row = self.core.cache.table_file(n)
        state = None
        with self._node_lock(nodeid, refusable=False):
            adopted = row is not None and self.nodes.adopt(nodeid, row.path, row.attr)
            with self._rows_cv:
                if n in self._rows_closing:  # (_rows_closed ends it without the node's lock)
                    assert self.session is not None
                    with self.session.blocking(refusable=False):  # another thread reads meanwhile
                        while n in self._rows_closing:
                            self._rows_cv.wait()
                backing_id = table.take_row(n)
                self._rows_registered -= backing_id > 0
            if backing_id < 0:  # taken meanwhile (its pin is that taking's)
                if adopted:
                    self.nodes.unpin(nodeid)
                return
            if row is None:
                return  # fails its CRC: no serving process answered it
            if backing_id:  # (its copy byte stays as the registration left it)
                key = Backings.ram_key(row.eid) if table.row_copy[n] & RAM_REGISTERED else row.eid
                state = NodeOpen(FileId.of(row.path, row.attr))
                state.refs, state.backing_id, state.eid = 0, backing_id, key
                state.published = state.private = True
                with self._opens_lock:
                    self._opens[nodeid] = state
                self._published.setdefault(key, nodeid)
        self.core.stats.incr("serve.table_nodes_taken")
        self._unpublished.put(("row", nodeid, state))

    def _retire(self, n: int) -> None:
        try:
            self._take_row(n)  # queues ("row", ...) for the reaper
        except Exception:
            log.exception("taking table node %d from the serving processes failed", n)

    def _row_taken(self, table: ServeTable, nodeid: int, state: NodeOpen | None) -> None:
        """After quiesce: a taken table node's opens and lookups the serving processes
        counted are its own now (as _take_back and _name_taken fold them)."""
        if state is not None:
            self._take_back(table, nodeid, state, False)
        if self.nodes.unpin(nodeid, table.take_lookups(nodeid)):
            self._forgotten(nodeid)

    def _take_row_of(self, eid: bytes) -> None:
        """The NVMe tier dropped the entry: its table node (if the serving processes still
        answer it) is taken, by the reaper (a tier's lock may be held here)."""
        n = self._row_theirs_of(eid)
        if n is not None:
            self._unpublished.put(("retire", n))

    def _row_theirs_of(self, eid: bytes) -> int | None:
        """The table node of entry `eid`, if the serving processes answer it."""
        if not self._rows or self._table is None:
            return None
        n = self.core.cache.table_record_of_entry(eid)
        return n if n is not None and n < self._table.rows and self._table.row_theirs(n) else None

    # -- which copy a table node's registration passes through: RAM's or the NVMe tier's ---------

    def _switch_row_of(self, eid: bytes, ram: bool) -> None:
        """RAM took the file (`ram`) or let it go: the serving processes' next registration
        of its table node is to be of RAM's copy, or of the NVMe tier's (by the reaper:
        _close_rows). The node stays theirs: before, RAM taking it took its opens, and the
        daemon registered RAM's copy and kept the node, its state, its name and its
        registration (1.6-2.1 KB a file RAM holds, measured)."""
        n = self._row_theirs_of(eid)
        if n is not None:
            self._unpublished.put(("switch", n, ram))

    def _rows_counted(self, reported: list[int]) -> None:
        """Table nodes a serving process registered a backing id for (node ids as reported:
        REGISTERED, and REGISTERED_RAM for RAM's copy): counted against the backing limit
        with this process's own registrations; past it, the oldest ids are closed (by the
        reaper: _close_rows), the nodes staying the serving processes'. A registration of
        the NVMe copy vouches for its record (the restart check's tests passed)."""
        table = self._table
        assert table is not None and self._backings is not None
        registered = [nodeid & ~(REGISTERED | REGISTERED_RAM) for nodeid in reported]
        nvme = [nodeid & ~REGISTERED for nodeid in reported if not nodeid & REGISTERED_RAM]
        self.core.stats.add_many({"serve.table_registrations": len(registered),
                                  "serve.table_registrations_ram": len(registered) - len(nvme)})
        order, base = self._row_order, table.row_base
        self.core.cache.table_rows_vouched([nodeid - base for nodeid in nvme])
        with self._rows_cv:
            order.extend(registered)
            self._rows_registered += len(registered)
            while self._rows_registered + len(self._backings) > self._backing_limit and self._row_head < len(order):
                nodeid = order[self._row_head]
                self._row_head += 1
                if table.row_state[nodeid - base] == ROW_FREE and table.slots[nodeid]:
                    self._rows_registered -= 1  # (given back if it was not closed)
                    self._unpublished.put(("close", nodeid - base))
            if self._row_head > 4096 and self._row_head * 2 > len(order):
                del order[:self._row_head]
                self._row_head = 0

    def _close_rows(self, rows: list[int], switches: list[tuple[int, bool | None]]) -> dict[int, int]:
        """The reaper, before a quiesce: the backing ids of these table nodes are to be
        closed (ServeTable.close_row): `rows` past the limit, `switches` (node, whether
        RAM's copy is wanted; None: as wanted now, a retry) where the id is the other copy's
        (_switch_row_of; once closed the next open registers the copy wanted; while
        something is open, tried again SWITCH_RETRY later, and less often while that
        lasts: until then the kernel reads the copy it has, the same bytes). The ids by
        node. A taking of one of them waits until _rows_closed. (Before the limit took
        nodes whole, and at 1.28 million files every open of the epoch after the first
        came to this process.)"""
        table = self._table
        assert table is not None
        closing = {}
        wanted = [(n, bool(table.row_copy[n] & RAM_WANTED) if ram is None else ram) for n, ram in switches]
        with self._rows_cv:
            for n, ram in [*wanted, *((n, None) for n in rows)]:
                try:
                    backing_id = table.close_row(n, ram)
                except OSError as exc:  # (its lock: nothing changed)
                    log.warning("closing the backing id of table node %d: %s", n, exc.strerror)
                    backing_id = 0
                if backing_id:
                    closing[n] = backing_id
                    self._rows_closing.add(n)
                    if ram is not None:
                        self._rows_switching.add(n)
                        self._rows_registered -= 1  # (given back if it is not closed)
                elif ram is None:
                    self._rows_registered += 1  # taken meanwhile (the taking counted it), or queued twice
                elif n not in self._rows_closing:  # (nothing to close: taken, or the copy wanted)
                    self._rows_switching.discard(n)
        return closing

    def _rows_closed(self, closing: dict[int, int]) -> None:
        """After the quiesce: the ids of nodes with nothing open are closed (their next open
        registers one again, in a serving process); a node still open keeps its id, and
        goes to the back of the queue."""
        table = self._table
        assert table is not None and self.session is not None
        closed, switched = [], [0, 0]  # to RAM's copy, back to the NVMe copy
        with self._rows_cv:
            try:
                for n, backing_id in closing.items():
                    if table.row_closed(n, backing_id):
                        closed.append(backing_id)
                        if n in self._rows_switching:
                            self._rows_switching.discard(n)
                            switched[not table.row_copy[n] & RAM_WANTED] += 1
                    else:
                        self._rows_registered += 1
                        if n in self._rows_switching:  # (its registration's place in the order stays)
                            self._switch_retry.append(n)
                        else:
                            self._row_order.append(table.row_base + n)
            finally:  # a taking waiting on one of them must never wait for good
                self._rows_closing.difference_update(closing)
                self._rows_cv.notify_all()
        if self._switch_retry:
            self._switch_wait = SWITCH_RETRY if sum(switched) else min(2 * self._switch_wait, SWITCH_RETRY_MAX)
        for backing_id in closed:
            self._close_private(backing_id)
        self.core.stats.add_many({"serve.table_backings_closed": len(closed) - sum(switched),
                                  "serve.table_switches": switched[0], "serve.table_switches_back": switched[1]})

    def _close_private(self, backing_id: int) -> None:
        """Close a backing id a serving process registered (the daemon holds no file for
        it). A connection already gone closes it anyway: nothing to say."""
        if self.session is None:
            return
        try:
            self.session.backing_close(backing_id)
        except OSError as exc:
            (log.debug if exc.errno in (errno.ENODEV, errno.ENOTCONN, errno.EBADF) else log.warning)(
                "closing backing id %d: %s", backing_id, exc.strerror)

    def _acl_blind(self) -> bool:
        """Under --allow-other a file's mode is cut down to what its POSIX ACL grants
        (Metadata._with_acl, a request to the source): an entry table's records carry the
        source's mode, so no table nodes are answered from them (the daemon answers)."""
        return self.config.allow_other

    def _table_nodes(self) -> TableNodes | None:
        """What the serving processes answer table nodes from, after a start from the NVMe
        tier's entry table (a clean stop's); None after any other start, or without
        serving processes, or under --allow-other (see _acl_blind)."""
        if not self.config.serve_processes or self._acl_blind():
            return None
        found = self.core.cache.entry_table()
        if found is None:
            return None
        table_fd, count = found
        data_fd = self._dir_fd(self.core.cache.fill_dir, "the NVMe tier's data directory")
        if data_fd < 0:
            os.close(table_fd)
            return None
        return TableNodes(count, table_fd, data_fd, self._ttl)

    @staticmethod
    def _dir_fd(path: str | None, what: str) -> int:
        """A descriptor of directory `path` (O_PATH) for the serving processes, which open
        cache files beneath it; -1 if there is none (logged: the daemon answers its files)."""
        if path is None:
            return -1
        try:
            return os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            log.warning("%s: %s; the daemon answers its files", what, exc.strerror)
            return -1

    def _table_lookup(self, path: str, a: Attr) -> tuple[int, bool]:
        """A lookup this process answers, with table nodes on: (node id, new) as
        Nodes.looked_up gives them, or (minus the node id, False) when there is nothing
        to publish: a directory (its path published instead), or a file the serving
        processes answer as a table node (the same node id as theirs)."""
        if a.is_dir:
            nodeid = self.nodes.add(path, a)
            self._publish_dir_path(nodeid, path)
            return -nodeid, False
        free = self._free_row(path, a) if a.is_file else None
        if free is None:
            return self.nodes.looked_up(path, a)
        nodeid, row = free
        self.nodes.adopt(nodeid, row.path, row.attr)
        found = self.nodes.add(path, a)
        return (-nodeid, False) if found == nodeid else (found, False)  # (the path's own node was here first)
