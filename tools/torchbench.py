#!/usr/bin/env python3
"""torchbench: real PyTorch DataLoader epochs through cachefs, side by side in one run.

    python tools/torchbench.py loader   [--latency 2ms] [--workers 4] [--epochs 3] [--repeats 3]
    python tools/torchbench.py hint     [--case ram,both] [--workers 4] [--epochs 3] [--repeats 3]
    python tools/torchbench.py diagnose [--seconds 10]

loader: an ImageFolder tree (tools/mkdataset.py) behind tools/slowfs.py; the same seeded
DataLoader epochs (decode + the standard training transforms by default) read directly
from slowfs and through cachefs over it, a fresh cache per repeat: images/s per epoch,
the ratio, and the daemon's peak RSS.

hint: HintedSampler against the plain sampler, each on its own fresh mount with the same
seeds, the page cache of the mount's files and of the NVMe tier's block files dropped
before every epoch (a dataset larger than RAM cannot live in it either; the tier's small
index stays cached, as it would):
  ram   the dataset is 4x the RAM tier and fits the NVMe tier, which `cachefs warm` fills
        first; every epoch is measured (RAM-tier hit rate, images/s);
  both  the dataset is larger than both tiers (RAM 1/8, NVMe 1/4 of it) over slowfs;
        epoch 1 is cold, epochs 2.. are measured.
The loader reads bytes only by default (--transform none, a GPU-decoding pipeline), so
that the epoch time is the storage's; with CPU decoding on 2 cores the CPU sets the pace.

diagnose: `cachefs diagnose` on three set-ups built here, each with its expected verdict:
slowfs at 5 ms (storage-bound), local disk with a heavy transform (cpu-bound), local
disk with a GPU-decoding pipeline, bytes only (fine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch.utils.data
from PIL import ImageFilter

from cachefs.config import format_size
from cachefs.pipeline import collate, make_transform
from cachefs.torch import HintedSampler, ImageFolder
from tools.common import Sampler, add_workspace_options, drop_caches, ensure_dataset, median, workspace, write_json
from tools.mounts import ROOT, cachefs, cachefs_cli, cachefs_stats, slowfs


def heavy(img: Any) -> Any:
    """A CPU-heavy augmentation (the diagnose set-up 2): a wide blur of the whole image,
    then the standard training transforms."""
    assert STANDARD is not None
    return STANDARD(img.filter(ImageFilter.GaussianBlur(8)))


STANDARD = make_transform("standard")[0]


class Decode:
    """loader(path): the file's bytes, or the decoded and transformed image."""

    def __init__(self, transform: str):
        self.fn, self.decode, _ = make_transform(transform)

    def __call__(self, path: str) -> Any:
        import io

        from PIL import Image

        with open(path, "rb") as f:
            data = f.read()
        if not self.decode:
            return data
        img = Image.open(io.BytesIO(data)).convert("RGB")
        return self.fn(img) if self.fn is not None else img


@contextlib.contextmanager
def dataset(args: argparse.Namespace) -> Iterator[tuple[str, str, int]]:
    """(work dir, dataset dir, dataset bytes); the dataset is made once per --workdir."""
    with workspace(args, "torchbench") as work:
        data = os.path.join(work, f"dataset-{args.classes}x{args.per_class}")
        yield work, data, ensure_dataset(data, args.classes, args.per_class)


def epoch(root: str, seed: int, workers: int, batch_size: int, transform: str, hinted: bool = False) -> dict:
    """One DataLoader epoch over ImageFolder(root): seconds, images, images/s."""
    ds = ImageFolder(root, loader=Decode(transform))
    sampler: Any = torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(seed))
    if hinted:
        sampler = HintedSampler(sampler, ds)
    loader = torch.utils.data.DataLoader(ds, batch_size=batch_size, sampler=sampler, num_workers=workers,
                                         collate_fn=collate)
    start = time.perf_counter()
    images = sum(len(targets) for _, targets in loader)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "images": images, "images_per_s": images / seconds}


def evict_data(*roots: str) -> int:
    """Drop the page cache of every file under `roots` (the mount's files, the NVMe tier's
    block files), and only those: a machine whose RAM cannot hold the dataset keeps its hot
    small files (the NVMe tier's index, the programs) cached, which drop_caches would not."""
    os.sync()  # dirty pages (blocks the NVMe writer just wrote) cannot be dropped
    n = 0
    for root in roots:
        for dirpath, _, files in os.walk(root):
            for name in files:
                try:
                    fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
                except OSError:
                    continue
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    n += 1
                finally:
                    os.close(fd)
    return n


def ram_rates(before: dict, after: dict) -> dict:
    def d(section: str, key: str) -> int:
        return after.get(section, {}).get(key, 0) - before.get(section, {}).get(key, 0)

    lookups = d("ram", "hits") + d("ram", "misses")
    return {"ram_hit_rate": d("ram", "hits") / lookups if lookups else 0.0,
            "disk_hit_rate": d("disk", "hits") / lookups if lookups else 0.0,
            "source_bytes": d("source", "bytes"), "hint_used": d("hint", "used")}


def med(rows: list[dict], key: str) -> float:
    return median(r[key] for r in rows)


# -- loader ----------------------------------------------------------------------------------

def cmd_loader(args: argparse.Namespace) -> int:
    results: dict[str, dict[int, list[dict]]] = {"direct": {}, "cachefs": {}}
    rss = []
    with dataset(args) as (work, data, total), slowfs(data, os.path.join(work, "slow"), latency=args.latency) as slow:
        for rep in range(args.repeats):
            print(f"repeat {rep + 1}/{args.repeats}: direct", file=sys.stderr)
            for e in range(1, args.epochs + 1):
                r = epoch(slow, rep * 100 + e, args.workers, args.batch_size, args.transform)
                results["direct"].setdefault(e, []).append(r)
            print(f"repeat {rep + 1}/{args.repeats}: cachefs", file=sys.stderr)
            mp, cache = os.path.join(work, "mnt"), os.path.join(work, f"cache{rep}")
            shutil.rmtree(cache, ignore_errors=True)
            with cachefs(slow, mp, cache, ram_size=args.ram_size, disk_size=args.disk_size):
                with Sampler(cachefs_stats(mp)["info"]["pid"], None) as sampler:
                    for e in range(1, args.epochs + 1):
                        r = epoch(mp, rep * 100 + e, args.workers, args.batch_size, args.transform)
                        results["cachefs"].setdefault(e, []).append(r)
                rss.append(sampler.rss)
            shutil.rmtree(cache, ignore_errors=True)
    n = args.classes * args.per_class
    print(f"\nDataLoader epochs: {n} JPEGs ({format_size(total)}), {args.workers} workers, batch "
          f"{args.batch_size}, transform {args.transform}; store slowfs {args.latency}/request; "
          f"median of {args.repeats}")
    print(f"{'epoch':>6}{'direct img/s':>14}{'cachefs img/s':>15}{'x direct':>10}")
    table = {}
    for e in range(1, args.epochs + 1):
        d, c = med(results["direct"][e], "images_per_s"), med(results["cachefs"][e], "images_per_s")
        table[e] = {"direct": d, "cachefs": c, "ratio": c / d}
        print(f"{e:>6}{d:>14.0f}{c:>15.0f}{c / d:>10.2f}")
    print(f"cachefs daemon peak RSS {format_size(max(rss))} (RAM tier {args.ram_size})")
    write_json(args.json, {"args": vars(args), "epochs": table, "raw": results, "peak_rss": max(rss)})
    return 0


# -- hint ------------------------------------------------------------------------------------

def hint_case(args: argparse.Namespace, case: str, work: str, data: str, total: int) -> dict[str, Any]:
    if case == "ram":
        ram, disk, latency, measured = total // 4, total * 2, args.latency, range(1, args.epochs + 1)
    else:
        ram, disk, latency, measured = total // 8, total // 4, args.latency, range(2, args.epochs + 1)
    # ram: a third mount whose RAM tier holds the whole dataset is the ceiling ("RAM speed")
    modes = ("plain", "hinted", "all-in-RAM") if case == "ram" else ("plain", "hinted")
    out: dict[str, Any] = {"ram_bytes": ram, "disk_bytes": disk, "latency": latency, **{m: {} for m in modes}}
    with slowfs(data, os.path.join(work, "slow"), latency=latency) as slow:
        for rep in range(args.repeats):
            for mode in modes:
                print(f"{case}: repeat {rep + 1}/{args.repeats}, {mode}", file=sys.stderr)
                mp, cache = os.path.join(work, "mnt"), os.path.join(work, f"cache-{case}-{mode}")
                shutil.rmtree(cache, ignore_errors=True)
                ram_size = str(2 * total if mode == "all-in-RAM" else ram)
                with cachefs(slow, mp, cache, ram_size=ram_size, disk_size=str(disk), extra=["--min-free", "0"]):
                    pid = cachefs_stats(mp)["info"]["pid"]
                    if case == "ram":
                        cachefs_cli("warm", mp, check=True, timeout=3600)
                    with Sampler(pid, None) as sampler:
                        for e in range(1, args.epochs + 1):
                            evict_data(mp, os.path.join(cache, "store"))
                            before = cachefs_stats(mp)
                            r = epoch(mp, rep * 100 + e, args.workers, args.batch_size, args.transform,
                                      hinted=mode == "hinted")
                            r.update(ram_rates(before, cachefs_stats(mp)))
                            if e in measured:
                                out[mode].setdefault(e, []).append(r)
                    out.setdefault("peak_rss", {}).setdefault(mode, []).append(sampler.rss)
                shutil.rmtree(cache, ignore_errors=True)
    return out


def cmd_hint(args: argparse.Namespace) -> int:
    if not drop_caches():
        raise SystemExit("torchbench hint: needs root, to drop the page cache before each epoch")
    report = {}
    with dataset(args) as (work, data, total):
        for case in args.case.split(","):
            report[case] = hint_case(args, case, work, data, total)
    n = args.classes * args.per_class
    print(f"\nHintedSampler vs the plain sampler: {n} JPEGs ({format_size(total)}), {args.workers} workers, "
          f"batch {args.batch_size}, transform {args.transform}; data files' page cache dropped before each "
          "epoch; "
          f"median of {args.repeats}")
    print(f"{'case':<6}{'epoch':>6}{'plain img/s':>13}{'hinted img/s':>14}{'speed-up':>10}"
          f"{'RAM hit plain':>15}{'RAM hit hinted':>16}{'NVMe hit':>10}{'all-in-RAM img/s':>18}")
    summary: dict[str, Any] = {}
    for case, r in report.items():
        for e in sorted(r["plain"]):
            p, h = r["plain"][e], r["hinted"][e]
            row: dict[str, float | None] = {"plain": med(p, "images_per_s"), "hinted": med(h, "images_per_s"),
                   "ram_plain": med(p, "ram_hit_rate"), "ram_hinted": med(h, "ram_hit_rate"),
                   "disk_hinted": med(h, "disk_hit_rate"), "time_ratio": med(p, "seconds") / med(h, "seconds")}
            ceiling = f"{med(r['all-in-RAM'][e], 'images_per_s'):>18.0f}" if "all-in-RAM" in r else f"{'-':>18}"
            row["all_in_ram"] = med(r["all-in-RAM"][e], "images_per_s") if "all-in-RAM" in r else None
            summary.setdefault(case, {})[e] = row
            print(f"{case:<6}{e:>6}{row['plain']:>13.0f}{row['hinted']:>14.0f}{row['time_ratio']:>10.2f}"
                  f"{row['ram_plain']:>15.2f}{row['ram_hinted']:>16.2f}{row['disk_hinted']:>10.2f}{ceiling}")
    for case, r in report.items():
        rss = ", ".join(f"{mode} {format_size(max(v))}" for mode, v in r["peak_rss"].items())
        print(f"{case}: RAM tier {format_size(r['ram_bytes'])}, NVMe tier {format_size(r['disk_bytes'])}, "
              f"store {r['latency']}/request; daemon peak RSS: {rss}")
    write_json(args.json, {"args": vars(args), "dataset_bytes": total, "summary": summary, "raw": report})
    return 0


# -- diagnose --------------------------------------------------------------------------------

def cmd_diagnose(args: argparse.Namespace) -> int:
    setups = [("slowfs 5 ms, standard transforms", "storage-bound", "slow", ["--transform", "standard"]),
              ("local disk, heavy transform", "cpu-bound", "local", ["--transform", "tools.torchbench:heavy"]),
              ("local disk, GPU decoding (bytes only)", "fine", "local", ["--transform", "none"])]
    rows = []
    with dataset(args) as (work, data, _), slowfs(data, os.path.join(work, "slow"), latency="5ms") as slow:
        for name, expected, where, extra in setups:
            path = slow if where == "slow" else data
            drop_caches()
            print(f"diagnose: {name}", file=sys.stderr)
            proc = subprocess.run([sys.executable, "-m", "cachefs", "diagnose", path, "--json",
                                   "--seconds", str(args.seconds), *extra],
                                  capture_output=True, text=True, cwd=ROOT, timeout=600)
            if proc.returncode != 0:
                raise SystemExit(f"diagnose failed on {name}: {proc.stderr.strip()}")
            r = json.loads(proc.stdout)
            rows.append({"setup": name, "expected": expected, "verdict": r["verdict"],
                         "images_per_s": r["loader"]["images_per_s"], "read_share": r["loader"]["read_share"],
                         "cpu_busy": r["loader"]["system"]["cpu_busy"],
                         "raw_files_per_s": r["raw"]["files_per_s"], "report": r})
    print(f"\ncachefs diagnose on three set-ups ({args.classes * args.per_class} JPEGs, "
          f"{args.seconds:.0f}s a measurement)")
    print(f"{'set-up':<40}{'expected':>15}{'verdict':>15}{'img/s':>8}{'waiting':>9}{'CPU':>6}{'raw files/s':>13}")
    for r in rows:
        print(f"{r['setup']:<40}{r['expected']:>15}{r['verdict']:>15}{r['images_per_s']:>8.0f}"
              f"{r['read_share']:>9.0%}{r['cpu_busy']:>6.0%}{r['raw_files_per_s']:>13.0f}")
    right = sum(r["verdict"] == r["expected"] for r in rows)
    print(f"{right} of {len(rows)} verdicts as expected")
    write_json(args.json, {"args": vars(args), "setups": rows})
    return 0 if right == len(rows) else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    for name in ("loader", "hint", "diagnose"):
        s = sub.add_parser(name)
        s.add_argument("--classes", type=int, default=10)
        s.add_argument("--per-class", type=int, default=200)
        add_workspace_options(s, repeats=None if name == "diagnose" else 3)
        if name != "diagnose":
            s.add_argument("--latency", default="2ms")
            s.add_argument("--workers", type=int, default=4)
            s.add_argument("--batch-size", type=int, default=32)
            s.add_argument("--epochs", type=int, default=3)
    lo = sub.choices["loader"]
    lo.add_argument("--transform", default="standard")
    lo.add_argument("--ram-size", default="1GiB")
    lo.add_argument("--disk-size", default="4GiB")
    h = sub.choices["hint"]
    h.add_argument("--case", default="ram,both", help="ram (dataset 4x RAM, within NVMe), both (larger than both)")
    h.add_argument("--transform", default="none")
    sub.choices["diagnose"].add_argument("--seconds", type=float, default=10.0)
    args = p.parse_args(argv)
    return {"loader": cmd_loader, "hint": cmd_hint, "diagnose": cmd_diagnose}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
