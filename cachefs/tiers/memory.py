"""The RAM tier: blocks in a byte-bounded LRU.

Invariants (checked by tests/test_tiers.py after every operation):
  - used_bytes == sum(len(v) for v in entries) <= capacity, at every moment;
  - a block larger than the whole tier is never admitted (and evicts nothing).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from cachefs.stats import Stats


class MemoryTier:
    name = "ram"

    def __init__(self, capacity: int, stats: Stats | None = None):
        self._capacity = int(capacity)
        self._entries: OrderedDict[bytes, bytes] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        self._stats = stats or Stats()
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

    def put(self, key: bytes, data: bytes) -> bool:
        size = len(data)
        if size > self._capacity:
            return False
        evicted = 0
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._used -= len(old)
            while self._used + size > self._capacity:
                _, victim = self._entries.popitem(last=False)
                self._used -= len(victim)
                evicted += 1
            self._entries[key] = data
            self._used += size
        if evicted:
            self._stats.incr("ram.evictions", evicted)
        return True

    def discard(self, key: bytes) -> None:
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._used -= len(old)

    def close(self) -> None:
        with self._lock:
            self._entries.clear()
            self._used = 0
