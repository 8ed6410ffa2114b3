"""Start and stop real mounts (slowfs, cachefs) from tools and tests, as subprocesses.

cachefs is started through its own CLI, daemonized, exactly as a user runs it; slowfs runs
in the foreground of a child process. Both are unmounted by `unmount()` or on context exit.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def is_mounted(path: str | os.PathLike) -> bool:
    path = os.path.abspath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


def cachefs_cli(*args: object, check: bool = False, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `python -m cachefs ARGS` and return the CompletedProcess."""
    proc = subprocess.run([sys.executable, "-m", "cachefs", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)
    if check and proc.returncode != 0:
        raise RuntimeError(f"cachefs {' '.join(map(str, args))} failed: {proc.stdout}{proc.stderr}")
    return proc


def cachefs_stats(mountpoint: str | os.PathLike) -> dict:
    return json.loads(cachefs_cli("stats", mountpoint, "--json", check=True).stdout)


def mount_cachefs(source: str | os.PathLike, mountpoint: str | os.PathLike, cache_dir: str | os.PathLike,
                  ram_size: str = "256MiB", disk_size: str = "1GiB", extra: Sequence[str] = ()) -> None:
    """Mount through the CLI. CACHEFS_TEST_PASSTHROUGH=off|on|auto sets --passthrough for
    every mount that does not set it itself (the test suite runs its mounts in both modes)."""
    os.makedirs(mountpoint, exist_ok=True)
    mode = os.environ.get("CACHEFS_TEST_PASSTHROUGH")
    default = ["--passthrough", mode] if mode else []
    cachefs_cli("mount", source, mountpoint, "--cache-dir", cache_dir, "--ram-size", ram_size,
                "--disk-size", disk_size, *default, *extra, check=True)


def mount_slowfs(source: str | os.PathLike, mountpoint: str | os.PathLike, latency: str = "2ms",
                 bandwidth: str = "0", attr_timeout: str = "1", log: str | None = None,
                 seek: str = "0") -> subprocess.Popen:
    os.makedirs(mountpoint, exist_ok=True)
    out = open(log, "w") if log else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "tools", "slowfs.py"), str(source), str(mountpoint),
                             "--latency", latency, "--bandwidth", bandwidth, "--attr-timeout", attr_timeout,
                             "--seek", seek],
                            stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while not is_mounted(mountpoint):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            detail = open(log).read() if log else ""
            raise RuntimeError(f"slowfs did not mount at {mountpoint}: {detail}")
        time.sleep(0.05)
    return proc


def unmount(mountpoint: str | os.PathLike) -> None:
    """Unmount cachefs (waiting for its daemon) or any FUSE mount; lazily if it is stuck."""
    if not is_mounted(mountpoint):
        return
    if cachefs_cli("umount", mountpoint).returncode == 0:
        return
    subprocess.run(["fusermount3", "-u", str(mountpoint)], capture_output=True)
    if is_mounted(mountpoint):
        subprocess.run(["fusermount3", "-uz", str(mountpoint)], capture_output=True)


@contextlib.contextmanager
def slowfs(source: str | os.PathLike, mountpoint: str | os.PathLike, **kw: str) -> Iterator[str]:
    proc = mount_slowfs(source, mountpoint, **kw)
    try:
        yield str(mountpoint)
    finally:
        unmount(mountpoint)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@contextlib.contextmanager
def cachefs(source: str | os.PathLike, mountpoint: str | os.PathLike, cache_dir: str | os.PathLike,
            **kw) -> Iterator[str]:  # type: ignore[no-untyped-def]
    mount_cachefs(source, mountpoint, cache_dir, **kw)
    try:
        yield str(mountpoint)
    finally:
        unmount(mountpoint)
