"""A cache tier whose entries are files: one file per cached source-file version, holding the
file's bytes at their own offsets and nothing else, so that the kernel can read it directly
(FUSE passthrough). Small files are one block and written whole; large ones are sparse,
filled block by block, with the blocks present tracked in memory (and, for the NVMe tier,
in its index log).

The policy (cachefs/policy.py) decides per block, as before: the keys are (entry id, block
index). A block the policy drops is punched out of its file; the last block of an entry,
or any block of an entry the kernel has open for passthrough, takes the whole entry's file
with it (unlinked: a reader that has it open keeps reading the version it opened).

Two subclasses: `MemoryTier` (files on tmpfs, the RAM budget) and `DiskTier` (files on the
cache disk, with an index that survives restarts).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable

from cachefs.config import FD_CACHE
from cachefs.directio import DescriptorCache, pread, pread_direct
from cachefs.identity import BlockKey, EntryInfo
from cachefs.policy import DEFAULT_POLICY, Policy, make_policy
from cachefs.stats import Stats
from cachefs.tiers.entry import Entry, allocated
from cachefs.tiers.layout import block_hash, entry_file, punch_hole, write_all

log = logging.getLogger(__name__)


class FileStore:
    """The machinery both tiers share. Thread-safe; writes are synchronous."""

    name = "store"

    def __init__(self, directory: str, capacity: int, stats: Stats | None = None,
                 policy: str | Policy = DEFAULT_POLICY, max_idle: float | None = None, direct: bool = False):
        self._dir = directory
        self._data = os.path.join(directory, "data")
        os.makedirs(self._data, mode=0o700, exist_ok=True)
        self._capacity = int(capacity)
        self._stats = stats or Stats()
        self.policy = policy if isinstance(policy, Policy) else make_policy(policy, self._capacity, max_idle)
        self._entries: dict[bytes, Entry] = {}
        self._lock = threading.RLock()
        self._direct = direct and self._probe_direct()
        self._fds = DescriptorCache(self._open_read, FD_CACHE, share=8)
        self.on_evict: Callable[[BlockKey], None] | None = None  # told of every evicted block
        self.on_drop: list[Callable[[bytes], None]] = []  # told of every entry dropped whole
        self.read_latency = 0.0  # seconds: moving average of a block read that hit
        self._made_dirs: set[str] = set()
        self._reserved = 0  # bytes held for files fetch processes are writing (see reserve)
        self._warned_check = False

    # -- paths and descriptors --------------------------------------------------------

    @property
    def directory(self) -> str:
        return self._dir

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        return self.policy.used

    def file_of(self, name: str) -> str:
        return entry_file(self._data, name)

    def _probe_direct(self) -> bool:
        probe = os.path.join(self._dir, ".direct-probe")
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT | os.O_CLOEXEC, 0o600)
            os.close(fd)
            return True
        except OSError:
            return False  # tmpfs and others refuse O_DIRECT: read through the page cache
        finally:
            try:
                os.unlink(probe)
            except OSError:
                pass

    def _open_read(self, name: str) -> int:
        return os.open(self.file_of(name), os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if self._direct else 0))

    def _open_write(self, name: str) -> int:
        path = self.file_of(name)
        sub = os.path.dirname(path)
        if sub not in self._made_dirs:
            os.makedirs(sub, mode=0o700, exist_ok=True)
            self._made_dirs.add(sub)
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)

    def clear(self) -> None:
        """Drop every entry (the tier stays usable)."""
        with self._lock:
            keys = list(self.policy.keys())
            for key in keys:
                self.policy.remove(key)
        self._evict(keys, counted=False)

    # -- lookups ----------------------------------------------------------------------

    def __contains__(self, key: BlockKey) -> bool:
        return key in self.policy

    def probably_has(self, key: BlockKey) -> bool:
        """Held, judged from memory (no I/O)."""
        return key in self.policy

    def __len__(self) -> int:
        return len(self.policy)

    def entry_ids(self) -> list[bytes]:
        """The ids of the entries held in memory now."""
        with self._lock:
            return list(self._entries)

    def entry(self, eid: bytes) -> Entry | None:
        return self._entry(eid)

    def _entry(self, eid: bytes) -> Entry | None:
        """The entry `eid` in memory (the NVMe tier brings one it restored at its start in)."""
        return self._entries.get(eid)

    def _cold_blocks(self) -> list[BlockKey]:
        """Blocks held but not in memory (the NVMe tier's restored entries)."""
        return []

    def info_of(self, eid: bytes) -> EntryInfo | None:
        e = self._entry(eid)
        return None if e is None else EntryInfo(e.path, e.attr, e.block_size)

    def get(self, key: BlockKey, lo: int = 0, hi: int | None = None, info: EntryInfo | None = None) -> bytes | None:
        """The block's bytes [lo:hi], counting an access; None (a miss) if it is not held,
        cannot be read, or fails its check. Only the range is read (a 4 KiB page fault
        does not copy a 1 MiB block), unless the block is still to be checked."""
        data = self._read(key, lo=lo, hi=hi)
        with self._lock:
            if data is not None and key in self.policy:
                self.policy.hit(key)
            else:
                self.policy.miss()
        return data

    def peek(self, key: BlockKey) -> bytes | None:
        """The block if held, without counting an access (a re-check, not a read)."""
        return self._read(key)

    def _read(self, key: BlockKey, buffered: bool = False, lo: int = 0, hi: int | None = None) -> bytes | None:
        """The block's bytes [lo:hi], checked against its hash if it has not been since the
        start (then the whole block is read). `buffered`: through the page cache even where
        the tier reads with O_DIRECT (for a file the kernel is about to read directly: it
        finds the pages there)."""
        eid, index = key
        with self._lock:
            e = self._entry(eid)
            if e is None or index >= len(e.hashes) or e.hashes[index] is None or not self._usable():
                return None
            expected = e.hashes[index]
            check = e.unverified is not None and index in e.unverified
            offset, length = e.extent(index)
            punched = e.punched
        if check and self._trusted(e):
            check = False
        hi = length if hi is None else min(hi, length)
        lo = min(max(lo, 0), hi)
        part = not check and (lo, hi) != (0, length)
        start = time.perf_counter()
        direct = self._direct and not buffered
        try:
            fd = self._fds.get(e.name) if not buffered else os.open(self.file_of(e.name), os.O_RDONLY | os.O_CLOEXEC)
            try:
                if part and not direct:
                    data = pread(fd, offset + lo, hi - lo)
                elif part:  # O_DIRECT: aligned pages around the range
                    a = lo & ~4095
                    data = pread_direct(fd, offset + a, min(length, -(-hi // 4096) * 4096) - a)[lo - a:hi - a]
                else:
                    data = pread_direct(fd, offset, length) if direct else pread(fd, offset, length)
            finally:
                os.close(fd)
        except OSError as exc:
            self._read_failed(key, exc)
            return None
        want = hi - lo if part else length
        if len(data) != want or (check and block_hash(data) != expected):
            if self._unchanged(e, key, expected):
                self._failed_check(key, "short" if len(data) != want else "checksum mismatch")
            return None
        if check:
            self._verified(e, index)
            if (lo, hi) != (0, length):
                data = data[lo:hi]
        elif not self._kept(e, eid, punched):
            return None  # dropped while read: what was read may be a hole of a newer file
        self.read_latency += (time.perf_counter() - start - self.read_latency) * 0.05
        self._read_ok()
        return data

    def _usable(self) -> bool:
        return True

    def _read_ok(self) -> None:
        pass

    def _read_failed(self, key: BlockKey, exc: OSError) -> None:
        log.debug("reading cached block of %s failed: %s", key[0].hex(), exc)
        self.discard(key)

    def _unchanged(self, e: Entry, key: BlockKey, expected: object) -> bool:
        """Whether the block read is still the tier's, as it was when the read began: an
        entry evicted, punched or written anew meanwhile (another thread's eviction, a new
        version) reads short or different, and that is a miss, not corruption."""
        with self._lock:
            now = self._entries.get(key[0])
            return now is e and key[1] < len(e.hashes) and e.hashes[key[1]] == expected

    def _kept(self, e: Entry, eid: bytes, punched: int) -> bool:
        """Whether the entry is still the tier's and no block of it was punched since
        `punched`: a read that began before a drop may have met the hole it left, or the
        file of a newer entry of the same id (not yet written there), and reads as zeros."""
        with self._lock:
            return self._entries.get(eid) is e and e.punched == punched

    def _failed_check(self, key: BlockKey, why: str) -> None:
        self._stats.incr(f"{self.name}.checksum_failures")
        path = self._entries[key[0]].path if key[0] in self._entries else key[0].hex()
        if not self._warned_check:  # once: a scribbled-on cache would otherwise log a line per file
            self._warned_check = True
            log.warning("cached block %d of %s failed verification (%s); dropping it and refetching "
                        "(further failures: %s.checksum_failures in cachefs stats)", key[1], path, why, self.name)
        else:
            log.debug("cached block %d of %s failed verification (%s)", key[1], path, why)
        self.discard(key)

    def _trusted(self, e: Entry) -> bool:
        """Whether the entry's unchecked blocks may be served without reading them (the NVMe
        tier's clean stops, see DiskTier._trusted); then they count as checked."""
        return False

    def _verified(self, e: Entry, index: int) -> None:
        with self._lock:
            if e.unverified is not None:
                e.unverified.discard(index)
                if not e.unverified:
                    e.unverified = None

    # -- writes -----------------------------------------------------------------------

    def has_room(self, size: int) -> bool:
        return self._usable() and self.policy.has_room(allocated(size))

    def put(self, key: BlockKey, data: bytes | memoryview, info: EntryInfo, evict: bool = True) -> bool:
        """Write a block into its entry's file if the policy admits it; with evict=False only
        into free room (a guess never pushes out cached data)."""
        return self._put(key, data, info, lambda size: self.policy.admit(key, size, evict),
                         "refused" if evict else "no_room")

    def _put(self, key: BlockKey, data: bytes | memoryview, info: EntryInfo,
             admit: Callable[[int], list[Hashable] | None], refused: str) -> bool:
        if not self._writable():
            return False
        eid, index = key
        size = allocated(len(data))
        with self._lock:
            e = self._entry(eid)
            if e is not None and e.hashes[index] is not None:
                return True
            self._before_admit(size)
            victims = admit(size)
            if victims is None:
                self._stats.incr(f"{self.name}.{refused}")
                return False
            new = e is None
            if new:
                e = Entry(eid, info.path, info.attr, info.block_size, time.time())
                self._entries[eid] = e
        assert e is not None
        self._evict(victims)
        h = block_hash(data)
        try:
            fd = self._open_write(e.name)
            try:
                if new and len(e.hashes) > 1:
                    os.ftruncate(fd, e.size)  # sparse: blocks arrive at their offsets
                write_all(fd, data, index * e.block_size)
                if new and len(e.hashes) == 1:
                    os.ftruncate(fd, len(data))  # a leftover file of a crashed run was longer
            finally:
                os.close(fd)
        except OSError as exc:
            with self._lock:
                self.policy.remove(key)
                if new and e.present == 0:
                    self._entries.pop(eid, None)
            self._write_failed(exc)
            return False
        with self._lock:
            current = self._entries.get(eid)
            kept = key in self.policy and current is e
            if kept and e.hashes[index] is None:
                e.hashes[index] = h
                e.present += 1
                self._recorded(e, index, h, new)
            elif not kept:  # evicted or dropped while we wrote: nothing to record
                self._abandoned(eid, e, current)
        if not kept:
            return False
        self._stats.add_many({f"{self.name}.writes": 1, f"{self.name}.written_bytes": len(data)})
        return True

    def _abandoned(self, eid: bytes, e: Entry, current: Entry | None) -> None:
        """A write whose block was let go meanwhile (the tier's lock held). If its entry
        holds nothing and nothing is being written to it, the entry goes, and the file with
        it; if the entry went already, the file the write re-created goes. Under the lock:
        a file unlinked outside it may already be a newer entry's of the same id."""
        if current is e:
            if e.present or any((eid, i) in self.policy for i in range(len(e.hashes))):
                return
            del self._entries[eid]
        elif current is not None:
            return  # a newer entry's file: not this write's to delete
        self._unlink(e.name)

    def unadopted(self, eid: bytes) -> None:
        """Delete a file written at entry `eid`'s path for adoption that will not be adopted,
        unless an entry of that id owns the path now (a write of its own may share the
        file: see _abandoned)."""
        with self._lock:
            if self._entry(eid) is None:
                self._unlink(eid.hex(), counted=False)

    def _unlink(self, name: str, counted: bool = True) -> None:
        """Delete an entry's file, with the tier's lock held (see _abandoned); a failure
        counts as the tier's write failure if `counted`."""
        self._fds.forget(name)
        try:
            os.unlink(self.file_of(name))
        except FileNotFoundError:
            pass
        except OSError as exc:
            if counted:
                self._write_failed(exc)

    def reserve(self, size: int) -> bool:
        """Hold `size` bytes of the budget for a file a fetch process is about to write
        (it is written before it is admitted): False if they are not free. Every reserve
        is followed by one release() of the same size."""
        size = allocated(size)
        with self._lock:
            if not self._usable() or self.policy.used + size > self.policy.capacity:
                return False
            self._reserved += size
            self.policy.capacity -= size
            return True

    def unreserve(self, size: int) -> None:
        size = allocated(size)
        with self._lock:
            self._reserved -= size
            self.policy.capacity += size

    def adopt(self, key: BlockKey, size: int, h: int, info: EntryInfo, evict: bool = False,
              reserved: int = 0) -> str:
        """Take the file a fetch process wrote at this entry's path (cachefs/fetcher.py) as
        the entry, whose one block is `key`: "adopted"; "held" if the entry exists already
        (someone else wrote it, or is writing it: the file is theirs); "refused" if the
        policy does not admit it, or the tier takes no writes (the file is deleted).
        `reserved`: room held for it by reserve(), given back here in the same step."""
        eid, index = key
        name = eid.hex()
        path = self.file_of(name)
        victims = None
        writable = self._writable()
        if writable:
            asize = allocated(size)
            with self._lock:  # (an RLock) the held room goes to this admission, no other
                if reserved:
                    self.unreserve(reserved)
                    reserved = 0
                if self._entry(eid) is not None:
                    return "held"
                self._before_admit(asize)
                victims = self.policy.admit(key, asize, evict)
                if victims is None:
                    self._stats.incr(f"{self.name}.{'refused' if evict else 'no_room'}")
                    self._unlink(name)
                else:
                    e = Entry(eid, info.path, info.attr, info.block_size, time.time())
                    e.hashes[index] = h
                    e.present = 1
                    self._entries[eid] = e
                    self._made_dirs.add(os.path.dirname(path))
                    self._recorded(e, index, h, True)
        if reserved:
            self.unreserve(reserved)
        if victims is None:
            if not writable:  # (refused by the policy, it went under the lock)
                self.unadopted(eid)
            return "refused"
        self._evict(victims)
        self._stats.add_many({f"{self.name}.writes": 1, f"{self.name}.written_bytes": size})
        return "adopted"

    @property
    def data_dir(self) -> str:
        return self._data

    def _writable(self) -> bool:
        return True

    def _before_admit(self, size: int) -> None:
        pass

    def _recorded(self, e: Entry, index: int, h: int, new: bool) -> None:
        pass

    def write_failed(self, exc: OSError) -> None:
        """A write to this tier made elsewhere (a fetch process) failed: counted as ours."""
        self._write_failed(exc)

    def _write_failed(self, exc: OSError) -> None:
        log.warning("writing to the %s tier failed: %s", self.name, exc)

    # -- eviction ---------------------------------------------------------------------

    def _evict(self, victims: list[Hashable] | None, counted: bool = True) -> None:
        """Drop blocks the policy let go (already out of the policy)."""
        if not victims:
            return
        for key in victims:
            self._drop_block(key)  # type: ignore[arg-type]
        if counted:
            self._stats.incr(f"{self.name}.evictions", len(victims))
        if self.on_evict is not None:
            for key in victims:
                self.on_evict(key)  # type: ignore[arg-type]

    def _drop_block(self, key: BlockKey) -> None:
        eid, index = key
        with self._lock:
            e = self._entry(eid)
            if e is None or e.hashes[index] is None:
                return
            e.hashes[index] = None
            e.present -= 1
            whole = e.present == 0 or e.users > 0
            if whole:
                # The kernel may be reading it (passthrough): never punch a hole under a
                # reader. The entry goes whole; an open file keeps its bytes. Blocks still
                # being written go too (their writers find them gone).
                for i in range(len(e.hashes)):
                    self.policy.remove((eid, i))
                    e.hashes[i] = None
                e.present = 0
                del self._entries[eid]
            else:
                e.punched += 1
            self._dropping(e, -1 if whole else index)
            # The file changes under the lock: outside it, a put of the same id may already
            # have made a newer entry whose file this unlink or hole would take.
            if whole:
                self._unlink(e.name)
            else:
                self._punch(e, index)
        if whole:
            for listener in self.on_drop:
                listener(eid)

    def _punch(self, e: Entry, index: int) -> None:
        offset, length = e.extent(index)
        try:
            fd = self._open_write(e.name)
            try:
                punch_hole(fd, offset, allocated(length))
            finally:
                os.close(fd)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
                self._write_failed(exc)

    def _dropping(self, e: Entry, index: int) -> None:
        """Recorded before the file changes (index -1: the whole entry)."""

    def discard(self, key: BlockKey) -> None:
        with self._lock:
            held = self.policy.remove(key)
        if held:
            self._evict([key], counted=False)

    def mark_stale(self, key: BlockKey) -> None:
        with self._lock:
            self.policy.mark_stale(key)

    # -- whole entries, for passthrough -------------------------------------------------

    def backing_file(self, eid: bytes, acquire: bool = False) -> str | None:
        """The path of the entry's file if every block is present (and checked since the
        start): what the kernel may read directly. None otherwise. With `acquire`, held
        for the kernel until release(), in the same step."""
        with self._lock:
            e = self._entry(eid)
            if e is None or not e.complete or not self._usable():
                return None
            if not e.unverified:
                return self._acquired(eid, e) if acquire else self.file_of(e.name)
            unverified = sorted(e.unverified)
        # once per entry after a start: trusted (DiskTier's clean stops), or each block read and compared
        if not self._trusted(e):
            for index in unverified:
                if self._read((eid, index), buffered=True) is None:
                    return None
        if not acquire:
            return self.file_of(e.name)
        with self._lock:
            e = self._entry(eid)
            return None if e is None or not e.complete else self._acquired(eid, e)

    def hit_whole(self, eids: list[bytes]) -> list[bool]:
        """Opens of entries' files answered elsewhere (a serving process's report): the
        blocks of each entry here whole count as hits of the policy, as an open acquired
        here would; for each, whether it was. The lock is taken once per 32 (an entry
        restored from the table is read in under it, and other users wait meanwhile)."""
        found: list[bool] = []
        entry_of = self._entry
        for at in range(0, len(eids), 32):
            with self._lock:
                if not self._usable():
                    found += [False] * len(eids[at:at + 32])
                    continue
                hits: list[BlockKey] = []
                for eid in eids[at:at + 32]:
                    e = entry_of(eid)
                    if e is not None and e.complete:
                        hits += [(eid, i) for i in range(len(e.hashes))]
                        found.append(True)
                    else:
                        found.append(False)
                self.policy.hit_many(hits)
        return found

    def needs_check(self, eid: bytes) -> bool:
        e = self._entry(eid)
        return e is not None and bool(e.unverified)

    def _acquired(self, eid: bytes, e: Entry) -> str:
        e.users += 1
        self._hit_blocks(eid, e)
        return self.file_of(e.name)

    def _hit_blocks(self, eid: bytes, e: Entry) -> None:
        self.policy.hit_many([(eid, i) for i in range(len(e.hashes))])

    def acquire(self, eid: bytes) -> bool:
        """The kernel opened the entry's file for passthrough: it is not punched until released."""
        with self._lock:
            e = self._entry(eid)
            if e is None:
                return False
            e.users += 1
            for i in range(len(e.hashes)):
                if (eid, i) in self.policy:
                    self.policy.hit((eid, i))
            return True

    def release(self, eid: bytes) -> None:
        with self._lock:  # (an entry out of memory, a cold record, has no holds to release)
            e = self._entries.get(eid)
            if e is not None and e.users > 0:
                e.users -= 1

    # -- checks and shutdown ------------------------------------------------------------

    def check(self) -> None:
        """Assert the invariants (tests): policy bookkeeping, blocks present = policy keys."""
        with self._lock:
            self.policy.check()
            held = {(eid, i) for eid, e in self._entries.items() for i, h in enumerate(e.hashes) if h is not None}
            cold = self._cold_blocks()
            assert not held.intersection(cold) and len(set(cold)) == len(cold), "a block both cold and in memory"
            held.update(cold)
            assert held == set(self.policy.keys()), "tier and policy disagree"
            for e in self._entries.values():
                assert e.present == sum(h is not None for h in e.hashes), "present count drifted"

    def flush(self) -> None:
        """Writes are synchronous: nothing is waiting."""

    def close(self) -> None:
        self._fds.close()
