"""The NVMe tier: checksummed blocks in a diskcache.Cache under the cache dir, kept or
evicted by a Policy (cachefs/policy.py), under two hard limits: --disk-size and --min-free.

Each value is `checksum.encode_block(key, data)`, stored under the 16-byte xxh3_128 of the
cache key; a get verifies the header (which holds the xxh3_64 of the full key) and treats
any failure (bad header, bad checksum, I/O error, SQLite error) as a counted miss,
deleting the entry.

Writes go through one background thread with a byte-bounded queue: a read that missed
returns as soon as the source answered, never after a write to the cache disk, and a full
queue drops the write (the block is still in RAM). That writer is the only thing that
grows the cache, which is what makes the budget exact: the policy admits a block only
within `limit`, and `limit` is re-measured from diskcache's own account of its volume
(database pages plus value files) and from statvfs of the cache disk whenever the tier
comes within EXACT_MARGIN of either limit, and at least every EXACT_EVERY writes.

The policy's bookkeeping is also the in-memory index: a miss is a dict lookup, not a
SQLite query. It is rebuilt from the database at start (oldest first) by the writer
thread before its first write; until then lookups ask diskcache.
"""

from __future__ import annotations

import errno
import io
import logging
import os
import queue
import shutil
import threading
import time

import diskcache
import xxhash

from cachefs.checksum import HEADER_SIZE, decode_block, encode_block
from cachefs.config import DISK_WRITE_QUEUE_BYTES, format_size
from cachefs.directio import read_file
from cachefs.errors import ChecksumError
from cachefs.policy import DEFAULT_POLICY, Policy, make_policy
from cachefs.stats import Stats

log = logging.getLogger(__name__)

_STOP = object()
WRITER_NICE = 10
WRITE_BATCH = 32        # blocks per SQLite transaction
EXACT_MARGIN = 8 << 20  # bytes: closer than this to a limit, every write re-measures
EXACT_EVERY = 64        # and at least every this many writes
DB_SLACK = 64 << 10     # room kept for the database's growth between two measurements,
SLACK_SHARE = 0.0025    # plus this share of the budget (a reading of the tier's size while
                        # the writer replaces files can count one twice)
WAL_PAGES = 32          # SQLite checkpoints its write-ahead log at this many pages
WAL_RESERVE = (WAL_PAGES + 32) * 4096  # the log's largest size: a checkpoint's worth plus a batch


def _allocated(size: int) -> int:
    """Bytes a file of `size` bytes takes on a filesystem with 4 KiB blocks."""
    return -(-size // 4096) * 4096


def disk_key(key: bytes) -> bytes:
    """The diskcache key of a cache key: 16 bytes, so the index costs little memory."""
    return xxhash.xxh3_128_digest(key)


class _BlockDisk(diskcache.Disk):
    """diskcache's Disk, writing a value in one write() call into one of SUBDIRS directories.

    Stock diskcache iterates an io.BytesIO, which yields *lines*: a block of random bytes
    became ~400 write() calls per 110 KB under the GIL, and the background writer then
    slowed the reads it was caching (a cold epoch took 1.6x longer with the NVMe tier on).
    It also spreads files over up to 65536 two-level directories, 4 KiB each, that no
    budget counted (measured: 4.5 MiB of directories for 1000 blocks); cachefs uses 16,
    created once.
    """

    def filename(self, key=diskcache.UNKNOWN, value=diskcache.UNKNOWN):  # type: ignore[no-untyped-def]
        name = os.urandom(16).hex()
        filename = os.path.join(name[0], name[1:] + ".val")
        return filename, os.path.join(self._directory, filename)

    direct = hasattr(os, "O_DIRECT")  # per class: one cache dir per daemon

    def fetch(self, mode, filename, value, read):  # type: ignore[no-untyped-def]
        """A value file read with O_DIRECT (see cachefs/directio.py), buffered where the
        cache dir's filesystem refuses it."""
        if mode != diskcache.core.MODE_BINARY or read or not filename:
            return super().fetch(mode, filename, value, read)
        path = os.path.join(self._directory, filename)
        if _BlockDisk.direct:
            try:
                return read_file(path, direct=True)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                _BlockDisk.direct = False
                log.info("cache dir does not support O_DIRECT (%s); using buffered reads", exc)
        return read_file(path, direct=False)

    def _write(self, full_path, iterator, mode, encoding=None):  # type: ignore[no-untyped-def]
        if not isinstance(iterator, io.BytesIO):
            return super()._write(full_path, iterator, mode, encoding)
        data = iterator.getvalue()
        try:
            fd = os.open(full_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(full_path), mode=0o700, exist_ok=True)
            fd = os.open(full_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        return len(data)


class _PerOSThread:
    """What diskcache keeps per thread (its SQLite connection), kept per OS thread instead.

    diskcache stores its connection in a threading.local. A libfuse worker thread enters
    Python through ctypes with a fresh thread state for each request, so every NVMe lookup
    from a FUSE thread opened a new SQLite connection (measured: 452 in one run of
    tests/fuse/test_concurrency.py) and the old ones lingered until garbage collection:
    descriptors grew past the number of threads. Keyed by threading.get_ident() (the
    pthread, which is also what sqlite3's same-thread check compares), one connection
    serves a thread for its life.
    """

    def __init__(self) -> None:
        object.__setattr__(self, "_slots", {})

    def _mine(self) -> dict:
        slots = object.__getattribute__(self, "_slots")
        return slots.setdefault(threading.get_ident(), {})

    def __getattr__(self, name: str) -> object:
        try:
            return self._mine()[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: object) -> None:
        self._mine()[name] = value

    def __delattr__(self, name: str) -> None:
        try:
            del self._mine()[name]
        except KeyError:
            raise AttributeError(name) from None

    def connections(self) -> list:
        slots = object.__getattribute__(self, "_slots")
        return [d["con"] for d in list(slots.values()) if d.get("con") is not None]

    def clear(self) -> None:
        object.__getattribute__(self, "_slots").clear()


# Consecutive cache-disk I/O failures (reads or writes: ENOSPC, EROFS, EIO, a vanished
# cache dir) after which the tier stops touching the disk for SUSPEND_FOR seconds: cachefs
# then runs on RAM and the source, with one warning instead of one per block.
SUSPEND_AFTER = 8
SUSPEND_FOR = 60.0

SUBDIRS = 16
ORPHAN_AGE = 60.0  # seconds: an unindexed value file older than this is an orphan
DIR_ENTRY_BYTES = 48  # an ext4 directory entry for a 31-character name, rounded up


class DiskTier:
    name = "disk"

    def __init__(self, directory: str, capacity: int, stats: Stats | None = None,
                 queue_bytes: int = DISK_WRITE_QUEUE_BYTES, policy: str | Policy = DEFAULT_POLICY,
                 max_idle: float | None = None, min_free: int = 0):
        self._dir = directory
        self._capacity = int(capacity)
        self._min_free = int(min_free)
        self._stats = stats or Stats()
        os.makedirs(directory, mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)
        self._cache = diskcache.Cache(
            directory,
            size_limit=1 << 62,
            eviction_policy="none",  # the policy chooses victims; diskcache never culls
            cull_limit=0,
            statistics=False,
            disk=_BlockDisk,
            # Every block in its own file, and a small write-ahead log: the database then
            # holds only rows, and what it adds to the tier's footprint stays small and
            # measurable (the budget counts the log and its index too, see _volume).
            disk_min_file_size=0,
            sqlite_wal_autocheckpoint=WAL_PAGES,
            sqlite_journal_size_limit=WAL_PAGES * 4096,
        )
        self._cache.close()  # the constructing thread's connection, from the threading.local
        self._connections = _PerOSThread()
        self._cache._local = self._connections
        self.policy = policy if isinstance(policy, Policy) else make_policy(policy, self._capacity, max_idle)
        self.policy.capacity = 0  # nothing is admitted before the limits are measured
        self._plock = threading.Lock()  # the policy: FUSE threads record hits, the writer admits
        self._queue: queue.Queue = queue.Queue()
        self._queued_bytes = 0
        self._queue_limit = queue_bytes
        self._qlock = threading.Lock()
        self._qroom = threading.Condition(self._qlock)
        # Keys admitted by the writer whose rows are not committed yet: another thread's
        # lookup misses them, and must not take that for "deleted behind our back".
        self._pending: set[bytes] = set()
        self._in_batch = False
        self._since_exact = 0
        self._entries_high = 0
        self._dirs_at_start = 0
        self._free_estimate = 0  # bytes free on the cache disk, minus what we wrote since measuring
        self._index_ready = threading.Event()
        self._started = threading.Event()  # the writer has loaded the index (or given up)
        self._measured_at = 0.0
        self._failures = 0  # cache-disk I/O failures in a row
        self.read_latency = 0.0  # seconds, moving average of a block read that hit
        self._suspended_until = 0.0  # monotonic; the tier is off until then
        self._stats.gauge("disk.suspended", lambda: int(self.suspended))
        self._writer = threading.Thread(target=self._write_loop, name="cachefs-disk-writer", daemon=True)
        self._writer.start()
        self._stats.gauge("disk.used_bytes", self._volume)
        self._stats.gauge("disk.capacity_bytes", lambda: self._capacity)
        self._stats.gauge("disk.entries", lambda: len(self.policy))
        self._stats.gauge("disk.queued_bytes", lambda: self._queued_bytes)

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
        """Everything the tier occupies on the cache disk: value files (counted in whole
        4 KiB filesystem blocks, as the policy counts them), their directories, database
        pages, and SQLite's write-ahead log and its shared-memory index."""
        return (self.policy.used + self._dir_bytes() + self._db_bytes() + self._file_size("-wal")
                + self._file_size("-shm"))

    def _dir_bytes(self) -> int:
        """The value directories: never shrunk by the filesystem, so counted at their high
        water mark (measured at start, then estimated per entry)."""
        self._entries_high = max(self._entries_high, len(self.policy))
        return max(self._dirs_at_start, 4096 * (SUBDIRS + 1) + DIR_ENTRY_BYTES * self._entries_high)

    def _db_bytes(self) -> int:
        ((pages,),) = self._cache._sql("PRAGMA page_count").fetchall()
        return int(pages) * int(self._cache._page_size)

    def _file_size(self, suffix: str) -> int:
        try:
            return os.stat(os.path.join(self._dir, "cache.db" + suffix)).st_size
        except OSError:
            return 0

    def _disk_free(self) -> int:
        st = os.statvfs(self._dir)
        return st.f_bavail * st.f_frsize

    # -- start-up --------------------------------------------------------------------

    def _load_index(self) -> None:
        """Rebuild the policy from the database, oldest first; drop rows of an older format."""
        rows = self._cache._sql(
            "SELECT key, CASE WHEN filename IS NULL THEN length(value) ELSE size END, filename"
            " FROM Cache ORDER BY store_time").fetchall()
        foreign, files = [], []
        with self._plock:
            self.policy.capacity = 1 << 62  # restored as found; _refresh_limits trims
            for key, size, filename in rows:
                if isinstance(key, bytes) and len(key) == 16:
                    self.policy.admit(key, _allocated(int(size or 0)))
                    if filename is not None:
                        files.append((key, filename))
                else:
                    foreign.append(key)
        for key in foreign:  # written by an older cachefs under full keys: not findable now
            self._cache.delete(key, retry=True)
        if foreign:
            log.info("NVMe tier: dropped %d blocks of an older cache format", len(foreign))
        with os.scandir(self._dir) as it:
            for entry in it:
                if entry.is_dir(follow_symlinks=False) and len(entry.name) == 2:
                    shutil.rmtree(entry.path, ignore_errors=True)  # that format's directories
        self._remove_orphans(files)
        self._dirs_at_start = sum(os.stat(os.path.join(self._dir, d)).st_blocks * 512
                                  for d in [".", *os.listdir(self._dir)]
                                  if os.path.isdir(os.path.join(self._dir, d)))
        log.info("NVMe tier index: %d blocks", len(rows) - len(foreign))

    def _remove_orphans(self, rows: list[tuple[bytes, str]]) -> None:
        """Make the files and the index (its (key, filename) rows) agree again after an
        unclean stop.

        A value file that no row names: a `kill -9` between writing a block's file and
        committing its row leaves one, and the budget could not count it. Files younger
        than ORPHAN_AGE are left alone: another daemon sharing the cache dir may be about
        to commit their rows. A row whose file is gone: inside the writer's transaction,
        diskcache deletes an evicted or replaced block's file at once, and the row's delete
        waits for the commit, which a `kill -9` never reaches. Such a row reads as a miss,
        but the budget would count it until the block was written again."""
        named = {name for _, name in rows}
        present = set()
        cutoff = time.time() - ORPHAN_AGE
        removed = freed = 0
        for sub in "0123456789abcdef"[:SUBDIRS]:
            try:
                entries = list(os.scandir(os.path.join(self._dir, sub)))
            except FileNotFoundError:
                continue
            for entry in entries:
                name = f"{sub}/{entry.name}"
                present.add(name)
                if not entry.name.endswith(".val") or name in named:
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                    if st.st_mtime < cutoff:
                        os.unlink(entry.path)
                        removed += 1
                        freed += st.st_blocks * 512
                except FileNotFoundError:
                    pass
        if removed:
            log.warning("NVMe tier: removed %d orphaned block files (%s) left by an unclean stop",
                        removed, format_size(freed))
        dangling = 0
        for key, name in rows:
            if name in present:
                continue
            # look again right before deleting: another daemon may have rewritten the block
            now = self._cache._sql("SELECT filename FROM Cache WHERE key = ?", (key,)).fetchone()
            if now is not None and now[0] == name and not os.path.exists(os.path.join(self._dir, name)):
                self._cache.delete(key, retry=True)
                with self._plock:
                    self.policy.remove(key)
                dangling += 1
        if dangling:
            log.warning("NVMe tier: dropped %d index entries whose block files an unclean stop had "
                        "already deleted", dangling)

    # -- reads -----------------------------------------------------------------------

    @property
    def suspended(self) -> bool:
        """Off after repeated I/O failures (see SUSPEND_AFTER): no reads, no writes."""
        return time.monotonic() < self._suspended_until

    def _io_failed(self, what: str, exc: BaseException) -> None:
        self._stats.incr("disk.errors")
        self._failures += 1
        log.debug("cache disk %s failed: %s", what, exc)
        if self._failures >= SUSPEND_AFTER and not self.suspended and self._check_dir():
            # (a removed cache dir is its own case, off until the next mount: _check_dir
            # says so once; failing reads, "unable to open database file", may see it first)
            self._suspended_until = time.monotonic() + SUSPEND_FOR
            self._stats.incr("disk.suspensions")
            log.warning("NVMe tier off for %.0fs after %d failed cache-disk operations (last: %s %s): "
                        "serving from RAM and the source", SUSPEND_FOR, self._failures, what, exc)

    def _check_dir(self) -> bool:
        """False (and the tier off until the next mount) if the cache dir's database is gone:
        someone removed the cache dir under a running daemon. Writing on would fill an
        unlinked database and recreated directories that no budget or restart could see."""
        if os.path.exists(os.path.join(self._dir, "cache.db")):
            return True
        if self._suspended_until != float("inf"):
            self._suspended_until = float("inf")
            self._stats.incr("disk.suspensions")
            log.warning("NVMe tier off: its cache dir %s was removed; serving from RAM and the source "
                        "until the next mount", self._dir)
        return False

    def _io_ok(self) -> None:
        if self._failures:
            if self._failures >= SUSPEND_AFTER:
                log.warning("NVMe tier working again")
            self._failures = 0

    def get(self, key: bytes) -> bytes | None:
        dkey = disk_key(key)
        if self.suspended:
            return None
        if self._index_ready.is_set():
            with self._plock:
                if dkey not in self.policy:
                    self.policy.miss()
                    return None
        start = time.perf_counter()
        try:
            blob = self._cache.get(dkey, default=None, read=False, retry=True)
        except Exception as exc:  # a failed read is a miss: the block comes from the source
            self._io_failed("read", exc)
            return None
        if blob is None:
            # Not found: either written by the writer and not committed yet (pending, or
            # committed since our read began: a second look finds it), or really gone
            # (another daemon, a delete) and then the index forgets it. Forgetting a key
            # whose file is on disk would leave that file outside the budget's account.
            gone = dkey not in self._pending and not self._has_row(dkey)
            if not gone and dkey not in self._pending:
                self._check_dir()  # a row without its file: was the cache dir removed?
            with self._plock:
                if gone and dkey not in self._pending:
                    self.policy.remove(dkey)
                else:
                    self.policy.miss()
            return None
        try:
            data = decode_block(key, blob)
        except ChecksumError as exc:
            self._stats.incr("disk.checksum_failures")
            log.warning("cached block failed verification (%s); dropping it and refetching", exc)
            self.discard(key)
            return None
        with self._plock:
            self.policy.hit(dkey)
        self._io_ok()
        self.read_latency += (time.perf_counter() - start - self.read_latency) * 0.05
        return data

    # -- writes ----------------------------------------------------------------------

    def put(self, key: bytes, data: bytes, evict: bool = True) -> bool:
        """Queue `data` for writing; False if the queue is full (the write is dropped).
        With evict=False the block is written only if it fits without evicting anything."""
        size = len(data)
        if self.suspended:
            self._stats.incr("disk.suspended_writes")
            return False
        with self._qlock:
            if not evict:
                # read-ahead and warming: wait for the writer rather than drop (a demand
                # miss never waits: it drops, and the block is still in RAM)
                self._qroom.wait_for(lambda: self._queued_bytes + size <= self._queue_limit, 30)
            if self._queued_bytes + size > self._queue_limit:
                self._stats.incr("disk.dropped_writes")
                return False
            if not evict and not self._room_for(self._queued_bytes + size + HEADER_SIZE):
                self._stats.incr("disk.no_room")
                return False
            self._queued_bytes += size
        self._queue.put((key, data, evict))
        return True

    def _room_for(self, size: int) -> bool:
        return self.policy.used + _allocated(size) <= self.policy.capacity

    def has_room(self, size: int) -> bool:
        """Room for `size` more bytes without evicting (an estimate, refreshed on each write)."""
        if self.suspended:
            return False
        with self._qlock:
            return self._room_for(self._queued_bytes + size + HEADER_SIZE)

    def put_now(self, key: bytes, data: bytes, evict: bool = True) -> bool:
        """Write synchronously (used by the writer thread and by tests)."""
        self._started.wait(30)
        if self.suspended or not self._check_dir():  # queued before the tier went off
            self._stats.incr("disk.suspended_writes")
            return False
        blob = encode_block(key, data)
        dkey = disk_key(key)
        try:
            self._refresh_limits(len(blob))
            with self._plock:
                victims = self.policy.admit(dkey, _allocated(len(blob)), evict)
                if victims is not None:
                    self._pending.add(dkey)
            if victims is None:
                self._stats.incr("disk.no_room" if not evict else "disk.refused")
                return False
            self._delete(victims)
            self._cache.set(dkey, blob, retry=True)
            self._free_estimate -= _allocated(len(blob))
            self._since_exact += 1
        except Exception as exc:  # the block stays in RAM; the reader never sees this
            with self._plock:
                self.policy.remove(dkey)
            self._io_failed("write", exc)
            return False
        finally:
            if not self._in_batch:  # committed already: no transaction around this write
                with self._plock:
                    self._pending.discard(dkey)
        self._stats.incr("disk.writes")
        self._stats.incr("disk.written_bytes", len(data))
        self._io_ok()
        return True

    def _refresh_limits(self, incoming: int = 0, force: bool = False) -> None:
        """Set the policy's capacity from the two hard limits, measured when near either.

        The policy counts blob bytes; the volume adds the database's pages. The limit for
        the policy is what is left of --disk-size after those pages, and of the cache
        disk's free space after --min-free. If either shrank below what is stored (a
        smaller budget on remount, another program filling the disk), the policy gives
        up entries, stale and least recently used first, until both hold again.
        """
        near = (self.policy.used + incoming + EXACT_MARGIN > self.policy.capacity
                or (self._min_free and self._free_estimate - incoming < self._min_free + EXACT_MARGIN))
        # Near a limit, measure again only if we wrote since (a full cache refusing one
        # block after another must not query SQLite each time), or once a second (the disk's
        # free space also moves with other programs' writes).
        changed = self._since_exact > 0 or time.monotonic() - self._measured_at > 1.0
        if not (force or (near and changed) or self._since_exact >= EXACT_EVERY):
            return
        self._since_exact = 0
        self._measured_at = time.monotonic()
        # The log grows and is checkpointed in cycles: reserve its largest size, so the
        # limit does not move (and evict) with each cycle.
        overhead = (self._db_bytes() + self._file_size("-shm") + max(self._file_size("-wal"), WAL_RESERVE)
                    + self._dir_bytes() + DIR_ENTRY_BYTES)
        limit = self._capacity - overhead - DB_SLACK - int(SLACK_SHARE * self._capacity)
        if self._min_free:
            free = self._disk_free()
            self._free_estimate = free
            limit = min(limit, self.policy.used + free - self._min_free - DB_SLACK)
        limit = max(0, limit)
        with self._plock:
            self.policy.capacity = limit
            victims = self.policy.shrink(self.policy.used - limit) if self.policy.used > limit else []
        self._delete(victims)

    def _delete(self, dkeys: list) -> None:
        for dkey in dkeys:
            self._cache.delete(dkey, retry=True)
        if dkeys:
            self._stats.incr("disk.evictions", len(dkeys))

    def discard(self, key: bytes) -> None:
        dkey = disk_key(key)
        with self._plock:
            self.policy.remove(dkey)
        try:
            self._cache.delete(dkey, retry=True)
        except Exception as exc:
            self._io_failed("delete", exc)

    def mark_stale(self, key: bytes) -> None:
        with self._plock:
            self.policy.mark_stale(disk_key(key))

    def __contains__(self, key: bytes) -> bool:
        return self._has_row(disk_key(key))

    def _has_row(self, dkey: bytes) -> bool:
        try:
            return dkey in self._cache
        except Exception:
            return True  # cannot tell: keep the index entry

    def probably_has(self, key: bytes) -> bool:
        """From the in-memory index, no I/O: exact for this daemon's writes once the index
        is loaded; before that, ask the database."""
        if self._index_ready.is_set():
            return disk_key(key) in self.policy
        return key in self

    def check(self) -> None:
        """Assert the invariants (tests): the policy's bookkeeping, and the hard budget."""
        with self._plock:
            self.policy.check()
        assert self._volume() <= self._capacity, f"volume {self._volume()} > budget {self._capacity}"

    def _write_loop(self) -> None:
        try:
            # Background work: the kernel gives the CPU to readers first (Linux threads
            # have their own nice value). Measured: without it, a writer catching up after
            # a cold epoch took a core from the next epoch's readers.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
        except (OSError, AttributeError):
            pass
        try:
            self._load_index()
            # a remount with a smaller --disk-size, or a fuller disk: back under both limits
            self._refresh_limits(force=True)
        except Exception as exc:
            # Without its index the tier admits nothing: cachefs runs on RAM and the source.
            log.warning("could not index the NVMe tier (%s); not caching on disk", exc)
        else:
            self._index_ready.set()
        finally:
            self._started.set()
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
                self._in_batch = True
                try:
                    for key, data, evict in items:
                        self.put_now(key, data, evict)
                finally:
                    self._in_batch = False
        except Exception as exc:  # put_now handles its own errors; this is the commit
            self._io_failed("commit", exc)
        finally:
            with self._plock:
                self._pending.clear()  # committed (or rolled back, and then looked up afresh)
            with self._qlock:
                self._queued_bytes -= sum(len(data) for _, data, _ in items)
                self._qroom.notify_all()

    def flush(self) -> None:
        """Wait until the writer has loaded the index (and trimmed the tier to its budget)
        and every queued write is on disk (or dropped after an error)."""
        self._started.wait(30)
        self._queue.join()

    def close(self) -> None:
        if self._writer.is_alive():
            self._queue.put(_STOP)
            self._writer.join()
        for con in self._connections.connections():  # every thread's, not only the caller's
            try:
                con.close()
            except Exception:  # a connection in use by a thread still running: it goes with it
                pass
        self._connections.clear()


__all__ = ["DiskTier", "HEADER_SIZE"]
