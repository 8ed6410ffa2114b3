"""Admission and eviction for one cache tier, as pure bookkeeping: keys, sizes, a clock.

A tier (RAM or NVMe) owns the bytes and a lock; its Policy decides which keys to keep.
Nothing here does I/O or locking, so the same code runs in the daemon, in the unit tests
and in tools/simulate.py.

Policies:

- ``keep`` (the default): CoorDL's MinIO, admit until full, then keep what you have.
  Under random-permutation epochs every sample is read once per epoch, so which samples
  are cached does not matter, only that they stay until they are read again: the hit
  rate is then exactly cache/dataset, where LRU evicts exactly the samples about to be
  read. A full tier replaces an entry only when it is *idle*, so that a new working set
  gets in:
    - steady: unread for IDLE_FACTOR times the longest recent reuse distance of the
      tier's hits (distances counted in accesses): in shuffled epochs that is two epochs,
      so a live sample is never taken for idle;
    - collapsed: when the tier's hit rate over the last window fell below a quarter of
      its long-run rate (the job moved to other data), unread for COLLAPSE_FACTOR times
      the mean reuse distance, about one epoch. The old set then leaves during the new
      set's first epoch, as fast as its entries pass one epoch unread; entries not read
      since the collapse began stay under this threshold after it ends;
    - and always: unread for longer than ``max_idle`` seconds.
- ``lru``: least recently used, always admits.

In every policy, entries marked stale (their source file changed or vanished) go first.

Pins (the sampler's order hint, cachefs/hints.py): a pinned entry is about to be read, so
no policy takes it as a victim; only a hard budget cut (`shrink`) may. `admit_pinned`
takes a hinted block in whatever the policy says: it replaces stale entries, then unpinned
ones in access order (oldest first), because a block known to be read next is worth more
than any guess about the rest. Pins are counted (two jobs may hint one block).

Invariants, checked after every operation by tests/test_policy.py:
  - used == sum of the entries' sizes <= capacity;
  - a key is in at most one state (live or stale), and stale keys are entries;
  - pinned keys are entries, and pinned_bytes == the sum of their sizes.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Protocol

from cachefs.config import DEFAULT_POLICY

# Idle thresholds (see the module docstring); tools/simulate.py measures them.
IDLE_FACTOR = 1.25       # x the longest of the last REUSE_SAMPLES reuse distances
COLLAPSE_FACTOR = 1.05   # x the mean reuse distance, while the hit rate has collapsed
REUSE_WINDOW = 1 << 20   # hits in the mean reuse distance's moving average, at most
REUSE_SAMPLES = 512      # recent reuse distances whose maximum sets the steady threshold
HIT_WINDOW_MIN = 64      # accesses per hit-rate window: at least this, and enough to expect
HIT_WINDOW_HITS = 32     # this many hits at the long-run rate (so noise is no collapse)
COLLAPSE_DROP = 0.25     # collapsed: window hit rate below this share of the long-run rate
COLLAPSE_MIN_HITS = 16   # ... and the long-run rate predicted at least this many hits
REUSE_MIN = 64           # a hit counts as a reuse only after this many accesses, and
REUSE_MIN_SHARE = 0.5    # this many per entry held: shorter is a re-read within one pass
                         # (a block read in pieces, two readers at once), not an epoch's

POLICIES = ("keep", "lru")


class Cold(Protocol):
    """Keys a tier restored at its start and has not brought into memory yet (the NVMe tier's
    entry table, cachefs/tiers/restored.py): held, counted in `used`, never stale or pinned.
    `warm(key)` brings the key's entry in (the tier calls `Policy.restore`) and says whether
    it was held. A hit may leave a key cold: `touch(key, tick, when)` records the access in
    the cold set's own columns and returns the key's tick before (0: not read since the
    start; -1: cooled as fetched ahead, first read now), or None if the key cannot stay cold
    (not held there, or not a whole file of one block; it is then brought in). `oldest()`
    yields the cold keys not read since the start, older than every other, in restore order
    with their sizes; `read_oldest()` those read since, as (key, size, tick, when), oldest
    tick first (a key read again since it was listed is left out: it is newer);
    `access(key)` a cold key's (tick, when), or None; `holds(key)` whether a key is held
    there (not brought in); `keys()` every cold key."""

    count: int
    used: int

    def warm(self, key: Hashable) -> bool: ...

    def touch(self, key: Hashable, tick: int, when: float) -> int | None: ...

    def holds(self, key: Hashable) -> bool: ...

    def oldest(self) -> Iterator[tuple[Hashable, int]]: ...

    def read_oldest(self) -> Iterator[tuple[Hashable, int, int, float]]: ...

    def access(self, key: Hashable) -> tuple[int, float] | None: ...

    def keys(self) -> Iterator[Hashable]: ...


class Policy:
    """Base: entries in access order (oldest first), byte accounting, stale marks."""

    name = "base"

    def __init__(self, capacity: int, max_idle: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.capacity = int(capacity)
        self.used = 0
        self.max_idle = max_idle
        self._clock = clock
        self._tick = 0  # one per access (hit or miss)
        # key -> (size, tick of last access, clock time of last access), oldest access first
        self._entries: OrderedDict[Hashable, tuple[int, int, float]] = OrderedDict()
        self._stale: dict[Hashable, None] = {}  # insertion-ordered set
        self._unread: set[Hashable] = set()  # admitted by a guess (read-ahead), not read yet
        self._pins: dict[Hashable, int] = {}  # key -> pin count (hinted, not read yet)
        self.pinned_bytes = 0
        self.mean_reuse = 0.0  # EWMA of (tick of hit - tick of the entry's previous access)
        self._hits_seen = 0
        self._reuses: deque[int] = deque(maxlen=REUSE_SAMPLES)
        self._max_reuse = 0
        # hit rate: of the current window, and its long-run average (an EWMA over windows)
        self._window_hits = 0
        self._window_accesses = 0
        self.long_run_hit_rate = 0.0
        self.collapsed = False
        self._collapsed_for = 0  # accesses since the collapse began
        self._collapse_tick = -1  # tick at which the latest collapse began
        self._window_length = HIT_WINDOW_MIN
        self._cold: Cold | None = None
        self._cold_when = 0.0  # clock time the cold keys count as last accessed

    # -- keys restored at a start, kept out of memory until touched ---------------------------

    def attach_cold(self, cold: Cold) -> None:
        """Hold `cold`'s keys as if admitted now, before any access (see Cold)."""
        self._cold = cold
        self._cold_when = self._clock()
        self.used += cold.used

    def restore(self, items: list[tuple[Hashable, int]], tick: int = 0, when: float = 0.0,
                unread: bool = False) -> None:
        """Keys of the cold set, brought into memory (their bytes already counted): the
        oldest entries if not read since the start, else the newest, as last read at `tick`
        and `when` (among the entries read since, one brought in is a little out of access
        order: its tick says when it was read, and the idle test goes by that); `unread`:
        cooled as fetched ahead and not read since (its first read is no reuse)."""
        for key, size in items:
            self._entries[key] = (size, tick, when or self._cold_when)
            if not tick:
                self._entries.move_to_end(key, last=False)
            if unread:
                self._unread.add(key)

    def cool(self, key: Hashable) -> tuple[int, int, float, bool] | None:
        """Hand `key` to the cold set (attached): out of memory, its bytes still counted
        (the cold set adds them to its own): (its size, tick and clock time of its last
        access, whether it was fetched ahead and not read since), or None if it stays (not
        in memory, pinned or stale). A file fetched ahead goes too: directory read-ahead
        outran a shuffled epoch over local disk, and 53,000 of 100,000 files were waiting
        for their first read at the checkpoint, kept in memory for the rest of the mount."""
        entry = self._entries.get(key)
        if entry is None or self._cold is None or key in self._pins or key in self._stale:
            return None
        del self._entries[key]
        unread = key in self._unread
        if unread:
            self._unread.discard(key)
        return entry[0], entry[1], entry[2], unread

    def compact(self) -> None:
        """Rebuild the entries' table after many left (cool): a dict keeps its table's size
        as keys go, and 200,000 cooled keys had left ~15 MB of it (a set too: the unread)."""
        self._entries = OrderedDict(self._entries)
        self._unread = set(self._unread)

    def _held(self, key: Hashable) -> bool:
        """Whether `key` is held; a cold key is brought into memory first."""
        if key in self._entries:
            return True
        cold = self._cold
        # (after warm() took the tier's lock, a key another thread brought in is in memory)
        return cold is not None and cold.count > 0 and (cold.warm(key) or key in self._entries)

    def _cold_keys(self) -> Iterator[tuple[Hashable, int]]:
        """The cold keys not read since the start (the oldest of all), with their sizes."""
        cold = self._cold
        if cold is not None and cold.count > 0:
            yield from cold.oldest()

    def _by_access(self) -> Iterator[tuple[Hashable, int, int, float]]:
        """Every key but those of _cold_keys as (key, size, tick, when), oldest access first:
        the entries in memory and the cold keys read since the start, merged by tick."""
        cold = self._cold
        entries = ((key, size, tick, when) for key, (size, tick, when) in self._entries.items())
        if cold is None or cold.count == 0:
            return entries
        return heapq.merge(cold.read_oldest(), entries, key=lambda item: item[2])

    # -- queries -----------------------------------------------------------------------

    def __contains__(self, key: Hashable) -> bool:
        if key in self._entries:
            return True
        cold = self._cold  # (a key brought in while asked is in the entries after holds)
        return cold is not None and (cold.holds(key) or key in self._entries)

    def __len__(self) -> int:
        return len(self._entries) + (self._cold.count if self._cold is not None else 0)

    def keys(self) -> list[Hashable]:
        cold = self._cold
        return (list(cold.keys()) if cold is not None and cold.count > 0 else []) + list(self._entries)

    def has_room(self, size: int) -> bool:
        return self.used + size <= self.capacity

    # -- accesses ----------------------------------------------------------------------

    def hit(self, key: Hashable) -> None:
        """A read found `key` in the tier."""
        self.hit_many((key,))

    def hit_many(self, keys: Iterable[Hashable]) -> None:
        """hit() for each of `keys` in turn (the blocks of the opens a serving process
        reported: about a tenth of the daemon's time in the epoch after a checkpoint went
        to one call per block), the clock read once."""
        entries, unread, now, cold = self._entries, self._unread, self._clock(), self._cold
        for key in keys:
            entry = entries.get(key)
            if entry is None:
                # a cold key read stays cold (its access in the cold set's columns, no
                # object per file); one that cannot is brought into memory
                before = cold.touch(key, self._tick + 1, now) if cold is not None and cold.count else None
                if before is not None:
                    self._access(1)
                    if before < 0:
                        continue  # cooled as fetched ahead, read now: a first read, no reuse
                    reuse = self._tick - before
                elif not self._held(key):
                    self.miss()
                    continue
                else:
                    entry = entries[key]
            if entry is not None:
                self._access(1)
                reuse = self._tick - entry[1]
                entries[key] = (entry[0], self._tick, now)
                entries.move_to_end(key)
                if unread and key in unread:
                    unread.discard(key)  # fetched ahead, now read: a first read, no reuse
                    continue
            held = len(entries) + (cold.count if cold is not None else 0)
            if reuse < REUSE_MIN or reuse < REUSE_MIN_SHARE * held:
                continue  # a re-read within one pass (a block read in pieces, two readers at once)
            self._reused(reuse, held)

    def _reused(self, reuse: int, held: int) -> None:
        """A hit `reuse` accesses after the entry's previous one, with `held` entries."""
        self._hits_seen += 1
        # averaged over about four passes over the tier's entries: within one epoch, early
        # hits have short reuse distances and late ones long, and the mean must not swing
        weight = 1.0 / min(self._hits_seen, max(HIT_WINDOW_MIN, min(REUSE_WINDOW, 4 * held)))
        self.mean_reuse += (reuse - self.mean_reuse) * weight
        if len(self._reuses) == REUSE_SAMPLES and self._reuses[0] == self._max_reuse:
            self._reuses.append(reuse)
            self._max_reuse = max(self._reuses)  # the maximum left the window
        else:
            self._reuses.append(reuse)
            self._max_reuse = max(self._max_reuse, reuse)

    def miss(self) -> None:
        """A read did not find its key in the tier."""
        self._access(0)

    def _access(self, hit: int) -> None:
        self._tick += 1
        self._window_hits += hit
        self._window_accesses += 1
        if self._window_accesses >= self._window_length:
            self._end_window()

    def _end_window(self) -> None:
        n = self._window_accesses
        rate = self._window_hits / n
        expected = self.long_run_hit_rate * n
        self.collapsed = expected >= COLLAPSE_MIN_HITS and rate < COLLAPSE_DROP * self.long_run_hit_rate
        if self.collapsed:
            if self._collapsed_for == 0:
                self._collapse_tick = self._tick - n
            self._collapsed_for += n
        else:
            self._collapsed_for = 0
        # The long-run rate follows over about two epochs (two mean reuse distances). It
        # holds still for the first two epochs of a collapse, the time the old set needs to
        # leave; after that, a new working set that hits less is the new normal.
        if self._collapsed_for == 0 or self._collapsed_for > 2 * self.mean_reuse:
            alpha = min(1.0, n / max(2 * self.mean_reuse, 2 * n))
            self.long_run_hit_rate += (rate - self.long_run_hit_rate) * alpha
        self._window_hits = self._window_accesses = 0
        # long enough to expect HIT_WINDOW_HITS hits, short enough to see a collapse
        # within a quarter of an epoch
        cap = max(HIT_WINDOW_MIN, int(self.mean_reuse / 4))
        self._window_length = min(cap, max(HIT_WINDOW_MIN, int(HIT_WINDOW_HITS / max(self.long_run_hit_rate, 1e-3))))

    # -- changes -----------------------------------------------------------------------

    def admit(self, key: Hashable, size: int, evict: bool = True) -> list[Hashable] | None:
        """Make room for `key` and record it; returns the victims the tier must drop, or
        None if the block is refused. With evict=False (read-ahead, warming) only free room
        is used: a guess never pushes out cached data."""
        return self._admit(key, size, evict, None)

    def admit_pinned(self, key: Hashable, size: int, pin_limit: int) -> list[Hashable] | None:
        """Admit a hinted block, pinned: room comes from stale entries, then unpinned ones
        oldest access first, whatever the policy. None (refused) if the pins would exceed
        `pin_limit` bytes or everything else is pinned."""
        return self._admit(key, size, True, pin_limit)

    def _admit(self, key: Hashable, size: int, evict: bool, pin_limit: int | None) -> list[Hashable] | None:
        """admit (pin_limit None) and admit_pinned (room taken oldest access first, then
        pinned, within `pin_limit` bytes of pins)."""
        if self._held(key):
            self.remove(key)  # a re-put replaces: refused, the key is not held at all
        pinned = pin_limit is not None
        if size > self.capacity or (pin_limit is not None and self.pinned_bytes + size > pin_limit):
            return None
        victims: list[Hashable] | None = []
        need = self.used + size - self.capacity
        if need > 0:
            if not evict:
                return None
            victims = self._lru_victims(need) if pinned else self._victims(need)
            if victims is None:
                return None
            for victim in victims:
                self.remove(victim)
        self._entries[key] = (size, self._tick, self._clock())
        self.used += size
        if pinned or not evict:
            self._unread.add(key)  # fetched ahead or hinted: its first read is no reuse
        if pinned:
            self.pin(key)
        return victims

    def pin(self, key: Hashable) -> bool:
        """Keep `key` until unpin(); False if it is not held."""
        if not self._held(key):
            return False
        entry = self._entries[key]
        count = self._pins.get(key, 0)
        if count == 0:
            self.pinned_bytes += entry[0]
        self._pins[key] = count + 1
        return True

    def unpin(self, key: Hashable) -> None:
        count = self._pins.get(key)
        if count is None:
            return
        if count > 1:
            self._pins[key] = count - 1
        else:
            del self._pins[key]
            self.pinned_bytes -= self._entries[key][0]

    def is_pinned(self, key: Hashable) -> bool:
        return key in self._pins

    def remove(self, key: Hashable) -> bool:
        if not self._held(key):
            return False
        entry = self._entries.pop(key)
        self.used -= entry[0]
        self._stale.pop(key, None)
        self._unread.discard(key)
        if self._pins.pop(key, None) is not None:
            self.pinned_bytes -= entry[0]
        return True

    def mark_stale(self, key: Hashable) -> None:
        """The source file of `key` changed or vanished: evict it before anything else."""
        if self._held(key):
            self._stale[key] = None

    def shrink(self, need: int) -> list[Hashable]:
        """Free at least `need` bytes whatever the policy (a hard budget beats any policy):
        stale entries first, then the least recently used. Returns the removed keys."""
        victims: list[Hashable] = []
        freed = 0
        for key in list(self._stale):
            if freed >= need:
                break
            freed += self._entries[key][0]
            victims.append(key)
            self.remove(key)
        for key, size in self._cold_keys():  # the oldest: restored at the start, not read since
            if freed >= need:
                return victims
            freed += size
            victims.append(key)
            self.remove(key)
        for pinned_too in (False, True):  # pins go last: a hard budget beats a hint
            chosen = []  # (removed after the walk, which reads the entries as it goes)
            for key, size, _, _ in self._by_access():
                if freed >= need:
                    break
                if pinned_too or key not in self._pins:
                    chosen.append(key)
                    freed += size
            for key in chosen:
                self.remove(key)
            victims += chosen
            if freed >= need:
                break
        return victims

    # -- policy ------------------------------------------------------------------------

    def _victims(self, need: int) -> list[Hashable] | None:
        raise NotImplementedError

    def _lru_victims(self, need: int, usable: Callable[[Hashable, int, float], bool] | None = None,
                     ) -> list[Hashable] | None:
        """Stale entries, then unpinned ones oldest access first, up to the first one that is
        not `usable` (entries are in access order: with an age test, none after it is usable
        either); None if they cannot free `need`."""
        victims, freed = self._stale_victims(need)
        chosen = set(victims)
        for key, size in self._cold_keys():  # older than every key in memory (never stale or pinned)
            if freed >= need:
                return victims
            if usable is not None and not usable(key, 0, self._cold_when):
                return None
            victims.append(key)
            freed += size
        for key, size, tick, when in self._by_access():
            if freed >= need:
                break
            if key in chosen or key in self._pins:
                continue
            if usable is not None and not usable(key, tick, when):
                break
            victims.append(key)
            freed += size
        return victims if freed >= need else None

    def _stale_victims(self, need: int) -> tuple[list[Hashable], int]:
        victims: list[Hashable] = []
        freed = 0
        for key in self._stale:
            if freed >= need:
                break
            if key in self._pins:
                continue
            victims.append(key)
            freed += self._entries[key][0]
        return victims, freed

    def idle_after(self, last: int | None = None) -> float:
        """Accesses without a read after which an entry last read at tick `last` counts as
        idle (inf: never). An entry not read since the latest collapse began belongs to the
        old working set: it is judged by the collapse threshold even after the new set's
        hits ended the collapse, so the old set's last entries leave within an epoch."""
        if self._hits_seen == 0:
            return float("inf")
        steady = IDLE_FACTOR * max(self._max_reuse, 1)
        if self.collapsed or (last is not None and last < self._collapse_tick):
            # Never below one reuse distance: sequential epochs "collapse" every epoch while
            # they read past the cached share, and an entry read at the start of an epoch
            # is read again one epoch later; any shorter threshold would evict it first.
            # Never above the steady threshold, so that older entries are idle first and
            # entries, kept in access order, stay in idle order.
            return min(COLLAPSE_FACTOR * max(self.mean_reuse, 1.0), steady)
        return steady

    def is_idle(self, key: Hashable, last: int | None = None, when: float | None = None) -> bool:
        """Whether `key` (last read at tick `last`, clock time `when`, where the caller knows)
        counts as idle."""
        if last is None or when is None:
            entry = self._entries.get(key)
            cold = self._cold.access(key) if entry is None and self._cold is not None else None
            last, when = (entry[1], entry[2]) if entry is not None else cold or (0, self._cold_when)
        if when == 0.0:
            when = self._cold_when  # (a cold key not read since the start)
        if self.max_idle is not None and self._clock() - when > self.max_idle:
            return True
        return self._tick - last > self.idle_after(last)

    def check(self) -> None:
        """Assert the invariants (tests call this after every operation)."""
        cold = self._cold.used if self._cold is not None else 0
        assert self.used == cold + sum(e[0] for e in self._entries.values()), "byte count drifted"
        assert 0 <= self.used <= self.capacity, f"used {self.used} > capacity {self.capacity}"
        assert all(k in self._entries for k in self._stale), "a stale key is not an entry"
        assert all(k in self._entries for k in self._unread), "an unread key is not an entry"
        assert all(k in self._entries for k in self._pins), "a pinned key is not an entry"
        assert self.pinned_bytes == sum(self._entries[k][0] for k in self._pins), "pinned bytes drifted"


class LRUPolicy(Policy):
    name = "lru"

    def _victims(self, need: int) -> list[Hashable] | None:
        return self._lru_victims(need)


class KeepPolicy(Policy):
    """MinIO with ageing: admit while there is room; when full, replace only stale or idle
    entries (oldest access first); otherwise refuse the new block."""

    name = "keep"

    def _victims(self, need: int) -> list[Hashable] | None:
        return self._lru_victims(need, usable=self.is_idle)


def make_policy(name: str, capacity: int, max_idle: float | None = None,
                clock: Callable[[], float] = time.monotonic) -> Policy:
    classes: dict[str, type[Policy]] = {"keep": KeepPolicy, "lru": LRUPolicy}
    if name not in classes:
        raise ValueError(f"unknown policy {name!r} (choose from {', '.join(POLICIES)})")
    return classes[name](capacity, max_idle=max_idle, clock=clock)


def parse_policy_spec(text: str) -> dict[str, str]:
    """'keep' -> both tiers; 'ram=lru,disk=keep' -> per tier. Raises ValueError."""
    text = text.strip()
    if "=" not in text:
        if text not in POLICIES:
            raise ValueError(f"unknown policy {text!r} (choose from {', '.join(POLICIES)})")
        return {"ram": text, "disk": text}
    out = {"ram": DEFAULT_POLICY, "disk": DEFAULT_POLICY}
    for part in text.split(","):
        tier, _, name = part.partition("=")
        tier, name = tier.strip(), name.strip()
        if tier not in out:
            raise ValueError(f"unknown tier {tier!r} in {text!r} (tiers: ram, disk)")
        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r} (choose from {', '.join(POLICIES)})")
        out[tier] = name
    return out
