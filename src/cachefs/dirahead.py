"""Directory read-ahead: the siblings of files the job reads, fetched in the background in
sorted order, one directory after another (the smallest path first, which is the order a
copied dataset lies on disk).
"""

from __future__ import annotations

import functools
import stat as stat_mod
import threading
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable

from cachefs.config import DIR_BATCH
from cachefs.fills import SmallFills
from cachefs.identity import DirEntry
from cachefs.prefetch import Prefetcher
from cachefs.readahead import DirectoryCursor
from cachefs.stats import Stats
from cachefs.tiers.multilevel import MultiLevelCache


class DirReadahead:
    """Read-ahead across files: the siblings of files the job reads, fetched in the
    background in sorted order, one directory after another (the smallest path first,
    which is the order a copied dataset lies on disk).

    A prefetch feeder: the pool asks it for one task at a time. A directory is listed in
    the worker that first needs it, never in the reader's FUSE thread.
    """

    def __init__(self, readdir: Callable[[str], Collection[DirEntry]], fills: SmallFills,
                 prefetch_file: Callable[[str, int | None], tuple[str, int]], fills_to_disk: Callable[[], bool],
                 cache: MultiLevelCache, stats: Stats, prefetcher: Prefetcher, block_size: int,
                 max_file_blocks: int, max_dirs: int = 100_000, good_since: Callable[[str], float] | None = None):
        self._readdir = readdir
        # The wall time since which the NVMe index's attributes answer a lookup in a directory
        # (Metadata.index_good_since): a file held whole and known good since is not filled
        self._good_since = good_since
        self._fills = fills
        self._prefetch_file = prefetch_file
        self._fills_to_disk = fills_to_disk
        self._cache = cache
        self._stats = stats
        self._block_size = block_size
        self._prefetcher = prefetcher
        self._max_file_blocks = max_file_blocks
        self._lock = threading.Lock()
        self._pending: dict[str, set[str]] = {}       # dir -> names read before it was listed
        self._active: dict[str, DirectoryCursor] = {}
        self._seen: OrderedDict[str, None] = OrderedDict()  # dirs taken on (bounded)
        self._max_dirs = max_dirs
        self.full = False  # every tier is full: stop guessing until there is room again

    def touch_many(self, paths: Iterable[str]) -> None:
        """Files read (or opened) in their directories: each directory not taken on yet is,
        and the files read are skipped by its cursor. One lock for a serving process's
        whole report."""
        new = 0
        with self._lock:
            for path in paths:
                directory, _, name = path.rpartition("/")
                directory = directory or "/"
                cursor = self._active.get(directory)
                if cursor is not None:
                    cursor.skip(name)
                elif directory in self._pending:
                    self._pending[directory].add(name)
                elif directory not in self._seen:
                    self._seen[directory] = None
                    if len(self._seen) > self._max_dirs:
                        self._seen.popitem(last=False)
                    self._pending[directory] = {name}
                    new += 1
        if new:
            self._stats.add_many({"prefetch.dirs": new})
            self._prefetcher.wake()

    def covered(self, directory: str) -> None:
        """Every file of `directory` is cached (and checked: see cachefs/published.py,
        _publish_dir): the job's reads there take nothing on."""
        with self._lock:
            if directory in self._pending or directory in self._active:
                return
            self._seen[directory] = None
            if len(self._seen) > self._max_dirs:
                self._seen.popitem(last=False)

    def __call__(self) -> tuple[object, Callable[[], object]] | None:
        if self.full:
            if not self._cache.has_room(self._block_size):
                return None
            self.full = False
        while True:
            with self._lock:
                if self._active:
                    directory = min(self._active)
                    cursor = self._active[directory]
                    name = cursor.next()
                    if name is None:
                        del self._active[directory]
                        continue
                    path = directory.rstrip("/") + "/" + name
                    if not (self._fills_to_disk() and self._fills.batches_shared):
                        return path, functools.partial(self._fetch, path)
                    # With a shared tier: a batch of siblings for one fetch process request
                    # (SmallFills.fill_many), one shared-tier round trip for all of them
                    # (not without one: see config.DIR_BATCH).
                    paths = [path]
                    while len(paths) < DIR_BATCH and (name := cursor.next()) is not None:
                        paths.append(directory.rstrip("/") + "/" + name)
                    return path, functools.partial(self._fetch_batch, paths)
                if not self._pending:
                    return None
                directory = min(self._pending)
                read = self._pending.pop(directory)
            try:
                entries = self._readdir(directory)
            except OSError:
                continue
            names = [e.name for e in entries if stat_mod.S_ISREG(e.type_mode) and e.name not in read]
            held = self._held(directory, names)
            cursor = DirectoryCursor(directory, (name for name in names if name not in held))
            with self._lock:
                self._active[directory] = cursor

    def _held(self, directory: str, names: list[str]) -> set[str]:
        """The files among `names` the NVMe tier holds whole, with attributes a lookup would be
        answered with now: passed by, with a probe of the index each (after a remount, a fill
        of each, its attributes, identity and claim, had cost the daemon about 0.02 ms per file
        of an epoch the serving processes answer, for no fetch)."""
        if self._good_since is None or not names:
            return set()
        since = self._good_since(directory)
        prefix = directory.rstrip("/") + "/"
        held_at = self._cache.held_at
        held = {name for name in names if (t := held_at(prefix + name)) is not None and t >= since}
        if held:
            self._stats.add_many({"prefetch.dir_cached": len(held)})
        return held

    def _fetch_batch(self, paths: list[str]) -> None:
        for path, small in zip(paths, self._fills.fill_many(paths), strict=True):
            outcome, _ = small if small is not None else self._prefetch_file(path, self._max_file_blocks)
            if outcome == "no_room":
                self.full = True
                return

    def _fetch(self, path: str) -> None:
        small = self._fills.fill(path) if self._fills_to_disk() else None
        outcome, _ = small if small is not None else self._prefetch_file(path, self._max_file_blocks)
        if outcome == "no_room":
            self.full = True
