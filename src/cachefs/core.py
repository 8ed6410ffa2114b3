"""The core: the daemon's middle, built in one place, over a Source and the cache.

It never imports the FUSE layer; cachefs/fs.py translates kernel requests into calls here,
and the unit tests call it directly with a MemorySource. It is made of parts, each a
module with one reason to change, built here with what each needs (nothing is patched
into them afterwards):

  - `Metadata` (cachefs/metadata.py): the TTL cache of attributes, listings and xattrs,
    answers from the NVMe tier's index after a restart, listings;
  - `SourceGuard` (cachefs/guard.py): every source request, its timeout, the gate, down
    detection and the errno table's verdict;
  - `Flights` (cachefs/flight.py): one fetch per missing block;
  - `BlockPath` (cachefs/blockpath.py): a reader's bytes, passthrough opens, read-ahead
    within a file, order hints' pinned fetches;
  - `SmallFills` (cachefs/fills.py): small files fetched whole into the NVMe tier, by
    fetch processes;
  - `DirReadahead` (cachefs/dirahead.py): the siblings of what the job reads.

The cache (cachefs/tiers/multilevel.py) is the one door to the tiers. What the FUSE layer
learns at INIT reaches the parts through the KernelHooks given here (cachefs/hooks.py).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable

from cachefs.blockpath import BlockPath, Fetching, Guesses, ReadObserver
from cachefs.blocks import entry_id
from cachefs.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_METADATA_TTL,
    DEFAULT_NEGATIVE_TTL,
    DEFAULT_READAHEAD_MAX,
    LISTING_STAT_WORKERS,
    METADATA_MAX_ENTRIES,
    READAHEAD_MODES,
    WHOLE_FILE_MAX,
)
from cachefs.dirahead import DirReadahead
from cachefs.fetcher import Fetchers
from cachefs.fills import SmallFills
from cachefs.flight import Flights
from cachefs.gate import SourceGate
from cachefs.guard import SourceGuard
from cachefs.hooks import KernelHooks
from cachefs.identity import FileId
from cachefs.listings import ListingStore
from cachefs.metadata import Metadata
from cachefs.prefetch import DIR, Prefetcher
from cachefs.source import Source
from cachefs.stats import Stats
from cachefs.tiers.multilevel import MultiLevelCache

__all__ = ["Core", "ReadObserver", "source_namespace"]


def source_namespace(source_root: str) -> bytes:
    """A short, stable id of a source directory, the first field of every cache key."""
    return hashlib.blake2b(source_root.encode("utf-8", "surrogateescape"), digest_size=8).hexdigest().encode()


class Core:
    # Long (74 lines) for a reason: the one place the parts are wired, in the order they
    # depend on each other; its length is their number.
    def __init__(
        self,
        source: Source,
        cache: MultiLevelCache,
        stats: Stats,
        namespace: bytes = b"default",
        block_size: int = DEFAULT_BLOCK_SIZE,
        metadata_ttl: float = DEFAULT_METADATA_TTL,
        negative_ttl: float = DEFAULT_NEGATIVE_TTL,
        clock: Callable[[], float] = time.monotonic,
        metadata_entries: int = METADATA_MAX_ENTRIES,
        prefetcher: Prefetcher | None = None,
        readahead: str = "off",
        readahead_max: int = DEFAULT_READAHEAD_MAX,
        source_timeout: float = 0.0,
        whole_file_max: int = WHOLE_FILE_MAX,
        check_acls: bool = False,
        hooks: KernelHooks | None = None,
        hints: Callable[[Core], ReadObserver] | None = None,
    ):
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        if readahead not in READAHEAD_MODES:
            raise ValueError(f"readahead must be one of {READAHEAD_MODES}")
        self.source = source
        self.cache = cache
        self.stats = stats
        self.namespace = namespace
        self.block_size = block_size
        self.prefetcher = prefetcher
        self.hooks = hooks if hooks is not None else KernelHooks()
        self.readahead = readahead if prefetcher is not None else "off"
        self.gate = SourceGate(prefetcher.workers if prefetcher is not None else LISTING_STAT_WORKERS, stats=stats)
        self.flights = Flights(self.gate)
        self.guard = SourceGuard(stats, self.gate, self.flights, self.hooks, source_timeout)
        listings = None
        if cache.listings_dir is not None:  # kept on the cache disk: a restarted walk needs no source
            listings = ListingStore(cache.listings_dir, cache.reserve, cache.unreserve)
            threading.Thread(target=listings.adopt_existing, name="cachefs-listings-adopt", daemon=True).start()
        self.metadata = Metadata(source, self.guard, cache, stats, self.hooks, self.source_changed, block_size,
                                 metadata_ttl, negative_ttl, clock, metadata_entries, check_acls, listings)
        parts = Fetching(source, self.metadata, self.guard, self.flights, cache, stats, Guesses(stats),
                         self.source_changed, namespace, block_size)
        self.fills = SmallFills(parts)
        max_file_blocks = max(1, readahead_max // block_size)
        self.dir_readahead: DirReadahead | None = None
        if self.readahead == "dir" and prefetcher is not None:
            self.dir_readahead = DirReadahead(self.metadata.readdir, self.fills, self.prefetch_file,
                                              lambda: self.fills_to_disk, cache, stats, prefetcher, block_size,
                                              max_file_blocks=max_file_blocks,
                                              good_since=self.metadata.index_good_since)
            prefetcher.add_feeder(DIR, self.dir_readahead)
        observers: list[ReadObserver] = []
        self.blocks = BlockPath(parts, self.hooks, prefetcher, self.readahead != "off", readahead_max, whole_file_max,
                                observers, self.dir_readahead.touch_many if self.dir_readahead is not None else None,
                                self.fills.fill_open)
        # The core's API is its parts' methods (no extra call per request).
        meta = self.metadata
        self.getattr = meta.getattr
        self.known_attr = meta.known_attr
        self.attr_expiry = meta.attr_expiry
        self.attrs_of = meta.attrs_of
        self.readdir = meta.readdir
        self.known_listing = meta.known_listing
        self.rows_serving = meta.rows_serving
        self.listing_attrs_wanted = meta.listing_attrs_wanted
        self.getxattr = meta.getxattr
        self.listxattr = meta.listxattr
        self.invalidate = meta.invalidate
        self.file_id = meta.file_id
        blocks = self.blocks
        self.read = blocks.read
        self.open_file = blocks.open_file
        self.count_opens = blocks.count_opens
        self.prefetch_block = blocks.prefetch_block
        self.fetch_pinned = blocks.fetch_pinned
        self.prefetch_small = self.fills.fill
        self.prefetch_small_batch = self.fills.fill_many
        # Order hints (cachefs.hints) attach last, with the core whole; the core imports
        # none of them, and tells them of every read.
        self.hints = hints(self) if hints is not None else None
        if self.hints is not None:
            observers.append(self.hints)

    def readlink(self, path: str) -> str:
        return self.guard.call("readlink", self.metadata.source.readlink, path)

    def statfs(self) -> dict:
        return self.guard.call("statfs", self.metadata.source.statfs)

    def prefetch_file(self, path: str, max_blocks: int | None = None) -> tuple[str, int]:
        return self.blocks.prefetch_file(path, max_blocks)

    def source_changed(self, path: str) -> None:
        """A file's cached identity turned out wrong: forget it (and, under a mount, have
        the kernel look it up again: KernelHooks.on_source_changed)."""
        (self.hooks.on_source_changed or self.invalidate)(path)

    @property
    def fills_to_disk(self) -> bool:
        return self.blocks.fills_to_disk

    @property
    def fetchers(self) -> Fetchers | None:
        return self.fills.fetchers

    def use_fetchers(self, fetchers: Fetchers) -> None:
        self.fills.use_fetchers(fetchers)

    def entry_id(self, fid: FileId) -> bytes:
        return entry_id(self.namespace, fid, self.block_size)

    @property
    def source_down(self) -> bool:
        return self.guard.down

    def close(self) -> None:
        self.metadata.stop_checking()
        if self.prefetcher is not None:
            self.prefetcher.stop()
        if self.fills.fetchers is not None:
            self.fills.fetchers.close()
        self.cache.close_shared()  # puts still queued are dropped: only a lost chance to share
        self.guard.close()
        self.metadata.close()
        self.cache.close()


