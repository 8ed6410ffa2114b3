#!/usr/bin/env python3
"""demo: cachefs in front of an emulated slow store, in one command (`make demo`).

Makes a small ImageFolder dataset of real JPEGs, serves it through tools/slowfs (2 ms per
request, 200 MB/s, like a busy NFS server), reads one epoch straight from the slow store,
then mounts cachefs over it and reads two epochs through the mount the way a DataLoader
with 8 workers does. Prints the epochs side by side and `cachefs stats`, then unmounts.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.common import ensure_dataset
from tools.epoch import format_row, list_imagefolder, run_epochs
from tools.mounts import cachefs, cachefs_cli, slowfs


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", help="where to put the dataset and mounts (default: a new temp dir)")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--per-class", type=int, default=100)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--latency", default="2ms")
    p.add_argument("--bandwidth", default="200MB")
    p.add_argument("--keep", action="store_true", help="keep the work dir afterwards")
    args = p.parse_args(argv)

    work = args.workdir or tempfile.mkdtemp(prefix="cachefs-demo-")
    src, slow, mnt, cache = (os.path.join(work, d) for d in ("dataset", "slow", "mnt", "cache"))
    slow_log, cache_log = os.path.join(work, "slowfs.log"), os.path.join(cache, "cachefs.log")
    try:
        if not os.path.isdir(src):
            print(f"1. making {args.classes * args.per_class} JPEGs in {src}")
        ensure_dataset(src, args.classes, args.per_class, quiet=True)
        print(f"2. serving it through slowfs at {slow} ({args.latency} per request, {args.bandwidth}/s)")
        with slowfs(src, slow, latency=args.latency, bandwidth=args.bandwidth, log=slow_log):
            rel = [os.path.relpath(x, slow) for x in list_imagefolder(slow)]
            print(f"3. one epoch read straight from the slow store, {args.workers} workers")
            direct = run_epochs(slow, args.workers, epochs=1, paths=[os.path.join(slow, r) for r in rel])[0]
            print("   " + format_row("direct (slow store)", direct))
            print(f"4. cachefs mount {slow} {mnt} --ram-size 512MiB --disk-size 2GiB --cache-dir {cache}")
            with cachefs(slow, mnt, cache, ram_size="512MiB", disk_size="2GiB"):
                print("5. two epochs through cachefs")
                rows = run_epochs(mnt, args.workers, epochs=2, paths=[os.path.join(mnt, r) for r in rel])
                for r in rows:
                    print("   " + format_row("cachefs", r) + f"   {direct['seconds'] / r['seconds']:6.1f}x direct")
                print(f"6. cachefs stats {mnt}\n")
                print(cachefs_cli("stats", mnt, check=True).stdout)
        print("unmounted; done.")
    except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        for name, path in (("slowfs", slow_log), ("cachefs", cache_log)):
            tail = _tail(path)
            if tail.strip():
                print(f"--- the last lines of the {name} log ({path}):\n{tail.rstrip()}", file=sys.stderr)
        print(f"demo: kept the work dir for a look: {work}", file=sys.stderr)
        return 1
    if not args.keep and not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
