"""Admission and eviction for one cache tier, as pure bookkeeping: keys, sizes, a clock.

A tier (RAM or NVMe) owns the bytes and a lock; its Policy decides which keys to keep.
Nothing here does I/O or locking, so the same code runs in the daemon, in the unit tests
and in tools/simulate.py.

Policies:

- ``keep`` (the default): CoorDL's MinIO, admit until full, then keep what you have.
  Under random-permutation epochs every sample is read once per epoch, so which samples
  are cached does not matter, only that they stay until they are read again: the hit
  rate is then exactly cache/dataset, where LRU evicts exactly the samples about to be
  read. To still follow a real change of working set, an entry that has gone unread for
  IDLE_FACTOR times the mean reuse distance of the tier's hits (counted in accesses), or
  for longer than ``max_idle`` seconds, becomes a victim for a new block.
- ``lru``: least recently used, always admits.

In every policy, entries marked stale (their source file changed or vanished) go first.

Invariants, checked after every operation by tests/test_policy.py:
  - used == sum of the entries' sizes <= capacity;
  - a key is in at most one state (live or stale), and stale keys are entries.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable

from cachefs.config import DEFAULT_POLICY

# An entry is idle once unread for this many times the mean reuse distance of hits. In
# random-permutation epochs a cached sample's reuse distance is at most two epochs, with a
# mean of one, so a factor above 2 never evicts a live sample there; tools/simulate.py
# measures the trade-off against how fast a new working set gets in.
IDLE_FACTOR = 2.5
# The mean reuse distance is an exponential moving average over this many hits.
REUSE_WINDOW = 1024

POLICIES = ("keep", "lru")


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
        self.mean_reuse = 0.0  # EWMA of (tick of hit - tick of the entry's previous access)
        self._hits_seen = 0

    # -- queries -----------------------------------------------------------------------

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[Hashable]:
        return list(self._entries)

    def size_of(self, key: Hashable) -> int | None:
        entry = self._entries.get(key)
        return entry[0] if entry else None

    def has_room(self, size: int) -> bool:
        return self.used + size <= self.capacity

    # -- accesses ----------------------------------------------------------------------

    def hit(self, key: Hashable) -> None:
        """A read found `key` in the tier."""
        self._tick += 1
        entry = self._entries.get(key)
        if entry is None:
            return
        size, last, _ = entry
        reuse = self._tick - last
        self._hits_seen += 1
        weight = 1.0 / min(self._hits_seen, REUSE_WINDOW)
        self.mean_reuse += (reuse - self.mean_reuse) * weight
        self._entries[key] = (size, self._tick, self._clock())
        self._entries.move_to_end(key)

    def miss(self) -> None:
        """A read did not find its key in the tier."""
        self._tick += 1

    # -- changes -----------------------------------------------------------------------

    def admit(self, key: Hashable, size: int, evict: bool = True) -> list[Hashable] | None:
        """Make room for `key` and record it; returns the victims the tier must drop, or
        None if the block is refused. With evict=False (read-ahead, warming) only free room
        is used: a guess never pushes out cached data."""
        if size > self.capacity:
            return None
        if key in self._entries:
            self.remove(key)
        victims: list[Hashable] | None = []
        if self.used + size > self.capacity:
            if not evict:
                return None
            victims = self._victims(self.used + size - self.capacity)
            if victims is None:
                return None
            for victim in victims:
                self.remove(victim)
        self._entries[key] = (size, self._tick, self._clock())
        self.used += size
        return victims

    def remove(self, key: Hashable) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self.used -= entry[0]
        self._stale.pop(key, None)
        return True

    def mark_stale(self, key: Hashable) -> None:
        """The source file of `key` changed or vanished: evict it before anything else."""
        if key in self._entries:
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
        while freed < need and self._entries:
            key = next(iter(self._entries))
            freed += self._entries[key][0]
            victims.append(key)
            self.remove(key)
        return victims

    # -- policy ------------------------------------------------------------------------

    def _victims(self, need: int) -> list[Hashable] | None:
        raise NotImplementedError

    def _stale_victims(self, need: int) -> tuple[list[Hashable], int]:
        victims: list[Hashable] = []
        freed = 0
        for key in self._stale:
            if freed >= need:
                break
            victims.append(key)
            freed += self._entries[key][0]
        return victims, freed

    def idle_after(self) -> float:
        """Accesses without a read after which an entry counts as idle (inf: never)."""
        if self._hits_seen == 0:
            return float("inf")
        return IDLE_FACTOR * max(self.mean_reuse, 1.0)

    def is_idle(self, key: Hashable) -> bool:
        _, last, when = self._entries[key]
        if self.max_idle is not None and self._clock() - when > self.max_idle:
            return True
        return self._tick - last > self.idle_after()

    def check(self) -> None:
        """Assert the invariants (tests call this after every operation)."""
        assert self.used == sum(e[0] for e in self._entries.values()), "byte count drifted"
        assert 0 <= self.used <= self.capacity, f"used {self.used} > capacity {self.capacity}"
        assert all(k in self._entries for k in self._stale), "a stale key is not an entry"


class LRUPolicy(Policy):
    name = "lru"

    def _victims(self, need: int) -> list[Hashable] | None:
        victims, freed = self._stale_victims(need)
        chosen = set(victims)
        for key, (size, _, _) in self._entries.items():
            if freed >= need:
                break
            if key not in chosen:
                victims.append(key)
                freed += size
        return victims


class KeepPolicy(Policy):
    """MinIO with ageing: admit while there is room; when full, replace only stale or idle
    entries (oldest access first); otherwise refuse the new block."""

    name = "keep"

    def _victims(self, need: int) -> list[Hashable] | None:
        victims, freed = self._stale_victims(need)
        chosen = set(victims)
        for key, (size, _, _) in self._entries.items():
            if freed >= need:
                break
            if key in chosen:
                continue
            if not self.is_idle(key):
                break  # entries are in access order: nothing after this one is idle either
            victims.append(key)
            freed += size
        return victims if freed >= need else None


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
