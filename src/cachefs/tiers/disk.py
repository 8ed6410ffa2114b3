"""The NVMe tier: entry files under CACHE_DIR/store/data and an append-only index
(cachefs/tiers/index.py), within two hard limits: --disk-size and --min-free.

Why not diskcache any more: a block stored through diskcache (a SQLite row, a value file
with cachefs's header) cost 0.29 ms of CPU; a plain file plus an index line with its xxh3
costs 0.10-0.12 ms (measured when the format changed, docs/benchmarks.md), and a cold epoch's budget
is 0.3 ms per file in all. And the kernel can pass reads through to a plain file, never
to a value file with a header.

Guarantees:
  - a block is recorded in the index only after its bytes are written, and every block
    carries its xxh3: after each start it is checked once before it is first served (a
    crash can leave a file empty on ext4), by reading it, or at one stat for a file that a
    clean stop wrote back and nothing changed since (tiers/checks.py); a background scrub
    reads them all again once per --scrub-interval, bounded in bytes and blocks a second;
  - an entry's removal is recorded before its file changes: a crash leaves at worst a
    file without a record, which the next start deletes;
  - a damaged index line, or an index that cannot be read at all, costs the blocks it
    described, never the mount: what does not verify is set aside (logged once) and
    fetched again;
  - everything under the tier's directory (files in 4 KiB blocks, directories, the index)
    stays within --disk-size, and the cache disk keeps --min-free free: the policy admits
    a block only within a limit re-measured whenever a write comes near it;
  - after 8 cache-disk failures in a row the tier turns itself off for 60 s (reads miss,
    writes are skipped); a removed cache dir turns it off until the next mount.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import os
import threading
import time
from collections.abc import Callable

from cachefs.config import (
    DEFAULT_SCRUB_INTERVAL,
    EXACT_EVERY,
    EXACT_MARGIN,
    INDEX_FLUSH_BYTES,
    INDEX_FLUSH_EVERY,
    INDEX_MIN,
    SUSPEND_AFTER,
    SUSPEND_FOR,
    format_size,
)
from cachefs.identity import Attr, BlockKey, EntryInfo
from cachefs.policy import DEFAULT_POLICY, Policy
from cachefs.stats import Stats
from cachefs.tiers import index
from cachefs.tiers.checkpoint import Checkpoints
from cachefs.tiers.checks import Checks, Synced, mark_synced
from cachefs.tiers.coldset import Restored
from cachefs.tiers.entry import Entry, allocated
from cachefs.tiers.layout import replace_durably
from cachefs.tiers.restored import FromTable
from cachefs.tiers.store import FileStore
from cachefs.tiers.table import Table

log = logging.getLogger(__name__)

DIR_BYTES = 4096        # a directory, until its entries outgrow one block
DIR_ENTRY_BYTES = 56    # an ext4 directory entry for a 32-character name, rounded up

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def syncfs(path: str) -> None:
    """Write back everything cached for the filesystem holding `path`."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        if _libc.syncfs(fd) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))
    finally:
        os.close(fd)


class DiskTier(Checkpoints, FromTable, Checks, FileStore):
    name = "disk"

    def __init__(self, directory: str, capacity: int, stats: Stats | None = None,
                 policy: str | Policy = DEFAULT_POLICY, max_idle: float | None = None, min_free: int = 0,
                 scrub: bool = True, scrub_every: float = DEFAULT_SCRUB_INTERVAL):
        os.makedirs(directory, mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)
        self.on_unpathed: list[Callable[[int], None]] = []  # told of table records a newer version replaces
        super().__init__(directory, capacity, stats, policy, max_idle, direct=True)
        self._min_free = int(min_free)
        self._scrub_every = scrub_every
        self._check_in_background = scrub  # the restart check and scrub (tests turn them off)
        self._index = os.path.join(directory, index.NAME)
        self._log_lock = threading.Lock()
        self._log_fd = -1
        self._log_bytes = 0          # the index file's size (with the lines not written yet)
        self._unwritten = bytearray()  # index lines waiting to be written
        self._live_bytes = 0         # of it, lines that still describe something (estimate)
        self._paths: dict[str, bytes] = {}  # source path -> id of its newest entry
        self._failures = 0
        self._suspended_until = 0.0  # monotonic; the tier is off until then
        self._since_exact = 0
        self._measured_at = 0.0
        self._entries_high = 0
        self._free_estimate = 0
        self._stop = threading.Event()
        self._restored: Restored | None = None  # entries restored from the table, not in memory yet
        self._restored_at = 0.0
        self._confirmed = False  # confirm() changed an entry's time since the start (see _write_table)
        self._table_id = 0           # the entry table the index names (0: none)
        self._table_bytes = 0
        self._checkpoint: Table | None = None  # this mount's entry table, for table nodes (checkpoint)
        self._checkpoint_bytes = 0  # its size, and those of the ones before it still mapped
        self._retired_bytes = 0
        self._retired_tables: list[Table] = []  # the checkpoints before it, closed once released
        self._stored_since_copy: list[tuple[str, bytes]] | None = None  # (during a checkpoint's write)
        self.stored_since_checkpoint = 0  # files stored since the last checkpoint's copy
        s = self._stats
        s.gauge("disk.suspended", lambda: int(self.suspended))
        s.gauge("disk.used_bytes", self._volume)
        s.gauge("disk.checkpoint_bytes", lambda: self._checkpoint_bytes)
        s.gauge("disk.capacity_bytes", lambda: self._capacity)
        s.gauge("disk.entries", lambda: len(self.policy))
        s.gauge("disk.files", self.files_held)
        s.gauge("disk.files_in_memory", lambda: len(self._entries))
        self.policy.capacity = 1 << 62  # restored as found; _refresh_limits trims
        self._load()
        self._refresh_limits(force=True)
        self._flusher = threading.Thread(target=self._flush_loop, name="cachefs-index", daemon=True)
        self._flusher.start()
        self._scrubber: threading.Thread | None = None
        if scrub:
            self._scrubber = threading.Thread(target=self._scrub_loop, name="cachefs-scrub", daemon=True)
            self._scrubber.start()

    # -- the budget ---------------------------------------------------------------------

    def _volume(self) -> int:
        """Everything the tier occupies: block files in 4 KiB blocks (as the policy counts
        them), the directories, the index and the entry table."""
        return self.policy.used + self._dir_bytes() + self._log_bytes + self._table_bytes + self._checkpoint_bytes

    def files_held(self) -> int:
        return len(self._entries) + (self._restored.files if self._restored is not None else 0)

    def _dir_bytes(self) -> int:
        """The tier's directories (data/ and the subdirectories made so far), which never
        shrink: counted at their high-water mark."""
        self._entries_high = max(self._entries_high, self.files_held())
        return DIR_BYTES * (2 + len(self._made_dirs)) + DIR_ENTRY_BYTES * self._entries_high

    def _index_reserve(self) -> int:
        """Room the index may grow into before it is compacted (and while it is)."""
        return max(INDEX_MIN, 2 * self._live_bytes) + self._live_bytes

    def _disk_free(self) -> int:
        st = os.statvfs(self._dir)
        return st.f_bavail * st.f_frsize

    def _before_admit(self, size: int) -> None:
        self._refresh_limits(size)

    def _refresh_limits(self, incoming: int = 0, force: bool = False) -> None:
        """Set the policy's capacity from the two hard limits, measured when near either.
        If either shrank below what is stored (a smaller budget on remount, another program
        filling the disk), the policy gives up blocks, stale and least recently used first."""
        with self._lock:
            near = (self.policy.used + incoming + EXACT_MARGIN > self.policy.capacity
                    or (self._min_free and self._free_estimate - incoming < self._min_free + EXACT_MARGIN))
            changed = self._since_exact > 0 or time.monotonic() - self._measured_at > 1.0
            self._since_exact += 1
            if not (force or (near and changed) or self._since_exact >= EXACT_EVERY):
                return
            self._since_exact = 0
            self._measured_at = time.monotonic()
            limit = (self._capacity - self._dir_bytes() - DIR_ENTRY_BYTES - self._index_reserve()
                     - self._checkpoint_bytes)
            if self._min_free:
                try:
                    free = self._disk_free()
                except OSError:
                    free = 0
                self._free_estimate = free
                limit = min(limit, self.policy.used + free - self._min_free)
            limit = max(0, limit)
            self.policy.capacity = limit - self._reserved  # (may be negative while it shrinks)
            limit = self.policy.capacity
            victims = self.policy.shrink(self.policy.used - limit) if self.policy.used > limit else []
        self._evict(victims)

    # -- failures -------------------------------------------------------------------------

    @property
    def suspended(self) -> bool:
        """Off after repeated I/O failures (see SUSPEND_AFTER): no reads, no writes."""
        return time.monotonic() < self._suspended_until

    def _usable(self) -> bool:
        return not self.suspended

    def _writable(self) -> bool:
        if self.suspended or not self._check_dir():
            self._stats.incr("disk.suspended_writes")
            return False
        return True

    def _io_failed(self, what: str, exc: BaseException) -> None:
        self._stats.incr("disk.errors")
        self._failures += 1
        log.debug("cache disk %s failed: %s", what, exc)
        if self._failures >= SUSPEND_AFTER and not self.suspended and self._check_dir():
            # (a removed cache dir is its own case, off until the next mount: _check_dir
            # says so once; failing reads may see it first)
            self._suspended_until = time.monotonic() + SUSPEND_FOR
            self._stats.incr("disk.suspensions")
            log.warning("NVMe tier off for %.0fs after %d failed cache-disk operations (last: %s %s): "
                        "serving from RAM and the source", SUSPEND_FOR, self._failures, what, exc)

    def _check_dir(self) -> bool:
        """False (and the tier off until the next mount) if the tier's index is gone:
        someone removed the cache dir under a running daemon. Writing on would fill files
        that no budget or restart could see."""
        if os.path.exists(self._index):
            return True
        if self._suspended_until != float("inf"):
            self._suspended_until = float("inf")
            self._stats.incr("disk.suspensions")
            log.warning("NVMe tier off: its cache dir %s was removed; serving from RAM and the source "
                        "until the next mount", self._dir)
        return False

    def _read_ok(self) -> None:
        if self._failures:
            if self._failures >= SUSPEND_AFTER:
                log.warning("NVMe tier working again")
            self._failures = 0

    def _read_failed(self, key: BlockKey, exc: OSError) -> None:
        if exc.errno == errno.ENOENT:  # its file is gone: the entry, or the whole cache dir
            if self._check_dir():
                self.discard(key)
            self._io_failed("read", exc)
            return
        self._io_failed("read", exc)

    def _write_failed(self, exc: OSError) -> None:
        self._io_failed("write", exc)

    # -- the index ------------------------------------------------------------------------

    def _append(self, line: bytes, live: bool = True) -> None:
        """Add lines to the index. They are written in batches (INDEX_FLUSH_BYTES, or
        INDEX_FLUSH_EVERY seconds by the flusher thread): one write() per line cost a cold
        file about 15 us. A crash loses at most the last batch, whose files the next start
        deletes as unrecorded."""
        with self._log_lock:
            if self._log_fd < 0:
                return
            self._unwritten += line
            self._log_bytes += len(line)
            if live:
                self._live_bytes += len(line)
            grown = self._log_bytes > max(INDEX_MIN, 2 * self._live_bytes)
            if len(self._unwritten) >= INDEX_FLUSH_BYTES:
                self._write_unwritten()
        if grown:
            self._compact()

    def _write_unwritten(self) -> None:
        """Write what is waiting (the index's lock held)."""
        if not self._unwritten or self._log_fd < 0:
            return
        try:
            view = memoryview(self._unwritten)
            while view:
                view = view[os.write(self._log_fd, view):]
        except OSError as exc:
            self._io_failed("index write", exc)
        self._unwritten = bytearray()

    def _flush_loop(self) -> None:
        while not self._stop.wait(INDEX_FLUSH_EVERY):
            with self._log_lock:
                self._write_unwritten()

    def flush(self) -> None:
        """Write the index lines still waiting."""
        with self._log_lock:
            self._write_unwritten()

    def _recorded(self, e: Entry, index_: int, h: int, new: bool) -> None:
        if type(e.unverified) is Synced:  # its file changes now: the clean stop no longer vouches for it
            e.unverified = set(e.unverified)
        line = index.block_line(e.name, index_, h)
        if new:
            line = index.entry_line(e.name, e.block_size, e.stored_at, e.attr, e.path) + line
            self._paths[e.path] = e.eid
            self._unpath(e.path, e.eid)  # a newer version of the path: a table's is not its newest
            self.stored_since_checkpoint += 1
            if self._stored_since_copy is not None:
                self._stored_since_copy.append((e.path, e.eid))
        self._append(line)

    def _dropping(self, e: Entry, index_: int) -> None:
        self._append(index.drop_line(e.name, index_), live=False)
        if index_ < 0:
            eid = e.eid
            if self._paths.get(e.path) == eid:
                del self._paths[e.path]
            self._live_bytes = max(0, self._live_bytes - 200 - 50 * len(e.hashes))

    def _snapshot(self, clean: bool) -> bytes:
        """The index of what is held now, as lines: first the entries still vouched for by
        an earlier clean stop (not checked since this start), each group followed by that
        stop's C line again; then the entries checked or written since this start, followed
        by a new C line if `clean` (this stop, after syncfs); then blocks still to be read."""
        synced: dict[int, list[bytes]] = {}
        lines: list[bytes] = []
        unchecked: list[bytes] = []
        with self._lock:
            for e in self._entries.values():
                u = e.unverified
                group = synced.setdefault(u.at_ns, []) if type(u) is Synced else lines
                group.append(index.entry_line(e.name, e.block_size, e.stored_at, e.attr, e.path))
                for i, h in enumerate(e.hashes):
                    if h is None:
                        continue
                    line = index.block_line(e.name, i, h)
                    (unchecked if type(u) is set and i in u else group).append(line)
            r = self._restored
            for _, row, trusted in r.rows() if r is not None else ():
                name = row.eid.hex()
                group = synced.setdefault(row.synced_ns, []) if row.synced_ns and not trusted else lines
                group.append(index.entry_line(name, row.block_size, row.stored_at, row.attr, row.path))
                for i, h in enumerate(row.hashes):
                    if h is not None:
                        (unchecked if not (row.synced_ns or trusted) else group).append(index.block_line(name, i, h))
        out: list[bytes] = []
        for at_ns in sorted(synced):
            out += synced[at_ns]
            out.append(index.clean_line(at_ns / 1e9))
        out += lines
        if clean:
            out.append(index.clean_line(time.time()))
        return b"".join(out + unchecked)

    def _compact(self, clean: bool = False) -> None:
        """Rewrite the index as what is held now (new file, fsync, rename). Locks in the
        order every writer takes them: the tier's, then the index's."""
        with self._lock, self._log_lock:
            try:
                data = self._snapshot(clean)
                replace_durably(self._index, data)
                fd = os.open(self._index, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
            except OSError as exc:
                self._io_failed("index compaction", exc)
                return
            if self._log_fd >= 0:
                os.close(self._log_fd)
            self._log_fd = fd
            self._unwritten = bytearray()  # the snapshot holds what they said
            self._log_bytes = self._live_bytes = len(data)
            self._drop_tables()  # the index no longer names one (a restored set reads on from its open file)

    # Long (98 lines) for a reason: one pass replays the index log in order; split, its
    # state (entries, blocks seen, damage) would travel between the pieces.
    def _load(self) -> None:
        """Rebuild the tier from its index: entries and blocks, oldest first into the
        policy; blocks recorded after the last clean stop are marked for checking; files
        nobody recorded are deleted. A damaged index costs what it described, not the mount."""
        records: list = []
        damaged = 0
        try:
            if os.path.exists(self._index):
                for record in index.read(self._index):
                    if record is None:
                        damaged += 1
                    else:
                        records.append(record)
        except OSError as exc:
            aside = f"{self._index}.unreadable-{int(time.time())}"
            log.warning("the NVMe tier's index could not be read (%s); set aside as %s, starting empty",
                        exc, aside)
            try:
                os.replace(self._index, aside)
            except OSError:
                pass
            records = []
        entries: dict[bytes, Entry] = {}
        done, damaged = self._start_from_table(records, entries, damaged)
        if done:
            return
        clean = bool(records) and isinstance(records[-1], index.CleanRecord)
        since_clean: list[BlockKey] = []  # blocks recorded since the last clean stop's mark
        marks = 0                         # C lines: not entries, not blocks (see the end)
        for r in records:
            if isinstance(r, index.EntryRecord):
                try:
                    eid = bytes.fromhex(r.entry)
                except ValueError:
                    continue
                if eid not in entries:
                    entries[eid] = Entry(eid, r.path, r.attr, r.block_size, r.stored_at)
                else:
                    entries[eid].stored_at = r.stored_at
            elif isinstance(r, index.BlockRecord):
                eid = bytes.fromhex(r.entry) if len(r.entry) == 32 else b""
                e = entries.get(eid)
                if e is None or not 0 <= r.block < len(e.hashes):
                    continue
                if e.hashes[r.block] is None:
                    e.present += 1
                e.hashes[r.block] = r.xxh3
                since_clean.append((eid, r.block))  # checked once before it is served: see CleanRecord
            elif isinstance(r, index.CleanRecord):
                mark_synced(entries, since_clean, int(r.at * 1e9))
                since_clean = []
                marks += 1
            elif isinstance(r, index.DropRecord):
                eid = bytes.fromhex(r.entry) if len(r.entry) == 32 else b""
                e = entries.get(eid)
                if e is None:
                    continue
                if r.block < 0:
                    del entries[eid]
                elif 0 <= r.block < len(e.hashes) and e.hashes[r.block] is not None:
                    e.hashes[r.block] = None
                    e.present -= 1
                    if e.unverified is not None:
                        e.unverified.discard(r.block)
        mark_synced(entries, since_clean, None)  # after the last clean stop: each block is read
        if damaged:
            log.warning("NVMe tier: %d damaged index lines skipped; the blocks they described will be "
                        "fetched again", damaged)
        # The files: delete those without a record; forget entries whose file is gone.
        on_disk = self._files()
        self._made_dirs.update(os.path.dirname(path) for path in on_disk.values())
        orphans = [path for name, path in on_disk.items() if bytes.fromhex(name) not in entries
                   or entries[bytes.fromhex(name)].present == 0]
        for path in orphans:
            try:
                os.unlink(path)
            except OSError:
                pass
        missing = [eid for eid, e in entries.items() if e.name not in on_disk or e.present == 0]
        for eid in missing:
            del entries[eid]
        if missing:
            log.info("NVMe tier: %d index entries had no file (removed behind the daemon's back)", len(missing))
        for eid, e in sorted(entries.items(), key=lambda kv: kv[1].stored_at):
            self._entries[eid] = e
            self._paths[e.path] = eid
            for i, h in enumerate(e.hashes):
                if h is not None:
                    self.policy.admit((eid, i), allocated(e.extent(i)[1]))
        synced = sum(type(e.unverified) is Synced for e in self._entries.values())
        log.info("NVMe tier: %d files, %d blocks, %s; %d files written back at a clean stop are trusted "
                 "if unchanged since, the rest are checked once before they are served%s",
                 len(self._entries), len(self.policy), format_size(self.policy.used), synced,
                 "" if clean or not records else " (the last stop was not clean)")
        if orphans:
            log.info("NVMe tier: deleted %d files no index line described (an unclean stop)", len(orphans))
        live = len(self._entries) + len(self.policy)
        if records and not (damaged or orphans or missing) and len(records) - marks == live:
            self._open_log()  # every line is live (a clean stop wrote it so): no need to rewrite it
        else:
            self._compact()  # a fresh index: what is held, damaged and dead lines gone

    def _open_log(self) -> None:
        """Append to the index as it is."""
        with self._log_lock:
            try:
                fd = os.open(self._index, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)
                self._log_bytes = self._live_bytes = os.fstat(fd).st_size
            except OSError as exc:
                self._io_failed("index open", exc)
                return
            self._log_fd = fd

    def _files(self) -> dict[str, str]:
        """Entry files on disk, by name."""
        found: dict[str, str] = {}
        try:
            subdirs = list(os.scandir(self._data))
        except OSError:
            return found
        for sub in subdirs:
            if not sub.is_dir(follow_symlinks=False):
                continue
            try:
                with os.scandir(sub.path) as it:
                    for f in it:
                        if len(f.name) == 32 and f.name.startswith(sub.name):
                            try:
                                bytes.fromhex(f.name)
                            except ValueError:
                                continue
                            found[f.name] = f.path
            except OSError:
                continue
        return found

    # -- what the metadata cache asks after a restart ---------------------------------------

    def attr_of(self, path: str) -> tuple[Attr, float] | None:
        """(attributes, wall time they were last known good) of the newest cached version
        of `path`. A restored entry is answered from its record, left out of memory."""
        eid = self._paths.get(path)
        if eid is None:
            if self._restored is None:
                return None
            row = self._restored_row(path)
            if row is not None:
                return row[1].attr, row[1].stored_at
            with self._lock:  # brought into memory meanwhile (by another thread), whole
                eid = self._paths.get(path)
            if eid is None:
                return None
        e = self._entries.get(eid)
        return None if e is None else (e.attr, e.stored_at)

    def confirm(self, path: str, same: Callable[[Attr], bool] | None = None) -> tuple[bytes, int] | None:
        """The source still has the newest cached version of `path` (if `same` says so of
        its attributes): they are good as of now (kept in the index at the next compaction
        or clean stop). Its entry id and its record of the entry table (-1: in memory), or
        None (none cached, or not the same)."""
        return self._known_good(path, time.time(), same)

    def outdated(self, path: str) -> None:
        """The source has another version of `path` than the newest cached one: its
        attributes are not known good any more (no lookup is answered with them, here or
        after a restart); a check that finds the source back at this version confirms it."""
        self._known_good(path, 0.0)

    def _known_good(self, path: str, when: float,
                    same: Callable[[Attr], bool] | None = None) -> tuple[bytes, int] | None:
        """The newest cached version of `path` has its attributes known good as of `when`
        (a record restored from the table and still there, in its column: Restored.stamp):
        its entry id and record (confirm), or None (none cached)."""
        eid = self._paths.get(path)
        if eid is None:
            found = self._restored_row(path)  # (None too if another thread brought it in meanwhile)
            with self._lock:
                r = self._restored
                if found is not None and r is not None and r.cold(found[0]):
                    if same is not None and not same(found[1].attr):
                        return None
                    r.stamp(found[0], when)
                    self._confirmed = True
                    return found[1].eid, found[0]
                eid = self._paths.get(path)  # (brought in since the look)
        e = self._entries.get(eid) if eid is not None else None
        if e is None or (same is not None and not same(e.attr)):
            return None
        e.stored_at = when
        self._confirmed = True
        return e.eid, -1

    # -- shutdown -------------------------------------------------------------------------------

    def close(self) -> None:
        """Write back the tier's files, then record a clean stop: the next start trusts
        every file unchanged since without reading it (tiers/checks.py)."""
        self._stop.set()
        self._flusher.join(10)
        if self._scrubber is not None:
            self._scrubber.join(10)
        if self._log_fd >= 0 and not self.suspended and os.path.exists(self._index):
            try:
                syncfs(self._dir)
                self._write_table()
            except OSError as exc:
                log.warning("NVMe tier: could not record a clean stop (%s); its blocks will be checked "
                            "at the next start", exc)
        with self._log_lock:
            self._write_unwritten()
            if self._log_fd >= 0:
                os.close(self._log_fd)
                self._log_fd = -1
        checkpoint, self._checkpoint = self._checkpoint, None
        for t in [*self._retired_tables, *([checkpoint] if checkpoint is not None else [])]:
            t.close()
        self._retired_tables = []
        super().close()


__all__ = ["DiskTier", "EntryInfo"]
