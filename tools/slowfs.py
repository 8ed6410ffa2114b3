#!/usr/bin/env python3
"""slowfs: a read-only passthrough FUSE filesystem that behaves like slow storage.

    python tools/slowfs.py SRC MNT --latency 2ms [--bandwidth 200MB]       # NFS-like
    python tools/slowfs.py SRC MNT --latency 0.2ms --bandwidth 150MB --hdd  # one disk head
    getfattr -n user.slowfs.stats MNT   # requests, bytes and seeks so far (JSON)

Network model: every request that reaches it (lookup/getattr, readdir, open, read) waits
`--latency` before it is answered, as a round trip would; many requests may be in flight
at once, as with NFS (lookups in one directory too, and one thread per request in
flight). A directory listing carries each entry's attributes when the kernel asks for
them (READDIRPLUS, as NFS has), so listing a directory costs one request, not one per
file. Data moves no faster than `--bandwidth` in total, through one
shared link. Like an NFS client mounted with rsize=1M: a large read() is sent as 1 MiB
requests, while the kernel's read-ahead stays at its 128 KiB default, so `cat` (128 KiB
reads) waits for one round trip after another.

Disk model (`--seek`, or `--hdd` for 8 ms): one head, so transfers happen one at a time,
nearest waiting request first unless one has waited 500 ms (a drive's command queue
under Linux's mq-deadline), and one that does not continue within 1 MiB of the last
pays the seek first. Files lie
on the disk back to back in sorted path order (how `cp -r` or rsync writes a dataset):
reading a directory's files in sorted order is sequential, shuffled it is a seek a file.

The kernel is told not to keep file pages across opens and to trust attributes for
`--attr-timeout` only, so a file read twice costs twice: a store much larger than RAM.

The filesystem itself is tools/slowfs.c, compiled on first use (needs a C compiler and
libfuse3-dev). It is C so that emulating the store costs almost no CPU: on this 2-core
machine a Python emulator used as much CPU as the cache it was there to measure.
Runs in the foreground until unmounted (fusermount3 -u MNT).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cachefs.config import parse_duration, parse_size
from cachefs.errors import CachefsError

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "slowfs.c")
BINARY = os.path.join(HERE, ".build", "slowfs")


def build() -> str:
    """Compile slowfs.c if the binary is missing or older than the source; return its path."""
    if os.path.exists(BINARY) and os.path.getmtime(BINARY) >= os.path.getmtime(SOURCE):
        return BINARY
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or not os.path.exists("/usr/include/fuse3/fuse.h"):
        raise CachefsError("building slowfs needs a C compiler and libfuse3-dev (apt-get install gcc libfuse3-dev)")
    os.makedirs(os.path.dirname(BINARY), exist_ok=True)
    tmp = BINARY + f".{os.getpid()}"
    cmd = [cc, "-O2", "-Wall", "-Wno-format-truncation", "-o", tmp, SOURCE, "-I/usr/include/fuse3",
           "-lfuse3", "-lpthread"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise CachefsError(f"compiling slowfs failed:\n{proc.stderr}")
    os.replace(tmp, BINARY)  # atomic: parallel builds never run a half-written binary
    return BINARY


def read_stats(mountpoint: str) -> dict:
    return json.loads(os.getxattr(mountpoint, "user.slowfs.stats"))


def reset_stats(mountpoint: str) -> None:
    os.getxattr(mountpoint, "user.slowfs.reset")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", nargs="?")
    p.add_argument("mountpoint", nargs="?")
    p.add_argument("--latency", default="2ms", help="per-request latency (default: %(default)s)")
    p.add_argument("--bandwidth", default="0", help="total bandwidth per second, e.g. 200MB; 0 = no cap")
    p.add_argument("--seek", default="0", help="disk model: seek time per non-sequential transfer")
    p.add_argument("--hdd", action="store_true", help="disk model with an 8 ms seek (same as --seek 8ms)")
    p.add_argument("--attr-timeout", default="1", help="kernel attribute cache, seconds (default: %(default)s)")
    p.add_argument("--build-only", action="store_true", help="compile and exit")
    args = p.parse_args(argv)
    try:
        binary = build()
        if args.build_only:
            return 0
        latency = parse_duration(args.latency, "--latency")
        bandwidth = parse_size(args.bandwidth, "--bandwidth")
        seek = parse_duration("8ms" if args.hdd and args.seek == "0" else args.seek, "--seek")
        attr_timeout = parse_duration(args.attr_timeout, "--attr-timeout")
    except CachefsError as exc:
        print(f"slowfs: error: {exc}", file=sys.stderr)
        return 2
    if args.source is None or args.mountpoint is None:
        p.error("SOURCE and MOUNTPOINT are required")
    if not os.path.isdir(args.source):
        print(f"slowfs: error: {args.source} is not a directory", file=sys.stderr)
        return 2
    os.execv(binary, [binary, args.source, args.mountpoint, repr(latency), str(bandwidth), repr(seek),
                      repr(attr_timeout)])


if __name__ == "__main__":
    sys.exit(main())
