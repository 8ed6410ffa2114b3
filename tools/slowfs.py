#!/usr/bin/env python3
"""slowfs: a read-only passthrough FUSE filesystem that behaves like slow storage.

Every request that reaches it (lookup/getattr, readdir, open, read) waits `--latency`
before it is answered, as a network round trip would; many requests may be in flight at
once, as with NFS. Like an NFS client mounted with rsize=1M: a large read() is sent as
1 MiB requests, while the kernel's read-ahead stays at its 128 KiB default, so `cat`
(128 KiB reads) waits for one round trip after another.

Data is delivered no faster than `--bandwidth` in total, through one shared link. With
--seek it models a hard disk instead (--hdd is --seek 8ms): one head, files laid out in
sorted path order, a seek for every non-sequential transfer (see Link). The kernel is
told not to keep file pages across opens and to trust attributes only briefly, so a
file read twice costs twice (a store much larger than RAM).

    python tools/slowfs.py SRC MNT --latency 2ms --bandwidth 200MB
    python tools/slowfs.py SRC MNT --latency 0.2ms --bandwidth 150MB --hdd
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


class Link:
    """Latency per request plus one shared bandwidth cap (a token bucket of 0 depth).

    With `seek` > 0 it is a hard disk instead: one head, so transfers happen one at a time,
    and a transfer that does not continue near where the last one ended pays `seek` first.
    Files lie on the disk back to back in sorted path order (how `cp -r` or rsync of a
    dataset writes them), so reading a directory's files in sorted order is sequential and
    reading them shuffled is one seek per file.
    """

    SEQUENTIAL_GAP = 1 << 20  # closer than this to the head: the drive's own cache covers it

    def __init__(self, latency: float, bandwidth: float, seek: float = 0.0, sleep=time.sleep,
                 clock=time.monotonic):
        self.latency = latency
        self.bandwidth = bandwidth  # bytes/s; 0 = unlimited
        self.seek = seek
        self._sleep = sleep
        self._clock = clock
        self._lock = threading.Lock()
        self._head_lock = threading.Lock()
        self._free_at = 0.0
        self._head = 0
        self.seeks = 0
        self.layout: dict[str, int] = {}
        self._layout_end = 0

    def lay_out(self, root: str) -> None:
        """Give every file a position on the virtual disk, in sorted path order."""
        pos = 0
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            for name in sorted(filenames):
                full = os.path.join(dirpath, name)
                self.layout["/" + os.path.relpath(full, root)] = pos
                try:
                    pos += os.lstat(full).st_size
                except OSError:
                    pass
        self._layout_end = pos

    def position(self, path: str, size_hint: int) -> int:
        with self._lock:
            if path not in self.layout:  # created after mount: appended at the end
                self.layout[path] = self._layout_end
                self._layout_end += size_hint
            return self.layout[path]

    def request(self, nbytes: int = 0, path: str | None = None, offset: int = 0) -> None:
        if self.latency:
            self._sleep(self.latency)
        if self.seek and path is not None:
            pos = self.position(path, nbytes) + offset
            with self._head_lock:  # one head: transfers are serialized
                if abs(pos - self._head) > self.SEQUENTIAL_GAP:
                    self.seeks += 1
                    self._sleep(self.seek)
                if self.bandwidth and nbytes:
                    self._sleep(nbytes / self.bandwidth)
                self._head = pos + nbytes
            return
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
            # with each entry's type, as NFS READDIRPLUS gives it: no lookup per entry
            with os.scandir(self._full(path)) as it:
                return [".", ".."] + [(e.name, e.stat(follow_symlinks=False).st_mode, 0) for e in it]
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
        self.link.request(len(data), path, offset)
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
                return json.dumps(dict(self.counts, seeks=self.link.seeks)).encode()
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
    p.add_argument("--seek", default="0", help="hard-disk model: seek time per non-sequential transfer")
    p.add_argument("--hdd", action="store_true", help="hard-disk model with an 8 ms seek (same as --seek 8ms)")
    p.add_argument("--attr-timeout", default="1", help="kernel attribute cache, seconds (default: %(default)s)")
    p.add_argument("-f", "--foreground", action="store_true", help="(always foreground; kept for symmetry)")
    args = p.parse_args(argv)
    try:
        seek = parse_duration("8ms" if args.hdd and args.seek == "0" else args.seek, "--seek")
        link = Link(parse_duration(args.latency, "--latency"), parse_size(args.bandwidth, "--bandwidth"), seek)
        attr_timeout = parse_duration(args.attr_timeout, "--attr-timeout")
    except CachefsError as exc:
        print(f"slowfs: error: {exc}", file=sys.stderr)
        return 2
    if not os.path.isdir(args.source):
        print(f"slowfs: error: {args.source} is not a directory", file=sys.stderr)
        return 2
    if link.seek:
        link.lay_out(os.path.realpath(args.source))
    fs = SlowFS(args.source, args.mountpoint, link, attr_timeout)
    fuse.FUSE(fs, args.mountpoint, foreground=True, nothreads=False, ro=True,
              fsname=f"slowfs:{os.path.basename(os.path.realpath(args.source))}", subtype="slowfs",
              max_threads=64, max_read=MAX_READ)
    return 0


if __name__ == "__main__":
    sys.exit(main())
