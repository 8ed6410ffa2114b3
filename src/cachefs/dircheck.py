"""The restart check's queue: directories to list with attributes in the background, each
before its trust runs out (cachefs/metadata.py, "the directory's check").

After a restart a directory is trusted without the source while its kept listing and its
files' index records are within --metadata-ttl. Where both were, the directory was passed
by, and nothing checked it until a lookup found a record past the TTL and asked the source,
one stat per file until a listing with attributes landed: a remount whose records were
older than the TTL and whose listings were not (kept by a later run) stat'ed 13,000-20,000
of 200,000 files in its first epoch, at a third of the speed. Here a directory comes up
again when its trust runs out, less a margin, so that its check lands before the job
meets the expired records.

The records of a tree run out together (its directories were checked together, and each
check renews all of a directory's records at once), so the checks are CHECK_WORKERS at a
time, and the margin is a fifth of the TTL (at most AHEAD_MAX): 1,000 directories checked
at ~0.3 s each (a listing of 1,281 uncached inodes beside an epoch) take ~75 s. A
directory waits in a heap by when it is due, once however often it is queued; one thread
sleeps until the first is due or one is queued, and hands it to the workers.
"""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from queue import Empty, SimpleQueue

AHEAD_MAX = 300.0  # seconds: at most, a trusted directory is checked this long before its trust runs out
CHECK_WORKERS = 4  # directories checked at a time (each a listing with attributes, then a compare)


class CheckQueue:
    def __init__(self, due: Callable[[str], float | None], check: Callable[[str], object], ttl: float,
                 workers: int = CHECK_WORKERS):
        self._due = due  # wall time by which a directory must be checked; None: it needs none (checked)
        self._check = check  # list it with attributes (compares and confirms: Metadata._check_dir)
        self.ahead = min(AHEAD_MAX, ttl / 5)
        self._workers = workers
        self._queue: SimpleQueue[str] = SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._running: set[str] = set()  # handed to the workers, not done (not queued again)
        self.waiting: set[str] = set()  # the directories waiting until they are due (the loop's)

    def submit(self, directory: str) -> None:
        """Check `directory` when it is due (at once if it is now)."""
        self._queue.put(directory)
        with self._lock:
            if self._thread is None:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="cachefs-check")
                self._thread = threading.Thread(target=self._loop, name="cachefs-check", daemon=True)
                self._thread.start()

    def stop(self, wait: float = 0.0) -> None:
        """The thread ends, and checks not started are dropped (at shutdown, first: they
        list through the source pool)."""
        self._queue.put("")
        thread = self._thread
        if wait and thread is not None:
            thread.join(wait)

    def _loop(self) -> None:
        later: list[tuple[float, str]] = []  # (when to look again, directory)
        waiting = self.waiting  # the directories in `later`
        assert self._pool is not None
        try:
            while True:
                try:
                    timeout = max(0.0, later[0][0] - time.time()) if later else None
                    directory = self._queue.get(timeout=timeout)
                except Empty:
                    directory = heapq.heappop(later)[1]
                    waiting.discard(directory)
                if not directory:
                    return
                with self._lock:
                    if directory in waiting or directory in self._running:  # (queued again)
                        continue
                due = self._due(directory)
                if due is None:
                    continue
                if due - self.ahead > time.time():
                    waiting.add(directory)
                    heapq.heappush(later, (due - self.ahead, directory))
                    continue
                with self._lock:
                    self._running.add(directory)
                self._pool.submit(self._run, directory)
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, directory: str) -> None:
        try:
            self._check(directory)
        except OSError:
            pass  # the job's own lookups see the error
        finally:
            with self._lock:
                self._running.discard(directory)
