"""Checkpoints: a mount that started without an entry table (a first mount, or one after a
crash) writes the NVMe tier's entries as one (cachefs/tiers/checkpoint.py) once it holds
enough of them, and its records become table nodes the serving processes answer
(cachefs/tablenodes.py), as after a remount; again, as the next generation, as it caches
more. The file system's side: when one is due, publishing it, the daemon's names and
registrations of the files it holds given up, the tables before released. A mixin of
CachefsFS (cachefs/fs.py). docs/design.md, "A checkpoint"."""

from __future__ import annotations

import collections
import logging
import os
import queue
import threading
from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING

from cachefs.config import (
    CHECKPOINT_EVERY,
    CHECKPOINT_GROWING,
    CHECKPOINT_MIN_FILES,
    CHECKPOINT_NEXT,
    CHECKPOINT_QUIET,
    NODE_TABLE_CAPACITY,
)
from cachefs.fuse.servetable import ServeTable, TableNodes
from cachefs.identity import Attr
from cachefs.nodes import Backings, Nodes
from cachefs.tiers.multilevel import TableFile

if TYPE_CHECKING:
    from cachefs.core import Core
    from cachefs.fuse.session import Session

log = logging.getLogger(__name__)

UNNAME_BATCH = 2048  # names taken back at a time under the names' lock (a lookup waits for it)


def checkpoint_due(limit: int, held: int, grown: int, opened: int, tabled: int = 0, since: int = 0,
                   growing_from: int = CHECKPOINT_MIN_FILES) -> bool:
    """Whether the NVMe tier's `held` files are to be checkpointed now: more than `limit`
    (--backing-files), grown by less than 1/CHECKPOINT_QUIET of them in the last
    CHECKPOINT_EVERY while the job opened files. A cold epoch still fetching grows the tier
    (1/100 had let one of 889 files/s through at 410,814 of 1.28 million files); one that
    pauses (a model checkpoint written mid-epoch) opens nothing: the checkpoint waits for
    an epoch that reads what is cached. After one of `tabled` files, the next generation
    is due on the same terms once the files stored `since` are more than 1/CHECKPOINT_NEXT
    of them (the rest of a cold epoch that paused, another dataset).

    A cold epoch still fetching has its files checkpointed too, for the daemon's memory,
    once the tier holds more than `growing_from` (CHECKPOINT_MIN_FILES) and then each time
    the files stored since the last are more than a CHECKPOINT_GROWING-th of the table's:
    what the daemon holds at the epoch's end (its high-water mark) is the files stored
    since the last generation, at most a ninth of them, and the tables written add up to
    less than nine times the last."""
    quiet = 0 <= grown <= held // CHECKPOINT_QUIET and opened > 0
    if held > limit and quiet and (not tabled or since > tabled // CHECKPOINT_NEXT):
        return True
    growing = 0 < grown <= held and opened > 0  # (the first look sees everything as grown)
    return growing and held > growing_from and (not tabled or since > tabled // CHECKPOINT_GROWING)


class Checkpointing:
    """The file system's checkpoints (see the module docstring)."""

    core: Core
    nodes: Nodes
    session: Session | None
    _table: ServeTable | None
    _rows: bool
    _backings: Backings | None
    _backing_limit: int
    _named: collections.OrderedDict[int, int]
    _names_lock: threading.Lock
    _changed: queue.Queue[str | array]
    _take_name: Callable[[int], None]
    _start_rows: Callable[..., None]
    _publish_dir_path: Callable[[int, str], None]
    _free_row: Callable[[str, Attr], tuple[int, TableFile] | None]
    _acl_blind: Callable[[], bool]
    _dir_fd: Callable[[str | None, str], int]

    _checkpointer: threading.Thread | None
    _checkpoint_stop: threading.Event
    _checkpoint_fds: list[int]  # the data directory's, then the checkpoints' tables still mapped, newest last

    def _init_checkpoints(self) -> None:
        self._checkpointer = None
        self._checkpoint_stop = threading.Event()
        self._checkpoint_fds = []

    def _checkpoint_room(self, rows: TableNodes | None) -> int:
        """Room in the serving table for a checkpoint's table nodes: in a mount that starts
        without an entry table (and has an NVMe tier), as many as the tier can hold files
        (4 KiB each at least)."""
        if rows is not None or not self.core.cache.has_disk:
            return 0
        return min(NODE_TABLE_CAPACITY, self.core.cache.disk_capacity // 4096)

    def _start_checkpoints(self) -> None:
        table = self._table
        if table is not None and table.room and not self._rows and not self._acl_blind():
            self._checkpointer = threading.Thread(target=self._checkpoint_loop, name="cachefs-checkpoint",
                                                  daemon=True)
            self._checkpointer.start()

    def _stop_checkpoints(self) -> None:
        self._checkpoint_stop.set()
        if self._checkpointer is not None:
            self._checkpointer.join(30)
        for fd in self._checkpoint_fds:
            os.close(fd)
        self._checkpoint_fds = []

    def _checkpoint_loop(self) -> None:
        """Once the NVMe tier holds more files than --backing-files keeps registered, and has
        stopped growing (by less than 1/CHECKPOINT_QUIET of its files in CHECKPOINT_EVERY:
        the cold epoch is over), its entries become table nodes (_checkpoint); again, as
        the next generation, once it cached many more. Until then a file whose
        registration was closed past the limit was the daemon's to look up and register
        again at each open, forwarded: at 1.28 million files, 0.557 ms of CPU per file in
        the first mount against 0.132 after a remount, where table nodes are the serving
        processes'. Past CHECKPOINT_MIN_FILES too, below the limit, and while a cold epoch
        still grows the tier (each time it doubled): the files a checkpoint records leave
        the daemon's objects where they are idle (about 1 KB each, and their published
        names), which lowers the cold epoch's mark, where the process's resident memory
        stays (design.md "Where it goes now"). A checkpoint that fails is not tried again.
        See checkpoint_due."""
        last, opened, tabled, failed = -1, 0, 0, False
        stats, cache = self.core.stats, self.core.cache
        while not self._checkpoint_stop.wait(CHECKPOINT_EVERY):
            self._release_checkpoints()
            if failed:
                continue  # (until the tables before are released)
            held = cache.disk_files
            opens = stats.get("opens.passthrough") + stats.get("opens.daemon")
            if checkpoint_due(min(self._backing_limit, CHECKPOINT_MIN_FILES), held, held - last, opens - opened, tabled,
                              cache.stored_since_checkpoint):
                try:
                    count = self._checkpoint()
                except Exception:
                    log.exception("the checkpoint of the NVMe tier's entries failed; the daemon answers them")
                    count = None
                if count is None:
                    if not tabled:
                        return
                    failed = True
                    continue
                tabled = count
            last, opened = held, opens

    def _checkpoint(self) -> int | None:
        """The NVMe tier's entries written as an entry table (MultiLevelCache.checkpoint), whose
        records the serving processes answer from now on as after a remount: a cached
        file's lookups from its record once the kernel has forgotten the daemon's node for
        it, its opens, its registration past the limit. The directories the kernel knows
        have their paths published (those it looks up later, at that lookup). Files RAM
        holds are in it too, their table nodes marked for RAM's copy before they are
        published (ServeTable.want_ram): they had been left out, the daemon's nodes with
        RAM's copies registered, 1.6-2.1 KB each of its memory (measured). A next generation
        (the records before in their numbers) is published in place of the one before,
        whose descriptor this process keeps until every serving process maps the new one.
        The records the serving processes answer now, or None (it failed)."""
        table = self._table
        if table is None:
            return None
        got = self.core.cache.checkpoint(room=table.room)
        if got is None:
            return None
        table_fd, count, ram_rows = got
        if table_fd < 0:  # nothing new to write
            return count
        table.want_ram(ram_rows)  # (their first registrations open RAM's copies)
        if self._rows:  # a next generation
            self._checkpoint_fds.append(table_fd)
            table.publish_rows(count, table_fd, self._checkpoint_fds[0])
            log.info("serving processes answer the %d files of the checkpoint's next entry table", count)
            self._checkpointed()
            return count
        data_fd = self._dir_fd(self.core.cache.fill_dir, "the NVMe tier's data directory")
        if data_fd < 0:
            os.close(table_fd)
            return None
        self._checkpoint_fds = [data_fd, table_fd]  # the serving processes open them (the newest table last)
        self._start_rows(count, (table_fd, data_fd))
        for nodeid, path in self.nodes.unversioned():
            a = self.core.metadata.last_known(path)
            if a is not None and a.is_dir:
                self._publish_dir_path(nodeid, path)
        self._checkpointed()
        return count

    def _checkpointed(self) -> None:
        """A checkpoint is published: its files are table nodes, which the serving processes
        register themselves; the daemon keeps no idle registration from now on
        (Backings.close_idle), and no published name of a file the serving processes answer
        from the table (_unname_tabled)."""
        if self._backings is not None:
            self.core.stats.incr("serve.checkpoint_backings_closed", self._backings.close_idle())
        self.core.stats.incr("serve.names_tabled", self._unname_tabled())
        self.core.stats.incr("serve.checkpoints")

    def _unname_tabled(self) -> int:
        """This process's nodes for files the checkpoint records (as the version the node
        stands for) have their published names taken back: the
        serving processes answer their next lookups from the table, as table nodes. The
        kernel is then told to drop its names of them all, published or not (by the
        invalidation thread, after a quiesce: _drop_names), so that it forgets the nodes
        at once, or at the file's last close, and this process's nodes go (their path,
        version, open state and registration, ~900 B each). Without the drop they went as
        the kernel let go of them: at 200,000 files, ~185,000 had stayed published through
        the epochs after the cold one, and once taken back 89,171 were still held at the
        cold epoch's end, the daemon's high-water mark. In batches under the names' lock;
        how many names were taken back."""
        table = self._table
        if table is None or not self._rows:
            return 0
        files, drop, taken = self.nodes.files(), array("Q"), 0
        for i in range(0, len(files), UNNAME_BATCH):
            with self._names_lock:
                for nodeid in files[i:i + UNNAME_BATCH]:
                    fid, a = self.nodes.file_id(nodeid), self.nodes.version(nodeid)
                    if not fid or not a or table.row_of(nodeid) >= 0 or self._free_row(fid.path, a) is None:
                        continue  # (a table node, or not recorded as this version)
                    drop.append(nodeid)
                    if nodeid in self._named:
                        self._take_name(nodeid)
                        taken += 1
        if taken:
            with self._names_lock:  # (an OrderedDict keeps its table as keys go)
                self._named = collections.OrderedDict(self._named)
            log.info("%d published names of files the checkpoint holds were taken back", taken)
        if drop:
            self._changed.put(drop)
        return taken

    def _drop_names(self, nodeids: array) -> None:
        """In the invalidation thread, once no serving process answers them (quiesce): the
        kernel told to drop its names of the nodes _unname_tabled found (a node forgotten
        since is passed over; one whose id was given out again meanwhile costs its file one
        more lookup)."""
        session, nodes, dropped = self.session, self.nodes, 0
        if session is None:
            return
        for nodeid in nodeids:
            fid = nodes.file_id(nodeid)
            found = None if fid is None else nodes.name_of(fid.path)
            if found is not None and session.notify_inval_entry(*found):
                dropped += 1
        self.core.stats.incr("serve.names_dropped", dropped)
        log.info("the kernel dropped its names of %d of the %d files the checkpoint holds that it had looked "
                 "up here", dropped, len(nodeids))

    def _release_checkpoints(self) -> None:
        """Once every serving process maps the newest checkpoint, the descriptors of the ones
        before it are closed, and their blocks leave the tier's budget."""
        fds, table, session = self._checkpoint_fds, self._table, self.session
        if len(fds) <= 2 or table is None or session is None or not table.rows_everywhere(session.servers_alive):
            return
        for fd in fds[1:-1]:
            os.close(fd)
        self._checkpoint_fds = [fds[0], fds[-1]]
        self.core.cache.checkpoint_released()
