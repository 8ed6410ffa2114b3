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

Listings bring no attributes. The first lookup of a file in a directory that found nothing
cached has the directory listed again with every entry's attributes, in the background
(once per --metadata-ttl): one listing in the directory's own order (NFS's READDIRPLUS;
on a local disk, stats in inode order, which the disk reads ahead, where a shuffled
epoch's lookups would read the inodes in random order: a cold epoch of 200,000 files ran
at 0.74x without), and the lookups that follow find them. Where something looks a
directory's entries up one after another (`ls -l`, `du`, a job reading a folder in
order), ATTRS_AHEAD_AFTER lookups in a row wait for that listing rather than stat each
file, and for ATTRS_WANTED_FOR seconds after, every listing brings its entries'
attributes and READDIRPLUS hands them to the kernel: the rest of an `ls -lR` costs no
lookup per file. A shuffled epoch's lookups seldom come twice in a row from one directory
of many, and a walk that only lists (os.walk, ImageFolder) looks no file up.
"""

from __future__ import annotations

import contextlib
import logging
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Executor

from cachefs.config import LIST_AHEAD
from cachefs.identity import DirEntry

log = logging.getLogger(__name__)

# Directories whose subdirectories are remembered (a walk descends through a few at once).
PARENTS = 64
# Different files of one directory looked up in a row that mean `ls -l` (see above).
ATTRS_AHEAD_AFTER = 4
# ...and how long listings bring attributes after (seconds; renewed by the next such run).
ATTRS_WANTED_FOR = 10.0
# Directories whose attributes' fetch is remembered (a fetch again after --metadata-ttl).
ATTRS_DIRS = 100_000
# How long a reader waits for a listing in flight before asking itself (seconds): the
# listing goes through the source guard, whose timeout ends it well before.
WAIT_LIMIT = 120.0


def _attrs_key(directory: str) -> str:
    """The key of a directory's listing with attributes in flight (no path has a NUL)."""
    return "\0attrs" + directory


class ListAhead:
    """Which directories to list ahead, and the listings in flight. Thread-safe."""

    def __init__(self, pool: Executor, fetch: Callable[[str], None], cached: Callable[[str], bool],
                 fetch_attrs: Callable[[str], object], window: int = LIST_AHEAD, attrs_every: float = 3600.0):
        self._pool = pool
        self._fetch = fetch  # stats and lists one directory into the cache
        self._cached = cached  # whether a directory's listing is cached
        self._fetch_attrs = fetch_attrs  # lists one directory with its entries' attributes
        self._window = window
        self._lock = threading.Lock()
        # parent -> its subdirectories in name order, and each one's place in it
        self._subdirs: OrderedDict[str, tuple[list[str], dict[str, int]]] = OrderedDict()
        self._flying: dict[str, threading.Event] = {}
        self._run_dir = ""  # the directory of the last files looked up, the last one, and how many
        self._run_name = ""
        self._run = 0
        self._attrs_until = 0.0  # time.monotonic() until which listings bring attributes
        self._attrs_every = attrs_every  # seconds before a directory's attributes are fetched again
        self._attrs_fetched: OrderedDict[str, float] = OrderedDict()  # directory -> when

    def listed(self, path: str, entries: Iterable[DirEntry]) -> None:
        """`path` was listed (from the source or its kept copy, by a reader or ahead)."""
        if self._window <= 0:
            return
        prefix = path.rstrip("/") + "/"
        subdirs = sorted(prefix + e.name for e in entries if e.type_mode == stat.S_IFDIR)
        if not subdirs:
            return
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
                self._pool.submit(self._run_task, d, self._fetch, d)
            except RuntimeError:  # the pool is closing
                self._done(d)

    def missed(self, path: str) -> None:
        """A lookup of `path` found nothing cached and stat'ed it (see above)."""
        directory = path.rpartition("/")[0] or "/"
        key = _attrs_key(directory)
        now = time.monotonic()
        with self._lock:
            last = self._attrs_fetched.get(directory)
            if key in self._flying or (last is not None and now - last < self._attrs_every):
                return
            self._attrs_fetched[directory] = now
            self._attrs_fetched.move_to_end(directory)
            while len(self._attrs_fetched) > ATTRS_DIRS:
                self._attrs_fetched.popitem(last=False)
            self._flying[key] = threading.Event()
        try:
            self._pool.submit(self._run_task, key, self._fetch_attrs, directory)
        except RuntimeError:  # the pool is closing
            self._done(key)

    def looked_up(self, path: str) -> None:
        """A reader looked up the file `path` (cached or not): ATTRS_AHEAD_AFTER different
        files of one directory in a row are `ls -l` (see above)."""
        directory, _, name = path.rpartition("/")
        with self._lock:
            if directory != self._run_dir:
                self._run_dir, self._run_name, self._run = directory, name, 1
            elif name != self._run_name:  # (an open looks its file up again)
                self._run_name = name
                self._run += 1
                if self._run >= ATTRS_AHEAD_AFTER:
                    self._attrs_until = time.monotonic() + ATTRS_WANTED_FOR

    def attrs_wanted(self) -> bool:
        """Whether listings should bring their entries' attributes now (see above)."""
        return time.monotonic() < self._attrs_until

    def wait(self, path: str, blocking: Callable[[], contextlib.AbstractContextManager[object]],
             attrs: bool = False) -> bool:
        """Wait for `path`'s listing if it is in flight (inside `blocking`: the session
        then has another thread read requests); whether it was. `attrs`: the listing with
        the attributes of `path`'s entries (see missed)."""
        event = self._flying.get(_attrs_key(path) if attrs else path)
        if event is None:
            return False
        with blocking():
            event.wait(WAIT_LIMIT)
        return True

    def in_flight(self) -> int:
        return len(self._flying)

    def _run_task(self, key: str, fetch: Callable[[str], object], path: str) -> None:
        try:
            fetch(path)
        except Exception as exc:  # a reader asking for it lists it itself, and sees the error
            log.debug("listing %s ahead failed: %s", path, exc)
        finally:
            self._done(key)

    def _done(self, path: str) -> None:
        with self._lock:
            event = self._flying.pop(path, None)
        if event is not None:
            event.set()
