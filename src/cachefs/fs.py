"""The cachefs file system: kernel requests (cachefs.fuse) translated into Core calls.

Thin by design: map node ids to source paths, call the core, turn every exception into an
errno (errors.to_errno) with one log line, answer the control interface (extended
attributes of the mount root named user.cachefs.*, invisible to readdir and to any name).

Kernel-side caching does the heavy lifting for a warm epoch:
  - entry and attribute timeouts = --metadata-ttl: lookups and stats stay in the kernel;
  - zero-message opens: the first open() answers ENOSYS, which (FUSE_NO_OPEN_SUPPORT) tells
    the kernel never to send OPEN, FLUSH or RELEASE again and to keep the page cache across
    opens. The kernel still drops a file's pages when its attributes show a new size or
    mtime (FUSE_AUTO_INVAL_DATA);
  - isatty()'s ioctl is answered by the session before any Python of ours runs.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import functools
import itertools
import json
import logging
import os
import queue
import stat as stat_mod
import threading
import time
from array import array
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from cachefs.checkpointing import Checkpointing
from cachefs.config import HINT_REPORT_OPENS, NODE_TABLE_CAPACITY, Config, backing_limit
from cachefs.core import Core
from cachefs.directio import OUT_OF_DESCRIPTORS, descriptor_limit, trim_descriptors
from cachefs.errors import QUIET, to_errno
from cachefs.fuse import protocol as p
from cachefs.fuse.ops import Connection, Entry, FuseError, Opened, Operations, Request, StatFs
from cachefs.fuse.serve import OWN_FH
from cachefs.fuse.servetable import ServeTable
from cachefs.fuse.session import Session
from cachefs.identity import Attr, FileId, dirents
from cachefs.nodes import Backings, ErrorLog, NodeLocks, NodeOpen, Nodes, to_fuse_attr, version_of
from cachefs.published import Published
from cachefs.serving import SERVE_MAIN
from cachefs.stats import FUSE_OPS
from cachefs.tablenodes import TableNodeOwner

log = logging.getLogger(__name__)

# Control interface: getfattr -n user.cachefs.stats MOUNTPOINT
CONTROL_PREFIX = "user.cachefs."
XATTR_STATS = CONTROL_PREFIX + "stats"
XATTR_INFO = CONTROL_PREFIX + "info"

# Locks the opens of a node take (striped by node id): one open of a file at a time

# extended attributes only root may read (the daemon may run as root for another user)
_PRIVILEGED_XATTRS = ("trusted.",)


F = TypeVar("F", bound=Callable[..., Any])

# fuse.<op> and fuse.<op>_us per operation the stats know; the rest count as "other"
_OP_KEYS = {op: (f"fuse.{op}", f"fuse.{op}_us") for op in FUSE_OPS}


def _fuse_op(fn: F) -> F:
    """An operation: any exception becomes one FuseError, logged once per path (ErrorLog)."""
    name = fn.__name__

    @functools.wraps(fn)
    def wrapper(self: CachefsFS, req: Request | None, nodeid: int, *args: Any) -> Any:
        try:
            try:
                return fn(self, req, nodeid, *args)
            except OSError as exc:
                # Out of descriptors: the caches give theirs back, and the request is tried
                # once more (a low `ulimit -n` must not leave every open failing).
                if exc.errno not in OUT_OF_DESCRIPTORS:
                    raise
                self._out_of_descriptors(exc)
                return fn(self, req, nodeid, *args)
        except FuseError as exc:
            code = exc.errno
            if code in QUIET:
                raise
            if code == errno.EAGAIN:  # refused while too many wait on the source: the session warned
                self.core.stats.add_many({"fuse.errors": 1, "fuse.busy_refusals": 1})
                raise
            self.core.stats.incr("fuse.errors")
            self._log_error(name, self.nodes._paths.get(nodeid), exc, code)
            raise
        except BaseException as exc:
            code = to_errno(exc)
            if code not in QUIET:
                self.core.stats.incr("fuse.errors")
                self._log_error(name, self.nodes._paths.get(nodeid), exc, code)
            raise FuseError(code) from None

    return wrapper  # type: ignore[return-value]


class CachefsFS(Published, TableNodeOwner, Checkpointing, Operations):
    """The file system cachefs mounts: a read-only mirror of the source through the core."""

    # READDIRPLUS (the kernel's adaptive kind, READDIRPLUS_AUTO), its entries with
    # attributes only while something stats what it lists (`ls -l`: see
    # cachefs/listahead.py); otherwise names and types, as READDIR's (see docs/design.md,
    # Listings).
    want_readdirplus = True

    def __init__(self, core: Core, config: Config, info: dict | None = None):
        self.core = core
        self.config = config
        self.want_no_open = self.zero_message_open = config.zero_message_open
        self.want_passthrough = config.passthrough != "off" and config.zero_message_open
        self.passthrough = False  # decided once the kernel has answered INIT (start_serving)
        self._opens: dict[int, NodeOpen] = {}  # node id -> how its open files are served
        self._node_locks = NodeLocks()
        self._opens_lock = threading.Lock()
        self._refused_logged = False
        self._backings: Backings | None = None
        self._info = info or {}
        self._owner = os.getuid()
        self.nodes = Nodes()
        self.session: Session | None = None
        # --open-per-handle: each open pins the file's identity, so one handle never mixes
        # blocks of two versions of a file.
        self._handles: dict[int, FileId] = {}
        self._fetched: dict[int, bytes] = {}  # handle -> the file's bytes, fetched at open, no tier kept
        self._next_fh = itertools.count(1)
        self._changed: queue.Queue[str | array] = queue.Queue()  # paths changed, nodes' names to drop
        self._invalidator: threading.Thread | None = None
        self._errors = ErrorLog()
        self._fd_warned = -1e18
        self._ttl = config.metadata_ttl
        self._valid = p.split_timeout(config.metadata_ttl)
        self._negative_ttl = config.negative_ttl
        # Serving processes (cachefs/fuse/serve.py): the table of published nodes, each
        # entry's published node, and nodes to take back from the table (forgotten or
        # dropped: see _reap_loop).
        self._table: ServeTable | None = None
        self._published: dict[bytes, int] = {}
        self._unpublished: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._named: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._naming: set[int] = set()
        self._names_lock = threading.Lock()
        self._backing_limit = config.backing_files or backing_limit()
        self._name_limit = min(self._backing_limit, NODE_TABLE_CAPACITY // 2)
        self._reaper: threading.Thread | None = None
        self._ahead_seen: set[str] = set()
        self._ahead_unlisted: set[str] = set()
        self._ahead_queue: queue.SimpleQueue[str | None] = queue.SimpleQueue()
        self._ahead_thread: threading.Thread | None = None
        self._ahead_stopped = False
        self._init_table_nodes()
        core.hooks.connect(on_source_changed=self._source_changed, on_confirmed=self._row_confirmed)
        core.stats.gauge("fuse.nodes", lambda: len(self.nodes))

    def _out_of_descriptors(self, exc: OSError) -> None:
        given = trim_descriptors()
        self.core.stats.incr("fuse.descriptor_trims")
        now = time.monotonic()
        if now - self._fd_warned > 60:
            self._fd_warned = now
            log.warning("out of file descriptors (%s; limit %d): gave back %d cached ones and retried; "
                        "raise the limit (ulimit -n, LimitNOFILE=) for a cache that keeps more open",
                        exc.strerror, descriptor_limit(), given)

    def _log_error(self, op: str, path: str | None, exc: BaseException, code: int) -> None:
        if code == errno.ETIMEDOUT and self.core.source_down:
            level, summary = logging.DEBUG, None  # the source's one warning stands for these
        else:
            level, summary = self._errors.level(op, path, code)
        log.log(level, "%s %s: %s (errno %d %s)", op, path, exc, code,
                errno.errorcode.get(code, "?"), exc_info=log.isEnabledFor(logging.DEBUG))
        if summary:
            log.warning(summary)

    # -- life cycle --------------------------------------------------------------------------

    def init(self, conn: Connection, session: Session) -> None:
        self.session = session
        self.core.hooks.connect(blocking=session.blocking)
        if not conn.no_open:
            self.zero_message_open = False
        self.core.stats.set_info(zero_message_open=self.zero_message_open)
        self._invalidator = threading.Thread(target=self._invalidate_loop, name="cachefs-invalidate", daemon=True)
        self._invalidator.start()

    def hint_sessions(self, on: bool) -> None:
        """Order hints' sessions started (True) or all ended: meanwhile the serving
        processes report every HINT_REPORT_OPENS opens (a hinted file's pin goes when the
        daemon hears of its open: see design.md, "Order hints")."""
        if self._table is not None:
            self._table.report_opens(HINT_REPORT_OPENS if on else 0)

    def start_serving(self, conn: Connection) -> None:
        """After INIT: choose how opens are served (see config.PASSTHROUGH_MODES), testing
        that this daemon may register backing files (CAP_SYS_ADMIN)."""
        mode = self.config.passthrough
        usable = self.want_passthrough and conn.passthrough and self._probe_backing()
        if usable or (mode == "on" and self.want_passthrough):
            self.passthrough, self.zero_message_open = True, False
        if usable and self.session is not None:
            self.core.hooks.connect(passthrough=True)
            self._backings = Backings(self.session, self._backing_limit)
            self.core.cache.on_drop(self._dropped)
            self.core.cache.on_promoted(self._superseded)
            self.core.stats.gauge("opens.backing_files", lambda: len(self._backings or ()))
            self.core.stats.gauge("opens.backing_files_ram", lambda: self._backings.ram_count if self._backings else 0)
            rows = self._table_nodes()
            ram_fd = self._dir_fd(self.core.cache.ram_fill_dir, "the RAM tier's data directory")
            try:
                self._table = self.session.start_servers(self.config.serve_processes or 0, NODE_TABLE_CAPACITY,
                                                         self._name_limit, rows, SERVE_MAIN,
                                                         self._checkpoint_room(rows), self._ttl, ram_fd)
                if self._table is not None and rows is not None and self._table.rows:
                    self._start_rows(rows.records)
                self._start_checkpoints()
            finally:  # the serving processes have theirs
                for fd in [fd for fd in (*(rows[1:3] if rows is not None else ()), ram_fd) if fd >= 0]:
                    os.close(fd)
            if self._table is not None:
                self._reaper = threading.Thread(target=self._reap_loop, name="cachefs-reap", daemon=True)
                self._reaper.start()
                log.info("serving processes: %d", self._table.processes)
                alive = self.session.servers_alive
                self.core.stats.gauge("serve.processes", lambda: sum(alive))
                self.core.stats.gauge("serve.published", lambda: len(self._published))
                self.core.stats.gauge("serve.names", lambda: len(self._named))
        if mode == "on" and self.want_passthrough and not usable:
            why = ("the kernel does not offer it" if not conn.passthrough
                   else "this daemon may not register backing files (it needs CAP_SYS_ADMIN)")
            log.warning("--passthrough on: %s; every open is served by the daemon", why)
        chosen = "passthrough" if usable else "zero-message" if self.zero_message_open else "daemon"
        why = ("" if usable or mode == "off" or not self.want_passthrough else
               "the kernel does not offer passthrough (Linux 6.9 or newer)" if not conn.passthrough else
               "registering backing files needs CAP_SYS_ADMIN (root)")
        self.core.stats.set_info(zero_message_open=self.zero_message_open, opens=chosen, opens_why=why)
        log.info("opens: %s%s", chosen, f" ({why})" if why else "")

    def _probe_backing(self) -> bool:
        """Whether the kernel takes a backing file from us (EPERM without CAP_SYS_ADMIN)."""
        assert self.session is not None
        probe = os.path.join(self.core.cache.scratch_dir, ".backing-probe")
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:
            return False
        try:
            backing_id = self.session.backing_open(fd)
            self.session.backing_close(backing_id)
            return True
        except OSError as exc:
            log.info("passthrough unavailable: registering a backing file failed (%s)", exc.strerror)
            return False
        finally:
            os.close(fd)
            os.unlink(probe)

    def destroy(self) -> None:
        self._changed.put("")  # stops the invalidation thread (it uses the table, closed after this)
        if self._invalidator is not None:
            self._invalidator.join(10)
        self._ahead_stopped = True  # names published ahead, then the serving processes' helper,
        self._ahead_queue.put(None)  # before what they use goes
        if self._ahead_thread is not None:
            self._ahead_thread.join(10)
        self._stop_checkpoints()
        self._unpublished.put(("stop",))
        if self._reaper is not None:
            self._reaper.join(10)
        with self._opens_lock:
            opens, self._opens = self._opens, {}
        for state in opens.values():
            if state.backing is not None:
                state.backing.release()
        if self._backings is not None:
            self._backings.close_all()
        self._rows, self._table = False, None  # the session closes the table: the tiers' threads leave it be

    def reply_failed(self, op: str, code: int) -> None:
        """The session's report of a reply the kernel refused (it logged the warning): the
        caller got an error, so it counts as one."""
        self.core.stats.add_many({"fuse.errors": 1, "fuse.reply_failures": 1})

    def observe(self, op: str, seconds: float, code: int) -> None:
        """The session's per-request observer: requests and time per operation."""
        count, micros = _OP_KEYS.get(op) or _OP_KEYS["other"]
        self.core.stats.add_many({count: 1, micros: int(seconds * 1e6)})

    # -- files that change on the source ----------------------------------------------------

    def _source_changed(self, path: str) -> None:
        """A file turned out changed or gone on the source: forget what the daemon knew of
        it, and have the kernel forget its name, so that the next open looks it up again
        and gets a node of the new version (see Nodes). Its old node keeps serving the old
        version to those who hold it: from the cache, or ESTALE."""
        self.core.invalidate(path)
        self._unname(path)
        self._changed.put(path)

    def _invalidate_loop(self) -> None:
        """Tell the kernel to drop the names of changed files (and a checkpoint's, _drop_names).
        Not done in a request thread: an invalidation from inside a request about the same
        directory can deadlock on its locks."""
        while True:
            items = [self._changed.get()]
            while not self._changed.empty():  # many changed at once: one wait for all of them
                items.append(self._changed.get())
            if "" in items:
                return
            paths = [item for item in items if isinstance(item, str)]
            for path in paths:
                self._unname(path)  # before the kernel drops the name: its next lookup comes here,
            if self._table is not None and self.session is not None:  # and no answer from before is on its way
                self._table.quiesce(self.session.servers_alive)
            for path in paths:
                if (found := self.nodes.name_of(path)) is not None and self.session is not None:
                    self.session.notify_inval_entry(*found)
                log.info("%s changed on the source; opens from now on get the new version", path)
            for nodeids in (item for item in items if not isinstance(item, str)):
                self._drop_names(nodeids)  # (a checkpoint's: Checkpointing._unname_tabled)

    def _fid(self, nodeid: int, path: str) -> FileId:
        """The file version a node stands for (Nodes), or the source's current one."""
        v = self.nodes.version(nodeid)
        if v is None:
            return self.core.file_id(path)
        return FileId.of(path, v)

    # -- metadata ----------------------------------------------------------------------------

    @_fuse_op
    def lookup(self, req: Request, parent: int, name: bytes) -> Entry | bytes:
        path = self.nodes.child(parent, name)
        try:
            a = self.core.getattr(path)
        except FileNotFoundError:
            # a negative entry: the kernel remembers "no such file" for --negative-ttl
            return Entry(0, p.Attr(0, 0, 0, 0, 0, 0, 0, 0, 0), self._negative_ttl, 0)
        return self._entry(path, a, parent, name)

    def _entry(self, path: str, a: Attr, parent: int, name: bytes) -> bytes:
        """The packed entry of a lookup that found `path`: the kernel counts it (FORGET)."""
        if self._rows:
            nodeid, new = self._table_lookup(path, a)
            if nodeid < 0:  # a directory, or a table node: nothing to publish
                return self._packed_entry(-nodeid, a)
        else:
            nodeid, new = self.nodes.looked_up(path, a)
        if self._table is not None and a.is_file and nodeid not in self._opens:
            self._publish_known(nodeid, FileId.of(path, a), new)
        entry = self._packed_entry(nodeid, a)
        if self._table is not None and a.is_file:
            self._publish_name(nodeid, parent, name, path, a, entry)
            self._ahead_soon(path.rpartition("/")[0] or "/")
        return entry

    @_fuse_op
    def lookup_known(self, req: Request, parent: int, name: bytes) -> bytes | None:
        path = self.nodes.child(parent, name)
        a = self.core.known_attr(path)
        if a is None:
            return None
        return self._entry(path, a, parent, name)

    def readdirplus_entries(self, req: Request, nodeid: int) -> bool:
        return self.core.listing_attrs_wanted()

    def forget(self, nodeid: int, nlookup: int) -> None:
        if self.nodes.forget(nodeid, nlookup):
            self._forgotten(nodeid)

    def _forgotten(self, nodeid: int) -> None:
        """The kernel holds the node no more: its open state goes, and its id is given out
        again (once taken back from the serving processes, if published)."""
        if nodeid not in self._opens:  # the common case: nothing can make a state for it now
            if self._table is not None:
                self._table.unpublish(nodeid)
            self.nodes.recycle(nodeid)
            return
        with self._node_lock(nodeid, refusable=False):  # as the reaper's take-back (published.py)
            state = self._opens.get(nodeid)
            if state is not None and state.published and self._table is not None:
                self._table.unpublish(nodeid)
                self._unpublished.put(("node", nodeid, state, True))  # the id is reused once taken back
                return
            if state is not None:  # no open is left of a node the kernel forgot
                with self._opens_lock:
                    state = self._opens.pop(nodeid, None)
            if self._table is not None:
                self._table.unpublish(nodeid)
        if state is not None:
            self._closed(state)
        self.nodes.recycle(nodeid)

    @_fuse_op
    def getattr(self, req: Request, nodeid: int, fh: int | None) -> tuple[p.Attr, float]:
        path = self.nodes.path(nodeid)
        pinned = self.nodes.version(nodeid)
        if pinned is None:
            return to_fuse_attr(self.core.getattr(path)), self._ttl
        try:
            attr: Attr | None = self.core.getattr(path)
        except FileNotFoundError:
            attr = None
        if attr is not None and version_of(attr) == version_of(pinned):
            return to_fuse_attr(attr), self._ttl
        # The file changed (or is gone) on the source: this node stays the version it was
        # looked up as, as a file on a local disk stays what an open descriptor holds.
        if self.nodes.id_of(path) == nodeid:
            self._changed.put(path)  # and the name is looked up again
        return to_fuse_attr(pinned), self._ttl

    @_fuse_op
    def readlink(self, req: Request, nodeid: int) -> bytes:
        return os.fsencode(self.core.readlink(self.nodes.path(nodeid)))

    @_fuse_op
    def opendir(self, req: Request, nodeid: int, flags: int) -> Opened:
        if not self.core.getattr(self.nodes.path(nodeid)).is_dir:
            raise FuseError(errno.ENOTDIR)
        # The kernel keeps the listing (until the directory's attributes change): an epoch
        # after the first lists no directory again.
        return Opened(0, p.FOPEN_CACHE_DIR | p.FOPEN_KEEP_CACHE)

    @_fuse_op
    def readdir(self, req: Request, nodeid: int, fh: int) -> list[tuple[bytes, int, int]]:
        # d_type comes with each entry: os.scandir()/os.walk() never need a stat per entry.
        # Plain tuples, the names' bytes as the daemon keeps them (identity.Listing).
        items = [(b".", stat_mod.S_IFDIR, 0), (b"..", stat_mod.S_IFDIR, 0)]
        items += dirents(self.core.readdir(self.nodes.path(nodeid)))
        return items

    @_fuse_op
    def statfs(self, req: Request, nodeid: int) -> StatFs:
        s = self.core.statfs()
        return StatFs(s["f_blocks"], s["f_bfree"], s["f_bavail"], s["f_files"], s["f_ffree"], s["f_bsize"],
                      s["f_namemax"], s["f_frsize"])

    # -- data ----------------------------------------------------------------------------------

    @_fuse_op
    def open(self, req: Request, nodeid: int, flags: int) -> Opened:
        if self.zero_message_open:
            # ENOSYS here means "success, and do not ask again" (FUSE_NO_OPEN_SUPPORT).
            raise FuseError(errno.ENOSYS)
        fid = self._fid(nodeid, self.nodes.path(nodeid))  # ENOENT/EISDIR now, not at the first read
        if self._table is not None and self._rows:
            n = self._table.row_of(nodeid)
            if n >= 0 and self._table.row_theirs(n):
                self._take_row(n)  # an open the serving processes could not answer: this process's from now on
        if not self.passthrough:
            fh = next(self._next_fh)
            self._handles[fh] = fid
            self.core.stats.incr("opens.daemon")
            return Opened(fh, p.FOPEN_KEEP_CACHE)
        with self._node_lock(nodeid):
            return self._open_passthrough(nodeid, fid)

    def _node_lock(self, nodeid: int, refusable: bool = True) -> contextlib.AbstractContextManager[None]:
        """The lock serializing the opens and releases of one node (see NodeLocks). A
        release's wait is never refused (the kernel ignores a release's error, and the open
        would stay counted)."""
        session = self.session
        if session is None:
            return self._node_locks.hold(nodeid, contextlib.nullcontext)
        return self._node_locks.hold(nodeid, lambda: session.blocking(refusable))

    def _open_passthrough(self, nodeid: int, fid: FileId) -> Opened:
        """One open in passthrough mode (the node's lock held). The kernel allows one
        backing file per inode at a time, and no cached opens beside passthrough ones
        (EIO, ETXTBSY): every open of a node is served the way its first open still held is."""
        assert self.session is not None
        fh = next(self._next_fh)
        state = self._opens.get(nodeid)
        if state is not None:
            if state.backing_id:
                # the version the first open got, until the last one closes: a handle
                # reads one version, whole
                again, _ = self.core.open_file(state.fid, fill=False)  # counted as the tier's hits
                state.refs += 1  # only once nothing can fail: a failed open gets no release
                if again is not None:
                    again.release()
                self.core.stats.incr("opens.passthrough")
                if state.published:
                    fh = OWN_FH | nodeid
                else:
                    self._handles[fh] = state.fid
                return Opened(fh, p.FOPEN_PASSTHROUGH | p.FOPEN_NOFLUSH, state.backing_id)
            state.refs += 1
            self._handles[fh] = fid
            self.core.stats.incr("opens.daemon")
            return Opened(fh, p.FOPEN_KEEP_CACHE)
        backing, fetched = self.core.open_file(fid)
        if fetched is not None:
            self._fetched[fh] = fetched
        state = NodeOpen(fid)
        if backing is not None:
            try:
                assert self._backings is not None
                state.backing_id = self._backings.get(backing)
                state.backing, state.eid = backing, self._backings.key(backing)
            except OSError as exc:
                backing.release()
                self._backing_refused(exc)
        with self._opens_lock:
            self._opens[nodeid] = state
        if state.backing_id and self._table is not None and self._table.publish(nodeid, state.backing_id):
            # From now on the serving processes answer its opens and releases, until the
            # kernel forgets the node or a tier drops the entry (see _reap).
            state.published = True
            self._published[state.eid] = nodeid
            self._check_doomed(state.eid)
            fh = OWN_FH | nodeid
        else:
            self._handles[fh] = fid
        if state.backing_id:
            self.core.stats.incr("opens.passthrough")
            return Opened(fh, p.FOPEN_PASSTHROUGH | p.FOPEN_NOFLUSH, state.backing_id)
        self.core.stats.incr("opens.daemon")
        return Opened(fh, p.FOPEN_KEEP_CACHE)

    def _backing_refused(self, exc: OSError) -> None:
        self.core.stats.incr("opens.fallback")
        if not self._refused_logged:
            self._refused_logged = True
            log.warning("the kernel refused a backing file (%s); such opens are served by the daemon",
                        exc.strerror)

    @_fuse_op
    def read(self, req: Request, nodeid: int, fh: int, offset: int, size: int) -> bytes:
        fetched = self._fetched.get(fh)
        if fetched is not None:
            chunk = fetched[offset:offset + size]
            self.core.stats.add_many({"reads.requests": 1, "reads.bytes": len(chunk),
                                      "source.served_bytes": len(chunk)})
            return chunk
        path = self.nodes.path(nodeid)
        return self.core.read(path, offset, size, fid=self._handles.get(fh) or self._fid(nodeid, path))

    @_fuse_op
    def release(self, req: Request, nodeid: int, fh: int) -> None:
        self._handles.pop(fh, None)
        self._fetched.pop(fh, None)
        if not self.passthrough:
            return
        with self._node_lock(nodeid, refusable=False):
            state = self._opens.get(nodeid)
            if state is None:
                return
            state.refs -= 1
            if state.refs > 0 or state.published:  # published: the table holds the rest of the count
                return
            with self._opens_lock:
                del self._opens[nodeid]
        self._closed(state)

    def _closed(self, state: NodeOpen) -> None:
        """The node's last open closed (or the node is gone): its backing file goes back."""
        if state.backing_id and state.private:
            self._close_private(state.backing_id)  # a serving process registered it
        elif state.backing_id and self._backings is not None:
            self._backings.put(state.eid)
        if state.backing is not None:
            state.backing.release()

    # -- extended attributes and the control interface -------------------------------------

    @_fuse_op
    def getxattr(self, req: Request, nodeid: int, name: bytes) -> bytes:
        text = os.fsdecode(name)
        if nodeid == p.ROOT_ID and text.startswith(CONTROL_PREFIX):
            return self._control(text, req.uid)
        if text.startswith(_PRIVILEGED_XATTRS) and req.uid != 0:
            raise FuseError(errno.ENODATA)  # the daemon may read them; the caller may not
        return self.core.getxattr(self.nodes.path(nodeid), text)

    @_fuse_op
    def listxattr(self, req: Request, nodeid: int) -> Iterable[bytes]:
        names = self.core.listxattr(self.nodes.path(nodeid))
        return [os.fsencode(n) for n in names if req.uid == 0 or not n.startswith(_PRIVILEGED_XATTRS)]

    def _control(self, name: str, uid: int) -> bytes:
        if uid not in (self._owner, 0):
            raise FuseError(errno.EACCES)
        if name == XATTR_STATS:
            if self.session is not None:
                self.session.settle()  # the serving processes' opens counted first
            self.core.cache.settle_promotions()  # and the RAM copies those opens queued
            return json.dumps(self.core.stats.snapshot(), separators=(",", ":")).encode()
        if name == XATTR_INFO:
            return json.dumps(dict(self._info, pid=os.getpid())).encode()
        raise FuseError(errno.ENODATA)
