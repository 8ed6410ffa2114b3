#!/usr/bin/env python3
"""bench: cachefs against the slow store and local disk, side by side in one run.

    python tools/bench.py epoch [--latency 2ms] [--hdd] [--workers 8] [--epochs 3] [--repeats 3]
    python tools/bench.py seq   [--size 1GiB] [--latency 2ms] [--bandwidth 300MB] [--repeats 3]
    python tools/bench.py cache [--policies keep,lru] [--disk-ratio 0.5] [--ram-size 32MiB] [--epochs 4]

epoch: an ImageFolder-style dataset (tools/mkdataset.py) behind tools/slowfs.py, read the
way torchvision + a DataLoader with N workers do (tools/epoch.py: seeded shuffle per epoch,
batches spread over worker processes), for epochs 1..E, by each system:
  direct   the slow store itself
  cachefs  cachefs over the slow store, a fresh cache per repeat (one row per --readahead
           mode and --prefetch-workers value given, so policies compare in one run)
  local    the same files on local disk, page cache dropped first (when root)
It prints files/s, MB/s, per-file p50/p99 and the ratio to direct and to local (medians
over repeats), the daemon's peak RSS and cache-dir size (psutil), and writes JSON.

seq: one large file read cold from start to end in 128 KiB reads (what `cat` does), direct
and through cachefs; MB/s, share of the bandwidth cap, and the source requests it took.

cache: a dataset larger than the cache (the NVMe tier --disk-ratio of it, the RAM tier
smaller still), read for several shuffled epochs through cachefs over slowfs, once per
policy, with the page cache dropped before each epoch so that every read reaches cachefs.
Per epoch: bytes read from the store against the optimum (1 - cache/dataset) x dataset.
Throughout: the daemon's RSS and the cache dir's disk usage (du) sampled 5 times a second,
against the budgets.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cachefs.config import format_size, parse_size
from tools.common import (
    Sampler,
    add_workspace_options,
    drop_caches,
    ensure_dataset,
    median,
    median_row,
    workspace,
    write_json,
)
from tools.epoch import list_imagefolder, read_sequentially, run_epochs
from tools.mounts import cachefs, cachefs_stats, slowfs
from tools.slowfs import read_stats, reset_stats

EPOCH_KEYS = ("seconds", "files_per_s", "mb_per_s", "p50_ms", "p99_ms")


def cmd_epoch(args: argparse.Namespace) -> int:
    with workspace(args, "bench") as work:
        return _epoch(args, work)


def _epoch(args: argparse.Namespace, work: str) -> int:
    data = os.path.join(work, "dataset")
    ensure_dataset(data, args.classes, args.per_class)
    rel = [os.path.relpath(p, data) for p in list_imagefolder(data)]
    seek = "8ms" if args.hdd else args.seek
    systems = [("direct", None)] + [(f"cachefs {ra} w{w}", (ra, w)) for ra in args.readahead.split(",")
                                    for w in map(int, str(args.prefetch_workers).split(","))] + [("local", None)]
    results: dict[str, dict[int, list[dict]]] = {name: {} for name, _ in systems}
    extra: dict[str, dict] = {}
    with slowfs(data, os.path.join(work, "slow"), latency=args.latency, bandwidth=args.bandwidth,
                seek=seek) as slow:
        for rep in range(args.repeats):
            for name, cfg in systems:
                print(f"repeat {rep + 1}/{args.repeats}: {name}", file=sys.stderr)
                if name == "local":
                    drop_caches()
                    rows = run_epochs(data, args.workers, args.epochs, seed=rep * 100,
                                      paths=[os.path.join(data, r) for r in rel], quiet=True)
                elif name == "direct":
                    reset_stats(slow)
                    rows = run_epochs(slow, args.workers, args.epochs, seed=rep * 100,
                                      paths=[os.path.join(slow, r) for r in rel], quiet=True)
                else:
                    assert cfg is not None
                    ra, workers = cfg
                    mp, cache = os.path.join(work, f"mnt{rep}"), os.path.join(work, f"cache{rep}")
                    shutil.rmtree(cache, ignore_errors=True)
                    with cachefs(slow, mp, cache, ram_size=args.ram_size, disk_size=args.disk_size,
                                 extra=["--readahead", ra, "--prefetch-workers", str(workers)]):
                        pid = cachefs_stats(mp)["info"]["pid"]
                        reset_stats(slow)
                        with Sampler(pid, cache) as sampler:
                            rows = []
                            for epoch in range(1, args.epochs + 1):
                                before = read_stats(slow)
                                r = run_epochs(mp, args.workers, 1, seed=rep * 100 + epoch - 1,
                                               paths=[os.path.join(mp, x) for x in rel], quiet=True)[0]
                                after = read_stats(slow)
                                r["epoch"] = epoch
                                r["source_bytes"] = after.get("bytes", 0) - before.get("bytes", 0)
                                rows.append(r)
                        s = cachefs_stats(mp)
                        extra[name] = {"peak_rss": sampler.rss, "peak_cache_dir": sampler.disk,
                                       "prefetch": s.get("prefetch", {}), "ram_hits": s["ram"].get("hits", 0)}
                for r in rows:
                    results[name].setdefault(r["epoch"], []).append(r)

    table = {name: {e: median_row(rows, EPOCH_KEYS) for e, rows in epochs.items()} for name, epochs in results.items()}
    store = f"{args.latency}/request" + (f", {args.bandwidth}/s" if args.bandwidth != "0" else "") + \
        (f", HDD seek {seek}" if seek != "0" else "")
    print(f"\nImageFolder epochs: {len(rel)} JPEGs, {args.workers} workers, store {store}, "
          f"median of {args.repeats}")
    print(f"{'system':<22}{'epoch':>6}{'files/s':>10}{'MB/s':>8}{'p50 ms':>9}{'p99 ms':>9}"
          f"{'x direct':>10}{'x local':>9}")
    for name, epochs in table.items():
        for e, r in sorted(epochs.items()):
            d, loc = table["direct"][e], table["local"][e]
            print(f"{name:<22}{e:>6}{r['files_per_s']:>10.0f}{r['mb_per_s']:>8.1f}{r['p50_ms']:>9.2f}"
                  f"{r['p99_ms']:>9.2f}{d['seconds'] / r['seconds']:>10.2f}{loc['seconds'] / r['seconds']:>9.2f}")
    for name, x in extra.items():
        p = x["prefetch"]
        print(f"{name}: peak RSS {format_size(x['peak_rss'])}, cache dir {format_size(x['peak_cache_dir'])}; "
              f"prefetched {p.get('blocks', 0)} blocks, used {p.get('used', 0)}, wasted {p.get('wasted', 0)}")
    write_json(args.json, {"args": vars(args), "epochs": table, "daemon": extra})
    return 0


def cat_read(path: str) -> float:
    return read_sequentially(path, 128 << 10)  # cat's read size


def cmd_seq(args: argparse.Namespace) -> int:
    with workspace(args, "bench-seq") as work:
        return _seq(args, work)


def _seq(args: argparse.Namespace, work: str) -> int:
    size = parse_size(args.size)
    src = os.path.join(work, "src")
    os.makedirs(src, exist_ok=True)
    big = os.path.join(src, "big.bin")
    if not os.path.exists(big) or os.path.getsize(big) != size:
        subprocess.run(["dd", "if=/dev/urandom", f"of={big}", "bs=1M", f"count={size >> 20}"],
                       check=True, capture_output=True)
    rows: dict[str, list[tuple[float, int]]] = {"direct": [], "cachefs": []}
    with slowfs(src, os.path.join(work, "slow"), latency=args.latency, bandwidth=args.bandwidth) as slow:
        for rep in range(args.repeats):
            reset_stats(slow)
            rows["direct"].append((cat_read(os.path.join(slow, "big.bin")), read_stats(slow).get("read", 0)))
            mp, cache = os.path.join(work, f"mnt{rep}"), os.path.join(work, f"cache{rep}")
            with cachefs(slow, mp, cache, ram_size=args.ram_size, disk_size=args.disk_size,
                         extra=["--readahead", args.readahead_mode]):
                reset_stats(slow)
                rows["cachefs"].append((cat_read(os.path.join(mp, "big.bin")), read_stats(slow).get("read", 0)))
            shutil.rmtree(cache, ignore_errors=True)
            print(f"repeat {rep + 1}/{args.repeats} done", file=sys.stderr)
    cap = parse_size(args.bandwidth)
    base = median(t for t, _ in rows["direct"])
    print(f"\ncold sequential read of {args.size} in 128 KiB reads (like cat), store {args.latency}/request"
          f"{', ' + args.bandwidth + '/s cap' if cap else ''}, median of {args.repeats}")
    print(f"{'system':<10}{'MB/s':>8}{'of cap':>8}{'x direct':>10}{'source reads':>14}")
    summary = {}
    for name, r in rows.items():
        t = median(x for x, _ in r)
        reqs = median(n for _, n in r)
        summary[name] = {"mb_s": size / t / 1e6, "of_cap": size / t / cap if cap else None,
                         "x_direct": base / t, "source_reads": reqs}
        of_cap = f"{size / t / cap:>7.0%}" if cap else f"{'-':>7}"
        print(f"{name:<10}{size / t / 1e6:>8.0f} {of_cap}{base / t:>10.2f}{reqs:>14.0f}")
    write_json(args.json, {"args": vars(args), "seq": summary})
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    if not drop_caches():
        raise SystemExit("bench cache: needs root, to drop the page cache before each epoch")
    with workspace(args, "bench-cache") as work:
        return _cache(args, work)


def _cache(args: argparse.Namespace, work: str) -> int:
    data = os.path.join(work, "dataset")
    ensure_dataset(data, args.classes, args.per_class)
    rel = [os.path.relpath(p, data) for p in list_imagefolder(data)]
    total = sum(os.path.getsize(os.path.join(data, r)) for r in rel)
    disk_budget = int(args.disk_ratio * total)
    ram_budget = parse_size(args.ram_size)
    # The tiers are inclusive (a fetched block is offered to both), so the cache holds
    # between the NVMe budget (every RAM block also on NVMe) and both budgets (none is).
    optimum = total - disk_budget
    optimum_both = max(0, total - disk_budget - ram_budget)
    report: dict[str, dict] = {}
    with slowfs(data, os.path.join(work, "slow"), latency=args.latency) as slow:
        for policy in args.policies.split(","):
            print(f"policy {policy}", file=sys.stderr)
            mp, cache = os.path.join(work, "mnt"), os.path.join(work, f"cache-{policy}")
            shutil.rmtree(cache, ignore_errors=True)
            with cachefs(slow, mp, cache, ram_size=str(ram_budget), disk_size=str(disk_budget),
                         extra=["--policy", policy, "--readahead", "off", "--min-free", "0"]):
                pid = cachefs_stats(mp)["info"]["pid"]
                epochs = []
                with Sampler(pid, os.path.join(cache, "store"), du_every=1) as sampler:
                    for epoch in range(1, args.epochs + 1):
                        drop_caches()
                        before = read_stats(slow).get("bytes", 0)
                        r = run_epochs(mp, args.workers, 1, seed=epoch,
                                       paths=[os.path.join(mp, x) for x in rel], quiet=True)[0]
                        r["source_bytes"] = read_stats(slow).get("bytes", 0) - before
                        epochs.append(r)
                s = cachefs_stats(mp)
            report[policy] = {"epochs": epochs, "peak_rss": sampler.rss, "peak_cache_dir": sampler.disk,
                              "samples": sampler.samples,
                              "ram": {k: s["ram"].get(k, 0) for k in ("hits", "evictions", "used_bytes")},
                              "disk": {k: s["disk"].get(k, 0) for k in
                                       ("hits", "writes", "refused", "evictions", "used_bytes")}}
    print(f"\n{len(rel)} JPEGs, {format_size(total)}; NVMe tier {format_size(disk_budget)} "
          f"({args.disk_ratio:.0%} of the dataset), RAM tier {format_size(ram_budget)}; store "
          f"{args.latency}/request, {args.workers} workers, page cache dropped before each epoch")
    print(f"optimum per epoch after the first, (1 - cache/dataset) x dataset: {format_size(optimum)} with "
          f"cache = the NVMe budget, {format_size(optimum_both)} with cache = both budgets "
          "(differences are shares of the dataset)")
    print(f"{'policy':<8}{'epoch':>6}{'files/s':>9}{'from store':>13}{'vs NVMe opt':>13}{'vs both opt':>13}")
    for policy, x in report.items():
        for i, r in enumerate(x["epochs"], 1):
            cells = [f"{(r['source_bytes'] - o) / total:+.1%}" if i > 1 else "" for o in (optimum, optimum_both)]
            print(f"{policy:<8}{i:>6}{r['files_per_s']:>9.0f}{format_size(r['source_bytes']):>13}"
                  f"{cells[0]:>13}{cells[1]:>13}")
    for policy, x in report.items():
        d = x["disk"]
        print(f"{policy:<8}NVMe: {d['writes']} writes, "
              f"{d['refused']} refused by the policy, {d['evictions']} evictions; "
              f"RAM: {x['ram']['evictions']} evictions")
    print("\nbudgets (sampled 5 times a second, "
          + ", ".join(f"{p}: {x['samples']} samples" for p, x in report.items()) + ")")
    for policy, x in report.items():
        print(f"{policy:<8}peak RSS {format_size(x['peak_rss'])} = RAM budget + "
              f"{format_size(x['peak_rss'] - ram_budget)}; peak cache dir {format_size(x['peak_cache_dir'])} "
              f"of {format_size(disk_budget)} ({'within' if x['peak_cache_dir'] <= disk_budget else 'OVER'})")
    write_json(args.json, {"args": vars(args), "dataset_bytes": total, "disk_budget": disk_budget,
                           "ram_budget": ram_budget, "optimum": optimum, "policies": report})
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    for name in ("epoch", "seq"):
        s = sub.add_parser(name)
        s.add_argument("--latency", default="2ms")
        s.add_argument("--bandwidth", default="0" if name == "epoch" else "300MB")
        add_workspace_options(s, repeats=3)
        s.add_argument("--ram-size", default="1GiB")
        s.add_argument("--disk-size", default="4GiB")
    e = sub.choices["epoch"]
    e.add_argument("--workers", type=int, default=8)
    e.add_argument("--epochs", type=int, default=3)
    e.add_argument("--classes", type=int, default=10)
    e.add_argument("--per-class", type=int, default=200)
    e.add_argument("--hdd", action="store_true", help="slowfs's hard-disk model (8 ms seeks)")
    e.add_argument("--seek", default="0")
    e.add_argument("--readahead", default="dir", help="comma-separated modes to compare, e.g. off,dir")
    e.add_argument("--prefetch-workers", default="16", help="comma-separated values to compare")
    sq = sub.choices["seq"]
    sq.add_argument("--size", default="1GiB")
    sq.add_argument("--readahead-mode", default="dir")
    c = sub.add_parser("cache")
    c.add_argument("--policies", default="keep,lru", help="comma-separated, one mount each")
    c.add_argument("--disk-ratio", type=float, default=0.5, help="NVMe budget / dataset size")
    c.add_argument("--ram-size", default="32MiB")
    c.add_argument("--epochs", type=int, default=4)
    c.add_argument("--latency", default="0.5ms")
    c.add_argument("--workers", type=int, default=8)
    c.add_argument("--classes", type=int, default=10)
    c.add_argument("--per-class", type=int, default=200)
    add_workspace_options(c)
    args = p.parse_args(argv)
    return {"epoch": cmd_epoch, "seq": cmd_seq, "cache": cmd_cache}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
