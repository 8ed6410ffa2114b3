"""What the file system keeps per kernel node (cachefs/fs.py is the file system itself):

  - `Nodes`: node ids <-> source paths, and the file version each regular file's node
    stands for (a node is one version: a file changed on the source gets a new node);
  - `NodeLocks`: the opens and releases of one node, one at a time;
  - `NodeOpen` and `Backings`: how a node's open files are served (passthrough through
    one backing file, or by the daemon), and the backing ids registered with the kernel;
  - `ErrorLog`: which failures get a warning line, bounded.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import itertools
import logging
import os
import stat as stat_mod
import threading
import time
from array import array
from collections.abc import Callable
from typing import Any

from cachefs.blocks import ENTRY_ID_SIZE
from cachefs.fuse import protocol as p
from cachefs.fuse.ops import FuseError
from cachefs.fuse.session import Session
from cachefs.heap import give_back
from cachefs.identity import Attr, FileId
from cachefs.tiers.multilevel import Backing

log = logging.getLogger(__name__)


class ErrorLog:
    """Which failures get a warning line. A job that retries a bad file every epoch, or a
    directory of a million files it may not read, must not flood the log: each (operation,
    path, errno) is warned about once an hour, at most `per_kind` different paths per
    (operation, errno) an hour, and then one line says the rest are only counted. Every
    failure is counted (fuse.errors) and logged at debug level. Memory is bounded: the
    paths are remembered least recently warned first out."""

    def __init__(self, max_paths: int = 10_000, per_kind: int = 100, window: float = 3600.0,
                 clock: Callable[[], float] = time.monotonic):
        self.max_paths, self.per_kind, self.window, self._clock = max_paths, per_kind, window, clock
        self._warned: collections.OrderedDict[tuple[str, str | None, int], float] = collections.OrderedDict()
        self._kinds: dict[tuple[str, int], tuple[float, int]] = {}
        self._lock = threading.Lock()

    def level(self, op: str, path: str | None, code: int) -> tuple[int, str | None]:
        """The level to log this failure at, and a summary line to log once as well."""
        now = self._clock()
        key = (op, path, code)
        with self._lock:
            last = self._warned.get(key)
            if last is not None and now - last < self.window:
                return logging.DEBUG, None
            start, count = self._kinds.get((op, code), (now, 0))
            if now - start >= self.window:
                start, count = now, 0
            self._kinds[(op, code)] = (start, count + 1)
            if count >= self.per_kind:
                summary = (f"{op}: more than {self.per_kind} files failed with {errno.errorcode.get(code, code)} "
                           f"within {self.window / 3600:g}h; the rest are counted in fuse.errors and logged "
                           "at debug level (-vv)") if count == self.per_kind else None
                return logging.DEBUG, summary
            self._warned[key] = now
            self._warned.move_to_end(key)
            while len(self._warned) > self.max_paths:
                self._warned.popitem(last=False)
            return logging.WARNING, None


class NodeLocks:
    """A lock per node while opens or releases of it are in progress: the opens of one node
    are served one at a time (see _open_passthrough), and those of different nodes never
    wait for each other. (Striped locks made 30 readers of different uncached files wait
    on each other's fetches from a stopped source.) A thread that must wait gives its
    place as a request reader to another (`blocking`), so waiting opens never stop the
    session from reading the kernel's requests."""

    def __init__(self) -> None:
        self._locks: dict[int, list[Any]] = {}  # node id -> [lock, threads holding or waiting]
        self._mutex = threading.Lock()

    def hold(self, nodeid: int, blocking: Callable[[], contextlib.AbstractContextManager[None]]) -> _NodeHold:
        """The node's lock, as a context manager; `blocking()` is entered around a wait for it."""
        return _NodeHold(self, nodeid, blocking)

    def _leave(self, nodeid: int, entry: list[Any]) -> None:
        with self._mutex:
            entry[1] -= 1
            if not entry[1]:
                del self._locks[nodeid]

    def __len__(self) -> int:
        return len(self._locks)


class _NodeHold:
    """One hold of a node's lock (NodeLocks.hold). A class rather than a generator-based
    context manager: it is taken several times per file (lookups, opens, releases,
    publishing and taking back), and a generator with its wrapper cost about a tenth of the
    daemon's interpreter time in the first epoch after a remount."""

    __slots__ = ("_blocking", "_entry", "_locks", "_nodeid")

    def __init__(self, locks: NodeLocks, nodeid: int, blocking: Callable[[], contextlib.AbstractContextManager[None]]):
        self._locks, self._nodeid, self._blocking = locks, nodeid, blocking
        self._entry: list[Any] = []

    def __enter__(self) -> None:
        locks, nodeid = self._locks, self._nodeid
        with locks._mutex:
            entry = locks._locks.get(nodeid)
            if entry is None:
                entry = locks._locks[nodeid] = [threading.Lock(), 0]
            entry[1] += 1
        lock: threading.Lock = entry[0]
        if not lock.acquire(blocking=False):
            try:
                with self._blocking():
                    lock.acquire()
            except BaseException:
                locks._leave(nodeid, entry)
                raise
        self._entry = entry

    def __exit__(self, *exc: object) -> None:
        entry = self._entry
        entry[0].release()
        self._locks._leave(self._nodeid, entry)


class NodeOpen:
    """How the open files of one node are served: through one backing file (passthrough),
    or by the daemon (backing_id 0)."""

    __slots__ = ("backing", "backing_id", "eid", "fid", "private", "published", "refs")

    def __init__(self, fid: FileId):
        self.fid = fid
        self.refs = 1
        self.backing_id = 0
        # In the serving processes' table (cachefs/fuse/serve.py): its opens may be answered
        # by any process, and `refs` plus the table's counts are the opens outstanding.
        self.published = False
        self.backing: Backing | None = None  # the cached file, held while the node is open
        self.eid = b""
        # backing_id was registered by a serving process for a table node (not in Backings):
        # closed at the node's last close
        self.private = False


class Backings:
    """Backing files registered with the kernel (FUSE_DEV_IOC_BACKING_OPEN), by entry. One
    stays registered after the last open of its file closes (up to `limit` idle ones, the
    least recently used closed first; see config.backing_limit): registering cost an open
    about 35 us of CPU, and the next epoch opens the same files again. Each registered file is held in its tier
    (acquire), so no hole is punched under the kernel; when a tier drops the entry anyway,
    its id is closed at once, or at its last close."""

    def __init__(self, session: Session, limit: int):
        self._session = session
        self._limit = limit
        self._ids: dict[bytes, list] = {}  # key -> [backing id, the held Backing, opens, doomed]
        self._idle: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.ram_count = 0  # of them, RAM copies (stats: opens.backing_files_ram)
        self.keep_idle = True  # copies kept registered after their last close (see close_idle)

    @staticmethod
    def key(backing: Backing) -> bytes:
        """Which copy a backing id stands for: an entry may be registered once per tier (a
        file promoted to RAM is registered anew, so that the kernel reads the RAM copy)."""
        return Backings.ram_key(backing.eid) if backing.in_ram else backing.eid

    @staticmethod
    def ram_key(eid: bytes) -> bytes:
        """The key of the entry's RAM copy (see key)."""
        return eid + b"r"

    @staticmethod
    def keys(eid: bytes) -> tuple[bytes, bytes]:
        """The keys an entry's copies may be registered under: NVMe's, RAM's."""
        return eid, Backings.ram_key(eid)

    @staticmethod
    def entry_of(key: bytes) -> bytes:
        """The entry id a key stands for, whichever copy (see key)."""
        return key[:ENTRY_ID_SIZE]

    @staticmethod
    def in_ram(key: bytes) -> bool:
        """Whether `key` stands for a RAM copy (an entry id is ENTRY_ID_SIZE bytes)."""
        return len(key) > ENTRY_ID_SIZE

    def get(self, backing: Backing) -> int:
        """A backing id for the cached file, counted as one more open. OSError if the
        kernel refuses it."""
        eid = self.key(backing)
        known = self.hold(eid)
        if known:
            return known
        fd = os.open(backing.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            backing_id = self._session.backing_open(fd)
        finally:
            os.close(fd)
        backing.hold()
        with self._lock:
            rec = self._ids.get(eid)
            if rec is None or rec[3]:
                # kept without its path (one per cached file: the path was 130 of ~500 bytes)
                self._ids[eid] = [backing_id, backing._replace(path=""), 1, False]
                self.ram_count += backing.in_ram
                return backing_id
            rec[2] += 1  # registered by another open meanwhile: use that one
            self._idle.pop(eid, None)
        self._close(backing_id, backing, counted=False)
        return int(rec[0])

    def hold(self, eid: bytes) -> int:
        """The backing id registered under `key` if any (counted as one more open), else 0."""
        with self._lock:
            rec = self._ids.get(eid)
            if rec is None or rec[3]:
                return 0
            rec[2] += 1
            self._idle.pop(eid, None)
            return int(rec[0])

    def doomed(self, key: bytes) -> bool:
        """Whether the copy registered under `key` was dropped by its tier (closed at its
        last close)."""
        with self._lock:
            rec = self._ids.get(key)
            return rec is not None and bool(rec[3])

    def put(self, eid: bytes) -> None:
        """An open of the entry's file closed."""
        closing = []
        with self._lock:
            rec = self._ids.get(eid)
            if rec is None:
                return
            rec[2] -= 1
            if rec[2] > 0:
                return
            if rec[3] or not self.keep_idle:
                del self._ids[eid]
                closing.append((eid, rec))
            else:
                self._idle[eid] = None
                while len(self._idle) > self._limit:
                    old, _ = self._idle.popitem(last=False)
                    closing.append((old, self._ids.pop(old)))
        for _, r in closing:
            self._close(r[0], r[1])

    def dropped(self, eid: bytes) -> None:
        """A tier dropped the entry: close its ids now, or at their last close. (Which tier
        is not said: a copy still kept in the other is registered again when opened.)"""
        for key in self.keys(eid):
            self._dropped(key)

    def superseded(self, eid: bytes) -> None:
        """RAM took the entry: its NVMe copy's id is closed now, or at its last close (opens
        register the RAM copy from now on). Kept, it held a kernel file and about 400 bytes
        of this process per file, and counted twice against the limit, which then kept
        half as many files registered."""
        self._dropped(eid)

    def _dropped(self, eid: bytes) -> None:
        with self._lock:
            rec = self._ids.get(eid)
            if rec is None:
                return
            if rec[2] > 0:
                rec[3] = True
                return
            del self._ids[eid]
            self._idle.pop(eid, None)
        self._close(rec[0], rec[1])

    def _close(self, backing_id: int, backing: Backing, counted: bool = True) -> None:
        if counted and backing.in_ram:
            with self._lock:
                self.ram_count -= 1
        try:
            self._session.backing_close(backing_id)
        except OSError as exc:
            log.debug("closing backing id %d failed: %s", backing_id, exc)
        backing.release()

    def close_idle(self) -> int:
        """Close the registrations nothing has open (idle), and from now on each at its last
        close; give back the tables they took; the number closed. After a checkpoint the
        files it recorded are the serving processes' table nodes, which register their own
        (RAM's copy where RAM holds the file): the daemon's idle ones (about 350 bytes each
        here, and a kernel file) only wait for a node of the daemon's the kernel still
        holds, which registers its file again at its next open (as does a file cached after
        the checkpoint, until the next one takes it)."""
        with self._lock:
            self.keep_idle = False
            recs = [self._ids.pop(key) for key in self._idle]
            self._idle = collections.OrderedDict()
            if recs:  # (a dict keeps its table as keys go)
                self._ids = dict(self._ids)
        for rec in recs:
            self._close(rec[0], rec[1])
        return len(recs)

    def close_all(self) -> None:
        with self._lock:
            recs, self._ids = self._ids, {}
            self._idle.clear()
        for rec in recs.values():
            self._close(rec[0], rec[1])

    def __len__(self) -> int:
        return len(self._ids)


def version_of(attr: Attr) -> tuple[int, int, int, int, str]:
    """What makes two stats of a regular file the same version (as FileId, with the type)."""
    return stat_mod.S_IFMT(attr.mode), attr.size, attr.mtime_ns, attr.ctime_ns, attr.version


NODES_REBUILD_MIN = 65536  # nodes dropped before Nodes' tables may be rebuilt (see Nodes._rebuild)


class Nodes:
    """Node ids the kernel holds, and the source path of each. A lookup adds one reference,
    FORGET takes them away; a node without references is forgotten here too. The root is
    node 1 and always known.

    A regular file's node is one version of it: a lookup that finds the file changed on the
    source (size, mtime or ctime) gets a new node id, and the old node keeps the version it
    was looked up as. The kernel keys its page cache, its open files and its mappings by
    node, so an old descriptor or mapping never meets a page of the new version, and a new
    open never meets a page of the old one (the kernel itself compares only size and
    mtime)."""

    def __init__(self) -> None:
        self._paths: dict[int, str] = {p.ROOT_ID: "/"}
        self._ids: dict[str, int] = {"/": p.ROOT_ID}
        self._refs: dict[int, int] = {}
        self._versions: dict[int, Attr] = {}  # node id -> the file version it stands for
        self._next = itertools.count(p.ROOT_ID + 1)
        self._free = array("Q")  # ids the kernel forgot, to give out again (see recycle)
        self._dropped = 0  # nodes dropped since the tables were last rebuilt (see _drop)
        self._pins: dict[int, int] = {}  # nodes kept whatever the kernel forgets (see pin)
        self._lock = threading.Lock()
        # Table nodes (ids rows_from to rows_to, one per record of the NVMe tier's entry
        # table, answered by the serving processes): never given out here, and known here
        # only once `resolve` (the file system's) adopts one (see adopt)
        self._rows_from = self._rows_to = 0
        self.resolve: Callable[[int], bool] | None = None

    def reserve(self, first: int, end: int) -> None:
        """Node ids first to end (exclusive) are table nodes: never given out here."""
        self._rows_from, self._rows_to = first, end

    def _new_id(self) -> int:
        nodeid = self._free.pop() if self._free else next(self._next)
        if self._rows_from <= nodeid < self._rows_to:
            self._next = itertools.count(self._rows_to + 1)
            nodeid = self._rows_to
        return nodeid

    def path(self, nodeid: int) -> str:
        try:
            return self._paths[nodeid]
        except KeyError:
            if self.resolve is not None and self._rows_from <= nodeid < self._rows_to and self.resolve(nodeid):
                return self._paths[nodeid]
            raise FuseError(errno.ESTALE, f"unknown node {nodeid}") from None

    def adopt(self, nodeid: int, path: str, attr: Attr) -> bool:
        """Table node `nodeid` stands for `path` as `attr` describes it here too, pinned once
        (by its record: the serving processes count its lookups and forgets until the file
        system takes it, then unpin folds them in). A node the path has already stays the
        path's. False if it was known already."""
        with self._lock:
            if nodeid in self._paths:
                return False
            self._paths[nodeid] = path
            self._versions[nodeid] = attr
            self._refs[nodeid] = 0
            self._pins[nodeid] = 1
            self._ids.setdefault(path, nodeid)
            return True

    def version(self, nodeid: int) -> Attr | None:
        """The attributes of the file version this node stands for (regular files only)."""
        return self._versions.get(nodeid)

    def file_id(self, nodeid: int) -> FileId | None:
        """The file version a regular file's node stands for, if the node is known."""
        path, attr = self._paths.get(nodeid), self._versions.get(nodeid)
        return None if path is None or attr is None else FileId.of(path, attr)

    def child(self, parent: int, name: bytes) -> str:
        if not name or b"/" in name or name in (b".", b".."):
            raise FuseError(errno.EINVAL if name not in (b".", b"..") else errno.ENOENT)
        base = self.path(parent)
        return (base if base != "/" else "") + "/" + os.fsdecode(name)

    def add(self, path: str, attr: Attr | None = None) -> int:
        """The node id of `path` as `attr` describes it, with one more reference from the
        kernel: a new id when a regular file is not the version its node stands for."""
        return self.looked_up(path, attr)[0]

    def looked_up(self, path: str, attr: Attr | None = None) -> tuple[int, bool]:
        """add(), and whether the id is new: the kernel has not heard of it yet (no request
        can name it until this lookup is answered)."""
        new = False
        with self._lock:
            nodeid = self._ids.get(path)
            if nodeid is not None and attr is not None:
                known = self._versions.get(nodeid)
                if (known is not None or attr.is_file) and nodeid != p.ROOT_ID and (
                        known is None or version_of(known) != version_of(attr)):
                    nodeid = None  # another version: the old node stays with its holders
            if nodeid is None:
                nodeid = self._new_id()
                self._ids[path] = nodeid
                self._paths[nodeid] = path
                new = True
            if attr is not None and attr.is_file:
                self._versions[nodeid] = attr
            if nodeid != p.ROOT_ID:
                self._refs[nodeid] = self._refs.get(nodeid, 0) + 1
            return nodeid, new

    def id_of(self, path: str) -> int | None:
        return self._ids.get(path)

    def name_of(self, path: str) -> tuple[int, bytes] | None:
        """(the node of `path`'s directory, its name there) as the kernel knows them (for
        FUSE_NOTIFY_INVAL_ENTRY), or None if the directory has no node."""
        directory, _, name = path.rpartition("/")
        parent = self._ids.get(directory or "/")
        return None if parent is None else (parent, os.fsencode(name))

    def files(self) -> array:
        """The ids of the nodes that stand for a file version (regular files)."""
        with self._lock:
            return array("Q", self._versions)

    def unversioned(self) -> list[tuple[int, str]]:
        """(node id, path) of each node that stands for no file version: directories (and
        links and the like)."""
        with self._lock:
            return [(nodeid, path) for nodeid, path in self._paths.items() if nodeid not in self._versions]

    def pin_ahead(self, path: str, attr: Attr | None = None) -> int | None:
        """The node of `path`, pinned (see pin), for a name published before the kernel looks
        it up (Published._publish_dir): a file without a node gets one, with no reference
        from the kernel. None if the path has no node and `attr` is None, or its node stands
        for another version of the file than `attr` (its holders' version is left alone)."""
        with self._lock:
            nodeid = self._ids.get(path)
            if nodeid is not None:
                known = self._versions.get(nodeid)
                if attr is not None and known is not None and version_of(known) != version_of(attr):
                    return None
            elif attr is None:
                return None
            else:
                nodeid = self._new_id()
                self._ids[path] = nodeid
                self._paths[nodeid] = path
                self._refs[nodeid] = 0
                if attr.is_file:
                    self._versions[nodeid] = attr
            self._pins[nodeid] = self._pins.get(nodeid, 0) + 1
            return nodeid

    def forget(self, nodeid: int, count: int) -> bool:
        """Take `count` of the kernel's references; True when that was the last of them (the
        kernel no longer knows the id: its owner gives it back with recycle). A pinned
        node stays, whatever its count (see pin)."""
        with self._lock:
            left = self._refs.get(nodeid, 0) - count
            if left > 0 or nodeid in self._pins:
                self._refs[nodeid] = left
                return False
            return self._drop(nodeid)

    def pin(self, nodeid: int) -> bool:
        """Keep the node (its id and path) whatever the kernel forgets, until unpin: its
        name is published to the serving processes, which count its lookups and forgets
        (or it is the directory of such a name). False for a node unknown here."""
        with self._lock:
            if nodeid not in self._paths:
                return False
            self._pins[nodeid] = self._pins.get(nodeid, 0) + 1
            return True

    def unpin(self, nodeid: int, lookups: int = 0) -> bool:
        """One pin less, and `lookups` more references (those the serving processes counted);
        True when the node is gone with it (as forget)."""
        with self._lock:
            left = self._refs.get(nodeid, 0) + lookups
            self._refs[nodeid] = left
            pins = self._pins.get(nodeid, 0) - 1
            if pins > 0:
                self._pins[nodeid] = pins
                return False
            self._pins.pop(nodeid, None)
            return left <= 0 and self._drop(nodeid)

    def _drop(self, nodeid: int) -> bool:
        self._refs.pop(nodeid, None)
        self._versions.pop(nodeid, None)
        path = self._paths.pop(nodeid, None) if nodeid != p.ROOT_ID else None
        if path is not None and self._ids.get(path) == nodeid:
            del self._ids[path]
        self._dropped += 1
        if self._dropped > NODES_REBUILD_MIN and self._dropped > 2 * len(self._paths):
            self._rebuild()
        return path is not None

    def _rebuild(self) -> None:
        """The tables rebuilt for the nodes held now: a dict keeps its table's size as keys
        go, and the kernel forgetting a cold epoch's nodes (200,000 files) had left ~30 MB
        of them. Once more nodes were dropped than twice those held, under the lock (a
        lookup waits out the copies and the heap's trim, tens of ms, once per so many)."""
        self._paths, self._ids, self._refs = dict(self._paths), dict(self._ids), dict(self._refs)
        self._versions, self._pins = dict(self._versions), dict(self._pins)
        self._dropped = 0
        give_back()

    def recycle(self, nodeid: int) -> None:
        """Give out a forgotten node id again: ids stay as dense as the nodes the kernel
        holds, which the serving processes' table is indexed by."""
        with self._lock:
            if nodeid not in self._paths and not self._rows_from <= nodeid < self._rows_to:
                self._free.append(nodeid)

    def __len__(self) -> int:
        return len(self._paths)


def to_fuse_attr(attr: Attr) -> p.Attr:
    return p.Attr(attr.ino or 1, attr.mode, attr.nlink, attr.uid, attr.gid, attr.size, attr.atime_ns,
                  attr.mtime_ns, attr.ctime_ns, attr.blocks, attr.rdev)
