#!/usr/bin/env python3
"""blocksize: measure cachefs's cache block size on a slow store, side by side.

    python tools/blocksize.py [--size 256MiB] [--latency 2ms] [--bandwidth 200MB] [--repeats 3]

For each block size: a fresh cachefs over tools/slowfs, then (a) a cold sequential read of
one big file in 1 MiB reads, (b) 100 cold random 128 KiB reads of another big file. Both
are compared with the same reads straight from slowfs. Prints medians over the repeats;
source bytes / bytes wanted shows the read amplification of large blocks on random access.
This is how the default block size (cachefs.config.DEFAULT_BLOCK_SIZE) was chosen.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cachefs.config import parse_size
from tools.common import add_workspace_options, median, workspace, write_json
from tools.epoch import read_sequentially
from tools.mounts import cachefs, cachefs_stats, slowfs

RANDOM_READS = 100
RANDOM_SIZE = 128 << 10


def seq_read(path: str) -> float:
    return read_sequentially(path, 1 << 20)


def random_reads(path: str, size: int, seed: int) -> float:
    rng = random.Random(seed)
    offsets = [rng.randrange(0, size - RANDOM_SIZE) for _ in range(RANDOM_READS)]
    t0 = time.perf_counter()
    fd = os.open(path, os.O_RDONLY)
    try:
        for off in offsets:
            os.pread(fd, RANDOM_SIZE, off)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="256MiB")
    p.add_argument("--latency", default="2ms")
    p.add_argument("--bandwidth", default="200MB")
    p.add_argument("--block-sizes", default="1MiB,2MiB,4MiB,8MiB,16MiB")
    add_workspace_options(p, repeats=3)
    args = p.parse_args(argv)
    with workspace(args, "blocksize") as work:
        return run(args, work)


def run(args: argparse.Namespace, work: str) -> int:
    size = parse_size(args.size)
    src = os.path.join(work, "src")
    os.makedirs(src, exist_ok=True)
    for name in ("seq.bin", "rand.bin"):
        path = os.path.join(src, name)
        if os.path.exists(path) and os.path.getsize(path) == size:
            continue
        with open(path, "wb") as f:
            for _ in range(size >> 20):
                f.write(os.urandom(1 << 20))
    rows: dict[str, dict[str, list[float]]] = {}
    with slowfs(src, os.path.join(work, "slow"), latency=args.latency, bandwidth=args.bandwidth) as slow:
        for rep in range(args.repeats):
            r = rows.setdefault("direct", {"seq": [], "rand": [], "amp": []})
            r["seq"].append(seq_read(os.path.join(slow, "seq.bin")))
            r["rand"].append(random_reads(os.path.join(slow, "rand.bin"), size, rep))
            r["amp"].append(1.0)
            for bs in args.block_sizes.split(","):
                mp, cache = os.path.join(work, f"mnt-{bs}-{rep}"), os.path.join(work, f"cache-{bs}-{rep}")
                with cachefs(slow, mp, cache, ram_size="1GiB", disk_size="2GiB", extra=["--block-size", bs]):
                    r = rows.setdefault(bs, {"seq": [], "rand": [], "amp": []})
                    r["seq"].append(seq_read(os.path.join(mp, "seq.bin")))
                    before = cachefs_stats(mp)["source"].get("bytes", 0)
                    r["rand"].append(random_reads(os.path.join(mp, "rand.bin"), size, rep))
                    fetched = cachefs_stats(mp)["source"].get("bytes", 0) - before
                    r["amp"].append(fetched / (RANDOM_READS * RANDOM_SIZE))
                print(f"  repeat {rep + 1}/{args.repeats} {bs} done", file=sys.stderr)
    base_seq = median(rows["direct"]["seq"])
    base_rand = median(rows["direct"]["rand"])
    print(f"\ncold reads over slowfs ({args.latency}/request, {args.bandwidth}/s), "
          f"{args.size} files, median of {args.repeats}")
    print(f"{'':<8}{'seq MB/s':>10}{'x direct':>10}{'rand 128K/s':>13}{'x direct':>10}{'src/wanted':>12}")
    summary = {}
    for name, r in rows.items():
        seq, rnd, amp = median(r["seq"]), median(r["rand"]), median(r["amp"])
        summary[name] = {"seq_mb_s": size / seq / 1e6, "seq_x_direct": base_seq / seq,
                         "rand_reads_s": RANDOM_READS / rnd, "rand_x_direct": base_rand / rnd, "amplification": amp}
        s = summary[name]
        print(f"{name:<8}{s['seq_mb_s']:>10.0f}{s['seq_x_direct']:>10.2f}{s['rand_reads_s']:>13.0f}"
              f"{s['rand_x_direct']:>10.2f}{amp:>12.1f}")
    write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
