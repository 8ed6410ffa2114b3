"""Warming: load a subtree into the cache ahead of training, in the store's order.

A `WarmJob` is a prefetch feeder at WARM priority, below a training job's own misses and
read-ahead: it walks the subtree depth-first in sorted order (the order a copied dataset
lies on disk and the order NFS lists it) and hands the pool one file at a time, so the
pool's workers fetch consecutive files in parallel. Blocks already cached are skipped
without touching the source, which makes a warm resumable: run it again and it loads
what is missing. It never evicts: once no tier has room it stops and reports what did
not fit.

With a shard (`cachefs warm PATH --shard RANK/WORLD`) a job warms only the files whose
path hashes to RANK of WORLD: N nodes each warm their share of a dataset into the shared
tier (`--shared-cache`), which then holds the whole of it for every node. The hash is of
the path under the source root, so every node splits the dataset alike.
"""

from __future__ import annotations

import functools
import logging
import stat as stat_mod
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import xxhash

from cachefs.readahead import DirectoryCursor

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from cachefs.core import Core


class WarmJob:
    def __init__(self, core: Core, roots: list[str], clock: Callable[[], float] = time.monotonic,
                 shard: tuple[int, int] | None = None):
        if shard is not None:
            rank, world = shard
            if not (isinstance(rank, int) and isinstance(world, int) and 0 <= rank < world):
                raise ValueError(f"shard must be RANK/WORLD with 0 <= RANK < WORLD, not {rank}/{world}")
        self._core = core
        self.roots = roots
        self.shard = shard
        self.error: str | None = None  # why the job stopped, if something failed under it
        self._clock = clock
        self._lock = threading.Lock()
        self._stack: list[DirectoryCursor] = []
        self._roots_left = sorted(roots, reverse=True)
        self._in_flight = 0
        self.started = clock()
        self.finished: float | None = None
        self.cancelled = False
        self.files_total = 0
        self.total_known = False  # the count of files to warm is complete (see _count_files)
        self.counts = {"files_done": 0, "files_loaded": 0, "files_cached": 0, "files_no_room": 0,
                       "files_failed": 0, "bytes_loaded": 0, "bytes_done": 0}
        self.no_room = False
        self._counted = threading.Thread(target=self._count_files, daemon=True)
        self._counted.start()

    # -- the total, for progress and ETA (listings only: no stat per file) ----------------

    def _count_files(self) -> None:
        total = 0
        todo = list(self.roots)
        while todo and not self.cancelled:
            path = todo.pop()
            try:
                attr = self._core.getattr(path)
                if not attr.is_dir:
                    total += 1 if attr.is_file and self.mine(path) else 0
                    continue
                for e in self._core.readdir(path):
                    child = path.rstrip("/") + "/" + e.name
                    if stat_mod.S_ISDIR(e.type_mode):
                        todo.append(child)
                    elif stat_mod.S_ISREG(e.type_mode) and self.mine(child):
                        total += 1
            except OSError:
                continue
            with self._lock:
                self.files_total = max(self.files_total, total)
        with self._lock:
            self.files_total = total
            self.total_known = not self.cancelled

    # -- the feeder ----------------------------------------------------------------------

    def __call__(self) -> tuple[object, Callable[[], object]] | None:
        while True:
            with self._lock:
                if self.cancelled or self.no_room:
                    return None
                if self._stack:
                    cursor = self._stack[-1]
                    name = cursor.next()
                    if name is None:
                        self._stack.pop()
                        continue
                    path = cursor.directory.rstrip("/") + "/" + name
                elif self._roots_left:
                    path = self._roots_left.pop()
                else:
                    return None
                self._in_flight += 1  # until listed or warmed: the job is not done meanwhile
            try:
                task = self._visit(path)
            except Exception as exc:  # a bug must end the job, not leave it "running" forever
                log.warning("warming stopped at %s: %s", path, exc)
                with self._lock:
                    self._in_flight -= 1
                    self.error = f"{path}: {exc}"
                    self.cancelled = True
                return None
            if task is not None:
                return path, task
            with self._lock:
                self._in_flight -= 1

    def _visit(self, path: str) -> Callable[[], object] | None:
        """A file's warm task; or None after pushing a directory (or skipping the path)."""
        try:
            attr = self._core.getattr(path)
        except OSError:
            self._count(files_failed=1, files_done=1)
            return None
        if attr.is_dir:
            try:
                entries = self._core.readdir(path)
            except OSError:
                return None
            # one cursor over files and subdirectories, in sorted order: depth first
            cursor = DirectoryCursor(path, (e.name for e in entries
                                            if stat_mod.S_ISDIR(e.type_mode) or stat_mod.S_ISREG(e.type_mode)))
            with self._lock:
                self._stack.append(cursor)
            return None
        if not attr.is_file or not self.mine(path):
            return None
        return functools.partial(self._warm_file, path, attr.size)

    def mine(self, path: str) -> bool:
        """Whether this job's shard holds the file (always, without a shard)."""
        if self.shard is None:
            return True
        rank, world = self.shard
        return xxhash.xxh64_intdigest(path.encode("utf-8", "surrogateescape")) % world == rank

    def _warm_file(self, path: str, size: int) -> None:
        try:
            outcome, fetched = self._core.prefetch_file(path)
        finally:
            with self._lock:
                self._in_flight -= 1
        if outcome == "no_room":
            self.no_room = True
            self._count(files_no_room=1, files_done=1, bytes_loaded=fetched, bytes_done=size)
        elif outcome == "error":
            self._count(files_failed=1, files_done=1)
        elif outcome == "cached":
            self._count(files_cached=1, files_done=1, bytes_done=size)
        else:
            self._count(files_loaded=1, files_done=1, bytes_loaded=fetched, bytes_done=size)

    def _count(self, **n: int) -> None:
        with self._lock:
            for k, v in n.items():
                self.counts[k] += v
        self._core.stats.add_many({f"warm.{k}": v for k, v in n.items() if k in ("files_loaded", "bytes_loaded")})

    # -- state ---------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        with self._lock:
            walked = not self._stack and not self._roots_left
            finished = (walked or self.no_room or self.cancelled) and self._in_flight == 0
        if finished and self.finished is None:
            self.finished = self._clock()
        return finished

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True

    def progress(self) -> dict[str, Any]:
        done = self.done
        with self._lock:
            out: dict[str, Any] = dict(self.counts)
            out["files_total"] = max(self.files_total, out["files_done"])
            # a walk that ended stopped short (no room, cancelled) has not seen every file: its
            # total is the counting thread's, known when that thread ends
            walked_all = done and not self.no_room and not self.cancelled
            out["total_known"] = self.total_known or walked_all
        elapsed = ((self.finished if done and self.finished else self._clock()) - self.started)
        out.update(state="failed" if self.error and done else "no_room" if self.no_room and done
                   else "cancelled" if self.cancelled and done else "done" if done else "running",
                   elapsed_s=round(elapsed, 3), roots=self.roots)
        if self.error:
            out["error"] = self.error
        if self.shard is not None:
            out["shard"] = list(self.shard)
        return out


def start(core: Core, paths: list[str], shard: tuple[int, int] | None = None) -> WarmJob:
    """Begin warming `paths` (files or directories) in the background; only the files of
    `shard` (rank, world) if given."""
    from cachefs.prefetch import WARM

    if core.prefetcher is None:
        raise RuntimeError("warming needs the prefetch pool (--prefetch-workers > 0)")
    for path in paths:
        core.getattr(path)  # ENOENT now, not halfway
    job = WarmJob(core, paths, shard=shard)
    core.prefetcher.add_feeder(WARM, job)
    return job


def finish(core: Core, job: WarmJob) -> None:
    job.cancel()
    if core.prefetcher is not None:
        core.prefetcher.remove_feeder(job)
