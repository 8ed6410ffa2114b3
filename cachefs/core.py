"""The core: metadata cache and block reads over a Source and a MultiLevelCache.

It never imports the FUSE binding; fuse_ops.py translates kernel requests into calls
here, and the unit tests call it directly with a MemorySource.

Data path of `read(path, offset, size)`:
  1. the file's identity (path, size, mtime_ns) comes from the metadata cache (TTL);
  2. the blocks covering the range are looked up RAM -> NVMe;
  3. a missing block is fetched whole from the source (a small file is one block) with an
     identity check, then put into the tiers; the requested slice is returned.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future

from cachefs.blocks import FileId, block_extent, block_key, block_range
from cachefs.config import DEFAULT_BLOCK_SIZE, DEFAULT_METADATA_TTL, DEFAULT_NEGATIVE_TTL, METADATA_MAX_ENTRIES
from cachefs.errors import SourceChanged
from cachefs.source import Attr, DirEntry, Source
from cachefs.stats import Stats
from cachefs.tiers.multilevel import MultiLevelCache

log = logging.getLogger(__name__)

_ANSWERS = {errno.ENODATA, errno.ENOTSUP, errno.EINVAL}


def source_namespace(source_root: str) -> bytes:
    """A short, stable id of a source directory, the first field of every cache key."""
    return hashlib.blake2b(source_root.encode("utf-8", "surrogateescape"), digest_size=8).hexdigest().encode()


class _TTLCache:
    """A bounded LRU of path -> (expiry, value). Values may be an errno (negative entry)."""

    def __init__(self, max_entries: int, clock: Callable[[], float]):
        self._data: OrderedDict[str, tuple[float, object]] = OrderedDict()
        self._max = max_entries
        self._clock = clock
        self._lock = threading.Lock()

    def get(self, key: str) -> object | None:
        with self._lock:
            hit = self._data.get(key)
            if hit is None:
                return None
            if hit[0] < self._clock():
                del self._data[key]
                return None
            self._data.move_to_end(key)
            return hit[1]

    def put(self, key: str, value: object, ttl: float) -> None:
        if ttl <= 0:
            return
        with self._lock:
            self._data[key] = (self._clock() + ttl, value)
            self._data.move_to_end(key)
            while len(self._data) > self._max:
                self._data.popitem(last=False)

    def pop(self, key: str) -> None:
        with self._lock:
            self._data.pop(key, None)

    def __len__(self) -> int:
        return len(self._data)


class Core:
    def __init__(
        self,
        source: Source,
        cache: MultiLevelCache,
        stats: Stats,
        namespace: bytes = b"default",
        block_size: int = DEFAULT_BLOCK_SIZE,
        metadata_ttl: float = DEFAULT_METADATA_TTL,
        negative_ttl: float = DEFAULT_NEGATIVE_TTL,
        clock: Callable[[], float] = time.monotonic,
        metadata_entries: int = METADATA_MAX_ENTRIES,
    ):
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        self.source = source
        self.cache = cache
        self.stats = stats
        self.namespace = namespace
        self.block_size = block_size
        self.metadata_ttl = metadata_ttl
        self.negative_ttl = negative_ttl
        self._attrs = _TTLCache(metadata_entries, clock)
        self._dirs = _TTLCache(max(1, metadata_entries // 10), clock)
        # Called with a path whose cached identity turned out wrong. The default forgets the
        # metadata at once; under a mount, fuse_ops holds the file in begin_change() until
        # the kernel has dropped its attributes and pages, so no read mixes two versions.
        self.on_source_changed: Callable[[str], None] = self.invalidate
        self._changing: dict[str, bool] = {}  # path -> kernel already told to drop it
        self._reading: dict[str, int] = {}  # path -> reads in progress (see wait_reads_done)
        self._reading_cond = threading.Condition()
        self._inflight: dict[bytes, Future] = {}
        self._inflight_lock = threading.Lock()
        stats.gauge("metadata.entries", lambda: len(self._attrs) + len(self._dirs))

    # -- metadata ----------------------------------------------------------------------

    def getattr(self, path: str) -> Attr:
        hit = self._attrs.get(path)
        if isinstance(hit, Attr):
            self.stats.incr("metadata.hits")
            return hit
        if isinstance(hit, int):
            self.stats.incr("metadata.hits")
            raise FileNotFoundError(hit, "no such file (cached)", path)
        self.stats.incr("metadata.misses")
        try:
            attr = self._source_call("stat", self.source.stat, path)
        except FileNotFoundError:
            self._attrs.put(path, errno.ENOENT, self.negative_ttl)
            raise
        self._attrs.put(path, attr, self.metadata_ttl)
        return attr

    def readdir(self, path: str) -> list[DirEntry]:
        hit = self._dirs.get(path)
        if hit is not None:
            self.stats.incr("metadata.hits")
            return hit  # type: ignore[return-value]
        self.stats.incr("metadata.misses")
        entries = self._source_call("listdir", self.source.listdir, path)
        self._dirs.put(path, entries, self.metadata_ttl)
        return entries

    def readlink(self, path: str) -> str:
        return self._source_call("readlink", self.source.readlink, path)

    def statfs(self) -> dict:
        return self._source_call("statfs", self.source.statfs)

    def getxattr(self, path: str, name: str) -> bytes:
        return self._source_call("getxattr", self.source.getxattr, path, name)

    def listxattr(self, path: str) -> list[str]:
        return self._source_call("listxattr", self.source.listxattr, path)

    def invalidate(self, path: str) -> None:
        """Forget cached metadata of `path` (its blocks are keyed by identity and simply stop matching)."""
        self._attrs.pop(path)
        self._dirs.pop(path)

    def begin_change(self, path: str) -> None:
        """A file changed on the source and the kernel may still hold the old version.

        Until end_change(), reads of it fail with ESTALE, so no new block can land next to
        an old page in one read() (the kernel keeps issuing READs for a read() that began
        under the old attributes, even after being told to drop them).
        """
        with self._reading_cond:
            self._changing[path] = False
        self.invalidate(path)

    def kernel_invalidated(self, path: str) -> None:
        """The kernel has dropped the file's attributes and pages (see fuse_ops)."""
        if path in self._changing:
            self._changing[path] = True

    def kernel_getattr(self, path: str) -> None:
        """The kernel asked for attributes. After its invalidation, that is the start of a
        read() under the new attributes: from here on the new version is served."""
        if self._changing.get(path):
            self.end_change(path)

    def end_change(self, path: str) -> None:
        self._changing.pop(path, None)

    def wait_reads_done(self, path: str, timeout: float = 10.0) -> bool:
        """Wait until no read of `path` that began before begin_change() is still running.

        Such a read may be about to hand the kernel a page of the old version; telling the
        kernel to drop its pages is only final once those have landed.
        """
        with self._reading_cond:
            return self._reading_cond.wait_for(lambda: not self._reading.get(path), timeout)

    def file_id(self, path: str) -> FileId:
        attr = self.getattr(path)
        if attr.is_dir:
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
        if not attr.is_file:
            raise OSError(errno.EINVAL, "not a regular file", path)
        return FileId(path, attr.size, attr.mtime_ns, attr.ctime_ns)

    # -- data --------------------------------------------------------------------------

    def read(self, path: str, offset: int, size: int, fid: FileId | None = None) -> bytes:
        """Bytes [offset, offset+size) of the file, short only at end of file."""
        if offset < 0 or size < 0:
            raise OSError(errno.EINVAL, "negative offset or size", path)
        with self._reading_cond:  # the check and the count together, or a read slips past both
            if self._changing and path in self._changing:
                raise SourceChanged(path)
            self._reading[path] = self._reading.get(path, 0) + 1
        try:
            return self._read(path, offset, size, fid)
        finally:
            with self._reading_cond:
                left = self._reading[path] - 1
                if left:
                    self._reading[path] = left
                else:
                    del self._reading[path]
                    self._reading_cond.notify_all()

    def _read(self, path: str, offset: int, size: int, fid: FileId | None) -> bytes:
        fid = fid or self.file_id(path)
        self.stats.incr("reads.requests")
        blocks = block_range(offset, size, fid.size, self.block_size)
        if not blocks:
            return b""
        end = min(offset + size, fid.size)
        parts = []
        served: dict[str, int] = {}
        for index in blocks:
            data, tier = self._block(fid, index)
            start = index * self.block_size
            lo = max(offset, start) - start
            hi = min(end, start + len(data)) - start
            parts.append(data if (lo == 0 and hi == len(data)) else data[lo:hi])
            served[f"{tier}.served_bytes"] = served.get(f"{tier}.served_bytes", 0) + hi - lo
        out = parts[0] if len(parts) == 1 else b"".join(parts)
        served["reads.bytes"] = len(out)
        self.stats.add_many(served)
        return out

    def get_block(self, fid: FileId, index: int) -> bytes:
        """One whole block: from a tier if cached, else fetched from the source and cached."""
        return self._block(fid, index)[0]

    def _block(self, fid: FileId, index: int) -> tuple[bytes, str]:
        key = block_key(self.namespace, fid, index, self.block_size)
        data = self.cache.get_ram(key)
        if data is not None:
            return data, "ram"
        # Single flight: concurrent readers of one missing block (the kernel's parallel
        # read-ahead, several DataLoader workers) share one NVMe lookup or source fetch.
        with self._inflight_lock:
            pending = self._inflight.get(key)
            owner = pending is None
            if owner:
                pending = self._inflight[key] = Future()
        assert pending is not None
        if not owner:
            self.stats.incr("reads.inflight_waits")
            return pending.result()
        try:
            result = self._fetch(key, fid, index)
            pending.set_result(result)
            return result
        except BaseException as exc:
            pending.set_exception(exc)
            raise
        finally:
            with self._inflight_lock:
                del self._inflight[key]

    def _fetch(self, key: bytes, fid: FileId, index: int) -> tuple[bytes, str]:
        # Again under ownership: the previous owner may have finished between our RAM
        # miss and taking the key, and its NVMe write may still be queued.
        data = self.cache.ram.get(key)
        if data is not None:
            return data, "ram"
        data = self.cache.get_disk(key)
        if data is not None:
            return data, "disk"
        offset, length = block_extent(index, fid.size, self.block_size)
        try:
            data = self._source_call("read_range", self.source.read_range, fid, offset, length)
        except SourceChanged:
            self.stats.incr("source.changed")
            self.on_source_changed(fid.path)
            raise
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ELOOP, errno.EISDIR, errno.ENOTDIR):
                self.on_source_changed(fid.path)  # gone or replaced: the cached stat is wrong
            raise
        self.stats.incr("source.bytes", len(data))
        self.cache.put(key, data)
        return data, "source"

    def _source_call(self, op: str, fn: Callable, *args):  # type: ignore[type-arg]
        self.stats.incr(f"source.{op}")
        try:
            return fn(*args)
        except FileNotFoundError:
            raise
        except OSError as exc:
            # "no such attribute" is an answer, not a failure of the source
            if not isinstance(exc, SourceChanged) and exc.errno not in _ANSWERS:
                self.stats.incr("source.errors")
            raise

    def close(self) -> None:
        self.cache.close()

