"""The one door to the tiers: RAM -> NVMe -> shared (memcached) -> the caller's source.

Nothing outside `cachefs/tiers/` names a tier: the core, the file system, hints, coverage
and the fetch processes ask this class, which owns

  - the lookup order (`get_local`: RAM, then NVMe; `get_remote`: the shared tier, then the
    source the caller passes), and the hit and miss counters of each step;
  - promotion: an NVMe hit is promoted into RAM when the RAM policy admits it, so RAM holds
    the blocks that were read first and keep being read; a whole file opened again is
    copied into RAM when RAM has free room for it (`open_backing`);
  - admission: a block fetched from the source is offered to every local tier, and each
    tier's own policy decides whether to keep it (the tiers are inclusive; nothing is
    demoted: a block leaving RAM is already on NVMe if NVMe admitted it), then queued for
    the shared tier;
  - pinning (order hints) and the room fetch processes hold while they write.

Adding a tier (a second NVMe disk, say) is a change to this package and to the options:
docs/design.md, "Where does a change go".
"""

from __future__ import annotations

import logging
import os
from array import array
from collections.abc import Callable
from typing import NamedTuple

from cachefs.errors import TierError
from cachefs.identity import Attr, BlockKey, EntryInfo
from cachefs.stats import Stats
from cachefs.tiers import Tier
from cachefs.tiers.disk import DiskTier
from cachefs.tiers.entry import allocated
from cachefs.tiers.memory import MemoryTier
from cachefs.tiers.promote import Promoter
from cachefs.tiers.shared import SharedTier
from cachefs.tiers.store import FileStore

log = logging.getLogger(__name__)


class TableFile(NamedTuple):
    """A record of the NVMe tier's entry table, as the file system's table nodes need it."""

    path: str
    attr: Attr
    eid: bytes


class Backing(NamedTuple):
    """A complete cached file the kernel may read directly, held in its tier (not punched
    or deleted) until released. `in_ram`: it is the RAM tier's copy."""

    tier: FileStore
    path: str
    eid: bytes

    @property
    def in_ram(self) -> bool:
        return isinstance(self.tier, MemoryTier)

    def hold(self) -> None:
        """One more hold on the file (released by one more release())."""
        self.tier.acquire(self.eid)

    def release(self) -> None:
        self.tier.release(self.eid)


# The hit and miss counters a read that waited for another thread's fetch adds, by the
# tier that fetch found the block in ("ram": it landed in RAM meanwhile).
_WAITED = {
    "ram": {"reads.inflight_waits": 1, "ram.hits": 1},
    "disk": {"reads.inflight_waits": 1, "ram.misses": 1, "disk.hits": 1},
    "source": {"reads.inflight_waits": 1, "ram.misses": 1, "disk.misses": 1},
    "shared": {"reads.inflight_waits": 1, "ram.misses": 1, "disk.misses": 1},
}
_WAITED_NO_DISK = dict(_WAITED, source={"reads.inflight_waits": 1, "ram.misses": 1},
                       shared={"reads.inflight_waits": 1, "ram.misses": 1})


class MultiLevelCache:
    def __init__(self, ram: MemoryTier, disk: DiskTier | None, stats: Stats, shared: SharedTier | None = None):
        self.ram = ram
        self.disk = disk
        self.shared = shared
        self._stats = stats
        self._local: tuple[FileStore, ...] = (ram, disk) if disk is not None else (ram,)
        self._chain: tuple[Tier, ...] = (*self._local, *((shared,) if shared is not None else ()))
        self._waited = _WAITED if disk is not None else _WAITED_NO_DISK
        self._promoter = Promoter(ram, disk, stats) if disk is not None else None

    # -- what the cache is --------------------------------------------------------------------

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The tiers in lookup order."""
        return self._chain

    @property
    def has_disk(self) -> bool:
        """Whether there is an NVMe tier (files fetched whole for passthrough go there)."""
        return self.disk is not None

    @property
    def remembers(self) -> bool:
        """Whether the NVMe tier holds entries from before this start (see indexed_attr)."""
        return self.disk is not None and len(self.disk) > 0

    @property
    def listings_dir(self) -> str | None:
        """Where listings are kept (cachefs/listings.py): beside the NVMe tier's files, in
        its budget; None without an NVMe tier."""
        return os.path.join(self.disk.directory, "listings") if self.disk is not None else None

    @property
    def shares(self) -> bool:
        return self.shared is not None

    @property
    def shared_namespace(self) -> str:
        return self.shared.namespace if self.shared is not None else ""

    @property
    def scratch_dir(self) -> str:
        """A directory on the RAM tier's filesystem (the file system's backing-file probe)."""
        return self.ram.directory

    @property
    def fill_dir(self) -> str:
        """Where fetch processes write the files they fill (the NVMe tier's data directory,
        in the store's own layout: cachefs/tiers/layout.py)."""
        assert self.disk is not None
        return self.disk.data_dir

    @property
    def ram_fill_dir(self) -> str | None:
        """Where fetch processes write a fill's RAM copy (the RAM tier's data directory);
        None if RAM takes nothing."""
        return self.ram.data_dir if self.ram.capacity > 0 else None

    # -- blocks -------------------------------------------------------------------------------

    def _failed(self, tier: Tier, exc: TierError) -> None:
        """A tier raised instead of answering: a miss (or a put not taken), counted."""
        self._stats.incr(f"{tier.name}.errors")
        log.debug("%s tier failed: %s", tier.name, exc)

    def get_ram(self, key: BlockKey, lo: int = 0, hi: int | None = None) -> bytes | None:
        """A reader's first look: bytes [lo:hi] of the block if RAM holds it (counted a RAM hit)."""
        try:
            data = self.ram.get(key, lo, hi)
        except TierError as exc:
            self._failed(self.ram, exc)
            return None
        if data is not None:
            self._stats.incr("ram.hits")
        return data

    def count_ram_miss(self) -> None:
        self._stats.incr("ram.misses")

    def count_waited(self, tier: str) -> None:
        """A reader waited for another thread's fetch, which found the block in `tier`:
        counted where it was found (a wait for an NVMe hit was served by the cache)."""
        self._stats.add_many(self._waited[tier])

    def get_local(self, key: BlockKey, promote: bool = True) -> tuple[bytes, str] | None:
        """The whole block from this node's tiers, RAM first, and the tier's name; an NVMe
        hit is promoted into RAM (if `promote`)."""
        try:
            data = self.ram.peek(key)
        except TierError as exc:
            self._failed(self.ram, exc)
            data = None
        if data is not None:
            return data, "ram"
        disk = self.disk
        if disk is None:
            return None
        try:
            data = disk.get(key)
        except TierError as exc:
            self._failed(disk, exc)
            data = None
        if data is None:
            self._stats.incr("disk.misses")
            return None
        self._stats.incr("disk.hits")
        if promote:
            info = disk.info_of(key[0])
            if info is not None and self.ram.put(key, data, info):
                self._stats.incr("ram.promotions")
        return data, "disk"

    def get_remote(self, key: BlockKey, info: EntryInfo, fetch: Callable[[], bytes],
                   share_wait: float = 0.0) -> tuple[bytes, str]:
        """A block missing from this node: from the shared tier if it has it ("shared"),
        else `fetch()` from the source ("source"), then queued for the shared tier (waiting
        up to `share_wait` seconds for room in its queue)."""
        shared = self.shared
        if shared is None:
            return fetch(), "source"
        data = self.get_shared(key, info)
        if data is not None:
            return data, "shared"
        data = fetch()
        shared.put(key, data, info, wait=share_wait)
        return data, "source"

    def get_shared(self, key: BlockKey, info: EntryInfo) -> bytes | None:
        """The whole block from the shared tier alone (a small-file fill asks it first)."""
        if self.shared is None:
            return None
        try:
            return self.shared.get(key, info=info)
        except TierError as exc:
            self._failed(self.shared, exc)
            return None

    def put(self, key: BlockKey, data: bytes, info: EntryInfo, evict: bool = True, to_ram: bool = True) -> bool:
        """Store a block in RAM and on NVMe (`to_ram` False: on NVMe only). With evict=False
        (read-ahead, warming) each tier takes it only if it fits without evicting; returns
        whether any did."""
        kept = False
        for tier in self._local if to_ram else self._local[1:]:
            try:
                kept = tier.put(key, data, info, evict) or kept
            except TierError as exc:
                self._failed(tier, exc)
        return kept

    def share(self, key: BlockKey, data: bytes | None, info: EntryInfo, wait: float = 0.0) -> None:
        """Queue a block this node fetched for the shared tier; `data` None: read it from
        the NVMe tier when its turn comes."""
        if self.shared is None or (data is None and self.disk is None):
            return
        disk = self.disk
        self.shared.put(key, data if data is not None else (lambda: disk.peek(key) if disk is not None else None),
                        info, wait=wait)

    def contains(self, key: BlockKey) -> bool:
        """Cached on this node, judged without I/O."""
        return key in self.ram or (self.disk is not None and self.disk.probably_has(key))

    def held(self, key: BlockKey) -> tuple[bool, bool]:
        """(in RAM, on NVMe), judged without I/O (coverage reports)."""
        return key in self.ram, self.disk is not None and self.disk.probably_has(key)

    def has_room(self, size: int) -> bool:
        return self.ram.has_room(size) or (self.disk is not None and self.disk.has_room(size))

    def mark_stale(self, key: BlockKey) -> None:
        """The block belongs to a version of a file that is gone: evict it first."""
        for tier in self._local:
            tier.mark_stale(key)

    def on_lost(self, listener: Callable[[BlockKey], None]) -> None:
        """Tell `listener` of a block RAM evicted that no NVMe tier holds."""
        disk = self.disk

        def evicted(key: BlockKey) -> None:
            if disk is None or not disk.probably_has(key):
                listener(key)

        self.ram.on_evict = evicted

    # -- order hints: pinned blocks in RAM ---------------------------------------------------------

    @property
    def ram_capacity(self) -> int:
        return self.ram.capacity

    @property
    def pinned_bytes(self) -> int:
        return self.ram.pinned_bytes

    @staticmethod
    def room_of(length: int) -> int:
        """What a block of `length` bytes takes in a tier (whole pages)."""
        return allocated(length)

    def pin(self, key: BlockKey) -> bool:
        """Hold a block RAM has until unpin(); False if RAM does not have it."""
        return self.ram.pin(key)

    def unpin(self, key: BlockKey) -> None:
        self.ram.unpin(key)

    def cheap_on_disk(self, key: BlockKey, below: float) -> bool:
        """On an NVMe tier whose reads take less than `below` seconds: a reader's own read
        costs less than fetching it ahead."""
        disk = self.disk
        return disk is not None and disk.read_latency < below and disk.probably_has(key)

    def fetch_pinned(self, key: BlockKey, info: EntryInfo, fetch: Callable[[], tuple[bytes, str]],
                     pin_limit: int) -> tuple[bytes, str, bool]:
        """A hinted block into RAM, pinned: from RAM, NVMe, or `fetch()` (the shared tier
        or the source; then stored on NVMe as the demand miss it stands for). Returns its
        bytes, the tier it came from and whether it is pinned."""
        data = self.ram.peek(key)
        if data is not None:
            return data, "ram", self.ram.pin(key)
        disk = self.disk
        data = disk.get(key) if disk is not None else None
        tier = "disk"
        if data is None:
            data, tier = fetch()
            if disk is not None:
                disk.put(key, data, info)
        return data, tier, self.ram.put_pinned(key, data, info, pin_limit)

    # -- whole files, for passthrough -----------------------------------------------------------

    def open_backing(self, eid: bytes, size: int, promote: bool) -> tuple[Backing | None, bool]:
        """A complete cached copy of the file version `eid` the kernel may read directly,
        RAM first, held until released; and whether it counts as a RAM hit. With `promote`,
        a copy on NVMe is queued for a copy into RAM when RAM has free room for it (see
        cachefs/tiers/promote.py): this open gets the NVMe copy, a later one the RAM copy."""
        found = self.acquire_backing(eid)
        if found is not None and not found.in_ram and promote:
            self._promote_soon(eid, size)
        return found, found is not None and found.in_ram

    def count_opens(self, opens: list[tuple[bytes, int, bool]]) -> list[str | None]:
        """Opens a serving process passed through, each (entry id, size, promote): each
        copy's blocks count as hits of the tier it stands in ("ram" or "disk"; None if no
        tier has it whole), and with `promote` a copy on NVMe is queued for RAM as at
        open_backing. Nothing is held: the serving process's backing id holds it. One
        lock per tier for the whole report."""
        tiers: list[str | None] = ["ram" if hit else None for hit in self.ram.hit_whole([o[0] for o in opens])]
        rest = [i for i, tier in enumerate(tiers) if tier is None]
        if rest and self.disk is not None:
            for i, hit in zip(rest, self.disk.hit_whole([opens[i][0] for i in rest]), strict=True):
                if hit:
                    tiers[i] = "disk"
                    eid, size, promote = opens[i]
                    if promote:
                        self._promote_soon(eid, size)
        return tiers

    def _promote_soon(self, eid: bytes, size: int) -> None:
        if self._promoter is not None and self.ram.policy.has_room(size):
            self._promoter.want(eid)

    def on_promoted(self, listener: Callable[[bytes], None]) -> None:
        """Tell `listener` of every file version copied from NVMe into RAM."""
        if self._promoter is not None:
            self._promoter.listeners.append(listener)

    def settle_promotions(self, timeout: float = 1.0) -> bool:
        """Wait until the files queued for RAM are copied (stats that count them)."""
        return self._promoter is None or self._promoter.drain(timeout)

    def in_ram(self, eid: bytes) -> bool:
        """Whether the RAM tier holds the file version whole."""
        return self.ram.backing_file(eid) is not None

    def acquire_backing(self, eid: bytes) -> Backing | None:
        """The file version's complete copy, RAM first, held until released; None if no
        tier has it whole (or its check after a restart fails)."""
        return self._backing(eid, acquire=True)

    def _backing(self, eid: bytes, acquire: bool = False) -> Backing | None:
        for tier in self._local:
            path = tier.backing_file(eid, acquire)
            if path is not None:
                return Backing(tier, path, eid)
        return None

    def verify(self, eid: bytes) -> None:
        """Check an entry held since before the start (see FileStore.backing_file) now,
        so that the open that passes it through finds it checked."""
        for tier in self._local:
            if tier.needs_check(eid):
                tier.backing_file(eid)

    def on_drop(self, listener: Callable[[bytes, bool], None]) -> None:
        """Tell `listener` of every file version a tier drops whole (its backing id goes),
        and whether that tier is RAM."""
        def told(ram: bool) -> Callable[[bytes], None]:
            return lambda eid: listener(eid, ram)

        for tier in self._local:
            tier.on_drop.append(told(tier is self.ram))

    # -- files fetch processes write into the NVMe tier ----------------------------------------

    def reserve(self, size: int) -> bool:
        """Hold room on NVMe for a file a fetch process is about to write (see FileStore.reserve)."""
        return self.disk is not None and self.disk.reserve(size)

    def unreserve(self, size: int) -> None:
        if self.disk is not None:
            self.disk.unreserve(size)

    def reserve_ram(self, size: int) -> bool:
        """Hold room in RAM for a fill's RAM copy, made by a fetch process (free room only:
        a guess never pushes out cached data)."""
        return self.ram.reserve(size)

    def unreserve_ram(self, size: int) -> None:
        self.ram.unreserve(size)

    def adopt(self, key: BlockKey, size: int, h: int, info: EntryInfo, reserved: int = 0,
              ram_reserved: int | None = None) -> bool:
        """Take the file a fetch process wrote as the entry of `key` (FileStore.adopt), and
        its RAM copy if it wrote one (`ram_reserved` not None: the room held for it, handed
        to RAM's admission); whether either tier took it."""
        assert self.disk is not None
        kept = self.disk.adopt(key, size, h, info, reserved=reserved) != "refused"
        if ram_reserved is not None:
            kept = self.ram.adopt(key, size, h, info, reserved=ram_reserved) != "refused" or kept
        return kept

    def write_failed(self, exc: OSError) -> None:
        """A fetch process could not write into the NVMe tier: the tier's own failure."""
        if self.disk is not None:
            self.disk.write_failed(exc)

    # -- what the NVMe tier remembers after a restart -----------------------------------------

    def indexed_attr(self, path: str) -> tuple[Attr, float] | None:
        """(attributes, wall time last known good) of the newest cached version of `path`."""
        return self.disk.attr_of(path) if self.disk is not None else None

    def held_at(self, path: str) -> float | None:
        """When the NVMe tier's whole copy of `path`'s newest version was last known good."""
        return self.disk.held_at(path) if self.disk is not None else None

    def table_file(self, n: int) -> TableFile | None:
        """Record n of that entry table (a table node's file), if it passes its CRC."""
        row = self.disk.table_row(n) if self.disk is not None else None
        return None if row is None else TableFile(row.path, row.attr, row.eid)

    def table_eid_size(self, n: int) -> tuple[bytes, int] | None:
        """Record n of that entry table: its entry id and file size, read cheaply (no path)."""
        return self.disk.table_eid_size(n) if self.disk is not None else None

    def table_rows_vouched(self, records: list[int]) -> None:
        """Records of that entry table whose files a serving process tested (FromTable.vouch_rows)."""
        if self.disk is not None:
            self.disk.vouch_rows(records)

    def table_record_of(self, path: str) -> int | None:
        """The record of that entry table holding the newest version of `path`, if any."""
        return self.disk.table_find(path=path) if self.disk is not None else None

    def table_record_of_entry(self, eid: bytes) -> int | None:
        """The record of that entry table holding entry `eid`, if any."""
        return self.disk.table_find(eid=eid) if self.disk is not None else None

    def entry_table(self) -> tuple[int, int] | None:
        """(a new descriptor of, records in) the entry table the NVMe tier started from
        after a clean stop; None if it did not (see DiskTier.entry_table)."""
        return self.disk.entry_table() if self.disk is not None else None

    def checkpoint(self, room: int | None = None) -> tuple[int, int, array] | None:
        """The NVMe tier's entries as an entry table of this mount's (or its next
        generation), for table nodes: (a new descriptor of it, records, the new records of
        files RAM holds too), (-1, records, none) if nothing is new, or None (see
        DiskTier.checkpoint)."""
        return self.disk.checkpoint(ram=set(self.ram.entry_ids()), room=room) if self.disk is not None else None

    def checkpoint_released(self) -> None:
        """No process maps a checkpoint older than the newest any more (its blocks are free)."""
        if self.disk is not None:
            self.disk.checkpoint_released()

    @property
    def stored_since_checkpoint(self) -> int:
        """Files the NVMe tier stored since its last checkpoint (since the start if none)."""
        return self.disk.stored_since_checkpoint if self.disk is not None else 0

    @property
    def disk_files(self) -> int:
        """Files the NVMe tier holds."""
        return self.disk.files_held() if self.disk is not None else 0

    @property
    def disk_capacity(self) -> int:
        """The NVMe tier's budget in bytes (0: no NVMe tier)."""
        return self.disk.capacity if self.disk is not None else 0

    def on_unpathed(self, listener: Callable[[int], None]) -> None:
        """Tell `listener` of each record of that table a newer version of its path replaces."""
        if self.disk is not None:
            self.disk.on_unpathed.append(listener)

    def confirm(self, path: str, same: Callable[[Attr], bool] | None = None) -> tuple[bytes, int] | None:
        """The source still has the newest cached version of `path` (if `same` says so of
        its attributes): its entry id and entry table record (-1: none), if the NVMe tier holds it."""
        return self.disk.confirm(path, same) if self.disk is not None else None

    def outdated(self, path: str) -> None:
        """The source has another version of `path` than the newest cached one."""
        if self.disk is not None:
            self.disk.outdated(path)

    def count_shared_servers(self, counts: dict[str, tuple[int, int]]) -> None:
        """What a fetch process counted per shared-tier server (hits, misses)."""
        if self.shared is not None:
            self.shared.add_server_counts(counts)

    def drain_shared(self, timeout: float = 30.0) -> bool:
        """Wait until the blocks queued for the shared tier are stored."""
        return self.shared.drain(timeout) if self.shared is not None else True

    def close_shared(self) -> None:
        """Stop sharing (at shutdown, before the source's threads stop): puts still queued
        are dropped, only a lost chance to share."""
        if self.shared is not None:
            self.shared.close()

    def close(self) -> None:
        self.close_shared()
        if self._promoter is not None:
            self._promoter.close()
        if self.disk is not None:
            self.disk.close()
        self.ram.close()
