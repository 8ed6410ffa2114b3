"""Listings ahead: the directories a walk lists next, listed before it asks.

A walk (os.walk, torchvision's ImageFolder, `find`) lists a directory, looks up one of its
subdirectories, lists it, and so on, one request after another: on a store where a
listing is a round trip, or a cold disk where it is a seek, the walk waits for each of
them in series, and so did cachefs, one request at a time behind it. Once a reader
listed a directory, its subdirectories are stat'ed and listed in the background, in name
order (ImageFolder's, and that of most walks a training job makes), up to LIST_AHEAD
beyond the last one a reader listed, as many at a time as the pool has workers. A reader
asking for a listing in flight waits for it instead of asking the source again.

What is listed ahead is what a walk would list anyway, once each (the listings are
cached for --metadata-ttl): a walk in another order gets its listings later, never more
of them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Executor

from cachefs.config import LIST_AHEAD

log = logging.getLogger(__name__)

# Directories whose subdirectories are remembered (a walk descends through a few at once).
PARENTS = 64
# How long a reader waits for a listing in flight before asking itself (seconds): the
# listing goes through the source guard, whose timeout ends it well before.
WAIT_LIMIT = 120.0


class ListAhead:
    """Which directories to list ahead, and the listings in flight. Thread-safe."""

    def __init__(self, pool: Executor, fetch: Callable[[str], None], cached: Callable[[str], bool],
                 window: int = LIST_AHEAD):
        self._pool = pool
        self._fetch = fetch  # stats and lists one directory into the cache
        self._cached = cached  # whether a directory's listing is cached
        self._window = window
        self._lock = threading.Lock()
        # parent -> its subdirectories in name order, and each one's place in it
        self._subdirs: OrderedDict[str, tuple[list[str], dict[str, int]]] = OrderedDict()
        self._flying: dict[str, threading.Event] = {}

    def listed(self, path: str, subdirs: list[str]) -> None:
        """`path` was listed from the source (by a reader or ahead) with these subdirectories."""
        if not subdirs or self._window <= 0:
            return
        subdirs.sort()
        with self._lock:
            self._subdirs[path] = (subdirs, {d: i for i, d in enumerate(subdirs)})
            self._subdirs.move_to_end(path)
            while len(self._subdirs) > PARENTS:
                self._subdirs.popitem(last=False)

    def read(self, path: str) -> None:
        """A reader listed `path`: the siblings after it, and its own first subdirectories,
        are listed ahead."""
        if self._window <= 0:
            return
        parent = path.rpartition("/")[0] or "/"
        todo: list[str] = []
        with self._lock:
            siblings = self._subdirs.get(parent) if path != "/" else None
            if siblings is not None:
                i = siblings[1].get(path)
                if i is not None:
                    todo += siblings[0][i + 1:i + 1 + self._window]
            own = self._subdirs.get(path)
            if own is not None:
                todo += own[0][:self._window]
            todo = [d for d in todo if d not in self._flying and not self._cached(d)]
            for d in todo:
                self._flying[d] = threading.Event()
        for d in todo:
            try:
                self._pool.submit(self._run, d)
            except RuntimeError:  # the pool is closing
                self._done(d)

    def wait(self, path: str, blocking: Callable[[], contextlib.AbstractContextManager[object]]) -> bool:
        """Wait for `path`'s listing if it is in flight (inside `blocking`: the session
        then has another thread read requests); whether it was."""
        event = self._flying.get(path)
        if event is None:
            return False
        with blocking():
            event.wait(WAIT_LIMIT)
        return True

    def in_flight(self) -> int:
        return len(self._flying)

    def _run(self, path: str) -> None:
        try:
            self._fetch(path)
        except Exception as exc:  # a reader asking for it lists it itself, and sees the error
            log.debug("listing %s ahead failed: %s", path, exc)
        finally:
            self._done(path)

    def _done(self, path: str) -> None:
        with self._lock:
            event = self._flying.pop(path, None)
        if event is not None:
            event.set()
