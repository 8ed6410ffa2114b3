"""The NVMe tier: checksummed blocks in a diskcache.Cache under the cache dir.

Each value is `checksum.encode_block(key, data)`; a get verifies it and treats any failure
(bad header, bad checksum, I/O error, SQLite error) as a counted miss, deleting the entry.

Writes go through one background thread with a byte-bounded queue: a read that missed
returns as soon as the source answered, never after an fsync on the cache disk, and a full
queue drops the write (the block is still in RAM). That writer is also the only thing that
grows the cache, which is what makes the budget exact: before each write it culls the
oldest entries until `volume + blob <= capacity`, where volume is diskcache's own account
of the database pages plus the value files.
"""

from __future__ import annotations

import io
import logging
import os
import queue
import threading

import diskcache
import xxhash

from cachefs.checksum import HEADER_SIZE, decode_block, encode_block
from cachefs.config import DISK_WRITE_QUEUE_BYTES
from cachefs.errors import ChecksumError
from cachefs.stats import Stats

log = logging.getLogger(__name__)

_STOP = object()
WRITER_NICE = 10
WRITE_BATCH = 32        # blocks per SQLite transaction
EXACT_MARGIN = 8 << 20  # bytes: closer than this to the budget, every write measures the volume
EXACT_EVERY = 64        # and at least every this many writes


class _BlockDisk(diskcache.Disk):
    """diskcache's Disk, writing a bytes value in one write() call.

    Stock diskcache iterates an io.BytesIO, which yields *lines*: a block of random bytes
    became ~400 write() calls per 110 KB under the GIL, and the background writer then
    slowed the reads it was caching (a cold epoch took 1.6x longer with the NVMe tier on).
    """

    def _write(self, full_path, iterator, mode, encoding=None):  # type: ignore[no-untyped-def]
        if isinstance(iterator, io.BytesIO):
            iterator = iter((iterator.getvalue(),))
        return super()._write(full_path, iterator, mode, encoding)


class DiskTier:
    name = "disk"

    def __init__(self, directory: str, capacity: int, stats: Stats | None = None,
                 queue_bytes: int = DISK_WRITE_QUEUE_BYTES):
        self._dir = directory
        self._capacity = int(capacity)
        self._stats = stats or Stats()
        os.makedirs(directory, mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)
        self._cache = diskcache.Cache(
            directory,
            size_limit=self._capacity,
            # No write on a hit: 'least-recently-used' would turn every read into a
            # SQLite write transaction. Issue #4 brings epoch-aware policies.
            eviction_policy="least-recently-stored",
            cull_limit=0,  # we cull ourselves, before a write, so the budget is never exceeded
            statistics=False,
            disk=_BlockDisk,
        )
        self._queue: queue.Queue = queue.Queue()
        self._queued_bytes = 0
        self._queue_limit = queue_bytes
        self._qlock = threading.Lock()
        self._qroom = threading.Condition(self._qlock)
        # Which keys are on disk, as 64-bit hashes: a miss (every block of a cold epoch) is
        # then a set lookup instead of a SQLite query under the GIL. Loaded in the
        # background; until then every lookup asks diskcache. A stale "present" (an entry
        # culled since) just costs that query; entries written by another daemon sharing
        # the cache dir are not seen by this one until it restarts (a refetch, never wrong bytes).
        self._present: set[int] = set()
        self._approx_used = 0  # volume after the last write: has_room() without a query
        self._since_exact = 0
        self._index_ready = threading.Event()
        threading.Thread(target=self._load_index, name="cachefs-disk-index", daemon=True).start()
        self._writer = threading.Thread(target=self._write_loop, name="cachefs-disk-writer", daemon=True)
        self._writer.start()
        self._stats.gauge("disk.used_bytes", self._volume)
        self._stats.gauge("disk.capacity_bytes", lambda: self._capacity)
        self._stats.gauge("disk.entries", self._len)

    @property
    def directory(self) -> str:
        return self._dir

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self._volume()

    def _volume(self) -> int:
        return int(self._cache.volume())

    def _len(self) -> int:
        return len(self._cache)

    def _load_index(self) -> None:
        try:
            rows = self._cache._sql("SELECT key FROM Cache").fetchall()
            self._present.update(xxhash.xxh3_64_intdigest(k) for (k,) in rows if isinstance(k, bytes))
            self._index_ready.set()
            log.info("NVMe tier index: %d blocks", len(rows))
        except Exception as exc:  # stay correct without it: every lookup asks diskcache
            log.warning("could not index the NVMe tier (%s); lookups will query it directly", exc)

    def get(self, key: bytes) -> bytes | None:
        if self._index_ready.is_set() and xxhash.xxh3_64_intdigest(key) not in self._present:
            return None
        try:
            blob = self._cache.get(key, default=None, read=False, retry=True)
        except Exception as exc:
            self._stats.incr("disk.errors")
            log.warning("cache disk read failed (%s); serving from the source", exc)
            return None
        if blob is None:
            return None
        try:
            return decode_block(key, blob)
        except ChecksumError as exc:
            self._stats.incr("disk.checksum_failures")
            log.warning("cached block failed verification (%s); dropping it and refetching", exc)
            self.discard(key)
            return None

    def put(self, key: bytes, data: bytes, evict: bool = True) -> bool:
        """Queue `data` for writing; False if the queue is full (the write is dropped).
        With evict=False the block is written only if it fits without evicting anything."""
        size = len(data)
        with self._qlock:
            if not evict:
                # read-ahead and warming: wait for the writer rather than drop (a demand
                # miss never waits: it drops, and the block is still in RAM)
                self._qroom.wait_for(lambda: self._queued_bytes + size <= self._queue_limit, 30)
            if self._queued_bytes + size > self._queue_limit:
                self._stats.incr("disk.dropped_writes")
                return False
            if not evict and self._approx_used + self._queued_bytes + size + HEADER_SIZE > self._capacity:
                return False
            self._queued_bytes += size
        self._queue.put((key, data, evict))
        return True

    def has_room(self, size: int) -> bool:
        """Room for `size` more bytes without evicting (an estimate, refreshed on each write)."""
        with self._qlock:
            return self._approx_used + self._queued_bytes + size + HEADER_SIZE <= self._capacity

    def put_now(self, key: bytes, data: bytes, evict: bool = True) -> bool:
        """Write synchronously (used by the writer thread and by tests)."""
        blob = encode_block(key, data)
        if len(blob) > self._capacity:
            return False
        try:
            # The exact volume is two SQLite queries; far from the limit, the running
            # estimate is enough (it can only be short by the database's page growth since
            # the last exact reading, a few KiB, far below EXACT_MARGIN).
            exact = (self._approx_used + len(blob) + EXACT_MARGIN > self._capacity
                     or self._since_exact >= EXACT_EVERY)
            volume = self._cache.volume() if exact else self._approx_used
            if volume + len(blob) > self._capacity:
                if not evict:
                    self._stats.incr("disk.no_room")
                    return False
                self._make_room(len(blob))
            self._cache.set(key, blob, retry=True)
            self._present.add(xxhash.xxh3_64_intdigest(key))
            if exact:
                # The write itself may have grown the database by a page; trim back under budget.
                volume = self._cache.volume()
                if volume > self._capacity:
                    self._make_room(0)
                    volume = self._cache.volume()
                self._approx_used = volume
                self._since_exact = 0
            else:
                self._approx_used += len(blob)
                self._since_exact += 1
        except Exception as exc:
            self._stats.incr("disk.errors")
            log.warning("cache disk write failed (%s); continuing without caching this block", exc)
            return False
        self._stats.incr("disk.writes")
        self._stats.incr("disk.written_bytes", len(data))
        return True

    def _make_room(self, need: int) -> None:
        target = max(0, self._capacity - need)
        self._cache.reset("size_limit", target, update=False)  # in memory only: no DB write
        evicted = self._cache.cull(retry=True)
        if evicted:
            self._stats.incr("disk.evictions", evicted)

    def discard(self, key: bytes) -> None:
        self._present.discard(xxhash.xxh3_64_intdigest(key))
        try:
            self._cache.delete(key, retry=True)
        except Exception as exc:
            log.warning("cache disk delete failed (%s)", exc)

    def __contains__(self, key: bytes) -> bool:
        return key in self._cache

    def probably_has(self, key: bytes) -> bool:
        """From the in-memory index, no I/O: True may be stale (culled since), False is
        exact once the index is loaded; before that, ask the database."""
        if self._index_ready.is_set():
            return xxhash.xxh3_64_intdigest(key) in self._present
        return key in self

    def _write_loop(self) -> None:
        try:
            # Background work: the kernel gives the CPU to readers first (Linux threads
            # have their own nice value). Measured: without it, a writer catching up after
            # a cold epoch took a core from the next epoch's readers.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        except (OSError, AttributeError):
            pass
        try:  # a remount with a smaller --disk-size: back under budget before anything else
            if self._cache.volume() > self._capacity:
                self._make_room(0)
            self._approx_used = self._cache.volume()
        except Exception as exc:
            log.warning("could not trim the NVMe tier to its budget (%s)", exc)
        while True:
            batch = [self._queue.get()]
            while len(batch) < WRITE_BATCH:  # what else is waiting goes into one transaction
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = _STOP in batch
            items = [item for item in batch if item is not _STOP]
            try:
                if items:
                    self._write_batch(items)
            finally:
                for _ in batch:
                    self._queue.task_done()
            if stop:
                return

    def _write_batch(self, items: list) -> None:
        try:
            with self._cache.transact(retry=True):
                for key, data, evict in items:
                    self.put_now(key, data, evict)
        except Exception as exc:  # put_now handles its own errors; this is the commit
            self._stats.incr("disk.errors")
            log.warning("cache disk write failed (%s)", exc)
        finally:
            with self._qlock:
                self._queued_bytes -= sum(len(data) for _, data, _ in items)
                self._qroom.notify_all()

    def flush(self) -> None:
        """Wait until every queued write is on disk (or dropped after an error)."""
        self._queue.join()

    def close(self) -> None:
        if self._writer.is_alive():
            self._queue.put(_STOP)
            self._writer.join()
        self._cache.close()


__all__ = ["DiskTier", "HEADER_SIZE"]
