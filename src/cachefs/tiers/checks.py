"""The NVMe tier's checks of its own bytes: once after each start (the restart check),
and once per --scrub-interval for bit rot (the scrub). A mixin of DiskTier, kept apart
because it is its own job: what may be trusted after a restart, and at what pace the
background reads go.

After a clean stop (everything written back with syncfs, then the index's C line) an
entry whose file has not changed since is trusted at the cost of one stat: reading and
hashing 200,000 small files after every remount cost the daemon a third of its CPU in the
first epoch. What a clean stop does not vouch for (a crash, a file written to since) is
read and compared once before it is served. A serving process makes the same test when it
registers a backing id for a file's first open: those registrations vouch for their
records (Restored.vouch), and the check of the entry table's records waits while they come.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from cachefs.config import (
    CLEAN_MARGIN_NS,
    SCRUB_IDLE_BLOCKS,
    SCRUB_IDLE_RATE,
    SCRUB_RATE,
    TRUST_RATE,
    VOUCH_QUIET,
    WRITER_NICE,
)
from cachefs.directio import DescriptorCache, pread, pread_direct
from cachefs.identity import BlockKey
from cachefs.stats import Stats
from cachefs.tiers.coldset import COLD
from cachefs.tiers.entry import Entry
from cachefs.tiers.layout import SUBDIR_CHARS, block_hash

if TYPE_CHECKING:
    from cachefs.tiers.coldset import Restored
    from cachefs.tiers.table import Row

log = logging.getLogger(__name__)


class Synced(set):
    """An entry's blocks still to be checked after a start, all of them written back at a
    clean stop at `at_ns` (wall clock, ns): if the entry's file has not changed since, its
    blocks are trusted without reading them (DiskTier._trusted). Blocks recorded after the
    last clean stop, or of an entry written to since, are a plain set: each is read and
    compared with its hash before it is served."""

    __slots__ = ("at_ns",)

    def __init__(self, at_ns: int, blocks: object = ()):
        super().__init__(blocks)  # type: ignore[call-overload]
        self.at_ns = at_ns


def mark_synced(entries: dict[bytes, Entry], blocks: list[BlockKey], at_ns: int | None) -> None:
    """Mark `blocks` (recorded before a clean stop at `at_ns`, or after the last one: None)
    to be checked after this start. An entry keeps a Synced set while every block still to
    check was written back at a clean stop (the earliest one counts)."""
    for eid, i in blocks:
        e = entries.get(eid)
        if e is None or e.hashes[i] is None:
            continue
        u = e.unverified
        if at_ns is None:
            if type(u) is not set:
                e.unverified = u = set(u or ())
            u.add(i)
        elif u is None:
            e.unverified = Synced(at_ns, (i,))
        else:
            u.add(i)
            if type(u) is Synced:
                u.at_ns = min(u.at_ns, at_ns)



def behind_serving() -> None:
    """Lower the calling thread's priority to WRITER_NICE: background work (the scrub, the
    restart check) runs behind the daemon's serving threads."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WRITER_NICE)
    except (OSError, AttributeError):
        pass


class Checks:
    """The restart check and the scrub, over a DiskTier's entries (see the module's text)."""

    if TYPE_CHECKING:  # what it uses of DiskTier (FileStore comes after it in the MRO)
        _entries: dict[bytes, Entry]
        _restored: Restored | None
        _lock: threading.RLock
        _stats: Stats
        _stop: threading.Event
        _fds: DescriptorCache
        _direct: bool
        _scrub_every: float

        @property
        def suspended(self) -> bool: ...

        def file_of(self, name: str) -> str: ...

        @property
        def data_dir(self) -> str: ...

        def _unchanged(self, e: Entry, key: BlockKey, expected: object) -> bool: ...

        def _failed_check(self, key: BlockKey, why: str) -> None: ...

        def _verified(self, e: Entry, index: int) -> None: ...

        def _entry(self, eid: bytes) -> Entry | None: ...

        def _cold_blocks(self) -> list[BlockKey]: ...

        def _sweep_orphans(self) -> int: ...

    def _trusted(self, e: Entry) -> bool:
        """Whether the entry's blocks may be served without reading them: all were written
        back at a clean stop (syncfs, then the index's C line), and its file has not changed
        since (its ctime is from before that stop, its size as recorded). Someone writing
        to the file while the daemon was down changes its ctime; a crash leaves the blocks
        written since the last clean stop unmarked. Bit rot changes neither: that is the
        periodic scrub's (--scrub-interval). Anything else is read and compared, once."""
        u = e.unverified
        if type(u) is not Synced:
            return False
        ok = self._unchanged_since(e.name, u.at_ns, e.size)
        with self._lock:
            if e.unverified is u:
                e.unverified = None if ok else set(u)
        if ok:
            self._stats.incr("disk.trusted_files")
        return ok

    def _pause(self, activity: Callable[[], int], seen: int) -> int | None:
        """Wait until `activity` (a count of the job's opens of cached files) has not moved
        for VOUCH_QUIET since it was `seen`: its value then, or None if the tier is closing.
        The background passes after a start wait so for what the job's opens do anyway."""
        now = activity()
        while now != seen:
            seen = now
            if self._stop.wait(VOUCH_QUIET):
                return None
            now = activity()
        return seen

    def _row_unchanged(self, row: Row) -> bool:
        """_unchanged_since for a record of the entry table (one a clean stop wrote back)."""
        return self._unchanged_since(row.eid.hex(), row.synced_ns, row.attr.size)

    def _unchanged_since(self, name: str, at_ns: int, size: int, data_fd: int = -1) -> bool:
        """Whether entry file `name` is as a clean stop at `at_ns` left it: its ctime from
        before that stop (less the margin), its size `size`. False without a stop (`at_ns`
        0: not written back at one), or if it cannot be stat'ed (the read that follows finds
        out why). `data_fd`: the data directory, open (a stat beneath it, not by the whole
        path)."""
        if not at_ns:
            return False
        try:
            if data_fd < 0:
                st = os.stat(self.file_of(name))
            else:
                st = os.stat(f"{name[:SUBDIR_CHARS]}/{name}", dir_fd=data_fd, follow_symlinks=False)
        except OSError:
            return False
        return st.st_ctime_ns < at_ns - CLEAN_MARGIN_NS and st.st_size == size

    def _scrub_loop(self) -> None:
        """Check blocks in the background: first each entry once after the start
        (_restart_check), then every block once per --scrub-interval (at most SCRUB_IDLE_RATE
        bytes and SCRUB_IDLE_BLOCKS blocks a second), sleeping in between: bit rot shows up
        as a checksum failure and a refetch, never as bytes served, and an idle mount does
        no work between passes."""
        behind_serving()
        if self._restored is not None:
            if self._stop.wait(1.0) or not self._check_restored(self._restored):
                return
            self._sweep_orphans()
        while not self._stop.wait(1.0):
            with self._lock:
                entries = [eid for eid, e in self._entries.items() if e.unverified]
            if not entries:
                break
            if not self._restart_check(entries):
                return
        while self._scrub_every > 0 and not self._stop.wait(self._scrub_every):
            with self._lock:
                todo = [(eid, i) for eid, e in self._entries.items() for i, h in enumerate(e.hashes) if h is not None]
                todo += self._cold_blocks()  # (each brought into memory as it is read)
            if not self._scrub(todo, SCRUB_IDLE_RATE, SCRUB_IDLE_BLOCKS):
                return
            self._stats.incr("disk.scrub_passes")

    def _restart_check(self, todo: list[bytes]) -> bool:
        """Check the entries `todo` once after a start, off the serving path (a reader that
        comes first checks its own): trusted after a clean stop at one stat each (at most
        TRUST_RATE a second), otherwise each block read and compared (SCRUB_RATE bytes a
        second). False if the tier is closing."""
        debt = 0.0
        for eid in todo:
            e = self._entries.get(eid)
            u = e.unverified if e is not None else None
            if not u:
                continue
            if self._trusted(e):  # type: ignore[arg-type]  # (e is not None when u is set)
                debt += 1.0 / TRUST_RATE
            else:
                for i in sorted(u):
                    debt += self._check_block((eid, i)) / SCRUB_RATE
            if debt >= 0.05:
                if self._stop.wait(debt):
                    return False
                debt = 0.0
        return not self._stop.is_set()

    def _check_restored(self, restored: Restored) -> bool:
        """The restart check of the entries restored from the table, left out of memory
        where their file is as the clean stop left it (one stat each beneath the data
        directory, the records read in bulk: Table.synced; TRUST_RATE a second); the others
        are brought in (their records read whole, CRC and all), to be read and compared by
        the check of entries in memory that follows. False if the tier is closing."""
        debt = 0.0
        trusted = 0
        state = restored.state
        try:
            data_fd = os.open(self.data_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError:
            data_fd = -1  # (stat'ed by path: what fails there, the reads that follow find)
        vouched = -1
        try:
            for n, eid, synced_ns, size in restored.table.synced():
                if vouched != restored.vouched:  # the job is opening files the serving processes test
                    if (paused := self._pause(lambda: restored.vouched, vouched)) is None:
                        return False
                    vouched = paused
                if state[n] != COLD:
                    continue  # in memory, gone, or trusted already (by needs_check, ahead of this pass)
                ok = self._unchanged_since(eid.hex(), synced_ns, size, data_fd)
                row = None if ok else restored.row(n)
                with self._lock:
                    if state[n] == COLD:
                        if ok:
                            restored.trust(n)
                            trusted += 1
                        elif row is not None:  # (a record failing its CRC: its file is fetched again when read)
                            restored.take(n, row)
                debt += 1.0 / TRUST_RATE
                if debt >= 0.05:
                    self._stats.incr("disk.trusted_files", trusted)
                    trusted = 0
                    if self._stop.wait(debt):
                        return False
                    debt = 0.0
        finally:
            if data_fd >= 0:
                os.close(data_fd)
        self._stats.incr("disk.trusted_files", trusted)
        return not self._stop.is_set()

    def _scrub(self, todo: list[BlockKey], rate: float, blocks_rate: float) -> bool:
        """Check `todo` at most `rate` bytes (and `blocks_rate` blocks, if not 0) a second;
        False if the tier is closing."""
        pause = 1.0 / blocks_rate if blocks_rate else 0.0
        for key in todo:
            if self._stop.wait(max(pause, self._check_block(key) / rate)):
                return False
        return not self._stop.is_set()

    def _check_block(self, key: BlockKey) -> int:
        """Read one block and compare it with its hash; the bytes read."""
        eid, i = key
        with self._lock:
            e = self._entry(eid)
            if e is None or e.hashes[i] is None or self.suspended:
                return 0
            expected = e.hashes[i]
            offset, length = e.extent(i)
        try:
            fd = self._fds.get(e.name)
            try:
                data = pread_direct(fd, offset, length) if self._direct else pread(fd, offset, length)
            finally:
                os.close(fd)
        except OSError:
            return 0
        self._stats.incr("disk.scrubbed_bytes", len(data))
        if len(data) != length or block_hash(data) != expected:
            if self._unchanged(e, key, expected):  # not evicted or rewritten while it was read
                self._failed_check(key, "found by the scrub")
        else:
            self._verified(e, i)
        return length
