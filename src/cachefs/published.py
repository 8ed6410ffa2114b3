"""The file system's side of the serving processes (cachefs/fuse/serve.py): which names and
nodes are published in their table, taking them back (a node forgotten by the kernel, its
entry dropped by a tier, a name changed on the source or pushed out by newer ones), and
their reports counted as the tiers' hits. A mixin of CachefsFS (cachefs/fs.py), which owns
the state it works on."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import stat as stat_mod
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from cachefs.config import AHEAD_DIRS_MAX, AHEAD_ROOM
from cachefs.fuse import protocol as p
from cachefs.fuse.serve import REGISTERED, decode_report
from cachefs.fuse.servetable import NAME_MAX, RAM_REGISTERED, ServeTable
from cachefs.identity import FS_ENCODING, FS_ERRORS, Attr, FileId
from cachefs.nodes import Backings, NodeOpen, Nodes, version_of

if TYPE_CHECKING:
    from cachefs.core import Core
    from cachefs.fuse.session import Session

log = logging.getLogger(__name__)


class Published:
    """Nodes published to the serving processes (see design.md, "Serving processes")."""

    core: Core
    nodes: Nodes
    session: Session | None
    _opens: dict[int, NodeOpen]
    _opens_lock: threading.Lock
    _backings: Backings | None
    _table: ServeTable | None
    _published: dict[bytes, int]  # Backings key -> the node published with it
    # What the reaper takes back: ("node", node id, its state, forgotten), ("copy", key),
    # ("name", node id, parent), or ("stop",)
    _unpublished: queue.SimpleQueue[tuple]
    _named: collections.OrderedDict[int, int]  # node id -> parent: published names, oldest first
    _naming: set[int]  # names being taken back (not published again until then)
    _names_lock: threading.Lock
    _name_limit: int
    _valid: tuple[int, int]
    # Directories whose cached files are published ahead (see _publish_dir)
    _ahead_seen: set[str]
    _ahead_unlisted: set[str]  # directories found with no listing in memory or kept
    _ahead_queue: queue.SimpleQueue[str | None]
    _ahead_thread: threading.Thread | None
    _ahead_stopped: bool
    _node_lock: Callable[..., contextlib.AbstractContextManager[None]]
    _closed: Callable[[NodeOpen], None]
    _forgotten: Callable[[int], None]
    # Table nodes (cachefs/tablenodes.py)
    _rows: bool
    _take_row: Callable[..., None]
    _take_row_of: Callable[..., None]
    _switch_row_of: Callable[[bytes, bool], None]
    _switch_retry: list[int]
    _switch_wait: float
    _retire: Callable[..., None]
    _row_taken: Callable[[ServeTable, int, NodeOpen | None], None]
    _rows_counted: Callable[[list[int]], None]
    _close_rows: Callable[[list[int], list[tuple[int, bool | None]]], dict[int, int]]
    _rows_closed: Callable[[dict[int, int]], None]

    def _publish_known(self, nodeid: int, fid: FileId, new: bool, register: bool = False) -> bool:
        """A file looked up whose cached copy has a backing id already (opened in an earlier
        epoch) is published before the kernel hears of the node: its opens and releases
        then never reach this process (the serving processes count them). With `register`
        (off the serving path), a copy not registered yet is registered first (RAM's if
        RAM has the file). Whether the node is published (by this call or another)."""
        assert self._backings is not None and self._table is not None
        eid = self.core.entry_id(fid)
        backing_id = self._backings.hold(Backings.ram_key(eid))
        if backing_id:
            eid = Backings.ram_key(eid)
        elif not self.core.cache.in_ram(eid):
            backing_id = self._backings.hold(eid)
        if not backing_id:
            if not register:
                return False  # not registered, or promoted since: the open registers the copy
            backing = self.core.cache.acquire_backing(eid)
            if backing is None:
                return False
            try:
                backing_id = self._backings.get(backing)  # holds the copy itself
            except OSError:
                return False
            finally:
                backing.release()
            eid = Backings.key(backing)
        if not 0 < nodeid < self._table.capacity:
            self._backings.put(eid)
            return False
        state = NodeOpen(fid)
        state.refs, state.backing_id, state.eid, state.published = 0, backing_id, eid, True
        # A new node id needs no node lock: no open can name it before this lookup is
        # answered (another lookup of the same name may: the first state in wins).
        with contextlib.nullcontext() if new else self._node_lock(nodeid, refusable=False):
            with self._opens_lock:
                taken = self._opens.get(nodeid)
                if taken is None:
                    self._opens[nodeid] = state
            if taken is not None:
                self._backings.put(eid)
                return taken.published
            self._table.publish(nodeid, backing_id)
            self._published[eid] = nodeid
        self._check_doomed(eid)
        return True

    def _packed_entry(self, nodeid: int, a: Attr) -> bytes:
        """The packed fuse_entry_out of a lookup of `nodeid` with attributes `a`."""
        return p.pack_entry_of(nodeid, a.ino or 1, a.mode, a.nlink, a.uid, a.gid, a.size, a.atime_ns,
                               a.mtime_ns, a.ctime_ns, a.blocks, a.rdev, self._valid)

    def _publish_name(self, nodeid: int, parent: int, name: bytes, path: str, a: Attr, entry: bytes) -> None:
        """A file looked up (by this process) has its name published: the serving processes
        answer its next lookups and forgets, and its getattrs, until its attributes are due
        for a check (--metadata-ttl). The node and its directory are pinned meanwhile: the
        kernel's forgets of them go uncounted here (see Nodes.pin). At most _name_limit
        names are published, the oldest taken back first."""
        table = self._table
        if table is None or not a.is_file or len(name) > NAME_MAX:
            return
        with self._names_lock:
            if self.nodes.id_of(path) != nodeid:
                return  # another lookup gave the path another version's node since
            older = table.find(parent, name)
            if older is not None and older != nodeid:
                self._take_name(older)  # the name's older version
            # Read under the lock, which _unname takes after the metadata forgot a change:
            # a name is never published with attributes the daemon has let go of.
            known = self.core.attr_expiry(path)
            if known is None or version_of(known[0]) != version_of(a):
                return  # changed (or forgotten) since this lookup: the next one publishes
            deadline = int(known[1] * 1e9)
            if nodeid in self._naming:
                return  # being taken back: published again at a lookup after that
            if nodeid in self._named:
                table.publish_name(nodeid, parent, name, entry, deadline)  # a new deadline
                return
            if not self.nodes.pin(nodeid):
                return  # forgotten meanwhile
            if not self.nodes.pin(parent):
                self.nodes.unpin(nodeid)
                return
            if not table.publish_name(nodeid, parent, name, entry, deadline):
                self.nodes.unpin(nodeid)
                self.nodes.unpin(parent)
                return
            self._named[nodeid] = parent
            while len(self._named) > self._name_limit:
                self._take_name(next(iter(self._named)))

    def _take_name(self, nodeid: int) -> None:
        """Lookups of the node's name go to this process again; its lookups counted by the
        serving processes are folded into the node's references by the reaper (under
        _names_lock)."""
        assert self._table is not None
        parent = self._named.pop(nodeid, None)
        if parent is None:
            return
        self._table.unpublish_name(nodeid)
        self._naming.add(nodeid)
        self._unpublished.put(("name", nodeid, parent))

    def _unname(self, path: str) -> None:
        """The file at `path` changed on the source (and the metadata forgot it): its name
        goes to this process again, whichever node it is published with."""
        if self._table is None:
            return
        if self._rows:
            n = self.core.cache.table_record_of(path)
            if n is not None:
                self._take_row(n)
        directory, _, name = path.rpartition("/")
        parent = self.nodes.id_of(directory or "/")
        with self._names_lock:
            nodeid = self.nodes.id_of(path)
            if nodeid is not None:
                self._take_name(nodeid)
            found = None if parent is None else self._table.find(parent, os.fsencode(name))
            if found is not None:
                self._take_name(found)

    def _name_taken(self, table: ServeTable, nodeid: int, parent: int) -> None:
        """After quiesce: the name's node and its directory unpinned, the lookups the
        serving processes counted added to the node's references. A node nobody holds any
        more is forgotten then."""
        gone = self.nodes.unpin(nodeid, table.take_lookups(nodeid))
        with self._names_lock:
            self._naming.discard(nodeid)
        if gone:
            self._forgotten(nodeid)
        if self.nodes.unpin(parent):
            self._forgotten(parent)

    def _check_doomed(self, key: bytes) -> None:
        """After a publish: a tier that dropped the copy meanwhile, or RAM that took a
        file published with its NVMe copy (their _dropped or _superseded found no node
        yet), gets the node taken back all the same."""
        assert self._backings is not None
        if self._backings.doomed(key) or (not Backings.in_ram(key) and self.core.cache.in_ram(key)):
            self._unpublished.put(("copy", key))

    def _superseded(self, eid: bytes) -> None:
        """RAM took a file (copied from NVMe in the background, cachefs/tiers/promote.py):
        a node published with the NVMe copy is taken back, and published again with the
        RAM copy once its opens have closed (see _take_back), so that the kernel reads RAM;
        the NVMe copy's backing id is closed then (Backings.superseded). A table node's
        next registration is of RAM's copy (_switch_row_of)."""
        if eid in self._published:
            self._unpublished.put(("copy", eid))
        self._switch_row_of(eid, True)
        if self._backings is not None:
            self._backings.superseded(eid)

    def _dropped(self, eid: bytes, ram: bool) -> None:
        """A tier dropped an entry (`ram`: RAM did): the node published with its file is
        taken back from the serving processes (by the reaper: a tier's lock may be held
        here, and the node's lock is taken before the tiers' everywhere else), and its
        backing id closed at its last close. Until then the kernel reads the dropped copy,
        the same bytes. A table node RAM let go of is registered with the NVMe copy next
        (_switch_row_of); one whose NVMe copy went is taken."""
        for key in Backings.keys(eid):
            if key in self._published:
                self._unpublished.put(("copy", key))
        if ram:
            self._switch_row_of(eid, False)
        else:
            self._take_row_of(eid)
        if self._backings is not None:
            self._backings.dropped(eid)

    def _ahead_soon(self, directory: str) -> None:
        """This process looked a file up in `directory`: its other cached files are
        published in the background (_publish_dir), once per directory a mount. Not at a
        listing: a walk lists every directory before the job reads a file, and publishing
        behind it made the walk after a remount 2.3 times as long (the walk's requests
        wait for the interpreter's lock)."""
        if self._table is None or self._rows or directory in self._ahead_seen:
            return  # (with table nodes, the serving processes answer a cached file's first lookup)
        if len(self._ahead_seen) >= AHEAD_DIRS_MAX or len(self._ahead_unlisted) >= AHEAD_DIRS_MAX:
            self._ahead_seen.clear()  # bounded: a directory queued again publishes only what is not yet
            self._ahead_unlisted.clear()
        self._ahead_seen.add(directory)
        self._ahead_queue.put(directory)
        with self._names_lock:
            if self._ahead_thread is None:
                self._ahead_thread = threading.Thread(target=self._ahead_loop, name="cachefs-ahead", daemon=True)
                self._ahead_thread.start()

    def _ahead_loop(self) -> None:
        # One thread at the daemon's priority. Measured after a remount (200,000 files):
        # at nice 19 (as the scrub) it held the interpreter's lock while the scheduler kept
        # it off the CPU, and the epoch was slower than with none; eight threads (its
        # opens of cache files wait on the disk) fought over that lock and cost more CPU
        # per file than one.
        while True:
            directory = self._ahead_queue.get()
            if directory is None:
                return
            try:
                self._publish_dir(directory)
            except Exception:
                log.exception("publishing the cached files of %s ahead failed", directory)

    def _publish_dir(self, directory: str) -> int:
        """Publish the names and nodes of the cached files in `directory` before the kernel
        looks them up: their first lookup, open and release of the mount are the serving
        processes' (after a remount, every file's first lookup and open had cost this
        process about 0.4 ms of CPU). Only what needs no source request: the listing and
        the attributes the daemon has (kept ones within --metadata-ttl, checked as a lookup
        answered from them is), and copies a tier holds whole. Each file costs one backing
        registration, within the names' limit (AHEAD_ROOM of it left for the job's own
        lookups). How many files were published."""
        # A kept listing is read from the cache disk once; a directory not listed yet is
        # asked again at its next lookup, from memory (the lookup lists it soon)
        entries = self.core.known_listing(directory, kept=directory not in self._ahead_unlisted)
        if self._table is None or entries is None:
            self._ahead_unlisted.add(directory)
            self._ahead_seen.discard(directory)
            return 0
        parent = self.nodes.pin_ahead(directory)  # its id stays its own while names are published under it
        if parent is None:
            self._ahead_seen.discard(directory)  # the kernel forgot it: published at its next lookup
            return 0
        prefix = directory.rstrip("/") + "/"
        published = missed = 0
        try:
            for e in entries:
                if self._ahead_stopped or len(self._named) >= self._name_limit - AHEAD_ROOM:
                    missed += 1
                    break
                name = e.name.encode(FS_ENCODING, FS_ERRORS)
                if not stat_mod.S_ISREG(e.type_mode) or len(name) > NAME_MAX:
                    continue
                path = prefix + e.name
                known = self.nodes.id_of(path)
                if known is not None and known in self._named:
                    continue
                a = self.core.known_attr(path, count=False)
                if a is None or not a.is_file or not a.size:
                    missed += a is None
                    continue
                nodeid = self.nodes.pin_ahead(path, a)
                if nodeid is None:
                    continue
                try:
                    if self._publish_known(nodeid, FileId.of(path, a), False, register=True):
                        self._publish_name(nodeid, parent, name, path, a, self._packed_entry(nodeid, a))
                        published += nodeid in self._named
                    else:
                        missed += 1
                finally:
                    if self.nodes.unpin(nodeid):
                        self._forgotten(nodeid)
        finally:
            if self.nodes.unpin(parent):
                self._forgotten(parent)
            self.core.stats.incr("serve.published_ahead", published)
        if not missed and self.core.dir_readahead is not None:
            self.core.dir_readahead.covered(directory)  # nothing to fetch or check ahead there
        return published

    def _reap_loop(self) -> None:
        """What to take back from the serving processes: nodes forgotten by the kernel
        (forget cleared their slots), nodes published with a copy a tier dropped (their
        slots are cleared here, if the node still stands for that copy), and names (cleared
        by _take_name). Once no serving process can still be answering from an old slot
        or record (quiesce), the opens and lookups counted in the table are folded into
        this process's counts. A forgotten node is then gone and its id free; a dropped
        one lives until its last release, which the serving processes forward."""
        while self._reap(self._next_batch()):
            pass  # (no batch is held while the next is waited for: below)

    def _next_batch(self) -> list[tuple]:
        """What the reaper takes back next: the first item queued, and those that came
        with it. Only `_reap` holds a batch: the loop had kept its last one (at 200,000
        files, 48,654 forgotten nodes' states, ~25 MB) until the next forget came."""
        try:  # (switches to try again wait a while: something had the copy open)
            batch = [self._unpublished.get(timeout=self._switch_wait if self._switch_retry else None)]
            time.sleep(0.005)  # a batch forget comes as many: one wait for all of them
        except queue.Empty:
            batch = []
        while not self._unpublished.empty():
            batch.append(self._unpublished.get())
        batch += [("switch", n, None) for n in self._switch_retry]
        self._switch_retry.clear()
        return batch

    def _reap(self, batch: list[tuple]) -> bool:
        """One batch of _reap_loop's; False once it is told to stop."""
        table = self._table
        assert table is not None and self.session is not None
        if any(item[0] == "stop" for item in batch):
            return False
        for item in batch:
            if item[0] == "retire":
                self._retire(*item[1:])
        while not self._unpublished.empty():  # what the retiring queued (more goes to the next batch)
            item = self._unpublished.get()
            if item[0] == "stop":
                return False
            if item[0] == "retire":
                self._retire(*item[1:])
            batch.append(item)
        rows = [item[1:] for item in batch if item[0] == "row"]
        taken = [item[1:] for item in batch if item[0] == "node"]
        taken += [found for item in batch if item[0] == "copy" and (found := self._unpublish_copy(table, item[1]))]
        names = [item[1:] for item in batch if item[0] == "name"]
        closing = self._close_rows([item[1] for item in batch if item[0] == "close"],
                                   [item[1:] for item in batch if item[0] == "switch"])
        if not taken and not names and not rows and not closing:
            return True
        waited = 0
        while not table.quiesce(self.session.servers_alive):
            waited += 5  # a serving process stopped mid-request: nothing is safe to fold yet
            log.warning("a serving process has not finished a request for %d s", waited)
        work: tuple[tuple[list, Callable[..., None], str], ...] = (
            (taken, self._take_back, "taking node %d back from the serving processes failed"),
            (names, self._name_taken, "taking the name of node %d back from the serving processes failed"),
            (rows, self._row_taken, "taking table node %d from the serving processes failed"))
        for items, call, failed in work:
            for item in items:
                try:
                    call(table, *item)
                except Exception:
                    log.exception(failed, item[0])
        try:
            self._rows_closed(closing)
        except Exception:
            log.exception("closing the backing ids of %d table nodes failed", len(closing))
        return True

    def _unpublish_copy(self, table: ServeTable, key: bytes) -> tuple[int, NodeOpen, bool] | None:
        nodeid = self._published.get(key)
        if nodeid is None:
            return None
        with self._node_lock(nodeid, refusable=False):
            state = self._opens.get(nodeid)
            if state is None or not state.published or state.eid != key:
                return None  # forgotten (and maybe given out again) meanwhile
            table.unpublish(nodeid)
            return nodeid, state, False

    def _take_back(self, table: ServeTable, nodeid: int, state: NodeOpen, forgotten: bool) -> None:
        """Fold a node's opens counted in the table into its state; a node forgotten, or
        with nothing open any more, loses its state. A named node (lookups answered by the
        serving processes, which never ask this process to publish it) whose copy was
        superseded (RAM took the file) or dropped is published again at once with the copy
        the tiers have now."""
        closing = None
        with self._node_lock(nodeid, refusable=False):
            if self._opens.get(nodeid) is state:  # not torn down, nor another node's since
                if state.published:
                    state.refs += table.take_counts(nodeid)
                    state.published = False
                    if self._published.get(state.eid) == nodeid:
                        del self._published[state.eid]
                if forgotten or state.refs <= 0:
                    with self._opens_lock:
                        del self._opens[nodeid]
                    closing = state
            if forgotten:
                table.unpublish(nodeid)
        if closing is not None:
            self._closed(closing)
        if forgotten:
            self.nodes.recycle(nodeid)
        elif closing is not None and nodeid in self._named:
            self._publish_known(nodeid, state.fid, False, register=True)

    def served(self, report: memoryview) -> None:
        """A serving process's report: its requests counted, and the files it opened counted
        as the tiers' hits (as an open this process answers counts them)."""
        counts, opened = decode_report(report)
        add = {"serve.forwarded": counts.pop("forwarded")[0]}
        for kind, (n, micros) in counts.items():
            add[f"fuse.{kind}"] = n
            add[f"fuse.{kind}_us"] = micros
        add["serve.answered"] = sum(n for n, _ in counts.values())
        add["metadata.hits"] = counts["lookup"][0] + counts["getattr"][0]
        states: list[NodeOpen | None] = []
        fids: list[FileId] = []
        eids: list[bytes | None] = []
        rows: list[int] = []  # per open counted: its table record, or -1
        registered: list[int] = []
        get_state = self._opens.get
        table, row_base, row_end = self._table, 0, 0
        if self._rows and table is not None:
            row_base, row_end = table.row_base, table.row_base + table.rows
        for nodeid in opened:
            if nodeid & REGISTERED:
                registered.append(nodeid)
                continue
            state = get_state(nodeid)
            if state is not None and state.published:
                states.append(state)
                fids.append(state.fid)
                eids.append(Backings.entry_of(state.eid))
                rows.append(-1)
                continue
            fid = state.fid if state is not None else self.nodes.file_id(nodeid)  # taken back since
            if fid is not None:
                states.append(state)
                fids.append(fid)
                eids.append(None)
                rows.append(-1)
            elif row_base <= nodeid < row_end:  # a table node: counted by its entry id and size
                found = self.core.cache.table_eid_size(nodeid - row_base)
                if found is not None:
                    states.append(None)
                    fids.append(FileId("", found[1], 0))
                    eids.append(found[0])
                    rows.append(nodeid - row_base)
        add["opens.passthrough"] = len(opened) - len(registered)  # (a registration is reported beside its open)
        self.core.stats.add_many(add)
        if registered:
            self._rows_counted(registered)
        try:
            in_ram = self.core.count_opens(fids, eids)
        except Exception as exc:  # counting only: it never fails a reader
            log.warning("counting %d opens the serving processes answered failed: %s", len(fids), exc)
            return
        for state, now_in_ram, n in zip(states, in_ram, rows, strict=True):
            if n >= 0 and now_in_ram and table is not None:
                if table.row_theirs(n) and not table.row_copy[n] & RAM_REGISTERED:
                    self._unpublished.put(("switch", n, True))  # RAM has it: RAM's copy registered next
            elif state is not None and state.published and now_in_ram and not Backings.in_ram(state.eid):
                # RAM took the file: the node is taken back, and once its opens have closed,
                # published again with the RAM copy (one backing per inode while open)
                self._unpublished.put(("copy", state.eid))
