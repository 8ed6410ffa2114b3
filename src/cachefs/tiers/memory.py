"""The RAM tier: blocks in a dict, bounded in bytes, kept or evicted by a Policy.

Invariants (checked by tests/test_tiers.py after every operation):
  - used_bytes == sum(len(v) for v in entries) <= capacity, at every moment;
  - a block larger than the whole tier is never admitted (and evicts nothing);
  - the blocks held are exactly the policy's keys.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from cachefs.policy import DEFAULT_POLICY, Policy, make_policy
from cachefs.stats import Stats


class MemoryTier:
    name = "ram"

    def __init__(self, capacity: int, stats: Stats | None = None, policy: str | Policy = DEFAULT_POLICY,
                 max_idle: float | None = None):
        self._capacity = int(capacity)
        self.policy = policy if isinstance(policy, Policy) else make_policy(policy, self._capacity, max_idle)
        self._entries: dict[bytes, bytes] = {}
        self._lock = threading.Lock()
        self._stats = stats or Stats()
        self.on_evict: Callable[[bytes], None] | None = None  # told of every evicted key
        self._stats.gauge("ram.used_bytes", lambda: self.policy.used)
        self._stats.gauge("ram.capacity_bytes", lambda: self._capacity)
        self._stats.gauge("ram.entries", lambda: len(self._entries))

    @property
    def used_bytes(self) -> int:
        return self.policy.used

    @property
    def capacity(self) -> int:
        return self._capacity

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            data = self._entries.get(key)
            if data is not None:
                self.policy.hit(key)
            else:
                self.policy.miss()
        return data

    def peek(self, key: bytes) -> bytes | None:
        """The block if held, without counting an access (a re-check, not a read)."""
        return self._entries.get(key)

    def put(self, key: bytes, data: bytes, evict: bool = True) -> bool:
        """Store a block if the policy admits it; with evict=False only into free room
        (read-ahead never pushes out data for a guess)."""
        with self._lock:
            victims = self.policy.admit(key, len(data), evict)
            self._store(key, data, victims)
        return self._admitted(victims, "ram.refused" if evict else "ram.no_room")

    def put_pinned(self, key: bytes, data: bytes, pin_limit: int) -> bool:
        """Store a hinted block, pinned until unpin(): it replaces unpinned blocks, oldest
        access first, whatever the policy (see Policy.admit_pinned). False if refused."""
        with self._lock:
            victims = self.policy.admit_pinned(key, len(data), pin_limit)
            self._store(key, data, victims)
        return self._admitted(victims, "ram.refused")

    def _store(self, key: bytes, data: bytes, victims: list | None) -> None:
        """Apply the policy's decision (lock held)."""
        if victims is None:
            if key not in self.policy:  # a refused re-put also dropped the old copy
                self._entries.pop(key, None)
            return
        for victim in victims:
            del self._entries[victim]
        self._entries[key] = data

    def _admitted(self, victims: list | None, refused: str) -> bool:
        if victims is None:
            self._stats.incr(refused)
            return False
        if victims:
            self._stats.incr("ram.evictions", len(victims))
            if self.on_evict is not None:
                for victim in victims:
                    self.on_evict(victim)
        return True

    def pin(self, key: bytes) -> bool:
        """Hold a cached block until unpin(); False if it is not cached."""
        with self._lock:
            return self.policy.pin(key)

    def unpin(self, key: bytes) -> None:
        with self._lock:
            self.policy.unpin(key)

    @property
    def pinned_bytes(self) -> int:
        return self.policy.pinned_bytes

    def has_room(self, size: int) -> bool:
        return self.policy.has_room(size)

    def discard(self, key: bytes) -> None:
        with self._lock:
            if self._entries.pop(key, None) is not None:
                self.policy.remove(key)

    def mark_stale(self, key: bytes) -> None:
        with self._lock:
            self.policy.mark_stale(key)

    def check(self) -> None:
        with self._lock:
            self.policy.check()
            assert set(self._entries) == set(self.policy.keys()), "tier and policy disagree"
            assert self.policy.used == sum(len(v) for v in self._entries.values())

    def close(self) -> None:
        with self._lock:
            for key in list(self._entries):
                self.policy.remove(key)
            self._entries.clear()
