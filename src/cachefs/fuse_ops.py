"""The FUSE adapter: the only module that imports the FUSE binding.

Thin by design: translate the kernel's requests into Core calls, map every exception to an
errno with errors.to_errno, and answer the control interface (extended attributes of the
mount root named user.cachefs.*, invisible to readdir and to any file name).

Kernel-side caching does the heavy lifting for a warm epoch:
  - entry/attr timeouts = --metadata-ttl, so lookups and stats stay in the kernel;
  - zero-message opens: the first open() returns ENOSYS, which (with FUSE_CAP_NO_OPEN_SUPPORT)
    tells the kernel to stop sending OPEN, FLUSH and RELEASE for files altogether, and to
    keep the page cache across opens (FOPEN_KEEP_CACHE is the no-open default). The
    kernel still drops a file's pages when its attributes show a new size or mtime
    (FUSE_AUTO_INVAL_DATA), so a changed file is reread;
  - no ioctl handler: libfuse answers isatty()'s TCGETS without entering Python.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import functools
import itertools
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cachefs import fuselib
from cachefs.blocks import FileId
from cachefs.config import FUSE_MAX_THREADS, MAX_READ, Config
from cachefs.core import Core
from cachefs.errors import to_errno
from cachefs.fuselib import StderrTail

if TYPE_CHECKING:
    import mfusepy as fuse_binding
else:
    fuse_binding = fuselib.load()  # mfusepy on libfuse 3, never libfuse 2

log = logging.getLogger(__name__)

FuseOSError = fuse_binding.FuseOSError

FUSE_CAP_NO_OPEN_SUPPORT = 1 << 17
FUSE_CAP_CACHE_SYMLINKS = 1 << 23

# Control interface: getfattr -n user.cachefs.stats MOUNTPOINT
CONTROL_PREFIX = "user.cachefs."
XATTR_STATS = CONTROL_PREFIX + "stats"
XATTR_INFO = CONTROL_PREFIX + "info"

# Seconds between a changed file's last old read returning and the kernel being told to
# drop its pages (twice): time for libfuse to deliver that read's reply.
REPLY_GRACE = 0.05

_QUIET_ERRNOS = {errno.ENOENT, errno.ENODATA, errno.EROFS, errno.ENOSYS}


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


def _fuse_op(fn: Callable) -> Callable:  # type: ignore[type-arg]
    """Run one FUSE operation: any exception becomes an errno, never a dead mount."""

    name = fn.__name__
    count_key, time_key = f"fuse.{name}", f"fuse.{name}_us"

    def wrapper(self: CachefsOperations, path: str | None, *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(self, path, *args)
        except FuseOSError:
            raise
        except BaseException as exc:
            code = to_errno(exc)
            if code not in _QUIET_ERRNOS:
                self.core.stats.incr("fuse.errors")
                self._log_error(name, path, exc, code)
            raise FuseOSError(code) from None
        finally:
            # time spent in the daemon per operation: where a slow request's time goes
            self.core.stats.add_many({count_key: 1, time_key: int((time.perf_counter() - start) * 1e6)})

    return functools.wraps(fn)(wrapper)


def _read_only(self: CachefsOperations, path: str | None, *args: Any) -> Any:
    raise FuseOSError(errno.EROFS)


class CachefsOperations(fuse_binding.Operations):
    use_ns = True  # times as integer nanoseconds, exactly as the source reports them

    def __init__(self, core: Core, config: Config, on_ready: Callable[[], None] | None = None,
                 info: dict | None = None):
        self.core = core
        self.config = config
        self.zero_message_open = config.zero_message_open
        self._ready_hooks: list[Callable[[], None]] = []
        self._on_ready = on_ready
        self._info = info or {}
        self._owner = os.getuid()
        self.was_mounted = False
        # --open-per-handle: each open pins the file's identity, so one handle never mixes
        # blocks of two versions of a file.
        self._handles: dict[int, FileId] = {}
        self._next_fh = itertools.count(1)
        self._fuse_ptr: int | None = None
        self._changed: queue.Queue[str] = queue.Queue()
        core.on_source_changed = self._source_changed
        self._errors = ErrorLog()

    def add_ready_hook(self, hook: Callable[[], None]) -> None:
        """Run `hook` in FUSE init, once the mount is live, before the on_ready callback."""
        self._ready_hooks.append(hook)

    def _log_error(self, op: str, path: str | None, exc: BaseException, code: int) -> None:
        if code == errno.ETIMEDOUT and self.core.source_down:
            level, summary = logging.DEBUG, None  # the source's one warning stands for these
        else:
            level, summary = self._errors.level(op, path, code)
        log.log(level, "%s %s: %s (errno %d %s)", op, path, exc, code,
                errno.errorcode.get(code, "?"), exc_info=log.isEnabledFor(logging.DEBUG))
        if summary:
            log.warning(summary)

    # -- lifecycle -----------------------------------------------------------------------

    def init_with_config(self, conn: Any, config_3: Any) -> None:
        if config_3 is not None:
            config_3.entry_timeout = self.config.metadata_ttl
            config_3.attr_timeout = self.config.metadata_ttl
            config_3.negative_timeout = self.config.negative_ttl
        if conn is not None:
            # libfuse refuses to run if this differs from the max_read mount option.
            conn.max_read = MAX_READ
            capable = int(conn.capable)
            if not capable & FUSE_CAP_NO_OPEN_SUPPORT:
                self.zero_message_open = False
            if capable & FUSE_CAP_CACHE_SYMLINKS:
                conn.want = int(conn.want) | FUSE_CAP_CACHE_SYMLINKS
        self.core.stats.set_info(zero_message_open=self.zero_message_open)
        self._fuse_ptr = fuse_binding._libfuse.fuse_get_context().contents.fuse
        threading.Thread(target=self._invalidate_loop, name="cachefs-invalidate", daemon=True).start()
        self.was_mounted = True
        for hook in self._ready_hooks:
            hook()
        if self._on_ready is not None:
            self._on_ready()

    def destroy(self, path: str) -> None:
        self._changed.put("")  # stops the invalidation thread
        self.core.close()

    def _source_changed(self, path: str) -> None:
        self.core.begin_change(path)
        self._changed.put(path)

    def _invalidate_loop(self) -> None:
        """Make the kernel forget a changed file, then let the daemon see its new identity.

        In that order: the kernel may hold the old size and pages of the file for a whole
        --metadata-ttl, and a daemon already serving new blocks under the old size would
        hand readers a mix of two versions. Until the kernel is told, reads of the file
        fail with ESTALE (Core.begin_change). Not done in the request thread: libfuse forbids
        notifications from inside a related operation (it can deadlock on page locks).
        """
        invalidate = fuse_binding._libfuse.fuse_invalidate_path
        invalidate.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        invalidate.restype = ctypes.c_int
        while True:
            path = self._changed.get()
            if not path:
                return
            self.core.wait_reads_done(path)
            # A read that just returned has its reply still on the way into the page cache;
            # so drop the pages after a moment, and once more after that.
            for _ in range(2):
                time.sleep(REPLY_GRACE)
                try:
                    invalidate(self._fuse_ptr, path.encode("utf-8", "surrogateescape"))
                except Exception as exc:  # an unknown path (-ENOENT) is fine: nothing to drop
                    log.debug("invalidating %s in the kernel failed: %s", path, exc)
            self.core.kernel_invalidated(path)
            log.info("%s changed on the source; readers get the new version from their next read()", path)

    # -- metadata ------------------------------------------------------------------------

    @_fuse_op
    def getattr(self, path: str, fh: Any = None) -> dict:
        self.core.kernel_getattr(path)
        return self.core.getattr(path).to_fuse()

    @_fuse_op
    def opendir(self, path: str) -> int:
        if not self.core.getattr(path).is_dir:
            raise FuseOSError(errno.ENOTDIR)
        return 0

    @_fuse_op
    def readdir(self, path: str, fh: Any) -> list:
        # (name, mode, 0): the kernel learns each entry's type (d_type) from the listing
        # itself, so os.scandir()/os.walk() never need a stat per entry.
        return [".", ".."] + [(e.name, e.type_mode, 0) for e in self.core.readdir(path)]

    @_fuse_op
    def readlink(self, path: str) -> str:
        return self.core.readlink(path)

    @_fuse_op
    def statfs(self, path: str) -> dict:
        return self.core.statfs()

    # -- data ----------------------------------------------------------------------------

    @_fuse_op
    def open(self, path: str, fi: Any) -> int:
        if self.zero_message_open:
            # ENOSYS here means "success, and do not ask again" (FUSE_CAP_NO_OPEN_SUPPORT).
            raise FuseOSError(errno.ENOSYS)
        if fi.flags & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_APPEND):
            raise FuseOSError(errno.EROFS)
        fh = next(self._next_fh)
        self._handles[fh] = self.core.file_id(path)  # ENOENT/EISDIR now, not at the first read
        fi.fh = fh
        fi.keep_cache = 1
        return 0

    @_fuse_op
    def read(self, path: str, size: int, offset: int, fh: Any) -> bytes:
        fid = self._handles.get(fh.fh) if fh is not None else None
        return self.core.read(path, offset, size, fid=fid)

    @_fuse_op
    def release(self, path: str, fh: Any) -> int:
        self._handles.pop(fh.fh, None)
        return 0

    # -- extended attributes and the control interface -------------------------------------

    @_fuse_op
    def getxattr(self, path: str, name: str, *args: Any) -> bytes:
        if path == "/" and name.startswith(CONTROL_PREFIX):
            return self._control(name)
        return self.core.getxattr(path, name)

    @_fuse_op
    def listxattr(self, path: str) -> list:
        return self.core.listxattr(path)

    def _control(self, name: str) -> bytes:
        uid, _gid, _pid = fuse_binding.fuse_get_context()
        if uid not in (self._owner, 0):
            raise FuseOSError(errno.EACCES)
        if name == XATTR_STATS:
            return json.dumps(self.core.stats.snapshot(), separators=(",", ":")).encode()
        if name == XATTR_INFO:
            return json.dumps(dict(self._info, pid=os.getpid())).encode()
        raise FuseOSError(errno.ENODATA)

    # -- everything that would write: a read-only mirror ------------------------------------
    chmod = chown = create = mkdir = mknod = rename = rmdir = symlink = link = _read_only
    truncate = unlink = utimens = write = setxattr = removexattr = _read_only


def _escape_opt(value: str) -> str:
    """Escape a value for libfuse's comma-separated -o list."""
    return value.replace("\\", "\\\\").replace(",", "\\,")


def run_fuse(ops: CachefsOperations, mountpoint: str, config: Config) -> None:
    """Mount and serve until unmounted or signalled (SIGINT/SIGTERM/SIGHUP: clean unmount)."""
    options: dict[str, Any] = {
        "ro": True,
        # The kernel checks the source's mode bits for every caller, from cached attributes:
        # EACCES at open() rather than at the first read, and no access() round trips.
        "default_permissions": True,
        "fsname": _escape_opt(config.source),
        "subtype": "cachefs",
        "max_read": MAX_READ,
        # Threads block in source reads with the GIL released; libfuse's default of 10
        # would cap a cold epoch's parallelism below what 8 DataLoader workers ask for.
        "max_threads": FUSE_MAX_THREADS,
        # Idle threads stay. libfuse ends idle threads beyond 10 and starts new ones under
        # load; each new thread opened its own SQLite connection to the NVMe tier's index
        # (diskcache's are per thread) and the ended ones kept theirs: descriptors grew
        # with every burst (tests/fuse/test_concurrency.py).
        "max_idle_threads": FUSE_MAX_THREADS,
    }
    if config.allow_other:
        options["allow_other"] = True
    # libfuse reports why a mount failed (a bad option, fusermount3's refusal) only on
    # stderr: keep its last lines for the error message until the mount is live.
    tail = StderrTail().start()
    ops.add_ready_hook(tail.stop)
    try:
        fuse_binding.FUSE(ops, mountpoint, raw_fi=True, foreground=True, nothreads=False,
                          debug=config.debug_fuse, **options)
    except RuntimeError as exc:
        tail.stop()
        # fuse_main() returns 8 when its loop ended on SIGINT/SIGTERM/SIGHUP (libfuse >= 3.x
        # records the signal as the session's error) - after a clean unmount. Only a
        # failure to mount or a real loop error is an error.
        if exc.args != (8,) or not ops.was_mounted:
            reason = tail.last() or f"fuse_main returned {exc.args[0]} without a message"
            raise RuntimeError(f"libfuse: {reason}") from None
        log.info("unmounted %s after a signal", mountpoint)
    finally:
        tail.stop()
