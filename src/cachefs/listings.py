"""Listings kept on the cache disk: a restarted mount walks its tree without the source.

Each directory listed from the source is written, in the background, to
`listings/<2 hex digits>/<xxh3_128 of its path, 32 hex digits>` beside the NVMe tier's
files: its path, when it was listed (wall clock), and each entry's name, type and inode
number, and the directory's own attributes, under a CRC-32. After a restart, a
directory's listing and attributes within --metadata-ttl of that time come from its file,
with no request to the source (the files' attributes come from the NVMe index the same
way); an older, damaged or missing one comes from the source.

The files count against the NVMe tier's budget (held as a reservation: a listing is kept
only while the tier has free room, and never pushes out cached data). Each is written to a
temporary name and renamed over: a kill leaves the old listing or the new one. Like the
rest of the cache they are disposable: one that fails its CRC is deleted and listed again.
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterable
from typing import NamedTuple

import xxhash

from cachefs.identity import FS_ENCODING, FS_ERRORS, STAT_FIELDS, Attr, DirEntry, Listing

log = logging.getLogger(__name__)

MAGIC = b"cachefsL1\n"
_COUNT = struct.Struct("<I")  # then the entries, packed as a Listing holds them (identity.ENTRY)
# mode, nlink, uid, gid, size, atime, mtime, ctime (ns), blocks, rdev, ino: Attr's fields
_ATTR = struct.Struct("<IQIIqqqqqQQ")
# Listings waiting to be written; more are not kept (the next start lists them again).
PENDING_MAX = 4096
TMP_MARGIN = 2.0  # seconds: a file's time is the kernel's coarse clock, a tick behind time.time()
DIR_BYTES = 4096  # what a directory of kept listings takes


class Kept(NamedTuple):
    listed_at: float  # wall clock
    entries: Listing
    attr: Attr | None  # the directory's own attributes, when they were known


def encode(path: str, listed_at: float, entries: Iterable[DirEntry], attr: Attr | None = None) -> bytes:
    raw = path.encode(FS_ENCODING, FS_ERRORS)
    own = b"\1" + _ATTR.pack(*attr[:STAT_FIELDS]) if attr is not None else b"\0"
    listing = Listing.of(entries)
    body = b"".join((struct.pack("<d I", listed_at, len(raw)), raw, own, _COUNT.pack(len(listing)), listing.packed))
    return MAGIC + struct.pack("<I", zlib.crc32(body)) + body


def decode(data: bytes, path: str) -> Kept | None:
    """The listing in a file's bytes; None if they are not `path`'s listing, or damaged."""
    start = len(MAGIC) + 4
    if not data.startswith(MAGIC) or len(data) < start + 12:
        return None
    if zlib.crc32(memoryview(data)[start:]) != struct.unpack_from("<I", data, len(MAGIC))[0]:
        return None
    listed_at, length = struct.unpack_from("<d I", data, start)
    pos = start + 12
    if data[pos:pos + length] != path.encode(FS_ENCODING, FS_ERRORS):
        return None  # another path with the same hash (or a renamed file)
    pos += length
    attr = None
    if data[pos] == 1:
        attr = Attr(*_ATTR.unpack_from(data, pos + 1))
        pos += _ATTR.size
    pos += 1
    (count,) = _COUNT.unpack_from(data, pos)
    entries = Listing.parse(data[pos + 4:], count)
    return None if entries is None else Kept(listed_at, entries, attr)


class ListingStore:
    """The listings kept under `directory`. `reserve` and `unreserve` hold their bytes in the
    NVMe tier's budget (MultiLevelCache.reserve). Thread-safe."""

    def __init__(self, directory: str, reserve: Callable[[int], bool], unreserve: Callable[[int], None]):
        self._dir = directory
        self._reserve = reserve
        self._unreserve = unreserve
        self._sizes: dict[str, int] = {}  # file name -> bytes reserved for it
        self._lock = threading.Lock()
        self._pending: queue.Queue[tuple[str, Iterable[DirEntry], float, Attr | None] | None] = queue.Queue(PENDING_MAX)
        self._made: set[str] = set()  # subdirectories made (and held) in this run
        self._adopted = False  # whether adopt_existing has counted what a previous run kept
        self._started = time.time()  # (a .tmp older than this is a previous run's: adopt_existing)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._writer = threading.Thread(target=self._write_loop, name="cachefs-listings", daemon=True)
        self._writer.start()

    def _file(self, path: str) -> tuple[str, str]:
        name = xxhash.xxh3_128_hexdigest(path.encode(FS_ENCODING, FS_ERRORS))
        return os.path.join(self._dir, name[:2]), name

    def has(self, path: str) -> bool:
        """Whether a listing of `path` is kept (a dict lookup once adopt_existing is done)."""
        sub, name = self._file(path)
        # _adopted read first: adopt_existing ending between the dict's look and it would
        # otherwise answer "not kept" for a listing it had just counted
        adopted = self._adopted
        return name in self._sizes or (not adopted and os.path.exists(os.path.join(sub, name)))

    def load(self, path: str) -> Kept | None:
        """The kept listing of `path`, or None."""
        sub, name = self._file(path)
        try:
            with open(os.path.join(sub, name), "rb") as f:
                data = f.read()
        except OSError:
            return None
        kept = decode(data, path)
        if kept is None:
            log.info("a kept listing of %s was damaged: listed again", path)
            self._remove(sub, name)
        return kept

    def save(self, path: str, entries: Iterable[DirEntry], listed_at: float | None = None,
             attr: Attr | None = None) -> None:
        """Keep this listing of `path`, and its own attributes if known (written in the
        background)."""
        try:
            self._pending.put_nowait((path, entries, time.time() if listed_at is None else listed_at, attr))
        except queue.Full:
            pass

    def drop(self, path: str) -> None:
        """Forget the kept listing of `path` (it changed on the source)."""
        self._remove(*self._file(path))

    def flush(self) -> None:
        """Wait until what was saved is written."""
        self._pending.join()

    def close(self) -> None:
        self._pending.put(None)
        self._writer.join(5)

    def count(self) -> int:
        """The files already reserved for (a start counts them in the background: see adopt_existing)."""
        return len(self._sizes)

    def adopt_existing(self) -> None:
        """Hold the budget for the listings a previous run kept (a start calls this in the
        background); those there is no room for any more are deleted."""
        try:
            subs = [e.path for e in os.scandir(self._dir) if e.is_dir(follow_symlinks=False)]
        except OSError:
            subs = []
        for sub in subs:
            try:
                files = list(os.scandir(sub))
            except OSError:
                continue
            if self._hold(os.path.basename(sub) + "/", DIR_BYTES):
                self._made.add(sub)
            for f in files:
                try:
                    st = f.stat(follow_symlinks=False)
                except OSError:
                    continue
                if f.name.endswith(".tmp"):
                    # a run cut short mid-write left it; one of this run's writes is in
                    # flight (deleted, it failed, and its kept listing went with it: the
                    # first directory a walk listed at a start, listed again at the next)
                    if st.st_mtime < self._started - TMP_MARGIN:
                        self._remove(sub, f.name)
                    continue
                if not self._hold(f.name, st.st_blocks * 512):
                    self._remove(sub, f.name)
        self._adopted = True

    def _hold(self, name: str, size: int) -> bool:
        with self._lock:
            old = self._sizes.get(name, 0)
            if size > old and not self._reserve(size - old):
                return False
            if size < old:
                self._unreserve(old - size)
            self._sizes[name] = size
            return True

    def _remove(self, sub: str, name: str) -> None:
        try:
            os.unlink(os.path.join(sub, name))
        except OSError:
            pass
        with self._lock:
            size = self._sizes.pop(name, 0)
            if size:
                self._unreserve(size)

    def _write_loop(self) -> None:
        while True:
            item = self._pending.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except OSError as exc:
                log.debug("keeping a listing failed: %s", exc)
            finally:
                self._pending.task_done()

    def _write(self, path: str, entries: Iterable[DirEntry], listed_at: float, attr: Attr | None) -> None:
        data = encode(path, listed_at, entries, attr)
        sub, name = self._file(path)
        if not self._hold(name, -(-len(data) // 4096) * 4096):
            return  # no room in the tier's budget: not kept
        if sub not in self._made:
            if not self._hold(os.path.basename(sub) + "/", DIR_BYTES):  # the directory's own block
                self._remove(sub, name)
                return
            os.makedirs(sub, mode=0o700, exist_ok=True)
            self._made.add(sub)
        tmp = os.path.join(sub, name + ".tmp")
        try:
            with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600), "wb") as f:
                f.write(data)
            os.replace(tmp, os.path.join(sub, name))
        except OSError:
            self._remove(sub, name + ".tmp")
            self._remove(sub, name)
            raise
