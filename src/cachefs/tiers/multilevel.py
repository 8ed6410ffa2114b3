"""RAM in front of NVMe: a read is served RAM -> NVMe -> (caller fetches from the source).

The rule between the tiers (docs/design.md, "Cache policy"):
  - a block fetched from the source is offered to both tiers, and each tier's own policy
    decides whether to keep it: the tiers are inclusive;
  - an NVMe hit is promoted into RAM when the RAM policy admits it (with `keep`: while RAM
    has room, or holds stale or idle blocks to replace), so RAM holds the blocks that were
    read first and keep being read;
  - nothing is demoted: a block leaving RAM is already on NVMe if NVMe admitted it.

It is also the core's one view of the cache: whole files for passthrough come from here
(`backing`), RAM first.
"""

from __future__ import annotations

import os
from typing import NamedTuple

from cachefs.stats import Stats
from cachefs.tiers.disk import DiskTier
from cachefs.tiers.memory import MemoryTier
from cachefs.tiers.store import BlockKey, EntryInfo, FileStore


class Backing(NamedTuple):
    """A complete cached file the kernel may read directly: which tier, which file."""

    tier: FileStore
    path: str


class MultiLevelCache:
    def __init__(self, ram: MemoryTier, disk: DiskTier | None, stats: Stats):
        self.ram = ram
        self.disk = disk
        self._stats = stats

    def get_disk(self, key: BlockKey, promote: bool = True) -> bytes | None:
        """Look a block up on NVMe; a hit is promoted into RAM (if `promote`)."""
        if self.disk is None:
            return None
        data = self.disk.get(key)
        if data is None:
            self._stats.incr("disk.misses")
            return None
        self._stats.incr("disk.hits")
        if not promote:
            return data
        info = self.disk.info_of(key[0])
        if info is not None and self.ram.put(key, data, info):
            self._stats.incr("ram.promotions")
        return data

    def put(self, key: BlockKey, data: bytes, info: EntryInfo, evict: bool = True, to_ram: bool = True) -> bool:
        """Store a block in RAM and on NVMe (`to_ram` False: on NVMe only). With evict=False
        (read-ahead, warming) each tier takes it only if it fits without evicting; returns
        whether any did."""
        in_ram = self.ram.put(key, data, info, evict) if to_ram else False
        on_disk = self.disk.put(key, data, info, evict) if self.disk is not None else False
        return in_ram or on_disk

    def promote(self, eid: bytes, found: Backing) -> Backing | None:
        """Copy a whole file from NVMe into RAM when RAM has free room for it (an open of a
        file filled for passthrough, which went to NVMe only); its RAM copy, or None."""
        e = found.tier.entry(eid)
        info = found.tier.info_of(eid)
        if e is None or info is None or not self.ram.has_room(e.size):
            return None
        try:
            fd = os.open(found.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return None
        try:
            for index in range(len(e.hashes)):
                offset, length = e.extent(index)
                data = os.pread(fd, length, offset)
                if len(data) != length or not self.ram.put((eid, index), data, info, evict=False):
                    return None
            # the NVMe copy's pages would be a second copy in memory: the kernel reads RAM's now
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            return None
        finally:
            os.close(fd)
        self._stats.incr("ram.promotions")
        return self.backing(eid)

    def has_room(self, size: int) -> bool:
        return self.ram.has_room(size) or (self.disk is not None and self.disk.has_room(size))

    def contains(self, key: BlockKey) -> bool:
        """Cached in some tier, judged without I/O."""
        return key in self.ram or (self.disk is not None and self.disk.probably_has(key))

    def mark_stale(self, key: BlockKey) -> None:
        """The block belongs to a version of a file that is gone: evict it first."""
        self.ram.mark_stale(key)
        if self.disk is not None:
            self.disk.mark_stale(key)

    def discard(self, key: BlockKey) -> None:
        self.ram.discard(key)
        if self.disk is not None:
            self.disk.discard(key)

    def acquire_backing(self, eid: bytes) -> Backing | None:
        """backing() and the tier's acquire() in one step (release with the tier's release())."""
        for tier in (self.ram, self.disk):
            if tier is not None:
                path = tier.acquire_backing(eid)
                if path is not None:
                    return Backing(tier, path)
        return None

    def verify(self, eid: bytes) -> None:
        """Check an entry held since before the start (see FileStore.backing_file) now,
        so that the open that passes it through finds it checked."""
        for tier in (self.ram, self.disk):
            if tier is not None and tier.needs_check(eid):
                tier.backing_file(eid)

    def backing(self, eid: bytes) -> Backing | None:
        """A tier holding the whole file version `eid`, RAM first; None if none does."""
        for tier in (self.ram, self.disk):
            if tier is not None:
                path = tier.backing_file(eid)
                if path is not None:
                    return Backing(tier, path)
        return None

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
        self.ram.close()
