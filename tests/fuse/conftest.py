"""Real mounts: cachefs through its CLI (daemonized, as users run it) and tools/slowfs."""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/fuse/" in str(item.fspath):
            item.add_marker(pytest.mark.fuse)


def _fuse_available():
    return os.path.exists("/dev/fuse") and shutil.which("fusermount3") is not None


@pytest.fixture(autouse=True)
def _need_fuse():
    if not _fuse_available():
        pytest.skip("needs /dev/fuse and fusermount3 (apt-get install fuse3)")


def cli(*args, check=False, timeout=60):
    """Run `python -m cachefs ARGS` and return the CompletedProcess."""
    proc = subprocess.run([sys.executable, "-m", "cachefs", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)
    if check and proc.returncode != 0:
        raise AssertionError(f"cachefs {' '.join(map(str, args))} failed: {proc.stdout}{proc.stderr}")
    return proc


def is_mounted(path):
    path = os.path.abspath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


def force_unmount(path):
    if is_mounted(path):
        subprocess.run(["fusermount3", "-uz", str(path)], capture_output=True)


def stats(mountpoint):
    return json.loads(cli("stats", mountpoint, "--json", check=True).stdout)


class Mounts:
    def __init__(self, tmp_path):
        self.tmp = tmp_path
        self.points = []

    def cachefs(self, source, name="mnt", cache_dir=None, extra=()):
        mp = self.tmp / name
        mp.mkdir(exist_ok=True)
        cache_dir = cache_dir or (self.tmp / "cache")
        args = ["mount", source, mp, "--cache-dir", cache_dir, "--ram-size", "256MiB", "--disk-size", "1GiB", *extra]
        cli(*args, check=True)
        self.points.append(mp)
        return mp

    def slowfs(self, source, name="slow", latency="1ms", bandwidth="0", attr_timeout="1"):
        mp = self.tmp / name
        mp.mkdir(exist_ok=True)
        log = open(self.tmp / f"{name}.log", "w")
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tools", "slowfs.py"), source, mp,
                                 "--latency", latency, "--bandwidth", bandwidth, "--attr-timeout", attr_timeout],
                                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while not is_mounted(mp):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"slowfs did not mount: {(self.tmp / f'{name}.log').read_text()}")
            time.sleep(0.05)
        self.points.append(mp)
        return mp

    def unmount(self, mp):
        proc = cli("umount", mp)
        if proc.returncode != 0:
            force_unmount(mp)

    def cleanup(self):
        for mp in reversed(self.points):
            if is_mounted(mp) and cli("umount", mp).returncode != 0:
                subprocess.run(["fusermount3", "-u", str(mp)], capture_output=True)
                force_unmount(mp)


@pytest.fixture
def mounts(tmp_path):
    m = Mounts(tmp_path)
    yield m
    m.cleanup()
