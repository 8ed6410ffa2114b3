"""A bounded TTL cache of path -> value: the daemon's attributes, listings and extended
attributes (cachefs/metadata.py)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable


class TTLCache:
    """A bounded map of path -> (expiry, value), the oldest stored dropped first. Values may
    be an errno (negative entry)."""

    def __init__(self, max_entries: int, clock: Callable[[], float]):
        self._data: OrderedDict[str, tuple[float, object]] = OrderedDict()
        self._peak = 0  # the most entries since the map was last rebuilt (see _shrink)
        self._max = max_entries
        self._clock = clock
        self._lock = threading.Lock()

    def get(self, key: str) -> object | None:
        # No lock and no reordering: a lookup is a dict read (atomic), and the entries are
        # dropped oldest-stored first (put moves an entry to the end).
        hit = self._data.get(key)
        if hit is None or hit[0] < self._clock():
            return None  # an expired entry stays, for get_stale, until pushed out
        return hit[1]

    def get_stale(self, key: str) -> object | None:
        """The entry even if expired: what to serve while the source does not answer."""
        with self._lock:
            hit = self._data.get(key)
            return None if hit is None else hit[1]

    def put(self, key: str, value: object, ttl: float) -> None:
        if ttl <= 0:
            return
        with self._lock:
            self._data[key] = (self._clock() + ttl, value)
            self._data.move_to_end(key)
            while len(self._data) > self._max:
                self._data.popitem(last=False)
            self._peak = max(self._peak, len(self._data))

    def expiry(self, key: str) -> tuple[object, float] | None:
        """The entry's value and when it expires (the clock's time), if it is there, not
        expired, and not a negative entry."""
        hit = self._data.get(key)
        if hit is None or hit[0] < self._clock() or isinstance(hit[1], int):
            return None
        return hit[1], hit[0]

    def pop(self, key: str) -> None:
        if key not in self._data:  # (no lock to take for what is not there)
            return
        with self._lock:
            if self._data.pop(key, None) is not None:
                self._shrink()

    def discard(self, key: str, value: object) -> None:
        """Drop the entry if it holds `value` (not one put since)."""
        with self._lock:
            hit = self._data.get(key)
            if hit is not None and hit[1] == value:
                del self._data[key]
                self._shrink()

    def _shrink(self) -> None:
        """A dict keeps its table's size as keys go: the map is rebuilt once fewer than an
        eighth of its peak are left (lock held). A cold epoch puts each file's attributes
        and takes them out as the tier stores the file: at 200,000 files the emptied table
        had held ~60 bytes per file. (get() reads either map: the same entries.)"""
        if self._peak > 1024 and len(self._data) * 8 < self._peak:
            self._data = OrderedDict(self._data)
            self._peak = len(self._data)

    def __len__(self) -> int:
        return len(self._data)
