"""The prefetch executor: a bounded pool of source fetchers with priorities.

Demand misses never queue here: the reader's own FUSE thread fetches them at once, and a
fetch already running for the same block (started by this pool) is shared through the
core's single-flight map instead of being issued twice. The pool runs what is left, best
priority first:

    HINT (0)       the files a job said it reads next (cachefs/hints.py)
    READAHEAD (1)  blocks ahead of a sequential reader inside a file
    DIR (2)        files of a directory the job is reading, in sorted order
    WARM (3)       `cachefs warm` and `--warm`, in the store's order

Queued tasks are de-duplicated by key (a second submit of a queued key only raises its
priority). Lower-priority work comes from *feeders*, callables asked for one task at a
time when nothing better is queued, so a million-file warm never sits in memory as a
million tasks. `step()` runs one task in the calling thread: the tests drive the executor
with it, deterministically and without threads; `start()` runs `workers` threads that
call it in a loop.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
from collections.abc import Callable, Hashable

from cachefs.config import PREFETCH_POLL, PREFETCH_POLL_MAX
from cachefs.stats import Stats

log = logging.getLogger(__name__)

HINT, READAHEAD, DIR, WARM = 0, 1, 2, 3

# Names of the pool's threads. The core calls the source directly from these (a guess that
# hangs holds one pool thread, not a reader); see Core._call_source.
THREAD_PREFIX = "cachefs-prefetch-"

Task = Callable[[], object]
# A feeder returns (key, task) or None when it has nothing (now).
Feeder = Callable[[], "tuple[Hashable, Task] | None"]


class Prefetcher:
    def __init__(self, workers: int, stats: Stats | None = None, max_queued: int = 4096):
        self.workers = workers
        self.max_queued = max_queued
        self._stats = stats or Stats()
        self._heap: list[tuple[int, int, Hashable]] = []
        self._queued: dict[Hashable, tuple[int, Task]] = {}  # key -> (priority, task)
        self._feeders: list[tuple[int, int, Feeder]] = []
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._stats.gauge("prefetch.queued", lambda: len(self._queued))

    # -- feeding -------------------------------------------------------------------------

    def submit(self, key: Hashable, task: Task, priority: int) -> bool:
        """Queue `task` under `key`; False if that key is already queued at this priority or
        better, or the queue is full (read-ahead is a guess: dropping it is always safe)."""
        with self._lock:
            queued = self._queued.get(key)
            if queued is not None and queued[0] <= priority:
                return False
            if queued is None and len(self._queued) >= self.max_queued:
                self._stats.incr("prefetch.dropped")
                return False
            self._queued[key] = (priority, task)
            heapq.heappush(self._heap, (priority, next(self._seq), key))
            self._wake.notify()
        return True

    def add_feeder(self, priority: int, feeder: Feeder) -> None:
        with self._lock:
            self._feeders.append((priority, next(self._seq), feeder))
            self._feeders.sort(key=lambda f: (f[0], f[1]))
            self._wake.notify_all()

    def remove_feeder(self, feeder: Feeder) -> None:
        with self._lock:
            self._feeders = [f for f in self._feeders if f[2] is not feeder]

    def wake(self, one: bool = False) -> None:
        """A feeder has work again: for all idle workers, or (one=True) for one task's worth
        (a hint window that moved by one file must not wake sixteen threads)."""
        with self._lock:
            if one:
                self._wake.notify()
            else:
                self._wake.notify_all()

    # -- running -------------------------------------------------------------------------

    def _pop(self) -> Task | None:
        """Best queued task, else the first feeder's next task (lock held)."""
        while self._heap:
            priority, _, key = heapq.heappop(self._heap)
            queued = self._queued.get(key)
            if queued is None or queued[0] != priority:
                continue  # superseded by a resubmit at a better priority
            del self._queued[key]
            return queued[1]
        return None

    def _from_feeders(self) -> Task | None:
        for _priority, _seq, feeder in list(self._feeders):
            try:
                item = feeder()
            except Exception as exc:
                log.warning("prefetch feeder failed: %s", exc)
                self.remove_feeder(feeder)
                continue
            if item is not None:
                return item[1]
        return None

    def step(self) -> bool:
        """Run the best available task in this thread; False if there was none."""
        with self._lock:
            # a feeder of better priority than every queued task goes first (order hints)
            feeder_first = bool(self._feeders) and (not self._heap or self._feeders[0][0] < self._heap[0][0])
            task = None if feeder_first else self._pop()
        if task is None:
            task = self._from_feeders()  # outside the lock: feeders may list directories
        if task is None and feeder_first:
            with self._lock:
                task = self._pop()
        if task is None:
            return False
        try:
            task()
        except Exception as exc:  # a failed guess is only counted
            self._stats.incr("prefetch.errors")
            log.debug("prefetch task failed: %s", exc)
        return True

    def _worker(self) -> None:
        poll = PREFETCH_POLL
        while True:
            with self._lock:
                if self._stopping:
                    return
            if self.step():
                poll = PREFETCH_POLL
                continue
            with self._lock:
                if self._stopping:
                    return
                # Feeders are polled again on wake-up, or after a while that doubles while
                # they have nothing (a full cache that frees room does not wake anyone):
                # an idle mount's sixteen workers polling five times a second cost 0.4%
                # of a core.
                woken = self._wake.wait(poll if self._feeders else None)
            poll = PREFETCH_POLL if woken else min(poll * 2, PREFETCH_POLL_MAX)

    def start(self) -> None:
        for i in range(self.workers):
            t = threading.Thread(target=self._worker, name=f"{THREAD_PREFIX}{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopping = True
            self._heap.clear()
            self._queued.clear()
            self._feeders.clear()
            self._wake.notify_all()
        for t in self._threads:
            t.join(timeout)
        self._threads.clear()

    def __len__(self) -> int:
        return len(self._queued)
