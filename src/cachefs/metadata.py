"""Metadata: what the daemon knows of the source's names and attributes.

A bounded TTL cache (--metadata-ttl, --negative-ttl) of attributes, listings and extended
attributes; cached files' lookups answered from the NVMe tier's index (within the TTL of
when each was last known good; after a restart each directory is checked once, in bulk,
by its first listing); listings of names and types only, those a walk lists next listed
ahead (cachefs/listahead.py). Every source request goes through cachefs/guard.py.
"""

from __future__ import annotations

import errno
import os
import stat as stat_mod
import threading
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor

from cachefs import acl
from cachefs.config import (
    DEFAULT_METADATA_TTL,
    DEFAULT_NEGATIVE_TTL,
    LISTING_STAT_WORKERS,
    METADATA_MAX_ENTRIES,
)
from cachefs.dircheck import CheckQueue
from cachefs.errors import SOURCE_DOWN
from cachefs.guard import SourceGuard, in_prefetch_thread
from cachefs.hooks import KernelHooks
from cachefs.identity import Attr, DirEntry, EntryInfo, FileId, Listing
from cachefs.listahead import ListAhead
from cachefs.listings import ListingStore
from cachefs.source import Source
from cachefs.stats import Stats
from cachefs.tiers.multilevel import MultiLevelCache
from cachefs.ttlcache import TTLCache
from cachefs.xattrs import XattrCache

CHECK_WAIT = 30.0  # s: at most, a listing waits for another thread's check of its directory
CHECK_SAMPLE = 8  # a trusted directory's files whose records say when it is due for its check


class Metadata:
    def __init__(self, source: Source, guard: SourceGuard, cache: MultiLevelCache, stats: Stats,
                 hooks: KernelHooks, on_changed: Callable[[str], None], block_size: int,
                 metadata_ttl: float = DEFAULT_METADATA_TTL, negative_ttl: float = DEFAULT_NEGATIVE_TTL,
                 clock: Callable[[], float] = time.monotonic, max_entries: int = METADATA_MAX_ENTRIES,
                 check_acls: bool = False, listings: ListingStore | None = None):
        self.source = source
        self._guard = guard
        self._cache = cache
        self.stats = stats
        self._hooks = hooks
        self._on_changed = on_changed  # a file's cached identity turned out wrong (Core.source_changed)
        self.block_size = block_size
        self.metadata_ttl = metadata_ttl
        self.negative_ttl = negative_ttl
        self._clock = clock
        self._attrs = TTLCache(max_entries, clock)
        self._dirs = TTLCache(max(1, max_entries // 10), clock)
        self._xattrs = XattrCache(source, guard, stats, metadata_ttl, max_entries, clock)
        # --allow-other: modes are cut down to what POSIX ACLs grant (see _with_acl)
        self.check_acls = check_acls
        # Listings and attributes ahead (cachefs/listahead.py), and the attributes
        # `--coverage --exact` asks for. Not prefetch threads: their requests go through
        # the source pool with the timeout, and count as demand at the gate (a reader's
        # listing may wait for them).
        self._stat_pool = ThreadPoolExecutor(LISTING_STAT_WORKERS, thread_name_prefix="cachefs-stat")
        self._ahead = ListAhead(self._stat_pool, self._list_ahead, lambda path: self._dirs.get(path) is not None,
                                lambda path: self._list(path, attrs=True), attrs_every=metadata_ttl)
        self._listings = listings  # listings kept on the cache disk (cachefs/listings.py)
        self._kept_dirs: set[str] = set()  # directories listed from them in this run
        # Cached files' lookups are answered from the attributes the NVMe tier stored them
        # under, within --metadata-ttl of when last known good; after a restart each
        # directory is checked once, in bulk, by its first listing with attributes (or in
        # the background, after a lookup answered so): a request per directory, not per file.
        self._index_answers = cache.has_disk  # cached files' attributes answer lookups (_index_answer)
        self._index_checks = cache.remembers  # entries from before this start: directories checked
        self._checked_dirs: dict[str, float] = {}  # dir -> wall time of its check (see _index_answer)
        self._answered: dict[str, set[str]] = {}  # dir -> names answered from the index, unchecked
        self._rows_dirs: set[str] = set()  # dirs whose files the serving processes answer from the index
        self._checking: dict[str, threading.Event] = {}  # dir -> set when its check has compared
        self._check_lock = threading.Lock()
        self._checks = CheckQueue(self._check_due, self._list, metadata_ttl)
        stats.gauge("metadata.entries", lambda: len(self._attrs) + len(self._dirs))
        stats.gauge("metadata.checks_waiting", lambda: len(self._checks.waiting))

    def getattr(self, path: str) -> Attr:
        hit, indexed = self._answer(path)
        if indexed:
            return hit  # type: ignore[return-value]
        if isinstance(hit, Attr):
            self.stats.incr("metadata.hits")
            if not hit.is_dir and not in_prefetch_thread():
                self._ahead.looked_up(path)  # `ls -l` (see cachefs/listahead.py)
            return hit
        if isinstance(hit, int):
            self.stats.incr("metadata.hits")
            raise FileNotFoundError(hit, "no such file (cached)", path)
        if self._listings is not None and self._listings.has(path) and self._kept(path) is not None:
            hit = self._attrs.get(path)  # a directory whose listing was kept, with its attributes
            if isinstance(hit, Attr):
                self.stats.incr("metadata.hits")
                return hit
        directory = path.rpartition("/")[0] or "/"
        # `ls -l`: the directory being listed with attributes (elsewhere, a lookup waits for
        # no listing: over a store whose stats are round trips that is a wait for all)
        if self._ahead.attrs_wanted() and self._ahead.wait(directory, self._hooks.blocking, attrs=True):
            hit = self.cached(path)
            if isinstance(hit, Attr):
                self.stats.incr("metadata.hits")
                return hit
        self.stats.incr("metadata.misses")
        try:
            attr = self._guard.call("stat", self.source.stat, path)
            if self.check_acls:
                attr = self._with_acl(path, attr)
        except FileNotFoundError:
            self._attrs.put(path, errno.ENOENT, self.negative_ttl)
            raise
        except OSError as exc:
            stale = self._stale(self._attrs, path, exc, self._older)
            if isinstance(stale, int):
                raise FileNotFoundError(stale, "no such file (cached)", path) from None
            return stale  # type: ignore[return-value]
        self._learned(path, attr)
        # The rest of the directory's attributes ahead, and `ls -l` (cachefs/listahead.py). A
        # walk looks subdirectories up one after another, and directory read-ahead the files
        # it fetches: neither counts.
        if not attr.is_dir and not in_prefetch_thread():
            self._ahead.missed(path)
            self._ahead.looked_up(path)
        return attr

    def known_attr(self, path: str, count: bool = True) -> Attr | None:
        """The attributes of `path` if the daemon knows them (cached, or in the index),
        without asking the source; None otherwise. `count`: as a hit (a kernel's request)."""
        hit, indexed = self._answer(path)
        if isinstance(hit, Attr) and count and not indexed:
            self.stats.incr("metadata.hits")
        return hit if isinstance(hit, Attr) else None

    def attr_expiry(self, path: str) -> tuple[Attr, float] | None:
        """The attributes known for `path` and when they are due for a check on the
        source (the clock's time, time.monotonic by default); None if none are known."""
        known = self._attrs.expiry(path)
        if known is not None or self._attrs.get(path) is not None:  # (or a negative entry)
            return (known[0], known[1]) if known is not None and isinstance(known[0], Attr) else None
        indexed = self._index_answer(path) if self._index_answers else None  # (not kept here)
        if indexed is not None:
            return indexed[0], self._clock() + indexed[1]
        attr = self._listed(path)  # (due with its listing)
        listing = self._dirs.expiry(path.rpartition("/")[0] or "/") if attr is not None else None
        return None if listing is None else (attr, listing[1])  # type: ignore[return-value]

    def attrs_of(self, paths: list[str], fetch: bool = False) -> dict[str, Attr]:
        """The attributes of those of `paths` the daemon knows (known_attr); with `fetch`,
        the rest from the source, LISTING_STAT_WORKERS at a time. A path that could not be
        stat'ed is left out."""
        known: dict[str, Attr] = {}
        unknown = []
        for path in paths:
            attr = self.known_attr(path)
            if attr is None:
                unknown.append(path)
            else:
                known[path] = attr
        if fetch and unknown:
            known.update(self._stat_all(unknown))
        return known

    def readdir(self, path: str) -> Collection[DirEntry]:
        hit = self._dirs.get(path)
        if hit is None and self._ahead.wait(path, self._hooks.blocking):  # being listed ahead
            hit = self._dirs.get(path)
        attrs = self._ahead.attrs_wanted()  # something stats what it lists (`ls -l`)
        if hit is not None and not (attrs and self._wants_attrs(path, hit)):  # type: ignore[arg-type]
            self.stats.incr("metadata.hits")
            self._ahead.read(path)
            return hit  # type: ignore[return-value]  # (a Listing)
        self.stats.incr("metadata.misses")
        entries: Collection[DirEntry] | None = None if attrs else self._kept(path)
        if entries is None:
            entries = self._list(path, attrs)
        self._ahead.read(path)
        return entries

    def known_listing(self, path: str, kept: bool = True) -> Listing | None:
        """`path`'s listing if the daemon has it (listed within --metadata-ttl, or with
        `kept` kept on the cache disk), without asking the source; None otherwise."""
        hit = self._dirs.get(path)
        if hit is not None:
            return hit  # type: ignore[return-value]
        return self._kept(path) if kept else None

    def _wants_attrs(self, path: str, listing: Listing) -> bool:
        """Whether a cached listing should be listed again with its entries' attributes
        (`ls -l`): if it came without, unless it was kept (after a restart the NVMe index
        answers for its files: lookup_known finds them)."""
        return bool(listing) and not listing.with_attrs and path not in self._kept_dirs

    def _kept(self, path: str) -> Listing | None:
        """`path`'s listing as kept on the cache disk, if listed within --metadata-ttl (a
        restarted mount): no request to the source, and no check of the directory until
        then, as its files' attributes are answered from the NVMe index until theirs. Not
        where those are past the TTL (or within the check's margin) and the directory was
        not checked since the start: listed again, with attributes, as its check (else the
        epoch met the expired records, a stat each: docs/benchmarks.md)."""
        if self._listings is None:
            return None
        kept = self._listings.load(path)
        if kept is None:
            return None
        listed_at, entries, attr = kept
        left = min(self.metadata_ttl - (time.time() - listed_at), self.metadata_ttl)
        if left <= 0 or (self._index_checks and path not in self._checked_dirs
                         and self._records_due(path, entries) - self._checks.ahead <= time.time()):
            return None
        self._dirs.put(path, entries, left)
        self._kept_dirs.add(path)
        if attr is not None and self._attrs.get(path) is None:  # its lookup needs no source either
            self._attrs.put(path, self._with_acl(path, attr), left)
        self.stats.incr("metadata.listings_kept")
        self._ahead.listed(path, entries)
        return entries

    def listing_attrs_wanted(self) -> bool:
        """Whether something stats what it lists now (`ls -l`: see ListAhead.looked_up)."""
        return self._ahead.attrs_wanted()

    def _list(self, path: str, attrs: bool = False) -> Collection[DirEntry]:
        """A listing from the source, into the cache. Names and d_type only: a walk (os.walk,
        ImageFolder) needs no attributes, and a stat per entry beside the listing (what
        this did while the kernel was given READDIRPLUS) was half the daemon's CPU in a
        walk of 200,000 files on a local disk, and a round trip each on a network store
        whose client keeps no attributes. Each entry is looked up when someone needs it,
        as reading the store directly would. The exceptions, one request with every
        entry's attributes: a directory's check after a restart (see _check_dir), and
        `attrs`: behind a file's first lookup in the directory, and for `ls -l`
        (cachefs/listahead.py)."""
        check = self._index_checks and path not in self._checked_dirs
        try:
            entries = self._guard.call("listdir", self.source.listdir, path, check or attrs)
        except OSError as exc:
            return self._stale(self._dirs, path, exc)  # type: ignore[return-value]
        prefix = path.rstrip("/") + "/"
        # packed, with the attributes it brought (Listing; not under --allow-other): the reader gets what came
        listing = Listing.of(entries, keep_attrs=attrs and not check and not self.check_acls)
        if check:
            self._check_dir(path, entries)
        else:
            self._wait_checked(path)
            if attrs:
                for e in entries:  # (a file the index answers needs no attributes in the listing)
                    if (e.attr is not None and self._learned(prefix + e.name, self._with_acl(prefix + e.name, e.attr),
                                                             listing.has_attrs) and listing.has_attrs):
                        listing.forget(e.name)
        self._dirs.put(path, listing, self.metadata_ttl)
        if self._listings is not None:  # with its own attributes: a restart's lookup of it asks nothing
            own = self.cached(path)  # (let go of under many files' lookups: asked again)
            self._listings.save(path, listing, attr=own if isinstance(own, Attr) else self._stat_one(path))
        self._ahead.listed(path, entries)  # (as it came: no name unpacked)
        return entries

    def _list_ahead(self, path: str) -> None:
        """A directory a walk lists next (ListAhead): its attributes (the walk looks it up
        first) and its listing: kept ones first (which bring both, after a restart)."""
        attrs = self._ahead.attrs_wanted()
        listing = self._dirs.get(path)
        stale = listing is None or (attrs and self._wants_attrs(path, listing))  # type: ignore[arg-type]
        if stale and not attrs and self._kept(path) is not None:
            stale = False
        if self.cached(path) is None:
            self._stat_one(path)
        if stale:
            self._list(path, attrs)

    def _stat_one(self, path: str, strict: bool = False) -> Attr | None:
        """The attributes of a listed entry from the source, into the metadata cache. Errors
        are left to the lookup that needs the entry (`strict`: only "no such file" is)."""
        try:
            attr = self._with_acl(path, self._guard.call("stat", self.source.stat, path))
        except FileNotFoundError:
            return None
        except OSError:
            if strict:
                raise
            return None
        self._learned(path, attr)
        return attr

    def _stat_all(self, paths: list[str]) -> dict[str, Attr]:
        """The attributes of listed entries from the source, fetched in parallel and waited
        for; an entry gone meanwhile is left out, any other failure raises (OSError)."""
        with self._hooks.blocking():
            try:
                futures = [(path, self._stat_pool.submit(self._stat_one, path, True)) for path in paths]
            except RuntimeError:  # closed meanwhile
                raise OSError(errno.ECANCELED, "cachefs is stopping") from None
            found = {path: future.result() for path, future in futures}
        return {path: attr for path, attr in found.items() if attr is not None}

    def _learned(self, path: str, attr: Attr, listed: bool = False) -> bool:
        """Attributes just read from the source, into the cache for the TTL; not if its
        listing keeps them (`listed`, or the same there). A cached version of the file the
        index holds that they match is confirmed instead: the index answers its lookups
        (_index_answer: not kept twice; under --allow-other they are kept too, cut down to
        the file's ACL as the index's are not); one they do not match is outdated. Whether
        the index answers them."""
        known = self._cache.indexed_attr(path) if self._index_answers and not attr.is_dir else None
        same = known is not None and FileId.of(path, known[0]).matches(attr)
        if same:
            self._confirm(path)
        if (same and not self.check_acls) or listed or self._listed(path) == attr:
            self._attrs.pop(path)  # (an older answer: these are newer)
        else:
            self._attrs.put(path, attr, self.metadata_ttl)
        if known is not None and not same:
            self._cache.outdated(path)
        return same and not self.check_acls

    def _confirm(self, path: str, fresh: Attr | None = None) -> bytes | None:
        """The source has the newest cached version of `path` (if its attributes match
        `fresh`: one read of its record): the index's entry is known good as of now, and so
        is its table node, if the serving processes answer one (KernelHooks.on_confirmed): a
        job past --metadata-ttl has each file checked once a TTL, not each lookup of it sent
        to the daemon. Its entry id, or None (none cached, or another version)."""
        same = None if fresh is None else lambda known: FileId.of(path, known).matches(fresh)
        found = self._cache.confirm(path, same)
        if found is not None and self._hooks.on_confirmed is not None:
            self._hooks.on_confirmed(*found)
        return None if found is None else found[0]

    def _index_answer(self, path: str) -> tuple[Attr, float] | None:
        """(attributes, seconds they stay good) of a lookup answered from the NVMe tier's
        index, or None. Not copied into the attributes cache: the index keeps them (a
        record of the entry table after a restart, 22 bytes of columns), and a copy there
        was ~600 bytes per file (the `Attr`, its integers, the cache's tuple, the path).
        Under --allow-other they are cut down to the file's ACL (a request to the source)
        and that copy is kept for the time they stay good."""
        known = self._cache.indexed_attr(path)
        if known is None:
            return None
        attr, stored_at = known
        left = min(self.metadata_ttl - (time.time() - stored_at), self.metadata_ttl)
        if left <= 0:
            return None  # too old
        directory, _, name = path.rpartition("/")
        directory = directory or "/"
        first, checking = False, None
        if not self._index_checks:  # every entry was stored in this mount, from the source (see _learned)
            self.stats.incr("metadata.index_hits")
            return self._acl_kept(path, attr, left), left
        with self._check_lock:
            checked = self._checked_dirs.get(directory)
            if checked is None:  # answered before its check, which compares it
                names = self._answered.get(directory)
                first = names is None
                if first:
                    names = self._answered[directory] = set()
                if directory not in self._rows_dirs:  # (there every name kept counts: _check_dir)
                    names.add(name)  # type: ignore[union-attr]
            elif stored_at < checked:
                # Not confirmed by the check (changed or gone since), nor cached since: the source
                # is asked. Confirmed or cached since, it is as good as the check's own attributes
                # (which the attributes cache may have let go: at 1.28 million files, each had cost
                # a stat). A check still comparing (it confirms after setting its time) is waited for.
                checking = self._checking.get(directory)
                if checking is None:
                    return None
        if checking is not None:
            with self._hooks.blocking():
                done = checking.wait(CHECK_WAIT)
            return self._index_answer(path) if done else None
        self.stats.incr("metadata.index_hits")
        if first:
            self._checks.submit(directory)
        return self._acl_kept(path, attr, left), left

    def _acl_kept(self, path: str, attr: Attr, left: float) -> Attr:  # (see _index_answer)
        if not self.check_acls:
            return attr
        attr = self._with_acl(path, attr)
        self._attrs.put(path, attr, left)
        return attr

    def index_good_since(self, directory: str) -> float:  # index answers there: stored since (_index_answer)
        with self._check_lock:
            checked = self._checked_dirs.get(directory, 0.0) if self._index_checks else 0.0
        return max(time.time() - self.metadata_ttl, checked)

    def rows_serving(self, directory: str) -> None:
        """The serving processes answer lookups in `directory` from the NVMe tier's entry
        table (its table nodes: cachefs/fuse/serve.py), as _index_answer answers them here: the
        directory's check is queued as the first such answer queues it, and every name of
        it counts as answered (the kernel may hold any of them)."""
        with self._check_lock:
            self._rows_dirs.add(directory)
        if self._index_checks and directory not in self._checked_dirs:
            self._checks.submit(directory)

    def _check_dir(self, directory: str, entries: Collection[DirEntry]) -> None:
        """The first listing of a directory since the start, with attributes: compared with
        the index (_compare)."""
        prefix = directory.rstrip("/") + "/"
        fresh = {e.name: e.attr for e in entries if e.attr is not None}
        self.stats.incr("metadata.dirs_checked")
        # Only now is the directory checked: until here a lookup found the index (and is
        # in `answered`), never the source (but a file the index does not hold).
        done = threading.Event()
        with self._check_lock:
            self._checked_dirs[directory] = time.time()  # (before _compare confirms what it finds)
            answered = self._answered.pop(directory, set())
            rows = directory in self._rows_dirs
            before = self._checking.get(directory)  # two listings at once both check: the
            self._checking[directory] = done       # second returns after the first too
        try:
            if rows:  # any name the kept listing had may have been answered (and gone since)
                kept = self._listings.load(directory) if self._listings is not None else None
                answered |= fresh.keys() | ({e.name for e in kept[1]} if kept is not None else set())
            self._compare(prefix, fresh, answered)
        finally:
            with self._check_lock:
                if self._checking.get(directory) is done:
                    del self._checking[directory]
            done.set()
        if before is not None:
            before.wait(CHECK_WAIT)

    def _wait_checked(self, directory: str) -> None:
        """A listing of `directory` while another thread's check compares it (see
        _check_dir) returns after that check: what it found changed is invalidated first."""
        with self._check_lock:
            done = self._checking.get(directory)
        if done is not None:
            done.wait(CHECK_WAIT)

    def _compare(self, prefix: str, fresh: dict[str, Attr], answered: set[str]) -> None:
        """A directory's check: the listing's attributes `fresh` against the index's. A file
        the index holds as the source has it is confirmed, with one read of its record (the
        index answers for it: not cached twice); the others' attributes are cached."""
        ttl = self.metadata_ttl
        for name, attr in fresh.items():
            path = prefix + name
            if self._confirm(path, attr) is not None:
                if self.check_acls:  # (kept cut down to the file's ACL, see _index_answer)
                    self._attrs.put(path, self._with_acl(path, attr), ttl)
                continue
            self._attrs.put(path, self._with_acl(path, attr), ttl)
            if name in answered and self._cache.indexed_attr(path) is not None:
                self.stats.incr("metadata.index_stale")
                self._on_changed(path)  # the kernel may hold the old attributes
        for name in answered - fresh.keys():  # gone from the source since it was cached
            self.stats.incr("metadata.index_stale")
            self._on_changed(prefix + name)

    def _check_due(self, directory: str) -> float | None:
        """When `directory`'s check is due (wall time; cachefs/dircheck.py): None once checked;
        now if no listing of it is kept; else when its kept listing, or its files' records,
        are past --metadata-ttl."""
        if directory in self._checked_dirs:
            return None
        known = self._dirs.expiry(directory)
        if known is None and self._kept(directory) is not None:
            known = self._dirs.expiry(directory)
        if known is None:
            return 0.0
        return min(time.time() + known[1] - self._clock(), self._records_due(directory, known[0]))  # type: ignore[arg-type]

    def _records_due(self, directory: str, entries: Listing) -> float:
        """When the first of `directory`'s files' index records passes --metadata-ttl (wall
        time), of the first CHECK_SAMPLE the index holds, in the listing's order: a check
        renews a directory's records together, so they are within seconds of each other."""
        due, prefix, sampled = float("inf"), directory.rstrip("/") + "/", 0
        for i, entry in enumerate(entries):
            record = self._cache.indexed_attr(prefix + entry.name) if entry.type_mode == stat_mod.S_IFREG else None
            if record is not None:
                due, sampled = min(due, record[1] + self.metadata_ttl), sampled + 1
            if sampled >= CHECK_SAMPLE or i >= 16 * CHECK_SAMPLE:
                break
        return due

    def _stale(self, cache: TTLCache, path: str, exc: OSError,
               also: Callable[[str], object | None] | None = None) -> object:
        """While the source does not answer, expired metadata is better than none: the files
        it names may be cached in full (`also`: where else to look). Else re-raises `exc`."""
        if exc.errno in SOURCE_DOWN:
            stale = cache.get_stale(path)
            if stale is None and also is not None:
                stale = also(path)
            if stale is not None:
                self.stats.incr("metadata.stale_served")
                return stale
        raise exc

    def _older(self, path: str) -> Attr | None:
        """What its directory's listing, else the NVMe tier's index, holds for `path`, however old."""
        listed = self._listed(path, stale=True)
        if listed is not None:
            return listed
        known = self._cache.indexed_attr(path) if self._index_answers else None
        return None if known is None else known[0]

    def getxattr(self, path: str, name: str) -> bytes:
        return self._xattrs.get(path, name)

    def listxattr(self, path: str) -> list[str]:
        return self._xattrs.list(path)

    def _with_acl(self, path: str, attr: Attr) -> Attr:
        """Under --allow-other (`check_acls`): the mode cut down to what the file's POSIX ACL
        grants each class of users (cachefs.acl), so the kernel never grants more."""
        return acl.restricted(attr, path, self.source.getxattr) if self.check_acls else attr

    def invalidate(self, path: str) -> None:
        """Forget cached metadata of `path` (its blocks, keyed by identity, stop matching), and have
        the index answer no lookup of it with a cached version's attributes: the next asks the source."""
        if self._index_answers:
            self._cache.outdated(path)
        self._attrs.pop(path)
        self._dirs.pop(path)
        self._xattrs.pop(path)
        listing, name = self._listing_of(path)
        if listing is not None:  # (its attributes of the file: unknown)
            listing.forget(name)
        if self._listings is not None:
            self._listings.drop(path)

    def entry_info(self, fid: FileId) -> EntryInfo:
        """What a tier records with a file version: path and attributes (a remount's lookups' answers)."""
        attr = self._attrs.get_stale(fid.path) or self._older(fid.path)
        if not isinstance(attr, Attr) or not fid.matches(attr):
            attr = Attr(stat_mod.S_IFREG | 0o444, 1, os.getuid(), os.getgid(), fid.size, fid.mtime_ns,
                        fid.mtime_ns, fid.ctime_ns, (fid.size + 511) // 512, version=fid.version)
        return EntryInfo(fid.path, attr, self.block_size)

    def file_id(self, path: str) -> FileId:
        attr = self.getattr(path)
        if attr.is_dir:
            raise IsADirectoryError(errno.EISDIR, "is a directory", path)
        if not attr.is_file:
            raise OSError(errno.EINVAL, "not a regular file", path)
        return FileId.of(path, attr)

    def _answer(self, path: str) -> tuple[object | None, bool]:
        """What answers `path`'s lookup without the source: the attributes cache's (Attr or
        errno), else a cached file's index record, else its listing's; and whether the index did."""
        hit = self._attrs.get(path)
        if hit is None and self._index_answers:
            indexed = self._index_answer(path)
            if indexed is not None:
                return indexed[0], True
        return (hit if hit is not None else self._listed(path)), False

    def cached(self, path: str) -> object | None:
        """The attributes cache's answer for `path` (Attr or errno), else its listing's (Attr), unexpired."""
        hit = self._attrs.get(path)
        return hit if hit is not None else self._listed(path)

    def _listed(self, path: str, stale: bool = False) -> Attr | None:
        """`path`'s attributes as its listing brought them, within its TTL (`stale`: however old)."""
        listing, name = self._listing_of(path, stale)
        return None if listing is None else listing.attr_of(name)

    def _listing_of(self, path: str, stale: bool = True) -> tuple[Listing | None, str]:
        """The listing of `path`'s directory if it keeps its entries' attributes (within its
        TTL, or `stale`: however old), and `path`'s name in it."""
        directory, _, name = path.rpartition("/")
        listing = (self._dirs.get_stale if stale else self._dirs.get)(directory or "/")
        return (listing if isinstance(listing, Listing) and listing.has_attrs else None), name

    def remember(self, path: str, attr: Attr) -> None:  # attributes learnt on the way (a fetch process's visit)
        self._learned(path, attr)

    def stored(self, path: str, attr: Attr) -> None:
        """A fill just cached `path` on the NVMe tier with `attr`: from now its lookups are
        the index's (_index_answer), and the attributes cache's copy goes, and its
        listing's (Listing.forget: a listing whose files are all cached keeps none)."""
        if self._index_answers:
            known = self._cache.indexed_attr(path)
            if known is not None and known[0] == attr:
                self._attrs.discard(path, attr)
                listing, name = self._listing_of(path)
                if listing is not None:
                    listing.forget(name)

    def last_known(self, path: str) -> Attr | None:
        """The attributes last known of `path`, even if expired (or the index's)."""
        attr = self._attrs.get_stale(path)
        return attr if isinstance(attr, Attr) else self._older(path) if attr is None else None

    def stop_checking(self, wait: float = 0.0) -> None:  # the restart check's thread (first, at shutdown)
        self._checks.stop(wait)

    def close(self) -> None:
        """Shut the stat pool (once the prefetch pool, which may list through it, stopped)."""
        self._stat_pool.shutdown(wait=False, cancel_futures=True)  # a hung stat stays hung
        if self._listings is not None:
            self._listings.close()
