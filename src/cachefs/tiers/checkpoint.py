"""A checkpoint: the NVMe tier's entries written as an entry table (cachefs/tiers/table.py)
in a mount that started without one, for the serving processes' table nodes (a record's
number is its node's id, less the serving table's base; cachefs/tablenodes.py).

Generations. A mount checkpoints again when it cached many files since (a cold epoch that
paused, another dataset): the next table keeps every record of the one before in its
number (the kernel may hold any of their node ids), written from the entry in memory
where the tier still holds it and copied from the old table where it does not (a dropped
entry's node is the daemon's already, but a request for it may still come), and appends
the files cached since, oldest first. The old table is unlinked at once; its blocks stay
counted in the budget until every serving process has mapped the new one
(`checkpoint_released`), since their mappings hold them.

Cooling. A checkpoint also takes the entries it records out of memory, where they are idle
(a whole file of one block, checked since the start, the newest of its path; open or not: a
kernel's open holds a file of several blocks against holes, and one of one block goes whole
either way, FileStore._drop_block): they
become cold records of it (`Restored.of_checkpoint`), as a start from a clean stop's table
leaves its records, 22 bytes of columns each instead of an `Entry` and the policy's tuple
(about 1 KB). Each generation's cold set is the next one's (the same numbers).
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
import time
from array import array
from collections.abc import Container
from typing import TYPE_CHECKING, cast

from cachefs.config import format_size
from cachefs.heap import give_back
from cachefs.policy import Policy
from cachefs.stats import Stats
from cachefs.tiers import table
from cachefs.tiers.coldset import Restored
from cachefs.tiers.entry import Entry
from cachefs.tiers.restored import row_of
from cachefs.tiers.table import Row, Table

log = logging.getLogger(__name__)

COOL_BATCH = 2048  # entries cooled per hold of the tier's lock


class Checkpoints:
    """DiskTier's checkpoints (see the module docstring)."""

    if TYPE_CHECKING:  # what it uses of DiskTier
        _lock: threading.RLock
        _entries: dict[bytes, Entry]
        _restored: Restored | None
        _checkpoint: Table | None
        _checkpoint_bytes: int
        _retired_bytes: int
        _retired_tables: list[Table]
        _paths: dict[str, bytes]
        _stats: Stats
        _stored_since_copy: list[tuple[str, bytes]] | None
        stored_since_checkpoint: int
        policy: Policy

        def _table_path(self, table_id: int) -> str: ...

        def _unpath(self, path: str, eid: bytes) -> None: ...

        def _bring(self, n: int, row: Row, trusted: bool, held: list[tuple[int, int]]) -> None: ...

        def _lost(self, eid: bytes) -> None: ...

        def _refresh_limits(self, incoming: int = 0, force: bool = False) -> None: ...

        @property
        def suspended(self) -> bool: ...

    def checkpoint(self, ram: Container[bytes] = (), room: int | None = None) -> tuple[int, int, array] | None:
        """Write the entries held now as an entry table of their own, for the serving
        processes' table nodes in a mount that started without a table (a first mount, or
        one after a crash), or its next generation (see the module docstring): (a new
        descriptor of it, records, the numbers of the new records whose entries are in
        `ram`: RAM holds those files too); (-1, the records of the one before, none) if no
        file is new since; None if this start came from a table, the tier
        lacks the room for it, it would have more than `room` records, or it cannot be
        written. The index does not name it (the index's lines stay the record of the
        tier; a clean stop writes its own table and removes this one, a start removes it
        as any table the index does not name). Each entry written or checked in this
        mount is vouched for by this checkpoint (`synced`: its file is checked at its first
        open if it changed since, as after a clean stop). Its size counts in the tier's
        The entries are copied under the tier's lock and written outside it: one dropped
        meanwhile is in the table, and its node's first open finds no file and goes to
        the daemon; the record of a path stored meanwhile is retired (on_unpathed). The
        entries it records that are idle leave memory for its cold set (_cool)."""
        if (self._restored is not None and self._checkpoint is None) or self.suspended:
            return None  # (a start from a clean stop's table: its records are the nodes')
        now = time.time_ns()
        with self._lock:
            held = dict(self._entries)
            self._stored_since_copy = []  # (the paths stored while it is written: see below)
            since, self.stored_since_checkpoint = self.stored_since_checkpoint, 0
        old = self._checkpoint
        found = None
        count = kept = 0
        try:
            # the records before in their numbers (each one's entry where memory holds it),
            # then the entries cached since with a block held, oldest first: entries, not
            # rows, until each row is written (a Row per record at once was ~700 bytes each)
            before = [held.pop(old.eid_of(n), None) for n in range(old.count)] if old is not None else []
            new = [e for e in held.values() if e.present and e.held]
            del held
            new.sort(key=lambda e: e.stored_at)
            kept = len(before)
            count = kept + len(new)
            if room is not None and count > room:
                log.info("NVMe tier: a checkpoint of %d files is more than the serving table has room for", count)
            elif count > kept:
                found = self._write_checkpoint(old, before, new, now)
        finally:
            with self._lock:  # the newest of a path stored while it was written is not the table's
                if found is not None:
                    self._checkpoint = found[0]
                    if self._restored is not None:  # (the cold set's records, in the same numbers)
                        self._restored.rebind(found[0])
                    if old is not None:  # mapped by the serving processes until they take the new one
                        self._retired_bytes += old.size
                    self._checkpoint_bytes = found[1] + self._retired_bytes
                elif count > kept:  # (not written: those files are still to be)
                    self.stored_since_checkpoint += since
                newer, self._stored_since_copy = self._stored_since_copy, None
        if found is None:
            return (-1, kept, array("I")) if count == kept else None
        self._taken_over(found[0], old, newer or [])
        self._cool(found[0], [(n, e) for n, e in enumerate(before) if e is not None]
                   + [(kept + i, e) for i, e in enumerate(new)], found[2])
        return os.dup(found[0].fileno()), found[0].count, array("I", (kept + i for i, e in enumerate(new)
                                                                      if e.eid in ram))

    def _taken_over(self, t: Table, old: Table | None, newer: list[tuple[str, bytes]]) -> None:
        """Checkpoint `t` stands for the tier now: the one before it (`old`) goes from the
        disk (its blocks once no serving process maps it), and the records of the paths
        stored `newer` while it was written are retired."""
        if old is not None:  # (closed once released: a reader of the cold set may still hold it)
            self._retired_tables.append(old)
            with contextlib.suppress(OSError):
                os.unlink(self._table_path(old.table_id))
        for p, eid in newer:
            self._unpath(p, eid)
        self._refresh_limits(force=True)
        log.info("NVMe tier: checkpoint of %d files written (%s)%s", t.count, format_size(t.size),
                 f", {t.count - old.count} after the {old.count} of the one before" if old is not None else "")

    def _cool(self, t: Table, candidates: list[tuple[int, Entry]], hidden: set[int]) -> int:
        """After checkpoint `t`: of the entries in memory it records (`candidates`: record
        number, entry), those idle leave memory for its cold set (see the module
        docstring); the records the path buckets do not lead to (`hidden`)
        and the others stay. In batches of COOL_BATCH under the tier's lock; the number
        cooled."""
        with self._lock:
            r = self._restored
            if r is None:
                r = self._restored = Restored.of_checkpoint(t, self._bring, self._lost, self._lock)
                self.policy.attach_cold(r)
        cooled = 0
        for i in range(0, len(candidates), COOL_BATCH):
            with self._lock:
                if r is not self._restored or r.table is not t or self.suspended:
                    break  # (a next generation cools its own)
                for n, was in candidates[i:i + COOL_BATCH]:
                    eid = was.eid
                    e = self._entries.get(eid)
                    if (e is None or e.unverified or e.punched or e.present != 1 or len(e.hashes) != 1
                            or n in hidden or n in r.unpathed or self._paths.get(e.path) != eid):
                        continue
                    got = self.policy.cool((eid, 0))
                    if got is None:
                        continue
                    del self._entries[eid], self._paths[e.path]
                    r.cool(n, got[0], got[1], got[2], e.stored_at, got[3])
                    cooled += 1
        if cooled:
            with self._lock:  # (a dict never shrinks as keys go: rebuilt, its table goes back to the system)
                self._entries = dict(self._entries)
                self._paths = dict(self._paths)
                self.policy.compact()
            give_back()
        self._stats.incr("disk.cooled_files", cooled)
        log.info("NVMe tier: %d files of the checkpoint left memory for its records", cooled)
        return cooled

    def _write_checkpoint(self, old: Table | None, before: list[Entry | None], new: list[Entry],
                          now: int) -> tuple[Table, int, set[int]] | None:
        """checkpoint's table: the records of `old` in their numbers (`before`: each one's
        entry where memory holds it; else its cold record, with its attributes' time since,
        or its record in `old`; a record of zeros where that fails its CRC), then the
        entries `new`, written a row at a time. The table, its size and the records its path
        buckets do not lead to (None if it lacks the room, or is not written)."""
        count = len(before) + len(new)
        estimate = table.size_for(count, (old.heap_bytes if old is not None else 0)
                                  + sum(table.heap_of(e.path, len(e.hashes)) for e in new))
        if self.policy.used + estimate > self.policy.capacity:  # (taken from the blocks' free room)
            log.info("NVMe tier: no room for a checkpoint of its %d files (%s)", count, format_size(estimate))
            return None
        table_id = random.getrandbits(63) + 1
        path = self._table_path(table_id)
        r = self._restored
        writer: table.Writer | None = None
        try:
            writer = table.Writer(path, count, now, table_id)
            for n, e in enumerate(before):
                writer.add(row_of(e, now) if e is not None else r.row(n) if r is not None and r.cold(n)
                           else cast(Table, old).row(n))
            for e in new:
                writer.add(row_of(e, now))
            size = writer.finish()
            found = Table(path, table_id)
        except (OSError, ValueError) as exc:
            log.warning("NVMe tier: the checkpoint could not be written (%s); the daemon answers the files "
                        "it holds", exc)
            if writer is not None:
                writer.abort()
            with contextlib.suppress(OSError):
                os.unlink(path)
            return None
        return found, size, writer.hidden

    def checkpoint_released(self) -> None:
        """Every serving process has mapped the newest checkpoint: the tables before it are
        gone from the disk, and from the budget."""
        with self._lock:
            self._checkpoint_bytes -= self._retired_bytes
            self._retired_bytes = 0
            retired, self._retired_tables = self._retired_tables, []
        for old in retired:
            old.close()
        self._refresh_limits(force=True)
