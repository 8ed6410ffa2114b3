"""RAM in front of NVMe: a read is served RAM -> NVMe -> (caller fetches from the source).

The rule between the tiers (docs/design.md, "Cache policy"):
  - a block fetched from the source is offered to both tiers (NVMe asynchronously), and
    each tier's own policy decides whether to keep it: the tiers are inclusive;
  - an NVMe hit is promoted into RAM when the RAM policy admits it (with `keep`: while RAM
    has room, or holds stale or idle blocks to replace), so RAM holds the blocks that were
    read first and keep being read;
  - nothing is demoted: a block leaving RAM is already on NVMe if NVMe admitted it.
"""

from __future__ import annotations

from cachefs.stats import Stats
from cachefs.tiers.disk import DiskTier
from cachefs.tiers.memory import MemoryTier


class MultiLevelCache:
    def __init__(self, ram: MemoryTier, disk: DiskTier | None, stats: Stats):
        self.ram = ram
        self.disk = disk
        self._stats = stats

    def get_disk(self, key: bytes) -> bytes | None:
        """Look a block up on NVMe; a hit is promoted into RAM."""
        if self.disk is None:
            return None
        data = self.disk.get(key)
        if data is None:
            self._stats.incr("disk.misses")
            return None
        self._stats.incr("disk.hits")
        if self.ram.put(key, data):
            self._stats.incr("ram.promotions")
        return data

    def put(self, key: bytes, data: bytes, evict: bool = True) -> bool:
        """Store a block in RAM and (asynchronously) on NVMe. With evict=False (read-ahead,
        warming) each tier takes it only if it fits without evicting; returns whether any did."""
        in_ram = self.ram.put(key, data, evict)
        on_disk = self.disk.put(key, data, evict) if self.disk is not None else False
        return in_ram or on_disk

    def has_room(self, size: int) -> bool:
        return self.ram.has_room(size) or (self.disk is not None and self.disk.has_room(size))

    def contains(self, key: bytes) -> bool:
        """Cached in some tier, judged without I/O (see DiskTier.probably_has)."""
        return key in self.ram or (self.disk is not None and self.disk.probably_has(key))

    def mark_stale(self, key: bytes) -> None:
        """The block belongs to a version of a file that is gone: evict it first."""
        self.ram.mark_stale(key)
        if self.disk is not None:
            self.disk.mark_stale(key)

    def discard(self, key: bytes) -> None:
        self.ram.discard(key)
        if self.disk is not None:
            self.disk.discard(key)

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
        self.ram.close()
