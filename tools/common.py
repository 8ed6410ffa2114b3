"""What the benchmarks and the demo share: a work dir, the dataset, the page cache, budgets
measured with psutil, medians.

Every tool makes its dataset once per --workdir (deterministic JPEGs, tools/mkdataset.py),
removes a temporary work dir at the end unless --keep, and keeps it (and says where) when
something failed, so the logs in it can be read.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
from collections.abc import Iterable, Iterator

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.mkdataset import build


def add_workspace_options(p: argparse.ArgumentParser, repeats: int | None = None) -> None:
    p.add_argument("--workdir", help="keep the dataset here between runs (default: a temp dir, removed)")
    p.add_argument("--keep", action="store_true", help="keep the temp work dir afterwards")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    if repeats is not None:
        p.add_argument("--repeats", type=int, default=repeats, help=f"runs to take the median of (default {repeats})")


@contextlib.contextmanager
def workspace(args: argparse.Namespace, prefix: str) -> Iterator[str]:
    """The work dir: --workdir, or a temp dir removed at the end unless --keep or a failure."""
    work = getattr(args, "workdir", None) or tempfile.mkdtemp(prefix=f"cachefs-{prefix}-")
    os.makedirs(work, exist_ok=True)
    failed = False
    try:
        yield work
    except BaseException:
        failed = True
        raise
    finally:
        if failed:
            print(f"{prefix}: kept the work dir for its logs: {work}", file=sys.stderr)
        elif not getattr(args, "workdir", None) and not getattr(args, "keep", False):
            shutil.rmtree(work, ignore_errors=True)


def ensure_dataset(path: str, classes: int, per_class: int, mean_kb: float = 110.0, quiet: bool = False) -> int:
    """Make the ImageFolder of JPEGs at `path` unless it is there; return its size in bytes."""
    if not os.path.isdir(path):
        if not quiet:
            print(f"making {classes * per_class} JPEGs in {path}", file=sys.stderr)
        build(path, classes, per_class, seed=0, mean_kb=mean_kb, progress=sys.stderr.isatty())
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def drop_caches() -> bool:
    """Write back and drop the kernel's page cache (root only); whether it was done."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        return True
    except OSError:
        return False


def du(path: str) -> int:
    """Bytes allocated under `path` (what a disk budget counts)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                pass
    return total


class Sampler:
    """Peak RSS of a process (5 samples a second) and peak size of a directory (1 a second,
    or with every RSS sample when du_every=1), as budgets are checked: at every sample."""

    def __init__(self, pid: int | None, directory: str | None, du_every: int = 5):
        self.pid, self.directory = pid, directory
        self.rss = 0
        self.disk = 0
        self.samples = 0
        self.du_every = du_every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        proc = psutil.Process(self.pid) if self.pid else None
        tick = 0
        while not self._stop.is_set():
            try:
                if proc is not None:
                    self.rss = max(self.rss, proc.memory_info().rss)
                if self.directory and tick % self.du_every == 0:  # walking the cache dir costs CPU
                    self.disk = max(self.disk, du(self.directory))
                self.samples += 1
            except (psutil.Error, OSError):
                pass
            tick += 1
            self._stop.wait(0.2)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def median(values: Iterable[float]) -> float:
    return statistics.median(values)


def median_row(rows: list[dict], keys: Iterable[str]) -> dict:
    """The first row, with each of `keys` replaced by its median over all rows."""
    out = dict(rows[0])
    for key in keys:
        out[key] = statistics.median(r[key] for r in rows)
    out["repeats"] = len(rows)
    return out


def write_json(path: str | None, obj: object) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=2, default=str)
