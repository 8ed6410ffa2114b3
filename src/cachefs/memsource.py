"""An in-memory Source for tests and simulations: counts calls, injects faults.

It implements the same contract as LocalSource (identity checks in read_range included), so
the core, the tiers and the policies are exercised without a mount or a disk.
"""

from __future__ import annotations

import errno
import posixpath
import stat as stat_mod
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable

from cachefs.errors import SourceChanged
from cachefs.identity import Attr, DirEntry, FileId
from cachefs.source import check_relpath


class MemorySource:
    def __init__(self, latency: float = 0.0, sleep: Callable[[float], None] = time.sleep):
        self._nodes: dict[str, tuple[Attr, object]] = {}
        self._lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.calls_by_path: Counter[tuple[str, str]] = Counter()  # (op, path as asked)
        self.xattrs: dict[str, dict[str, bytes]] = {}
        self.bytes_read = 0
        self.faults: dict[tuple[str, str], int] = {}  # (op, path) -> errno
        self.latency = latency
        self._sleep = sleep
        self._clock_ns = 1_700_000_000 * 10**9
        self._open_gate = threading.Event()  # cleared: requests for hung paths block
        self._open_gate.set()
        self._hung: set[str] | None = None  # None while hung: every path
        self.add_dir("/")

    # -- building the tree -------------------------------------------------------------

    def _tick(self) -> int:
        self._clock_ns += 1_000_000
        return self._clock_ns

    def _put(self, path: str, mode: int, payload: object, size: int, mtime_ns: int | None) -> None:
        path = "/" + check_relpath(path)
        parent = posixpath.dirname(path)
        if path != "/" and parent not in self._nodes:
            self.add_dir(parent)
        t = self._tick() if mtime_ns is None else mtime_ns
        ino = zlib.crc32(path.encode("utf-8", "surrogateescape")) + 2  # stable per path, as on a disk
        self._nodes[path] = (Attr(mode, 1, 0, 0, size, t, t, t, (size + 511) // 512, 0, ino), payload)

    def add_dir(self, path: str, mode: int = 0o755) -> None:
        self._put(path, stat_mod.S_IFDIR | mode, None, 0, None)

    def add_file(self, path: str, data: bytes, mode: int = 0o644, mtime_ns: int | None = None) -> None:
        self._put(path, stat_mod.S_IFREG | mode, bytes(data), len(data), mtime_ns)

    def add_symlink(self, path: str, target: str) -> None:
        self._put(path, stat_mod.S_IFLNK | 0o777, target, len(target), None)

    def remove(self, path: str) -> None:
        del self._nodes[path]

    def hang(self, *paths: str) -> None:
        """From now on, requests for `paths` (all paths if none given) block until release():
        a server that stopped answering."""
        self._hung = set(paths) if paths else None
        self._open_gate.clear()

    def release(self) -> None:
        self._open_gate.set()

    # -- the Source interface ----------------------------------------------------------

    def _enter(self, op: str, path: str) -> tuple[Attr, object]:
        with self._lock:
            self.calls[op] += 1
            self.calls_by_path[op, path] += 1
        if self.latency:
            self._sleep(self.latency)
        path = "/" + check_relpath(path)
        if not self._open_gate.is_set() and (self._hung is None or path in self._hung):
            self._open_gate.wait()
        err = self.faults.get((op, path)) or self.faults.get((op, "*"))
        if err:
            raise OSError(err, "injected fault", path)
        try:
            return self._nodes[path]
        except KeyError:
            raise FileNotFoundError(errno.ENOENT, "no such file", path) from None

    def stat(self, path: str) -> Attr:
        return self._enter("stat", path)[0]

    def listdir(self, path: str, attrs: bool = False) -> list[DirEntry]:
        attr, _ = self._enter("listdir", path)
        if not attr.is_dir:
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", path)
        prefix = path.rstrip("/") + "/"
        entries = [DirEntry(p[len(prefix):], stat_mod.S_IFMT(a.mode), a.ino, a if attrs else None)
                   for p, (a, _) in sorted(self._nodes.items())
                   if p.startswith(prefix) and p != "/" and "/" not in p[len(prefix):]]
        return entries

    def read_range(self, fid: FileId, offset: int, size: int) -> bytes:
        attr, data = self._enter("read_range", fid.path)
        if not attr.is_file:
            raise IsADirectoryError(errno.EISDIR, "not a file", fid.path)
        same = fid.matches(attr)
        if not same or offset + size > attr.size:
            raise SourceChanged(fid.path)
        assert isinstance(data, bytes)
        with self._lock:
            self.bytes_read += size
        return data[offset:offset + size]

    def read_whole(self, path: str, limit: int, expect: FileId | None = None) -> tuple[Attr, bytes | None]:
        attr, data = self._enter("read_range", path)  # one request, as a read
        if not attr.is_file:
            raise OSError(errno.EINVAL, "not a regular file", path)
        if expect is not None and not expect.matches(attr):
            raise SourceChanged(path)
        if attr.size > limit:
            return attr, None
        assert isinstance(data, bytes)
        with self._lock:
            self.bytes_read += len(data)
        return attr, data

    def readlink(self, path: str) -> str:
        attr, target = self._enter("readlink", path)
        if not stat_mod.S_ISLNK(attr.mode):
            raise OSError(errno.EINVAL, "not a symlink", path)
        assert isinstance(target, str)
        return target

    def statfs(self) -> dict:
        with self._lock:
            self.calls["statfs"] += 1
        return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": 1000, "f_bfree": 500, "f_bavail": 400,
                "f_files": 100, "f_ffree": 50, "f_favail": 50, "f_namemax": 255}

    def set_xattr(self, path: str, name: str, value: bytes) -> None:
        self.xattrs.setdefault(path, {})[name] = value

    def getxattr(self, path: str, name: str) -> bytes:
        self._enter("getxattr", path)
        try:
            return self.xattrs[path][name]
        except KeyError:
            raise OSError(errno.ENODATA, "no such attribute", path) from None

    def listxattr(self, path: str) -> list[str]:
        self._enter("listxattr", path)
        return list(self.xattrs.get(path, {}))
