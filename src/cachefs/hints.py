"""Order hints: a job tells the daemon which files it will read next, and the daemon fetches
that window into RAM ahead of the reads (opt-in; cachefs.torch.HintedSampler sends them).

No transparent cache can guess a shuffled epoch's order; the sampler knows it. Each job's
hints are one *session*, tied to one control-socket connection:

    client -> {"op": "hint", "lookahead": N, "label": "..."}       opens the session
    daemon -> {"session": id, "budget_bytes": B}                   (not final)
    client -> {"paths": ["/a/1.jpg", ...], "yielded": k}           as its sampler advances
    client closes the connection (epoch over, job gone, kill -9)   -> the session ends

`yielded` is how many samples the sampler has handed out; paths arrive in the order the
job will read them, up to `lookahead` samples ahead of it.

The daemon (HintBoard):
  - fetches each session's paths in order, on the prefetch pool, ahead of everything but
    demand misses, into RAM from the source (also offered to NVMe, as a demand miss would
    be), and from NVMe only while NVMe reads take HINT_DISK_LATENCY or more: below that
    the job's own read costs less than fetching ahead;
  - pins each block it fetched until the job reads it: no policy evicts a pinned block,
    and a hinted block replaces unpinned ones (oldest access first) whatever the policy;
  - keeps at most `budget` bytes pinned: HINT_RAM_SHARE of the RAM tier, split evenly
    between the live sessions, so it never evicts what it fetched before it is read;
  - never pins a block the job read before its fetch started (the job got ahead of the
    pool there: the fetch moves on to the next file);
  - releases a pin when the block is read, when the job's sampler is `lookahead` samples
    past it (the job skipped it), and when the session ends: an epoch cut short or a
    crashed job leaves nothing pinned.
Without a session nothing changes: the only cost on the read path is one attribute test.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from cachefs.blocks import block_extent, block_key
from cachefs.config import HINT_DISK_LATENCY, HINT_RAM_SHARE, HINT_READ_MEMORY, MAX_QUEUED_PATHS, WAKE_MORE_ROOM
from cachefs.hintclient import DEFAULT_LOOKAHEAD
from cachefs.identity import BlockKey, FileId

if TYPE_CHECKING:
    from cachefs.core import Core

log = logging.getLogger(__name__)







class HintSession:
    def __init__(self, sid: int, label: str, lookahead: int):
        self.id = sid
        self.label = label
        self.lookahead = max(1, lookahead)
        self.queue: deque[tuple[int, str]] = deque()  # (position, path) not fetched yet
        self.received = 0  # positions given out so far
        self.yielded = 0  # samples the job's sampler has handed out
        self.holds: dict[BlockKey, tuple[int, int]] = {}  # key -> (position, size): pinned for us
        self.pinned = 0  # bytes
        self.reserved = 0  # bytes being fetched for this session
        self.closed = False
        self.full = False  # a fetch found the window full: wait for a read to free some


class HintBoard:
    """The daemon's side: sessions, their windows, and the pins they hold."""

    def __init__(self, core: Core, share: float = HINT_RAM_SHARE):
        self._core = core
        self._cache = core.cache
        self.limit = int(self._cache.ram_capacity * share)
        self._lock = threading.Lock()
        self._sessions: dict[int, HintSession] = {}
        self._holders: dict[BlockKey, list[HintSession]] = {}  # key -> sessions holding a pin
        self._ids = itertools.count(1)
        self._turn = 0
        self._fetching: dict[BlockKey, bool] = {}  # key being fetched -> a job read it meanwhile
        # Blocks a job read while a session was open, before any session pinned them or
        # started their fetch: the job got ahead of the pool there, and fetching one now
        # would pin a block already read, holding a share of the window until the session
        # ends (a bounded memory, oldest first: HINT_READ_MEMORY).
        self._read_first: dict[BlockKey, None] = {}
        # Read by the block path on every block read: True while a session is open or a pin
        # is held (the only cost on the read path without a session is this test).
        self.holding = False
        self._watchers: list[Callable[[bool], None]] = []  # told when sessions start and stop
        stats = core.stats
        stats.gauge("hint.sessions", lambda: len(self._sessions))
        stats.gauge("hint.pinned_bytes", lambda: sum(s.pinned for s in list(self._sessions.values())))
        stats.gauge("hint.queued", lambda: sum(len(s.queue) for s in list(self._sessions.values())))

    # -- sessions ----------------------------------------------------------------------

    def open(self, label: str = "", lookahead: int = DEFAULT_LOOKAHEAD) -> HintSession:
        with self._lock:
            session = HintSession(next(self._ids), label, lookahead)
            self._sessions[session.id] = session
            self.holding = True
            if len(self._sessions) == 1:
                for watcher in self._watchers:
                    watcher(True)
        self._core.stats.incr("hint.sessions_opened")
        return session

    def watch(self, watcher: Callable[[bool], None]) -> None:
        """Call `watcher(True)` when sessions start (now, if some are open) and
        `watcher(False)` when the last one ends; under the board's lock, so it must be
        quick (the serving processes' report interval: ServeTable.report_opens)."""
        with self._lock:
            self._watchers.append(watcher)
            if self._sessions:
                watcher(True)

    def budget(self) -> int:
        """Bytes one session may hold pinned now."""
        return self.limit // max(1, len(self._sessions))

    def add(self, session: HintSession, paths: Iterable[str], yielded: int) -> None:
        """The job's next paths, in read order, and how far its sampler has got."""
        paths = list(paths)
        released: list[BlockKey] = []
        with self._lock:
            if session.closed:
                return
            for path in paths:
                session.queue.append((session.received, path))
                session.received += 1
            while len(session.queue) > MAX_QUEUED_PATHS:
                session.queue.popleft()
                self._core.stats.incr("hint.skipped")
            session.yielded = max(session.yielded, int(yielded))
            # Pins the sampler has left `lookahead` samples behind: the job skipped them.
            horizon = session.yielded - session.lookahead
            for key, (position, _) in list(session.holds.items()):
                if position < horizon:
                    self._release(session, key)
                    released.append(key)
        self._core.stats.incr("hint.paths", len(paths))
        if released:
            self._core.stats.incr("hint.expired", len(released))
        self._wake()

    def close(self, session: HintSession) -> None:
        """The job went away (or its epoch ended): drop its queue and every pin it holds."""
        with self._lock:
            session.closed = True
            session.queue.clear()
            self._sessions.pop(session.id, None)
            unread = len(session.holds)
            for key in list(session.holds):
                self._release(session, key)
            if not self._sessions:
                self._read_first.clear()
                self.holding = bool(self._holders)
                for watcher in self._watchers:
                    watcher(False)
        if unread:
            self._core.stats.incr("hint.expired", unread)
        self._wake()

    def _release(self, session: HintSession, key: BlockKey) -> None:
        """Drop one session's pin of `key` (lock held)."""
        _, size = session.holds.pop(key)
        session.pinned -= size
        session.full = False
        holders = self._holders.get(key)
        if holders is not None:
            holders.remove(session)
            if not holders:
                del self._holders[key]
        self._cache.unpin(key)
        self.holding = bool(self._holders) or bool(self._sessions)

    def _wake(self, one: bool = False) -> None:
        if self._core.prefetcher is not None:
            self._core.prefetcher.wake(one)

    # -- the read path -----------------------------------------------------------------

    def on_read(self, key: BlockKey) -> None:
        """A job read `key`: one session's pin of it is used up (the one hinted earliest)."""
        with self._lock:
            holders = self._holders.get(key)
            if not holders:
                if key in self._fetching:
                    self._fetching[key] = True  # read off the fetch itself, before its pin lands
                elif self._sessions:
                    read_first = self._read_first
                    read_first[key] = None
                    if len(read_first) > HINT_READ_MEMORY:
                        del read_first[next(iter(read_first))]
                return
            session = min(holders, key=lambda s: s.holds[key][0])
            was_full = session.full or session.pinned >= self.budget()
            self._release(session, key)
        self._core.stats.incr("hint.used")
        if was_full:
            self._wake(one=True)

    # -- fetching (a prefetch feeder) --------------------------------------------------

    def __call__(self) -> tuple[object, Callable[[], object]] | None:
        """The next path of the next session with room in its budget, round robin."""
        with self._lock:
            found = self._next_locked()
            if found is None:
                return None
            session, position, path = found
            # Falling behind (much of the window free): each worker that found work wakes
            # one more, up to the whole pool, which a slow store needs. Ahead (the window
            # nearly full, the steady state over NVMe): one worker per file the job reads,
            # as more threads would only fight the job's reads for the GIL.
            room = self.budget() - session.pinned - session.reserved
            more = bool(session.queue) and room > self.budget() * WAKE_MORE_ROOM
        if more:
            self._wake(one=True)
        return ("hint", session.id, position), functools.partial(self._fetch, session, position, path)

    def _next_locked(self) -> tuple[HintSession, int, str] | None:
        sessions = [s for s in self._sessions.values() if s.queue]
        if not sessions:
            return None
        budget = self.budget()
        for i in range(len(sessions)):
            session = sessions[(self._turn + i) % len(sessions)]
            if session.full or session.pinned + session.reserved >= budget:
                continue
            while session.queue:
                position, path = session.queue.popleft()
                if position < session.yielded - session.lookahead:
                    self._core.stats.incr("hint.skipped")  # the job passed it while queued
                    continue
                self._turn += i + 1
                return session, position, path
        return None

    def _fetch(self, session: HintSession, position: int, path: str) -> None:
        core = self._core
        try:
            fid = core.file_id(path)
        except OSError:
            core.stats.incr("hint.errors")
            return
        try:
            for index in range(-(-fid.size // core.block_size)):
                if session.closed:
                    return
                if not self._fetch_block(session, position, fid, index):
                    with self._lock:  # the window is full: this file waits at the front
                        if not session.closed:
                            session.queue.appendleft((position, path))
                    return
        except OSError as exc:  # the job's own read will see (and report) the error
            core.stats.incr("hint.errors")
            log.debug("hinted fetch of %s failed: %s", path, exc)

    def _fetch_block(self, session: HintSession, position: int, fid: FileId, index: int) -> bool:
        """Pin one block for `session`; False if its window is full (the file waits)."""
        core = self._core
        key = block_key(core.namespace, fid, index, core.block_size)
        _, length = block_extent(index, fid.size, core.block_size)
        size = self._cache.room_of(length)  # what it takes in RAM (whole pages), as the tier counts it
        with self._lock:
            if session.closed or key in session.holds:
                return True
            if key in self._read_first:  # the job read it already: no pin, on to the next
                del self._read_first[key]
                core.stats.incr("hint.passed")
                return True
            # Bytes in flight are reserved, so that concurrent fetches (one per pool
            # thread) never take the session past its budget, nor RAM past the pin limit.
            if session.pinned + session.reserved + size > self.budget() and session.pinned + session.reserved > 0:
                session.full = True  # until the job reads one of its blocks
                core.stats.incr("hint.window_full")
                return False
            session.reserved += size
            self._fetching.setdefault(key, False)
        read_meanwhile = False
        try:
            outcome = core.fetch_pinned(fid, index, self.limit, HINT_DISK_LATENCY)
        finally:
            with self._lock:
                session.reserved -= size
                read_meanwhile = bool(self._fetching.pop(key, False))
        if outcome in ("inflight", "on_disk"):
            if outcome == "on_disk":
                core.stats.incr("hint.left_on_disk")
            return True  # a reader is fetching it right now, or its NVMe read is cheap
        if outcome == "refused":  # RAM is all pinned (by other sessions): wait
            with self._lock:
                session.full = True
            return False
        with self._lock:
            if session.closed or key in session.holds or read_meanwhile:
                # the session ended, or pinned it twice, or the job already read it (it
                # waited for this very fetch): nothing to hold
                self._cache.unpin(key)
                if read_meanwhile:
                    core.stats.incr("hint.used")
                return True
            session.holds[key] = (position, size)
            session.pinned += size
            self._holders.setdefault(key, []).append(session)
            self.holding = True
        core.stats.add_many({f"hint.from_{outcome}": 1, "hint.bytes": length})
        return True

def attach(core: Core) -> HintBoard:
    """Order hints for this core (given to it as Core(..., hints=attach)): a board, fed to
    its prefetch pool ahead of every other guess. The core calls the board back on reads
    (Core.hints) and imports nothing of it."""
    assert core.prefetcher is not None, "order hints need the prefetch pool"
    from cachefs.prefetch import HINT

    board = HintBoard(core)
    core.prefetcher.add_feeder(HINT, board)
    return board
