#!/usr/bin/env python3
"""crashbench: how fast a mount comes back after `kill -9` with a large NVMe tier.

    python tools/crashbench.py [--entries 100000] [--files 2000] [--repeats 3]

Fills a cache dir with ENTRIES blocks (1 KiB each, written straight through the NVMe tier),
mounts cachefs over a small ImageFolder tree with that cache dir, reads the tree with 8
processes and kills the daemon with SIGKILL in the middle of it, then mounts again on the
same mount point and cache dir. Reports, per repeat: seconds for `cachefs mount` to return
after the crash (it clears the stale mount), seconds until the NVMe index is loaded (the
daemon loads it in the background), and whether every file then reads back byte for byte.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import signal
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cachefs.identity import EntryInfo
from cachefs.source import Attr
from cachefs.tiers.disk import DiskTier
from tools.common import add_workspace_options, ensure_dataset, median, workspace, write_json
from tools.mounts import cachefs_cli, cachefs_stats, is_mounted, unmount


def fill(cache_dir: str, entries: int) -> float:
    start = time.monotonic()
    tier = DiskTier(os.path.join(cache_dir, "store"), 1 << 40, min_free=0, scrub=False)
    for n in range(entries):  # files of another source: the mount's own files are not among them
        eid = os.urandom(16)
        tier.put((eid, 0), os.urandom(1024), EntryInfo(f"/other/{n}", Attr(0o100644, 1, 0, 0, 1024, 0, 0, 0), 1 << 20))
    tier.close()
    return time.monotonic() - start


def _read_all(paths: list[str]) -> int:
    n = 0
    for p in paths:
        try:
            with open(p, "rb") as f:
                n += len(f.read())
        except OSError:
            pass
    return n


def mount(src: str, mp: str, cache: str) -> float:
    start = time.monotonic()
    cachefs_cli("mount", src, mp, "--cache-dir", cache, "--ram-size", "64MiB", check=True, timeout=120)
    return time.monotonic() - start


def index_loaded(mp: str, entries: int, timeout: float = 600) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if cachefs_stats(mp)["disk"].get("entries", 0) >= entries:
            return time.monotonic() - start
        time.sleep(0.05)
    return float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--files", type=int, default=2000)
    add_workspace_options(ap, repeats=3)
    args = ap.parse_args()
    with workspace(args, "crashbench") as work:
        return run(args, work)


def run(args: argparse.Namespace, work: str) -> int:
    src, mp, cache = (os.path.join(work, d) for d in ("src", "mnt", "cache"))
    rows = []
    try:
        ensure_dataset(src, 10, args.files // 10, mean_kb=50)
        rel = sorted(os.path.relpath(os.path.join(d, f), src) for d, _, fs in os.walk(src) for f in fs)
        expected = {r: open(os.path.join(src, r), "rb").read() for r in rel}
        print(f"filling the NVMe tier with {args.entries} blocks...", file=sys.stderr)
        print(f"  {fill(cache, args.entries):.1f}s", file=sys.stderr)
        os.makedirs(mp, exist_ok=True)
        mount(src, mp, cache)
        index_loaded(mp, args.entries)
        for rep in range(args.repeats):
            pid = cachefs_stats(mp)["info"]["pid"]
            with multiprocessing.get_context("fork").Pool(8) as pool:
                paths = [os.path.join(mp, r) for r in rel]
                pending = pool.map_async(_read_all, [paths[i::8] for i in range(8)])
                time.sleep(0.5)                                  # in the middle of the reads
                os.kill(pid, signal.SIGKILL)
                pending.wait(120)
            remount_s = mount(src, mp, cache)                    # clears the stale mount
            index_s = index_loaded(mp, args.entries)
            wrong = sum(open(os.path.join(mp, r), "rb").read() != data for r, data in expected.items())
            rows.append({"remount_s": remount_s, "index_s": index_s, "wrong_files": wrong,
                         "disk_entries": cachefs_stats(mp)["disk"].get("entries", 0)})
            print(f"repeat {rep + 1}: remount {remount_s:.2f}s, index of {rows[-1]['disk_entries']} blocks "
                  f"loaded {index_s:.2f}s later, {wrong} wrong files", file=sys.stderr)
    finally:
        if is_mounted(mp):
            unmount(mp)
        subprocess.run(["fusermount3", "-uz", mp], capture_output=True)
    print(f"\nkill -9 mid-read with {args.entries} blocks on NVMe, median of {args.repeats}: "
          f"cachefs mount returned in {median(r['remount_s'] for r in rows):.2f}s, "
          f"index loaded {median(r['index_s'] for r in rows):.2f}s later, "
          f"{sum(r['wrong_files'] for r in rows)} wrong files")
    write_json(args.json, {"args": vars(args), "rows": rows})
    return 0 if all(r["wrong_files"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
