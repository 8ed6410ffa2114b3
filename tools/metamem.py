"""Daemon memory per file of metadata: what `ls -lR` of a big tree costs cachefs's daemon.

Makes FILES empty files in directories of 1,000, mounts the tree, then lists every
directory and stats every file and asks for the two extended attributes `ls -l` asks for
(the kernel is told to forget nothing: --metadata-ttl 1h). Prints the daemon's RSS before
and after (psutil), per file, and what the stats count as metadata entries.

    python tools/metamem.py --files 100000 --workdir /tmp/metamem
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.mounts import cachefs_stats, mount_cachefs, unmount

PER_DIR = 1000


def make_tree(root: str, files: int) -> None:
    marker = os.path.join(root, f".made-{files}")
    if os.path.exists(marker):
        return
    shutil.rmtree(root, ignore_errors=True)
    for i in range(files):
        d = os.path.join(root, f"d{i // PER_DIR:04d}")
        if i % PER_DIR == 0:
            os.makedirs(d)
        open(os.path.join(d, f"file-{i:07d}.jpg"), "wb").close()
    open(marker, "w").close()


def daemon_pid(mp: str) -> int:
    return int(json.loads(os.getxattr(mp, "user.cachefs.info"))["pid"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--workdir", default="/tmp/cachefs-metamem")
    args = ap.parse_args()
    src, mp, cache = (os.path.join(args.workdir, x) for x in ("src", "mnt", "cache"))
    print(f"making {args.files} files ...", file=sys.stderr)
    make_tree(src, args.files)
    shutil.rmtree(cache, ignore_errors=True)
    mount_cachefs(src, mp, cache, extra=["--metadata-ttl", "1h", "--readahead", "off"])
    try:
        proc = psutil.Process(daemon_pid(mp))
        time.sleep(0.5)
        before = proc.memory_info().rss
        start = time.monotonic()
        for d in sorted(x for x in os.listdir(mp) if not x.startswith(".")):
            for name in os.listdir(os.path.join(mp, d)):
                path = os.path.join(mp, d, name)
                os.lstat(path)
                for attr in ("security.selinux", "system.posix_acl_access"):
                    try:
                        os.getxattr(path, attr, follow_symlinks=False)
                    except OSError:
                        pass
        took = time.monotonic() - start
        after = proc.memory_info().rss
        entries = cachefs_stats(mp)["metadata"]["entries"]
    finally:
        unmount(mp)
    per = (after - before) / args.files
    print(f"files {args.files}  listed+stat'd+2 xattrs each in {took:.1f} s  daemon RSS {before / 2**20:.0f} -> "
          f"{after / 2**20:.0f} MiB  = {per:.0f} bytes per file  (metadata.entries {entries})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
