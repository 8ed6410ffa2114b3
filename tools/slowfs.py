#!/usr/bin/env python3
"""slowfs: a read-only passthrough FUSE filesystem that behaves like slow storage.

Every request that reaches it (lookup/getattr, readdir, open, read) waits `--latency`
before it is answered, as a network round trip would; many requests may be in flight at
once, as with NFS. Reads are up to 1 MiB with 1 MiB kernel read-ahead (as root), like an
NFS client mounted with rsize=1M. Data is delivered no faster than `--bandwidth` in total, through one
shared link. The kernel is told not to keep file pages across opens and to trust
attributes only briefly, so a file read twice costs twice (a store much larger than RAM).

    python tools/slowfs.py SRC MNT --latency 2ms --bandwidth 200MB [-f]
    getfattr -n user.slowfs.stats MNT      # request and byte counters as JSON

Used by the tests, the demo and the benchmarks in tools/.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import threading
import time
from collections import Counter

import mfusepy as fuse

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cachefs.config import MAX_READ, parse_duration, parse_size
from cachefs.errors import CachefsError
from cachefs.mount import tune_readahead


class Link:
    """Latency per request plus one shared bandwidth cap (a token bucket of 0 depth)."""

    def __init__(self, latency: float, bandwidth: float, sleep=time.sleep, clock=time.monotonic):
        self.latency = latency
        self.bandwidth = bandwidth  # bytes/s; 0 = unlimited
        self._sleep = sleep
        self._clock = clock
        self._lock = threading.Lock()
        self._free_at = 0.0

    def request(self, nbytes: int = 0) -> None:
        if self.latency:
            self._sleep(self.latency)
        if self.bandwidth and nbytes:
            with self._lock:
                start = max(self._clock(), self._free_at)
                self._free_at = start + nbytes / self.bandwidth
                done = self._free_at
            delay = done - self._clock()
            if delay > 0:
                self._sleep(delay)


class SlowFS(fuse.Operations):
    use_ns = True

    def __init__(self, root: str, mountpoint: str, link: Link, attr_timeout: float):
        self.root = os.path.realpath(root)
        self.mountpoint = os.path.abspath(mountpoint)
        self.link = link
        self.attr_timeout = attr_timeout
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def _count(self, op: str, nbytes: int = 0) -> None:
        with self._lock:
            self.counts[op] += 1
            if nbytes:
                self.counts["bytes"] += nbytes

    def _full(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def init_with_config(self, conn, config):
        if conn is not None:
            conn.max_read = MAX_READ
        # like an NFS client with rsize=1M: 1 MiB requests and read-ahead
        threading.Thread(target=tune_readahead, args=(self.mountpoint, MAX_READ), daemon=True).start()
        if config is not None:
            config.entry_timeout = self.attr_timeout
            config.attr_timeout = self.attr_timeout
            config.negative_timeout = 0

    def getattr(self, path, fh=None):
        self._count("getattr")
        self.link.request()
        try:
            st = os.lstat(self._full(path))
        except OSError as exc:
            raise fuse.FuseOSError(exc.errno) from None
        keys = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_blocks", "st_rdev")
        out = {k: getattr(st, k) for k in keys}
        out.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
        return out

    def readdir(self, path, fh):
        self._count("readdir")
        self.link.request()
        try:
            return [".", ".."] + os.listdir(self._full(path))
        except OSError as exc:
            raise fuse.FuseOSError(exc.errno) from None

    def readlink(self, path):
        self._count("readlink")
        self.link.request()
        return os.readlink(self._full(path))

    def open(self, path, flags):
        self._count("open")
        self.link.request()
        if flags & (os.O_WRONLY | os.O_RDWR):
            raise fuse.FuseOSError(errno.EROFS)
        try:
            return os.open(self._full(path), os.O_RDONLY)
        except OSError as exc:
            raise fuse.FuseOSError(exc.errno) from None

    def read(self, path, size, offset, fh):
        data = os.pread(fh, size, offset)
        self._count("read", len(data))
        self.link.request(len(data))
        return data

    def release(self, path, fh):
        os.close(fh)
        return 0

    def statfs(self, path):
        st = os.statvfs(self.root)
        return {k: getattr(st, k) for k in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail",
                                            "f_files", "f_ffree", "f_favail", "f_namemax")}

    def getxattr(self, path, name, *args):
        if path == "/" and name == "user.slowfs.stats":
            with self._lock:
                return json.dumps(dict(self.counts)).encode()
        if path == "/" and name == "user.slowfs.reset":
            with self._lock:
                self.counts.clear()
            return b"{}"
        raise fuse.FuseOSError(errno.ENODATA)


def read_stats(mountpoint: str) -> dict:
    return json.loads(os.getxattr(mountpoint, "user.slowfs.stats"))


def reset_stats(mountpoint: str) -> None:
    os.getxattr(mountpoint, "user.slowfs.reset")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source")
    p.add_argument("mountpoint")
    p.add_argument("--latency", default="2ms", help="per-request latency (default: %(default)s)")
    p.add_argument("--bandwidth", default="0", help="total bandwidth cap per second, e.g. 200MB; 0 = none")
    p.add_argument("--attr-timeout", default="1", help="kernel attribute cache, seconds (default: %(default)s)")
    p.add_argument("-f", "--foreground", action="store_true", help="(always foreground; kept for symmetry)")
    args = p.parse_args(argv)
    try:
        link = Link(parse_duration(args.latency, "--latency"), parse_size(args.bandwidth, "--bandwidth"))
        attr_timeout = parse_duration(args.attr_timeout, "--attr-timeout")
    except CachefsError as exc:
        print(f"slowfs: error: {exc}", file=sys.stderr)
        return 2
    if not os.path.isdir(args.source):
        print(f"slowfs: error: {args.source} is not a directory", file=sys.stderr)
        return 2
    fs = SlowFS(args.source, args.mountpoint, link, attr_timeout)
    fuse.FUSE(fs, args.mountpoint, foreground=True, nothreads=False, ro=True,
              fsname=f"slowfs:{os.path.basename(os.path.realpath(args.source))}", subtype="slowfs",
              max_threads=64, max_read=MAX_READ)
    return 0


if __name__ == "__main__":
    sys.exit(main())
