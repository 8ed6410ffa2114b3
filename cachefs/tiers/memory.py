"""The RAM tier: blocks in a byte-bounded LRU.

Invariants (checked by tests/test_tiers.py after every operation):
  - used_bytes == sum(len(v) for v in entries) <= capacity, at every moment;
  - a block larger than the whole tier is never admitted (and evicts nothing).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from cachefs.stats import Stats


class MemoryTier:
    name = "ram"

    def __init__(self, capacity: int, stats: Stats | None = None):
        self._capacity = int(capacity)
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self._stats = stats or Stats()
        self.on_evict: Callable[[bytes], None] | None = None  # told of every evicted key
        self._stats.gauge("ram.used_bytes", lambda: self._used)
        self._stats.gauge("ram.capacity_bytes", lambda: self._capacity)
        self._stats.gauge("ram.entries", lambda: len(self._entries))

    @property
    def used_bytes(self) -> int:
        return self._used

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
                self._entries.move_to_end(key)
        return data

    def put(self, key: bytes, data: bytes, evict: bool = True) -> bool:
        """Store a block; with evict=False only if it fits without evicting anything
        (read-ahead never pushes out data for a guess)."""
        size = len(data)
        if size > self._capacity:
            return False
        victims: list[bytes] = []
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._used -= len(old)
            if not evict and self._used + size > self._capacity:
                if old is not None:  # put back what was there
                    self._entries[key] = old
                    self._used += len(old)
                return False
            while self._used + size > self._capacity:
                victim, vdata = self._entries.popitem(last=False)
                self._used -= len(vdata)
                victims.append(victim)
            self._entries[key] = data
            self._used += size
        if victims:
            self._stats.incr("ram.evictions", len(victims))
            if self.on_evict is not None:
                for victim in victims:
                    self.on_evict(victim)
        return True

    def has_room(self, size: int) -> bool:
        return self._used + size <= self._capacity

    def discard(self, key: bytes) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._used -= len(old)

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._used = 0
