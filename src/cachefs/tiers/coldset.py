"""The cold set: the entries a start of the NVMe tier found in its entry table
(cachefs/tiers/table.py) and has not brought into memory (cachefs/tiers/restored.py brings
them in as the daemon needs them).

What is kept per record is a few flat columns, 22 bytes: its state, its shape once read,
the policy's last access to it (tick and clock time) and when a check last found its
attributes to be the source's. A record stays cold when a check confirms it, and a whole
file of one block (an image; the files table nodes stand for) when its opens are counted
as hits or it is promoted into RAM: an entry in memory costs about 1 KB (its `Entry`,
`Row`, `Attr` and the policy's tuples), and an epoch after a remount used to bring every
record in.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Callable, Hashable, Iterator
from typing import cast

from cachefs.identity import BlockKey
from cachefs.tiers.entry import allocated
from cachefs.tiers.table import Row, Table, block_bytes

COLD = 0      # in the table only
TRUSTED = 1   # in the table only, and the restart check found its file as the clean stop left it
WARM = 2      # brought into memory (or dropped since: the tier's entries say)
GONE = 3      # its record failed its CRC (its file deleted)

UNKNOWN, SINGLE, OTHER = 0, 1, 2  # a record's shape, once read: a whole file of one block, or not
OUTDATED = -1.0  # in Restored.checked: its attributes are not the source's (their time 0)


class Restored:
    """The cold set of a DiskTier's policy (cachefs.policy.Cold). `bring(n, row, trusted,
    held)` is the tier's: make record n's entry (the row read and checked; `held`: its
    blocks and their sizes) and hand its blocks to `Policy.restore`. Called with the
    tier's lock held, as the policy is."""

    def __init__(self, table: Table, bring: Callable[[int, Row, bool, list[tuple[int, int]]], None],
                 lost: Callable[[bytes], None], lock: threading.RLock):
        self.table = table
        self.state = bytearray(table.count)
        self.count = table.blocks   # blocks held cold
        self.used = table.used      # their bytes, as the policy counts them
        self.files = table.count    # records still cold
        self._bring = bring
        self._lost = lost  # told the id of a record that failed its CRC (as far as it reads)
        self._lock = lock  # the tier's: a policy query can come without it (probably_has)
        self._first = 0             # no record before it is cold and unread (see oldest)
        self.unpathed: set[int] = set()  # records whose path has a newer entry since the start
        # hits on records left cold (Policy.hit_many -> touch): the policy's tick of the
        # last (0: none since the start) and its clock time; each record's shape
        self.ticks = array("q", bytes(8 * table.count))
        self.whens = array("f", bytes(4 * table.count))
        self.shape = bytearray(table.count)
        self.fresh = bytearray(table.count)  # cooled as fetched ahead, not read since (cool)
        # when each record's attributes were last found to be the source's since the start
        # (wall clock; 0: not since, OUTDATED: found changed): its `stored_at` then
        self.checked = array("d", bytes(8 * table.count))
        self.read = 0               # cold records read since the start
        self.vouched = 0            # records the serving processes' registrations vouched for (vouch)
        self.touches = 0            # hits on them
        self._found: dict[bytes, int] = {}  # whole_cold's answers, for the touch that follows
        self._recent: dict[int, Row] = {}   # records a lookup read, for the questions after it (seen)
        self._by_tick = array("i")     # read_oldest's records, by tick as they were listed,
        self._listed_ticks = array("q")  # those ticks,
        self._listed_at = 0              # `touches` when they were listed,
        self._listed_from = 0            # and the first that may still be cold and unread since

    @classmethod
    def of_checkpoint(cls, table: Table, bring: Callable[[int, Row, bool, list[tuple[int, int]]], None],
                      lost: Callable[[bytes], None], lock: threading.RLock) -> Restored:
        """A cold set over a checkpoint of this mount (cachefs/tiers/checkpoint.py): its
        records start in memory (WARM), the tier's entries; those that are idle are cooled
        into it (cool)."""
        r = cls(table, bring, lost, lock)
        r.state = bytearray([WARM]) * table.count
        r.count = r.used = r.files = 0
        r._first = table.count  # (no record is cold and unread since the start: see oldest)
        return r

    def rebind(self, table: Table) -> None:
        """The checkpoint's next generation (the records before in their numbers, then the
        files stored since, in memory) stands for this set's table now. The tier's lock held."""
        extra = table.count - len(self.state)
        if extra < 0:
            raise ValueError("a next generation has fewer records than the table before it")
        self.state += bytearray([WARM]) * extra
        self.shape += bytes(extra)
        self.fresh += bytes(extra)
        self.ticks.frombytes(bytes(8 * extra))
        self.whens.frombytes(bytes(4 * extra))
        self.checked.frombytes(bytes(8 * extra))
        self.table = table
        self._recent.clear()

    def cool(self, n: int, size: int, tick: int, when: float, stored_at: float, unread: bool = False) -> None:
        """Record n's entry, a whole file of one block checked since the start (`size` bytes
        on disk), leaves memory: the policy's last access to it (`tick`, `when`) and its
        attributes' time go into the columns, as for a record read since the start; one
        admitted before the policy's first access and not read since (tick 0) is among the
        oldest, in the table's order (stored_at), as a record not read since a start is.
        `unread`: fetched ahead and not read yet (its admission is its access; its first
        read counts no reuse, see touch). The tier's lock held."""
        self.state[n] = TRUSTED
        self.shape[n] = SINGLE
        self.fresh[n] = unread
        self.files += 1
        self.count += 1
        self.used += size
        self.ticks[n] = tick
        self.whens[n] = when
        self.stamp(n, stored_at)
        if tick:
            self.read += 1
            self._by_tick = array("i")  # (listed again: read_oldest)
        else:
            self._first = min(self._first, n)

    def row(self, n: int, row: Row | None = None) -> Row | None:
        """Record n (Table.row, or `row` read already), with its attributes' time as
        checked since the start."""
        row = row or self._recent.get(n) or self.table.row(n)
        checked = self.checked[n]
        if row is None or not checked:
            return row
        return row._replace(stored_at=max(checked, 0.0))

    def stamp(self, n: int, when: float) -> None:  # its attributes the source's as of `when` (0: not)
        self.checked[n] = when or OUTDATED

    def found(self, eid: bytes, n: int, blocks: int = 0) -> None:
        """Entry `eid` is record n (read there by the caller): not looked up again. With
        `blocks`, the record's number of blocks: its shape is not read again either (a file
        of one block is whole: its record has its hash). A table node's open reports it,
        read by the serving process that answered the open from the whole record, CRC and
        all."""
        if len(self._found) > 2048:
            self._found.clear()
        self._found[eid] = n
        if blocks and self.shape[n] == UNKNOWN:
            self.shape[n] = SINGLE if blocks == 1 else OTHER

    def seen(self, n: int, row: Row) -> None:
        """Record n was read (a lookup's, by path): its number, shape and row are not read
        again for the questions that follow the lookup (directory read-ahead's fill, the
        open: whether a tier holds it, whether it needs a check). A table is never
        rewritten in place, so a row read once stays its record."""
        self.found(row.eid, n)
        if self.shape[n] == UNKNOWN:
            self.shape[n] = _shape(row)
        if len(self._recent) > 256:
            self._recent.clear()
        self._recent[n] = row

    def number(self, eid: bytes, forget: bool = False) -> int | None:
        """Entry `eid`'s record number: as found() remembered it (`forget`: no longer), or probed."""
        n = self._found.pop(eid, None) if forget else self._found.get(eid)
        return self.table.find(eid) if n is None else n

    def whole_cold(self, eid: bytes) -> bool:
        """Whether entry `eid` is a cold record of a whole file of one block, which a hit
        leaves cold (see touch)."""
        n = self.number(eid)
        if n is None or self.state[n] >= WARM or not self._single(n):
            return False
        self.found(eid, n)
        return True

    def holds(self, key: Hashable) -> bool:
        """Whether the cold set holds block `key`, without bringing its record in (asked
        without the tier's lock: a record being brought in is waited for)."""
        eid, block = cast(BlockKey, key)
        if (n := self.number(eid)) is None:
            return False
        if self.state[n] >= WARM:
            with self._lock:  # (after a bring-in the policy's entries have its keys; after
                if self.state[n] >= WARM:  # a cooling, this set has: Restored.cool)
                    return False
        if self._single(n):
            return block == 0
        row = self.table.row(n)
        return row is not None and 0 <= block < len(row.hashes) and row.hashes[block] is not None

    def _single(self, n: int) -> bool:  # (a whole file of one block: its shape, read once)
        shape = self.shape[n]
        if shape == UNKNOWN:
            row = self.table.row(n)
            if row is None:
                with self._lock:
                    if self.state[n] < WARM:
                        self._gone(n)
                return False
            shape = self.shape[n] = _shape(row)
        return shape == SINGLE

    def touch(self, key: Hashable, tick: int, when: float) -> int | None:
        """A hit on `key` that leaves its record cold (Cold.touch): the tick of its access
        before (0: none since the start; -1: cooled as fetched ahead, and this is its
        first read); the tier's lock held."""
        eid, block = cast(BlockKey, key)
        n = self.number(eid, forget=True) if block == 0 and self.files else None
        if n is None or self.state[n] >= WARM or not self._single(n):
            return None
        before = self.ticks[n]
        if not before:
            self.read += 1
        if self.fresh[n]:
            self.fresh[n] = 0
            before = -1
        self.touches += 1
        self.ticks[n] = tick
        self.whens[n] = when
        return before

    def access(self, key: Hashable) -> tuple[int, float] | None:
        """(tick, clock time) of a cold record's last hit since the start, or None."""
        n = self.number(cast(BlockKey, key)[0])
        if n is None or self.state[n] >= WARM or not self.ticks[n]:
            return None
        return self.ticks[n], self.whens[n]

    def read_oldest(self) -> Iterator[tuple[Hashable, int, int, float]]:
        """The cold records read since the start, as (key, size, tick, when), oldest tick
        first (Cold.read_oldest), from a listing sorted by tick (about a second for 1.28
        million: made again once the hits since outnumber a quarter of it). A record read
        again since it was listed is left out until then (it is newer than any listed, and
        no candidate to go first)."""
        if self.touches - self._listed_at > max(1024, len(self._by_tick) // 4) or (self.read and not self._by_tick):
            ticks = self.ticks
            order = sorted((n for n in range(self.table.count) if ticks[n] and self.state[n] < WARM),
                           key=ticks.__getitem__)
            self._by_tick, self._listed_ticks = array("i", order), array("q", (ticks[n] for n in order))
            self._listed_at, self._listed_from = self.touches, 0
        by_tick, listed, i = self._by_tick, self._listed_ticks, self._listed_from
        while i < len(by_tick):
            n = by_tick[i]
            if self.state[n] >= WARM or self.ticks[n] != listed[i]:
                if i == self._listed_from and by_tick is self._by_tick:
                    self._listed_from += 1  # gone for good from this listing
                i += 1
                continue
            found = self.table.eid_size(n)
            if found is not None:  # (a file of one block: its size on disk, as the policy counts it)
                yield (found[0], 0), allocated(found[1]), listed[i], self.whens[n]
            i += 1

    def warm(self, key: Hashable) -> bool:
        """Bring the entry of `key` (an (entry id, block) pair) into memory if it is cold;
        whether that block is held."""
        if not self.files:
            return False
        eid, block = cast(BlockKey, key)
        n = self.number(eid)
        if n is None:
            return False
        row = self.table.row(n) if self.state[n] < WARM else None  # (before the lock: may wait on the disk)
        with self._lock:
            row = self.take(n, row)
        return row is not None and 0 <= block < len(row.hashes) and row.hashes[block] is not None

    def take(self, n: int, row: Row | None = None) -> Row | None:
        """Bring record n into memory (the tier's entry and the policy's keys; `row`: the
        record already read); None if it was not cold, or fails its CRC (then it is
        counted as held until the next clean stop writes a table without it: the budget
        errs on the safe side)."""
        state = self.state[n]
        if state >= WARM:
            return None
        row = row or self.row(n)
        if row is None:
            self._gone(n)
            return None
        self.state[n] = WARM
        self.files -= 1
        held = block_bytes(row)
        self.count -= len(held)
        self.used -= sum(size for _, size in held)
        self._bring(n, row, state == TRUSTED, held)
        return row

    def _gone(self, n: int) -> None:
        self.state[n] = GONE
        self.files -= 1
        self._lost(self.table.eid_of(n))

    def cold(self, n: int) -> bool:
        return self.state[n] < WARM

    def trust(self, n: int) -> None:
        if self.state[n] == COLD:
            self.state[n] = TRUSTED

    def vouch(self, records: list[int]) -> int:
        """Records whose files a serving process found as the clean stop left them (its own
        test, at the open it registered a backing id for: Mapped.open_held) are trusted as
        the restart check would trust them; how many were still to check. `vouched` counts
        them (the restart check waits while it grows). The tier's lock held."""
        state, found = self.state, 0
        for n in records:
            if 0 <= n < len(state) and state[n] == COLD:
                state[n] = TRUSTED
                found += 1
        self.vouched += len(records)
        return found

    def oldest(self) -> Iterator[tuple[Hashable, int]]:
        """The cold blocks not read since the start in restore order (oldest `stored at`
        first), with their sizes. Records that leave the cold set meanwhile are skipped."""
        n = self._first
        while n < self.table.count:
            if self.state[n] >= WARM or self.ticks[n]:  # (a record read since is newer)
                if n == self._first:
                    self._first += 1
                n += 1
                continue
            row = self.table.row(n)
            if row is None:
                self._gone(n)
                n += 1
                continue
            for block, size in block_bytes(row):
                if self.state[n] >= WARM:
                    break
                yield (row.eid, block), size
            n += 1

    def keys(self) -> Iterator[Hashable]:
        """Every cold block, read since the start or not."""
        for _n, row, _ in self.rows():
            for block, _ in block_bytes(row):
                yield row.eid, block

    def cold_order(self) -> tuple[array[int], array[float]]:
        """The numbers of the records still cold, and each one's `stored at` as row() gives
        it (a clean stop sorts them by it without reading a row of each first)."""
        state, checked = self.state, self.checked
        numbers = array("I", (n for n in range(self.table.count) if state[n] < WARM))
        when = self.table.stored_ats()
        return numbers, array("d", (max(checked[n], 0.0) if checked[n] else when[n] for n in numbers))

    def rows(self) -> Iterator[tuple[int, Row, bool]]:
        """(record number, row, trusted by the restart check) of every record still cold,
        in restore order."""
        for n in range(self.table.count):
            if self.state[n] < WARM:
                row = self.row(n)
                if row is not None:
                    yield n, row, self.state[n] == TRUSTED


def _shape(row: Row) -> int:
    return SINGLE if len(row.hashes) == 1 and row.hashes[0] is not None else OTHER
