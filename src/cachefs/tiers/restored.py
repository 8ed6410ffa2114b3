"""DiskTier's side of its entry table (cachefs/tiers/table.py): writing it at a clean stop,
a start from it (a mount after a clean stop checks the table's header and reads nothing
else), and its records brought into memory as the daemon needs them (a read or an open it
serves, a file of several blocks hit, the restart check finding it changed, the policy
taking it as a victim); a lookup of its path reads its record. Records not brought in
are the cold set (cachefs/tiers/coldset.py).
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
from array import array
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from cachefs.config import SWEEP_RATE, format_size
from cachefs.identity import BlockKey, EntryInfo
from cachefs.policy import Policy
from cachefs.stats import Stats
from cachefs.tiers import index, table
from cachefs.tiers.checks import Synced
from cachefs.tiers.coldset import COLD, TRUSTED, WARM, Restored
from cachefs.tiers.entry import Entry
from cachefs.tiers.layout import SUBDIR_CHARS, replace_durably
from cachefs.tiers.table import Row, Table

log = logging.getLogger(__name__)
assert SUBDIR_CHARS == 2  # a data subdirectory per first byte of the entry id (_sweep_orphans)


def row_of(e: Entry, now_ns: int) -> Row:
    """An entry in memory as a table records it at `now_ns` (a clean stop's or a
    checkpoint's time): vouched for by an earlier stop's time while that stop still
    vouches for it, by `now_ns` if every block was written or checked since the start,
    else by nothing (0: its blocks are read before they are served)."""
    u = e.unverified
    synced = u.at_ns if type(u) is Synced else 0 if u else now_ns
    return Row(e.eid, e.path, e.attr, e.block_size, e.stored_at, synced, list(e.hashes))


class FromTable:
    """DiskTier's side of the table: writing it at a clean stop, a start from it, and
    bringing its entries into memory as they are touched."""

    if TYPE_CHECKING:  # what it uses of DiskTier
        _dir: str
        _data: str
        _index: str
        _lock: threading.RLock
        _log_lock: threading.Lock
        _entries: dict[bytes, Entry]
        _paths: dict[str, bytes]
        _made_dirs: set[str]
        _restored: Restored | None
        _restored_at: float
        _table_id: int
        _table_bytes: int
        _checkpoint: Table | None
        on_unpathed: list[Callable[[int], None]]
        _unwritten: bytearray
        _log_bytes: int
        _live_bytes: int
        _log_fd: int
        _confirmed: bool
        _check_in_background: bool
        _stats: Stats
        policy: Policy

        def file_of(self, name: str) -> str: ...

        def _io_failed(self, what: str, exc: BaseException) -> None: ...

        def _open_log(self) -> None: ...

        def _row_unchanged(self, row: Row) -> bool: ...

        _stop: threading.Event

        def _pause(self, activity: Callable[[], int], seen: int) -> int | None: ...

        def _refresh_limits(self, incoming: int = 0, force: bool = False) -> None: ...

        def _usable(self) -> bool: ...

        @property
        def suspended(self) -> bool: ...

    def _table_path(self, table_id: int) -> str:
        return os.path.join(self._dir, index.table_name(table_id))

    def _drop_tables(self, keep: int = 0) -> None:
        """Delete the entry tables the index does not name (`keep`), and leftovers."""
        self._table_id = keep
        if not keep and self._restored is None:
            self._table_bytes = 0  # (a restored set's mapping holds its table's blocks until the end)
        try:
            names = [n for n in os.listdir(self._dir) if n.startswith("entries-")]
        except OSError:
            return
        for name in names:
            if not keep or name != index.table_name(keep):
                try:
                    os.unlink(os.path.join(self._dir, name))
                except OSError:
                    pass

    def _write_table(self) -> None:
        """A clean stop (after syncfs): everything held as a new entry table, then an index
        of one line naming it (each fsync'd, then renamed over). The next start opens it and
        reads nothing else. An entry still vouched for by an earlier stop keeps that stop's
        time; one checked or written since this start is vouched for by this stop; one with
        blocks still to check is read at the next start."""
        with self._lock, self._log_lock:
            if (self._table_id and self._restored is not None and not self._unwritten and not self._confirmed
                    and self._log_bytes == len(index.table_line(self._table_id))):
                # Nothing was added, dropped or confirmed since the start from this table:
                # it stands for this stop too (its entries checked since keep the earlier
                # stop's time, which still vouches for them). An epoch's stop costs a syncfs.
                self._close_log()
                return
            stop_ns = time.time_ns()
            # in restore order (`stored at`), the entries in memory first where equal, then
            # the cold records; a row made only as it is written: rows made first, at 1.28
            # million files, had been ~1 KB of objects each at once
            entries = [e for e in self._entries.values() if e.held]
            r = self._restored
            cold, when = r.cold_order() if r is not None else (array("I"), array("d"))
            when = array("d", (e.stored_at for e in entries)) + when
            order = sorted(range(len(when)), key=when.__getitem__)
            del when
            table_id = random.getrandbits(63) + 1
            line = index.table_line(table_id)
            writer: table.Writer | None = None
            try:
                writer = table.Writer(self._table_path(table_id), len(order), stop_ns, table_id)
                for i in order:
                    if i < len(entries):
                        writer.add(row_of(entries[i], stop_ns))
                        continue
                    n, rs = cold[i - len(entries)], cast(Restored, r)
                    row = rs.row(n)  # (None: a record of zeros, as one failing its CRC is)
                    writer.add(row._replace(synced_ns=stop_ns) if row is not None and rs.state[n] == TRUSTED else row)
                size = writer.finish()
                replace_durably(self._index, line)
            except OSError as exc:
                if writer is not None:
                    writer.abort()
                self._io_failed("entry table", exc)
                self._drop_tables(self._table_id)
                return
            self._drop_tables(table_id)
            self._table_bytes = size
            self._unwritten = bytearray()
            self._log_bytes = self._live_bytes = len(line)
            self._close_log()

    def _close_log(self) -> None:
        """The stop is recorded: nothing appends after it."""
        if self._log_fd >= 0:
            os.close(self._log_fd)
            self._log_fd = -1

    def _start_from_table(self, records: list, entries: dict[bytes, Entry], damaged: int) -> tuple[bool, int]:
        """The part of a start the entry table plays, if the index's first line names one
        (taken off `records`): with nothing after it (a clean stop) the tier starts from the
        table as it is, and (True, damaged) says the start is done; otherwise its rows go
        into `entries`, for the lines after it to be replayed on. (False, damaged lines and
        records so far) then."""
        if not records or not isinstance(records[0], index.TableRecord):
            self._drop_tables()
            return False, damaged
        found = self._open_table(records.pop(0).table)
        if found is None:
            return False, damaged + 1
        if not records and not damaged:
            self._restore(found)  # a clean stop, nothing since: map the table, read nothing else
            return True, damaged
        for n in range(found.count):  # the table, then what the log says happened after it
            row = found.row(n)
            if row is not None:
                entries[row.eid] = self._entry_of(row)
            else:
                damaged += 1
        return False, damaged

    def _open_table(self, table_id: int) -> Table | None:
        """The entry table the index names, or None (logged) if it cannot be read."""
        self._drop_tables(table_id)
        try:
            found = Table(self._table_path(table_id), table_id)
        except (OSError, ValueError) as exc:
            log.warning("the NVMe tier's entry table could not be read (%s); the files it described will "
                        "be fetched again", exc)
            return None
        self._table_bytes = found.size
        return found

    def _restore(self, found: Table) -> None:
        """Start from a clean stop's table without reading it: its entries stay in the
        table until touched (cachefs/tiers/restored.py), held by the policy meanwhile."""
        self._restored = Restored(found, self._bring, self._lost, self._lock)
        self._restored_at = time.time()
        self.policy.attach_cold(self._restored)
        try:
            self._made_dirs.update(d.path for d in os.scandir(self._data) if d.is_dir(follow_symlinks=False))
        except OSError:
            pass
        self._open_log()
        self._live_bytes += 250 * found.count  # what the table would take as index lines
        log.info("NVMe tier: %d files, %d blocks, %s, restored from the clean stop's entry table; each "
                 "file's is checked at a stat before it is served", found.count, found.blocks,
                 format_size(found.used))

    def _nodes_table(self) -> Table | None:
        """The entry table the serving processes' table nodes stand for: the one this start
        came from (a clean stop's), or this mount's checkpoint (see checkpoint)."""
        r = self._restored
        return r.table if r is not None else self._checkpoint

    def table_row(self, n: int) -> Row | None:
        """Record n of that table, if it passes its CRC (None without one)."""
        t = self._nodes_table()
        return None if t is None or not 0 <= n < t.count else t.row(n)

    def table_eid_size(self, n: int) -> tuple[bytes, int] | None:
        """Record n's entry id and file size (Table.brief), to count the open of its table
        node: a restored record's number and shape are remembered for that count
        (Restored.found)."""
        t = self._nodes_table()
        found = None if t is None or not 0 <= n < t.count else t.brief(n)
        if found is None:
            return None
        r = self._restored
        if r is not None and t is r.table:
            r.found(found[0], n, found[2])
        return found[:2]

    def vouch_rows(self, records: list[int]) -> None:
        """Table nodes a serving process registered a backing id for, after its own test of
        their files (Restored.vouch): trusted without the restart check's stat, if they stand
        for records of the table this start came from."""
        r = self._restored
        if r is None or self._nodes_table() is not r.table:
            return
        with self._lock:
            found = r.vouch(records)
        self._stats.add_many({"disk.trusted_files": found, "disk.vouched_files": found})

    def held_at(self, path: str) -> float | None:
        """The wall time the attributes of `path`'s newest cached version were last known
        good, if the tier holds that version whole and checked since the start (None if
        not): directory read-ahead's question for each sibling, answered with no object per
        file (a record's path compared, not its CRC: a damaged one is fetched at its open).
        One still to check is not (read-ahead's fill checks it ahead of the job's open)."""
        eid = self._paths.get(path)
        if eid is not None:
            e = self._entries.get(eid)
            return e.stored_at if e is not None and e.complete and not e.unverified else None
        r = self._restored
        try:
            found = r.table.path_brief(path) if r is not None and r.files else None
        except OSError:
            return None
        if r is None or found is None:
            return None
        n, stored_at, nblocks = found
        if nblocks != 1 or r.state[n] != TRUSTED or n in r.unpathed:
            return None  # (brought into memory: its entry, above, unless dropped since)
        checked = r.checked[n]
        return max(checked, 0.0) if checked else stored_at

    def table_find(self, path: str | None = None, eid: bytes | None = None) -> int | None:
        """The record of that table holding `path`'s newest version, or entry `eid`."""
        t = self._nodes_table()
        if t is None:
            return None
        return t.find_path(path) if path is not None else t.find(eid) if eid is not None else None

    def entry_table(self) -> tuple[int, int] | None:
        """(a new descriptor of, records in) that table, for the serving processes' table
        nodes; None without one."""
        t = self._nodes_table()
        return None if t is None else (os.dup(t.fileno()), t.count)

    def _unpath(self, path: str, eid: bytes) -> None:
        """Entry `eid` is the newest of `path` now: a record of that table holding another
        version of it is not the path's newest any more (its table node is retired)."""
        r = self._restored
        t = r.table if r is not None and r.files else self._checkpoint
        if t is None:
            return
        n = t.find_path(path)
        if n is not None and t.eid_of(n) != eid:
            if r is not None:
                r.unpathed.add(n)
            for listener in self.on_unpathed:
                listener(n)

    def _restored_row(self, path: str) -> tuple[int, Row] | None:
        """(record number, row) of the newest version of `path` if it is restored and cold."""
        r = self._restored
        if r is None or not r.files:
            return None
        found = r.table.path_row(path)
        if found is None or found[0] in r.unpathed or not r.cold(found[0]):
            return None
        r.seen(*found)
        row = r.row(*found)
        return None if row is None else (found[0], row)

    # -- entries restored from the table ------------------------------------------------------

    def _entry(self, eid: bytes) -> Entry | None:
        e = self._entries.get(eid)
        r = self._restored
        if e is None and r is not None and r.files:
            n = r.number(eid)  # (read before the lock: a read may wait on the disk)
            if n is not None:
                row = r.row(n) if r.cold(n) else None
                with self._lock:  # (the bring-in marks a record taken before its entry is in memory)
                    if r.cold(n):
                        r.take(n, row)
                    e = self._entries.get(eid)
        return e

    def _checked_cold(self, r: Restored, n: int) -> bool:
        """Whether cold record n is checked since the start: trusted by the restart check, or,
        its pass not there yet (directory read-ahead and promotions run ahead), here at one stat."""
        if r.state[n] == COLD and self._check_in_background:
            row = r.row(n)
            if row is not None and self._row_unchanged(row):
                with self._lock:
                    if r.state[n] == COLD:
                        r.trust(n)
                        self._stats.incr("disk.trusted_files")
        return r.state[n] == TRUSTED

    def needs_check(self, eid: bytes) -> bool:
        """A cold record checked since the start (_checked_cold) needs none, and stays cold."""
        r = self._restored
        if eid not in self._entries and r is not None and r.files:
            n = r.number(eid)
            if n is not None and r.state[n] < WARM and self._checked_cold(r, n):
                return False
        return super().needs_check(eid)  # type: ignore[misc]

    def cold_copy(self, eid: bytes) -> tuple[str, int, int, EntryInfo] | None:
        """(its file, size, block hash, info) if entry `eid` is a cold record of a whole file
        of one block, checked since the start: what a promotion copies into RAM, leaving it cold."""
        r = self._restored
        if eid in self._entries or r is None or not r.files or not r.whole_cold(eid):
            return None
        n = r.number(eid)  # (whole_cold's, remembered)
        row = None if n is None or not self._checked_cold(r, n) else r.row(n)
        if row is None or row.hashes[0] is None or not self._usable():
            return None
        return self.file_of(eid.hex()), row.attr.size, row.hashes[0], EntryInfo(row.path, row.attr, row.block_size)

    def hit_whole(self, eids: list[bytes]) -> list[bool]:
        """FileStore.hit_whole, where a whole file of one block restored from the table and
        not brought in since stays out of memory: its hit goes into the cold set's columns
        (Restored.touch), no entry is made for it."""
        r = self._restored
        if r is None or not r.files:
            return super().hit_whole(eids)  # type: ignore[misc,no-any-return]
        entries = self._entries
        cold = [eid not in entries and r.whole_cold(eid) for eid in eids]
        rest = iter(super().hit_whole([eid for eid, c in zip(eids, cold, strict=True) if not c]))  # type: ignore[misc]
        with self._lock:
            usable = self._usable()
            if usable:
                self.policy.hit_many([(eid, 0) for eid, c in zip(eids, cold, strict=True) if c])
        return [usable if c else next(rest) for c in cold]

    def _bring(self, n: int, row: Row, trusted: bool, held: list[tuple[int, int]]) -> None:
        """Record n of the table into memory: its entry, and its blocks (`held`, with their
        sizes) to the policy, as the oldest (Restored.take; the tier's lock held)."""
        self._entries[row.eid] = self._entry_of(row, trusted)
        r = self._restored
        if row.newest and r is not None and n not in r.unpathed and row.path not in self._paths:
            self._paths[row.path] = row.eid
        # (as last read while cold, if it was: Restored.touch)
        self.policy.restore([((row.eid, i), size) for i, size in held],
                            *(r.ticks[n], r.whens[n], bool(r.fresh[n])) if r else ())

    def _lost(self, eid: bytes) -> None:
        """A restored record failed its CRC: its file goes (fetched again when read)."""
        if eid not in self._entries:
            try:
                os.unlink(self.file_of(eid.hex()))
            except OSError:
                pass

    def _sweep_orphans(self) -> int:
        """After a start from the table (which lists nothing): delete the files older than
        the start that no entry describes (written by someone else into the cache dir, or
        by a run that stopped between a file and its record). In the background, once: the
        ids of the records still cold read in bulk (the first 8 bytes of each, by data
        subdirectory: 8 bytes a record while it runs), then a subdirectory at a time, its
        names against them, at most SWEEP_RATE files a second, and only while the job opens
        no cached file (_pause); the number deleted."""
        r = self._restored
        if r is None:
            return 0
        cold: list[array[int] | None] = [array("Q") for _ in range(256)]  # by the id's first byte: its subdirectory
        state = r.state
        for n, eid, _, _ in r.table.synced():
            if state[n] < WARM:
                cold[eid[0]].append(int.from_bytes(eid[:8], "big"))  # type: ignore[union-attr]
        try:
            subdirs = sorted(d.name for d in os.scandir(self._data) if d.is_dir(follow_symlinks=False))
        except OSError:
            return 0
        gone = 0
        debt = 0.0
        busy = r.vouched + r.touches  # the job's opens of cached files, counted (see below)
        for sub in subdirs:
            try:
                first = int(sub, 16) if len(sub) == SUBDIR_CHARS else -1
                if first < 0:  # (not a subdirectory of ours: nothing in it is)
                    continue
                held, cold[first] = cold[first], None
                fd = os.open(os.path.join(self._data, sub), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            except (ValueError, OSError):
                continue
            try:
                keys = set(held or ())
                for name in os.listdir(fd):
                    gone += self._orphan(sub, fd, name, keys)
                    debt += 1.0 / SWEEP_RATE
                    if debt >= 0.05:
                        if self._stop.wait(debt):
                            return gone
                        debt = 0.0
                        if (paused := self._pause(lambda: r.vouched + r.touches, busy)) is None:
                            return gone  # (a job reading: it waited for a pause)
                        busy = paused
            except OSError:
                continue
            finally:
                os.close(fd)
        if gone:
            log.info("NVMe tier: deleted %d files no entry described", gone)
        return gone

    def _orphan(self, sub: str, fd: int, name: str, cold: set[int]) -> bool:
        """Delete file `name` of data subdirectory `sub` (open at `fd`) if it is an orphan:
        not a cold record's (`cold`: their ids' first 8 bytes), nor an entry's in memory,
        and older than the start (_sweep_orphans). Whether it was."""
        if len(name) != 32 or not name.startswith(sub):
            return False
        try:
            if int(name[:16], 16) in cold:
                return False
            eid = bytes.fromhex(name)
        except ValueError:
            return False
        if eid in self._entries:
            return False
        try:
            if os.stat(name, dir_fd=fd, follow_symlinks=False).st_mtime >= self._restored_at - 2:
                return False  # written since the start (a fetch process's file before it is adopted)
            with self._lock:
                if self._entries.get(eid) is None:
                    os.unlink(name, dir_fd=fd)
                    return True
        except OSError:
            pass
        return False

    @staticmethod
    def _entry_of(row: Row, trusted: bool = False) -> Entry:
        e = Entry(row.eid, row.path, row.attr, row.block_size, row.stored_at)
        e.hashes = list(row.hashes)
        held = [i for i, h in enumerate(e.hashes) if h is not None]
        e.present = len(held)
        e.unverified = None if trusted else Synced(row.synced_ns, held) if row.synced_ns else set(held)
        return e

    def _cold_blocks(self) -> list[BlockKey]:
        r = self._restored
        return [] if r is None else cast(list[BlockKey], list(r.keys()))

