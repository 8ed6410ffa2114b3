"""Promotions: files copied from the NVMe tier into RAM in the background.

An open of a file whose copy is on NVMe only, when RAM has free room for it, is answered
with the NVMe copy (the kernel reads it itself in passthrough mode) and the file is queued
here; one thread copies it into RAM, after which the next open finds the RAM copy. Doing
that copy inside the open (a read of the NVMe file, with the page cache dropped a disk
read, then the RAM file written from Python bytes) was the largest share of the daemon's
time in the first epoch after a remount: 29% of its samples at 200,000 files, on the one
path every request waits behind.

A file of one block (every file of an ImageFolder tree of JPEGs) is copied by the kernel
(`sendfile` from the NVMe file into a new RAM file, no bytes in Python) and the RAM tier
adopts it with the block's hash the NVMe tier recorded (from its record in the entry
table when it was restored there and not brought into memory: DiskTier.cold_copy); a
file of several blocks (up to WHOLE_FILE_MAX) is copied block by block through
`FileStore.put`. The queue is bounded (PROMOTE_QUEUE): an open that finds it full
promotes nothing, and a later open of the file queues it again. Listeners hear of each
file promoted (the file system takes back a node published with the NVMe copy, see
cachefs/published.py).
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from cachefs.tiers.layout import create_exclusive, write_all

if TYPE_CHECKING:
    from cachefs.identity import EntryInfo
    from cachefs.stats import Stats
    from cachefs.tiers.disk import DiskTier
    from cachefs.tiers.entry import Entry
    from cachefs.tiers.memory import MemoryTier

log = logging.getLogger(__name__)

PROMOTE_QUEUE = 8192  # files waiting for a copy into RAM, at most


class Promoter:
    def __init__(self, ram: MemoryTier, disk: DiskTier, stats: Stats, limit: int = PROMOTE_QUEUE):
        self._ram, self._disk, self._stats = ram, disk, stats
        self._limit = limit
        self._queue: collections.deque[bytes] = collections.deque()
        self._queued: set[bytes] = set()  # in the queue or being copied
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.listeners: list[Callable[[bytes], None]] = []

    def want(self, eid: bytes) -> None:
        """Queue the file version `eid` (on NVMe, not in RAM) for a copy into RAM."""
        with self._cond:
            if eid in self._queued or self._closed:
                return
            if len(self._queue) >= self._limit:
                self._stats.incr("ram.promotions_skipped")
                return
            self._queue.append(eid)
            self._queued.add(eid)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="cachefs-promote", daemon=True)
                self._thread.start()
            self._cond.notify()

    def drain(self, timeout: float) -> bool:
        """Wait until every queued file is copied (or given up); False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queued or self._closed, timeout)

    def close(self) -> None:
        """Stop: what is still queued is not copied (a lost chance, nothing else)."""
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(10)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    self._queued.clear()
                    self._cond.notify_all()
                    return
                eid = self._queue.popleft()
            try:
                done = self.promote(eid)
            except Exception:  # a lost chance to serve from RAM; never a reader's failure
                log.exception("copying a file into the RAM tier failed")
                done = False
            with self._cond:
                self._queued.discard(eid)
                if not self._queued:
                    self._cond.notify_all()
            if done:
                for listener in self.listeners:
                    listener(eid)

    def promote(self, eid: bytes) -> bool:
        """Copy the file version `eid` from NVMe into RAM's free room now; whether RAM has
        it from this copy."""
        ram, disk = self._ram, self._disk
        if ram.backing_file(eid) is not None:
            return False  # RAM took it meanwhile
        cold = disk.cold_copy(eid)  # a record restored from the table, left there
        e: Entry | None = None
        path: str | None
        h: int | None
        if cold is not None:
            path, size, h, info = cold
        else:
            path = disk.backing_file(eid)  # (checked since the start, or None)
            e = disk.entry(eid)
            found = disk.info_of(eid)
            if path is None or e is None or found is None:
                return False
            size, h, info = e.size, e.hashes[0] if len(e.hashes) == 1 else None, found
        if not ram.has_room(size):
            return False
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False  # dropped meanwhile
        try:
            if h is not None:
                done = self._copy_file(eid, fd, size, h, info)
            else:
                assert e is not None
                done = self._copy_blocks(eid, fd, e, info)
            if done:  # the NVMe copy's pages would be a second copy in memory
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            done = False
        finally:
            os.close(fd)
        if done:
            self._stats.incr("ram.promotions")
        return done

    def _copy_file(self, eid: bytes, src: int, size: int, h: int, info: EntryInfo) -> bool:
        """One block: the kernel copies the file into RAM's room, which adopts it."""
        ram = self._ram
        if not ram.reserve(size):
            return False
        reserved = size
        try:
            dest = ram.file_of(eid.hex())
            try:
                out = create_exclusive(dest)
            except FileExistsError:
                return False  # being written by someone else (a read's fill)
            try:
                _kernel_copy(src, out, size)
            except OSError:
                os.close(out)
                ram.unadopted(eid)
                raise
            os.close(out)
            reserved = 0
            return ram.adopt((eid, 0), size, h, info, evict=False, reserved=size) == "adopted"
        finally:
            if reserved:
                ram.unreserve(reserved)

    def _copy_blocks(self, eid: bytes, src: int, e: Entry, info: EntryInfo) -> bool:
        for index in range(len(e.hashes)):
            offset, length = e.extent(index)
            data = os.pread(src, length, offset)
            if len(data) != length or not self._ram.put((eid, index), data, info, evict=False):
                return False
        return True


def _kernel_copy(src: int, out: int, size: int) -> None:
    """`size` bytes from the start of `src` to `out`, copied by the kernel where it can."""
    offset = 0
    try:
        while offset < size:
            n = os.sendfile(out, src, offset, size - offset)
            if n == 0:
                raise OSError(errno.EIO, "the NVMe file is shorter than its entry")
            offset += n
        return
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP) or offset:
            raise
    data = os.pread(src, size, 0)  # sendfile refused these files: through this process
    if len(data) != size:
        raise OSError(errno.EIO, "the NVMe file is shorter than its entry")
    write_all(out, data)
