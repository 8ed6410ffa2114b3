#!/usr/bin/env python3
"""simulate: replay training-style access patterns through cachefs's real core, tiers and
policies, over an in-memory source (no mount), and measure each tier's hit rate against
the cache/dataset optimum.

    python tools/simulate.py                       # table + plot, both tiers, all patterns
    python tools/simulate.py --tier ram --patterns random,sequential --png sim.png

Patterns (each an "epoch" reads every file of the dataset once, except where noted):
  random      a new seeded shuffle per epoch (a DataLoader with shuffle=True)
  sequential  the same sorted order every epoch (the pathological case for LRU)
  sharded     DistributedSampler: one shuffle per epoch split over --ranks ranks on this
              node, the ranks' reads interleaved
  two-jobs    two jobs train on the same dataset at once, each with its own shuffle
  change      --epochs epochs on dataset A, then as many on a disjoint dataset B of the
              same size (the working set changes halfway)

Hit rates are byte hit rates: bytes the tier served over bytes read (the optimum, the
cache/dataset ratio, is one of bytes too). The steady-state hit rate is the mean over the
epochs after the first two. With random
epochs no policy can beat cache/dataset (every file is read once per epoch), which is
the optimum line in the plot. The RAM tier is measured alone (no NVMe tier); the NVMe
tier is measured with a RAM tier of zero bytes, so every read reaches it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
from collections.abc import Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cachefs.core import Core
from cachefs.memsource import MemorySource
from cachefs.policy import POLICIES
from cachefs.stats import Stats
from cachefs.tiers.disk import DiskTier
from cachefs.tiers.memory import MemoryTier
from cachefs.tiers.multilevel import MultiLevelCache

PATTERNS = ("random", "sequential", "sharded", "two-jobs", "change")
RATIOS = (0.1, 0.2, 0.3, 0.35, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def epoch_order(pattern: str, files: list[str], epoch: int, seed: int, ranks: int) -> Iterator[str]:
    """The reads of one epoch, in the order the cache sees them."""
    if pattern == "sequential":
        yield from files
        return
    rng = random.Random(seed * 1000 + epoch)
    if pattern in ("random", "change"):
        order = files[:]
        rng.shuffle(order)
        yield from order
    elif pattern == "sharded":
        order = files[:]
        rng.shuffle(order)  # the sampler's global permutation, the same on every rank
        shards = [order[r::ranks] for r in range(ranks)]
        for i in range(max(len(s) for s in shards)):  # ranks read concurrently
            for shard in shards:
                if i < len(shard):
                    yield shard[i]
    elif pattern == "two-jobs":
        a, b = files[:], files[:]
        rng.shuffle(a)
        random.Random(seed * 1000 + epoch + 500).shuffle(b)
        for x, y in zip(a, b, strict=True):
            yield x
            yield y
    else:
        raise ValueError(pattern)


class Rig:
    """A core over an in-memory dataset with one tier under test."""

    def __init__(self, tier: str, policy: str, capacity: int, block: int, workdir: str):
        self.stats = Stats()
        self.tier, self.policy, self.workdir = tier, policy, workdir
        self.source = MemorySource()
        self.block = block
        self.set_capacity(capacity)

    def set_capacity(self, capacity: int) -> None:
        """(Re)build the tiers with the tier under test holding `capacity` bytes."""
        if self.tier == "ram":
            ram = MemoryTier(capacity, self.stats, policy=self.policy)
            disk = None
        else:
            ram = MemoryTier(0, self.stats, policy=self.policy)
            disk = DiskTier(tempfile.mkdtemp(dir=self.workdir), capacity, self.stats, policy=self.policy,
                            min_free=0, scrub=False)
        if getattr(self, "cache", None) is not None:
            self.cache.close()
        self.cache = MultiLevelCache(ram, disk, self.stats)
        self.core = Core(self.source, self.cache, self.stats, block_size=self.block)

    def add_dataset(self, prefix: str, n: int, seed: int) -> tuple[list[str], int]:
        """n files of ImageNet-like sizes (lognormal, mean about 110 KB), one block each;
        returns their paths and total bytes."""
        rng = random.Random(seed)
        paths = [f"/{prefix}/f{i:06d}" for i in range(n)]
        self.source.add_dir(f"/{prefix}")
        total = 0
        for path in paths:
            size = min(self.block, max(4096, int(rng.lognormvariate(11.4, 0.5))))
            self.source.add_file(path, rng.randbytes(size))
            total += size
        return paths, total

    def hit_bytes(self) -> int:
        return self.stats.get(f"{self.tier}.served_bytes")

    def read_bytes(self) -> int:
        return self.stats.get("reads.bytes")

    def read(self, path: str) -> None:
        self.core.read(path, 0, self.block)  # the whole file: it is at most one block

    def close(self) -> None:
        self.cache.close()


def run(tier: str, policy: str, pattern: str, ratio: float, files: int, epochs: int,
        block: int, seed: int, ranks: int, workdir: str) -> list[float]:
    """Byte hit rate of the tier in each epoch."""
    rig = Rig(tier, policy, 0, block, workdir)
    try:
        a, total = rig.add_dataset("a", files, seed)
        datasets = [a]
        if pattern == "change":
            datasets.append(rig.add_dataset("b", files, seed + 1)[0])
        rig.set_capacity(int(ratio * total))
        rates = []
        for phase, dataset in enumerate(datasets):
            for epoch in range(epochs):
                hits, reads = rig.hit_bytes(), rig.read_bytes()
                for path in epoch_order(pattern, dataset, phase * epochs + epoch, seed, ranks):
                    rig.read(path)
                rates.append((rig.hit_bytes() - hits) / (rig.read_bytes() - reads))
        for t in (rig.cache.ram, rig.cache.disk):
            if t is not None:
                t.check()  # the invariants held to the end (bytes within budget, one state per key)
        return rates
    finally:
        rig.close()
        del rig
        gc.collect()  # the core and its tiers reference each other: free the dataset now


def steady(rates: list[float]) -> float:
    tail = rates[2:] or rates
    return sum(tail) / len(tail)


def plot(results: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib); no plot", file=sys.stderr)
        return
    keys = sorted({(r["tier"], r["pattern"]) for r in results if r["pattern"] != "change"})
    cols = min(3, len(keys))
    rows = -(-len(keys) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, (tier, pattern) in zip(axes.flat, keys, strict=False):
        ax.plot([0, 1], [0, 1], color="grey", linestyle="--", label="optimum (cache/dataset)")
        for policy in sorted({r["policy"] for r in results}):
            pts = sorted((r["ratio"], r["steady"]) for r in results
                         if (r["tier"], r["pattern"], r["policy"]) == (tier, pattern, policy))
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=policy)
        ax.set_title(f"{tier} tier, {pattern} epochs")
        ax.set_xlabel("cache / dataset")
        ax.set_ylabel("steady-state hit rate")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}", file=sys.stderr)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tier", choices=("ram", "disk", "both"), default="both")
    p.add_argument("--policies", default=",".join(POLICIES), help="comma-separated (default: %(default)s)")
    p.add_argument("--patterns", default=",".join(PATTERNS), help="comma-separated (default: %(default)s)")
    p.add_argument("--ratios", default=",".join(map(str, RATIOS)), help="cache/dataset ratios")
    p.add_argument("--files", type=int, default=2000, help="files in the dataset (about 110 KB each)")
    p.add_argument("--disk-files", type=int, default=2000, help="the same for the NVMe tier")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--block", type=int, default=1 << 20, help="block size in bytes (a file is at most one)")
    p.add_argument("--ranks", type=int, default=4, help="ranks for the sharded pattern")
    p.add_argument("--change-ratio", type=float, default=0.5, help="cache/dataset for the change pattern")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--png", default="simulate.png", help="plot file ('' for none)")
    p.add_argument("--json", help="write every result here")
    args = p.parse_args()
    try:
        policies = [x for x in args.policies.split(",") if x]
        patterns = [x for x in args.patterns.split(",") if x]
        ratios = [float(x) for x in args.ratios.split(",") if x]
        for name in policies:
            if name not in POLICIES:
                raise ValueError(f"unknown policy {name!r}")
        for name in patterns:
            if name not in PATTERNS:
                raise ValueError(f"unknown pattern {name!r}")
        if not ratios or not all(0 < r <= 1 for r in ratios):
            raise ValueError("ratios must lie in (0, 1]")
    except ValueError as exc:
        p.error(str(exc))
    tiers = ["ram", "disk"] if args.tier == "both" else [args.tier]
    jobs = []
    for tier in tiers:
        files = args.files if tier == "ram" else args.disk_files
        for pattern in patterns:
            for ratio in ([args.change_ratio] if pattern == "change" else ratios):
                for policy in policies:
                    jobs.append((tier, policy, pattern, ratio, files))
    results = []
    with tempfile.TemporaryDirectory(prefix="cachefs-sim-") as workdir:
        for i, (tier, policy, pattern, ratio, files) in enumerate(jobs, 1):
            if sys.stderr.isatty():
                print(f"\r[{i}/{len(jobs)}] {tier} {pattern} {policy} {ratio:.2f}   ", end="", file=sys.stderr)
            rates = run(tier, policy, pattern, ratio, files, args.epochs, args.block, args.seed,
                        args.ranks, workdir)
            results.append({"tier": tier, "policy": policy, "pattern": pattern, "ratio": ratio,
                            "files": files, "epochs": rates, "steady": steady(rates)})
    if sys.stderr.isatty():
        print(file=sys.stderr)

    print("steady-state hit rate (epochs 3..), and as a share of the optimum cache/dataset")
    print(f"{'tier':<5} {'pattern':<11} {'ratio':>5}  " + "  ".join(f"{p:>13}" for p in policies))
    for tier in tiers:
        for pattern in patterns:
            if pattern == "change":
                continue
            for ratio in ratios:
                cells = []
                for policy in policies:
                    r = next(x for x in results if (x["tier"], x["pattern"], x["ratio"], x["policy"])
                             == (tier, pattern, ratio, policy))
                    cells.append(f"{r['steady']:.3f} ({r['steady'] / ratio:4.0%})")
                print(f"{tier:<5} {pattern:<11} {ratio:>5.2f}  " + "  ".join(f"{c:>13}" for c in cells))
    if "change" in patterns:
        print(f"\nworking-set change at cache/dataset {args.change_ratio}: hit rate per epoch "
              f"(dataset A for {args.epochs} epochs, then B)")
        for tier in tiers:
            for policy in policies:
                r = next(x for x in results if (x["tier"], x["pattern"], x["policy"]) == (tier, "change", policy))
                a, b = r["epochs"][:args.epochs], r["epochs"][args.epochs:]
                print(f"{tier:<5} {policy:<5}  A: " + " ".join(f"{x:.2f}" for x in a)
                      + "  |  B: " + " ".join(f"{x:.2f}" for x in b))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    if args.png:
        plot(results, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
