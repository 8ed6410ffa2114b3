#!/usr/bin/env python3
"""epoch: read an ImageFolder tree the way a PyTorch DataLoader does, and time it.

    python tools/epoch.py ROOT [--workers 8] [--epochs 2] [--batch-size 32] [--seed 0] [--unbuffered] [--json FILE]

The file list is built like torchvision's ImageFolder (sorted class directories, sorted
files, image extensions); each epoch shuffles it with seed+epoch, cuts it into batches and
hands the batches to N worker processes, each of which opens and reads every file of its
batch in turn (bytes only, no decode), with `open(path, "rb")` as PIL's and torchvision's
loaders do: before Python 3.14 that open calls `isatty()`, on a FUSE mount one more request
per open. --unbuffered opens with buffering=0, which does not (as 3.14's open() of a
regular file does not). Prints one line per epoch: files/s, MB/s and
per-file latency p50/p99; with --json also writes them. No torch needed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import time

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def list_imagefolder(root: str) -> list[str]:
    """Paths in torchvision.datasets.ImageFolder's order."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    paths = []
    for cls in classes:
        for dirpath, _, files in sorted(os.walk(os.path.join(root, cls), followlinks=True)):
            for name in sorted(files):
                if name.lower().endswith(IMG_EXTENSIONS):
                    paths.append(os.path.join(dirpath, name))
    return paths


def _read_batch(paths: list[str], buffering: int = -1) -> list[tuple[float, int]]:
    out = []
    for path in paths:
        t0 = time.perf_counter()
        with open(path, "rb", buffering=buffering) as f:
            n = len(f.read())
        out.append((time.perf_counter() - t0, n))
    return out


def _read_batch_unbuffered(paths: list[str]) -> list[tuple[float, int]]:
    return _read_batch(paths, buffering=0)


def read_sequentially(path: str, chunk: int) -> float:
    """Seconds to read `path` start to end in `chunk`-sized read() calls, unbuffered."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(chunk):
            pass
    return time.perf_counter() - t0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def run_epochs(root: str, workers: int = 8, epochs: int = 2, batch_size: int = 32, seed: int = 0,
               paths: list[str] | None = None, quiet: bool = False, unbuffered: bool = False) -> list[dict]:
    paths = paths if paths is not None else list_imagefolder(root)
    if not paths:
        raise SystemExit(f"epoch: no image files under {root}")
    results = []
    ctx = mp.get_context("fork")
    with ctx.Pool(workers) as pool:
        for epoch in range(1, epochs + 1):
            order = paths[:]
            random.Random(seed + epoch).shuffle(order)
            batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
            t0 = time.perf_counter()
            lat, nbytes = [], 0
            first_batch = 0.0
            read = _read_batch_unbuffered if unbuffered else _read_batch
            for done, res in enumerate(pool.imap(read, batches, chunksize=1), 1):
                if done == 1:
                    first_batch = time.perf_counter() - t0  # what a training step waits for first
                for seconds, n in res:
                    lat.append(seconds)
                    nbytes += n
                if not quiet and sys.stderr.isatty():
                    print(f"\r  epoch {epoch}: {done}/{len(batches)} batches", end="", file=sys.stderr, flush=True)
            wall = time.perf_counter() - t0
            if not quiet and sys.stderr.isatty():
                print("\r" + " " * 40 + "\r", end="", file=sys.stderr)
            results.append({
                "epoch": epoch, "files": len(order), "bytes": nbytes, "seconds": wall,
                "files_per_s": len(order) / wall, "mb_per_s": nbytes / wall / 1e6,
                "p50_ms": percentile(lat, 0.5) * 1e3, "p99_ms": percentile(lat, 0.99) * 1e3,
                "mean_ms": statistics.fmean(lat) * 1e3, "first_batch_s": first_batch,
            })
    return results


def format_row(label: str, r: dict) -> str:
    return (f"{label:<22} epoch {r['epoch']}: {r['files']:>6} files {r['seconds']:7.2f}s "
            f"{r['files_per_s']:8.0f} files/s {r['mb_per_s']:7.1f} MB/s  "
            f"p50 {r['p50_ms']:6.2f} ms  p99 {r['p99_ms']:7.2f} ms")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--unbuffered", action="store_true",
                   help="open with buffering=0: no isatty() per open (Python 3.14's open() makes none either)")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    results = run_epochs(args.root, args.workers, args.epochs, args.batch_size, args.seed,
                         unbuffered=args.unbuffered)
    for r in results:
        print(format_row(args.root, r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
