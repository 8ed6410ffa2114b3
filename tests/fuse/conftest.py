"""Real mounts: cachefs through its CLI (daemonized, as users run it) and tools/slowfs."""

import os
import shutil

import pytest

from tools.mounts import ROOT, cachefs_cli, cachefs_stats, is_mounted, mount_cachefs, mount_slowfs, unmount

__all__ = ["ROOT", "Mounts", "cli", "is_mounted", "stats"]

cli = cachefs_cli
stats = cachefs_stats


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/fuse/" in str(item.fspath):
            item.add_marker(pytest.mark.fuse)


@pytest.fixture(autouse=True)
def _need_fuse():
    if not (os.path.exists("/dev/fuse") and shutil.which("fusermount3")):
        pytest.skip("needs /dev/fuse and fusermount3 (apt-get install fuse3)")


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


@pytest.fixture
def mounts(tmp_path):
    m = Mounts(tmp_path)
    yield m
    m.cleanup()
