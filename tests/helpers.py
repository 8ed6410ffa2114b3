"""Helpers the tests import: a fake clock, a core without a mount, real mounts, other users.

Fixtures stay in the conftest.py files; everything a test module imports by name lives here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from cachefs.core import Core
from cachefs.stats import Stats
from cachefs.tiers.memory import MemoryTier
from cachefs.tiers.multilevel import MultiLevelCache
from tools.mounts import ROOT, cachefs_cli, cachefs_stats, is_mounted, mount_cachefs, mount_slowfs, unmount

__all__ = ["ROOT", "SYSTEM_PYTHON", "FakeClock", "Mounts", "as_user", "cli", "is_mounted", "make_core",
           "portable_python", "stats", "wait_listed"]

cli = cachefs_cli
stats = cachefs_stats

# Another user cannot run root's own interpreter (pyenv and the venv live under /root, 0700).
SYSTEM_PYTHON = "/usr/bin/python3"
NOBODY = 65534


class FakeClock:
    """A clock the test advances by hand: TTLs are tested without sleeping."""

    def __init__(self, start: float = 1000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def run_until_idle(prefetcher, limit: int = 1_000_000) -> int:
    """Run a prefetcher's tasks in this thread until none is left (deterministic tests)."""
    n = 0
    while n < limit and prefetcher.step():
        n += 1
    return n


def wait_listed(core, timeout: float = 10.0) -> None:
    """Wait until no listing is in flight ahead of a walk (cachefs/listahead.py)."""
    deadline = time.monotonic() + timeout
    while core.metadata._ahead.in_flight():
        assert time.monotonic() < deadline, "listings ahead never finished"
        time.sleep(0.005)


def make_core(source, *, ram=64 << 20, disk=None, shared=None, block_size=64 << 10, clock=None, stats=None, **kw):
    """A Core over `source` with a RAM tier (and `disk`, `shared`, if given), no mount:
    built by the constructor the daemon builds its core with (cachefs.daemon.build_core)."""
    stats = stats or Stats()
    cache = MultiLevelCache(MemoryTier(ram, stats), disk, stats, shared)
    extra = {"clock": clock} if clock is not None else {}
    return Core(source, cache, stats, namespace=b"test", block_size=block_size, **extra, **kw)


class Mounts:
    """Mounts made by one test, all unmounted at its end (innermost first)."""

    def __init__(self, tmp_path):
        self.tmp = tmp_path
        self.points = []
        self.procs = []

    def cachefs(self, source, name="mnt", cache_dir=None, extra=()):
        mp = self.tmp / name
        mount_cachefs(source, mp, cache_dir or (self.tmp / "cache"), extra=extra)
        self.points.append(mp)
        return mp

    def slowfs(self, source, name="slow", latency="1ms", bandwidth="0", attr_timeout="1"):
        mp = self.tmp / name
        self.procs.append(mount_slowfs(source, mp, latency, bandwidth, attr_timeout, log=str(self.tmp / f"{name}.log")))
        self.points.append(mp)
        return mp

    def unmount(self, mp):
        unmount(mp)

    def cleanup(self):
        for mp in reversed(self.points):
            unmount(mp)
        for proc in self.procs:
            proc.wait(timeout=10)


def portable_python(base: Path) -> tuple[str, dict[str, str]]:
    """An interpreter and environment with which another user runs this checkout's cachefs.

    The venv and the clone may sit where only root can read (CI clones under /root), so the
    package and its dependencies are copied under `base` (which the caller makes 0755) and
    run by the system's python3 of the same version. Raises RuntimeError when there is no
    such interpreter.
    """
    import psutil
    import xxhash

    import cachefs

    if not os.path.exists(SYSTEM_PYTHON):
        raise RuntimeError(f"{SYSTEM_PYTHON} is missing")
    version = subprocess.run([SYSTEM_PYTHON, "-c", "import sys; print(sys.version_info[:2])"],
                             capture_output=True, text=True).stdout.strip()
    if version != str(tuple(sys.version_info[:2])):
        raise RuntimeError(f"{SYSTEM_PYTHON} is Python {version}, the venv's is {tuple(sys.version_info[:2])}")
    lib = base / "pylib"
    lib.mkdir(mode=0o755)
    for module in (cachefs, psutil, xxhash):
        origin = Path(module.__file__)
        if origin.name == "__init__.py":
            shutil.copytree(origin.parent, lib / origin.parent.name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(origin, lib / origin.name)
    for path in [lib, *lib.rglob("*")]:
        os.chmod(path, 0o755 if path.is_dir() else 0o644)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "PYTHONPATH": str(lib), "HOME": str(base / "home")}
    return SYSTEM_PYTHON, env


def as_user(argv: list[str], uid: int = NOBODY, gid: int = NOBODY, env: dict[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess:
    """Run a command as another user (no supplementary groups) and return what it printed."""

    def drop() -> None:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)

    return subprocess.run(argv, capture_output=True, text=True, preexec_fn=drop, timeout=timeout, cwd="/",
                          env=env if env is not None else {"PATH": "/usr/bin:/bin"})
