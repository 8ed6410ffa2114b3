"""Small-file fills: passthrough mode's read-ahead of files of one block (most of a dataset
of images), one visit to the source each (open, fstat, read, close) instead of a stat and
then a read, straight into the NVMe tier, by a fetch process where there are some
(cachefs/fetcher.py), in the daemon's own threads where there are none.

A fetch process writes the file before the daemon admits it: its room in the budget is
held meanwhile (and handed to the admission), so the budget holds with fetches in flight.
The daemon keeps every decision: single flight, admission, the index, the stats.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import NamedTuple

from cachefs.blockpath import Fetching, share_wait
from cachefs.blocks import block_key
from cachefs.errors import SourceChanged, invalidates
from cachefs.fetcher import (
    CHANGED,
    ERROR,
    EXISTS,
    LARGE,
    READ,
    SHARED,
    STORED,
    UNSTORED,
    Fetchers,
    FetchUnavailable,
    Fill,
    Filled,
)
from cachefs.identity import Attr, BlockKey, EntryInfo, FileId

Outcome = tuple[str, int] | None  # (what happened, bytes fetched); None: not a one-block file


class Claim(NamedTuple):
    """A file of one block this thread fills (it owns the block's flight)."""

    fid: FileId
    key: BlockKey
    pending: Future[object]


class SmallFills:
    def __init__(self, parts: Fetching):
        (self._source, self._meta, self._guard, self._flights, self._cache, self._stats, self._guesses,
         self._on_changed, self.namespace, self.block_size) = parts
        self.fetchers: Fetchers | None = None  # fetch processes, once started (use_fetchers)

    def use_fetchers(self, fetchers: Fetchers) -> None:
        """Fill through these fetch processes from now on (they start after INIT, once
        passthrough is known: see cachefs.daemon.start_fetchers)."""
        fetchers.on_late = self._late
        self.fetchers = fetchers

    def _late(self, request: Fill, reply: Filled) -> None:
        """A fill its caller stopped waiting for (--source-timeout) that its fetch process
        finished: the files it wrote are nobody's. They are adopted where the tiers have
        free room, as a fill ahead's would be (or are another fill's by now, or deleted):
        left behind, the NVMe one made the next fills of the file find it written and give
        up, and the RAM one kept RAM from ever taking the file, outside RAM's budget."""
        if reply.kind != STORED:
            return
        attr = reply.attr
        if attr is None:  # (its bytes came from the shared tier: the version asked for)
            if request.expect is None:
                return
            attr = _attr_of(request.expect)
        fid = request.expect if reply.attr is None else FileId.of(request.path, attr)
        assert fid is not None
        key = block_key(self.namespace, fid, 0, self.block_size)
        self._cache.adopt(key, attr.size, reply.hash, EntryInfo(request.path, attr, self.block_size),
                          ram_reserved=0 if reply.in_ram else None)
        self._stats.incr("source.late_fills")  # (once taken: a reader of the count finds the file held)

    @property
    def batches_shared(self) -> bool:
        """Whether fetch processes ask the shared tier themselves (directory read-ahead then
        sends batches: one shared-tier round trip for many files)."""
        return self.fetchers is not None and self.fetchers.shared

    # -- what to fill ------------------------------------------------------------------------

    def _claim(self, path: str, hit: Attr, reserve: bool) -> Claim | Outcome:
        """The fill of a file of one block whose attributes are known: the file's identity,
        its key and the claim on it (owned by the caller), or the outcome if there is
        nothing to fetch. With `reserve`, its room on NVMe is held too (see fill_many)."""
        if not hit.is_file or not 0 < hit.size <= self.block_size:
            return None
        expect = FileId.of(path, hit)
        key = block_key(self.namespace, expect, 0, self.block_size)
        cache = self._cache
        if cache.contains(key):
            # After a restart each entry is checked once before it is passed through:
            # done here, ahead of the job, instead of in its open
            cache.verify(key[0])
            return "cached", 0
        if not (cache.reserve(hit.size) if reserve else cache.has_room(hit.size)):
            self._stats.incr("prefetch.no_room")
            return "no_room", 0
        pending, owner = self._flights.claim(key)
        if not owner:
            if reserve:
                cache.unreserve(hit.size)
            return "inflight", 0
        return Claim(expect, key, pending)

    @contextmanager
    def _owning(self, claims: list[Claim]) -> Iterator[None]:
        """Around the fetch of claimed files: waiters wake when it is over, and look for the
        entry (BlockPath.block)."""
        try:
            with self._flights.owning(*(key for _, key, _ in claims)):
                yield
        finally:
            for _, key, pending in claims:
                self._flights.end(key, pending, (b"", "source"))

    # -- one file ---------------------------------------------------------------------------

    def fill(self, path: str) -> Outcome:
        """Fetch the file at `path` into the NVMe tier if it is a file of one block.
        Returns (outcome, bytes fetched) as BlockPath.prefetch_file does, or None if it is
        not a regular file of one block (prefetch_file's business)."""
        hit = self._meta.cached(path)
        if hit is None:
            # Its identity first: a stat (listings bring none), which the job's own lookup
            # of the file then finds cached. The fill claims the file's key with it, so
            # that an open of the file meanwhile waits for this fetch instead of fetching
            # it again, and the shared tier is asked by identity (maybe no read at all).
            try:
                hit = self._meta.getattr(path)
            except OSError:
                return "error", 0
        if not isinstance(hit, Attr):
            return "error", 0
        claim = self._claim(path, hit, reserve=False)
        if not isinstance(claim, Claim):
            return claim
        with self._owning([claim]):
            return self._fetch(path, claim.fid, claim.key)

    def _fetch(self, path: str, expect: FileId, key: BlockKey) -> Outcome:
        """The fetch of fill(), owning `key`."""
        if self._cache.shares:
            info = EntryInfo(path, _attr_of(expect), self.block_size)
            data = self._cache.get_shared(block_key(self.namespace, expect, 0, self.block_size), info)
            known = self._meta.last_known(path)
            if data is not None and known is not None:
                return self._fetched(path, key, Filled(SHARED, known, data=data), None)
        fetchers = self.fetchers
        if fetchers is None:
            return self._fetched(path, key, self._read_here(path, expect), None)
        room = [expect.size]
        if not self._cache.reserve(room[0]):
            self._stats.incr("prefetch.no_room")
            return "no_room", 0
        ram_room = self._ram_room(fetchers, expect.size)
        try:
            try:
                reply = self._guard.call("stat", fetchers.fill, path, self.block_size, expect,
                                         self._guard.timeout or None, bool(ram_room[0]))
            except FetchUnavailable:  # this one is done here; all of them, if none is left
                if fetchers.channels <= 0 and self.fetchers is fetchers:
                    self.fetchers = None
                    fetchers.close()
                reply = self._read_here(path, expect)
            except OSError:
                reply = Filled(ERROR)
            return self._fetched(path, key, reply, room, ram_room=ram_room)
        finally:
            self._unreserve(room, ram_room)

    def fill_open(self, fid: FileId) -> str | None:
        """A reader's open of this cold file of one block: fetched by a fetch process into
        the NVMe tier (and RAM's, while RAM has room, as read-ahead's fills are), the
        daemon adopting it, its request on this thread under the fetch process's own
        timeout. Where the bytes came from ("source"), or None if it was not done here (no
        fetch process or none free, a shared tier, no free room, another thread fetching
        it or done with it): the caller fetches it the block path's way. The source's
        error fails the open as the block path's would (a file changed since its lookup:
        ESTALE, and its name is looked up again). A fill in the daemon's own threads cost
        the daemon 0.1-0.2 ms more per file (the source's system calls and the NVMe write
        under its interpreter lock, the hand-off to a source thread)."""
        fetchers = self.fetchers
        cache = self._cache
        # (no channel free: a busy moment, or as many hung files as channels; the block
        # path's source threads then do it)
        if fetchers is None or cache.shares:
            return None
        if not fetchers.idle:
            self._stats.incr("opens.fill_busy")
            return None
        if not cache.reserve(fid.size):
            return None
        key = block_key(self.namespace, fid, 0, self.block_size)
        room, ram_room = [fid.size], [0]
        try:
            pending, owner = self._flights.claim(key)
            if not owner:
                return None
            with self._owning([Claim(fid, key, pending)]):
                if cache.contains(key):  # filled ahead between the open's look and the claim
                    return None
                ram_room = self._ram_room(fetchers, fid.size)
                try:
                    # the reader waits on a read: timed and counted as one (a fill ahead
                    # counts its visit as a stat, and the read untimed)
                    reply = self._guard.call("read_range", fetchers.fill_for_reader, fid.path, self.block_size,
                                             fid, self._guard.timeout or None, bool(ram_room[0]), bounded=True)
                except FetchUnavailable:  # the processes died (rare)
                    return None
                except SourceChanged:
                    self._changed(fid.path)
                    raise
                except OSError as exc:
                    if invalidates(exc):
                        self._on_changed(fid.path)  # gone or replaced: the cached stat is wrong
                    raise
                outcome = self._fetched(fid.path, key, reply, room, ram_room=ram_room, guess=False)
            return "source" if outcome is not None and outcome[0] == "fetched" else None
        finally:
            self._unreserve(room, ram_room)

    def _changed(self, path: str) -> None:
        """The source's file at `path` is not the version the fill asked for: counted, and
        its cached attributes forgotten (the next lookup asks the source)."""
        self._stats.incr("source.changed")
        self._on_changed(path)

    def _ram_room(self, fetchers: Fetchers, size: int) -> list[int]:
        """RAM's room for a fill's copy, held if free ([0]: none; the fill is NVMe's alone).
        The fetch process writes the copy from the bytes it has: RAM takes the file at its
        fill, not behind a later open (a copy there made the daemon's open register the
        file twice and take its node back once)."""
        return [size if fetchers.ram and self._cache.reserve_ram(size) else 0]

    def _unreserve(self, room: list[int], ram_room: list[int]) -> None:
        """Give back what a fill held and did not hand to an admission."""
        if room[0]:
            self._cache.unreserve(room[0])
        if ram_room[0]:
            self._cache.unreserve_ram(ram_room[0])

    def _read_here(self, path: str, expect: FileId) -> Filled:
        """A fill's visit to the source in this process, as a fetch process's reply (READ,
        with the bytes)."""
        try:
            attr, data = self._guard.call("stat", self._source.read_whole, path, self.block_size, expect)
        except SourceChanged:
            return Filled(CHANGED)
        except OSError:
            return Filled(ERROR)
        return Filled(READ, attr, data=data) if data is not None else Filled(LARGE, attr)

    # -- a batch of one directory's files ------------------------------------------------------

    def fill_many(self, paths: list[str]) -> list[Outcome]:
        """fill() for several files of one directory at once, through one request to a fetch
        process (which asks the shared tier for all of them in one request per server): the
        daemon's cost per file is its bookkeeping, not a round trip each. Files whose
        identity could not be had, or that are not one block, go one by one."""
        fetchers = self.fetchers
        if not self._cache.has_disk or fetchers is None:
            return [self.fill(p) for p in paths]
        out: list[Outcome] = [None] * len(paths)
        batch: list[tuple[int, Claim]] = []
        unknown = [path for path in paths if self._meta.cached(path) is None]
        found: dict[str, Attr] = {}
        if unknown:  # identities first (see fill), stat'ed in parallel (a cached file's: the index's, not kept)
            with contextlib.suppress(OSError):  # those left unknown go one by one, and fail there
                found = self._meta.attrs_of(unknown, fetch=True)
        for i, path in enumerate(paths):
            hit = found.get(path) or self._meta.cached(path)
            claim = self._claim(path, hit, reserve=True) if isinstance(hit, Attr) else None
            if claim is None:
                out[i] = self.fill(path)
            elif isinstance(claim, Claim):
                batch.append((i, claim))
            else:
                out[i] = claim
                if claim[0] == "no_room":
                    break
        if not batch:
            return out
        claims = [claim for _, claim in batch]
        rooms = [[c.fid.size] for c in claims]
        ram_rooms = [self._ram_room(fetchers, c.fid.size) for c in claims]
        with self._owning(claims):
            shared_done = False  # the fetch process stored what it read in the shared tier
            try:
                try:
                    got = self._guard.call("stat", fetchers.fill_many,
                                           [Fill(c.fid.path, self.block_size, c.fid, bool(r[0]))
                                            for c, r in zip(claims, ram_rooms, strict=True)],
                                           self._guard.timeout or None)
                    replies, shared_done = got.replies, fetchers.shared
                    if got.counts:
                        self._stats.add_many(got.counts)  # what the fetch process counted of the shared tier
                    if got.servers:
                        self._cache.count_shared_servers(got.servers)  # and per server, for cachefs stats
                except FetchUnavailable:
                    replies = [self._read_here(c.fid.path, c.fid) for c in claims]
                except OSError:
                    replies = [Filled(ERROR)] * len(claims)
                for (i, c), reply, room, ram_room in zip(batch, replies, rooms, ram_rooms, strict=True):
                    if reply.attr is None and reply.kind in (STORED, EXISTS, UNSTORED):  # from the shared tier
                        known = self._meta.last_known(c.fid.path)
                        reply = reply._replace(attr=known) if known is not None else Filled(ERROR)
                    out[i] = self._fetched(c.fid.path, c.key, reply, room, shared_done, ram_room)
            finally:
                for room, ram_room in zip(rooms, ram_rooms, strict=True):
                    self._unreserve(room, ram_room)
        return out

    # -- what comes back ----------------------------------------------------------------------

    def _fetched(self, path: str, key: BlockKey, reply: Filled, room: list[int] | None,
                 shared_done: bool = False, ram_room: list[int] | None = None, guess: bool = True) -> Outcome:
        """What a fill does with the answer: cache the attributes, adopt or store the file
        (handing the held `room`, and `ram_room` if RAM got a copy, to the admissions),
        count, and queue what came from the source for the shared tier (unless
        `shared_done`: a batch whose fetch process stored it there itself). `guess`: a
        fill of read-ahead's (counted as prefetch.*), not a reader's open."""
        kind = reply.kind
        if kind == CHANGED:
            self._changed(path)
            return "error", 0
        if kind == ERROR:
            if guess:
                self._stats.incr("prefetch.errors")
            return "error", 0
        attr = reply.attr
        assert attr is not None
        self._meta.remember(path, attr)  # what the job's lookup will ask
        if not attr.is_file or not 0 < attr.size <= self.block_size:
            return None if kind == LARGE else ("cached", 0)
        # Counted as a stat (the open and fstat), and a read if it was read: the two
        # requests an NFS client sends (OPEN or GETATTR, then READ).
        from_shared = kind == SHARED or reply.shared
        if not from_shared:
            self._stats.add_many({"source.read_range": 1, "source.bytes": attr.size} if guess else
                                 {"source.bytes": attr.size})
        cache = self._cache
        if kind == EXISTS:
            return "cached" if cache.contains(key) else "inflight", 0
        if kind == UNSTORED:
            cache.write_failed(OSError(reply.errno, reply.message))
            return "error", 0
        if guess:
            self._guesses.add(key)  # before it is visible in a tier (see BlockPath.prefetch_block)
        info = EntryInfo(path, attr, self.block_size)
        if kind in (READ, SHARED):
            assert reply.data is not None
            admitted = cache.put(key, reply.data, info, evict=False, to_ram=False)
        else:
            assert kind == STORED and room is not None
            held, room[0] = room[0], 0
            ram_held = None
            if reply.in_ram and ram_room is not None:
                ram_held, ram_room[0] = ram_room[0], 0
            admitted = cache.adopt(key, attr.size, reply.hash, info, reserved=held, ram_reserved=ram_held)
        if not admitted:
            if guess:
                self._guesses.discard(key)
                self._stats.incr("prefetch.no_room")
            return "no_room", 0
        self._meta.stored(path, attr)  # its lookups are the index's from now
        if guess:
            self._stats.add_many({"prefetch.blocks": 1, "prefetch.bytes": attr.size})
        if cache.shares and not from_shared and not shared_done:
            cache.share(key, reply.data if kind == READ else None, info, wait=share_wait())
        return "fetched", attr.size


def _attr_of(fid: FileId) -> Attr:
    """Attributes standing for a file version whose stat is not at hand."""
    return Attr(0o100444, 1, 0, 0, fid.size, fid.mtime_ns, fid.mtime_ns, fid.ctime_ns, version=fid.version)
