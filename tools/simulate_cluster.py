#!/usr/bin/env python3
"""simulate_cluster: a scale model of a cluster's first epochs through cachefs, with and
without the shared tier, for node counts this machine cannot run (8, 64, 256 nodes on an
ImageNet-sized dataset), checked against what tools/cluster.py measures with 2-4 nodes.

    python tools/simulate_cluster.py                          # table, ImageNet-1k defaults
    python tools/simulate_cluster.py --store-gbps 2 --png cluster.png --check results.json

The model (its assumptions, stated):
- A dataset of S bytes in F files, on a store that serves at most B bytes/s in all.
- N nodes, each with a cache (RAM + NVMe) that holds the dataset, and a cold read rate
  of at most R bytes/s of its own (its CPU, its link).
- Access: "sharded" (DistributedSampler: every epoch one shuffle split over the nodes,
  disjoint shares) or "replicated" (every node reads the whole dataset every epoch).
  With cachefs's directory read-ahead on (the default), a node fetches the unread files
  of every directory it reads: in the sharded case each node then pulls the whole
  dataset in its first epoch, as "replicated" does ("sharded+readahead").
- Without the shared tier each node fetches from the store what it has not cached
  itself. With it, each byte crosses the store once per cluster (the first node to need
  it, or the node whose `warm --shard` it falls to); the rest is read from memcached
  servers, one per node, each serving at most M bytes/s (its NIC).
- An epoch takes as long as its slowest resource: the store (bytes from it / B), the
  shared tier (bytes from it / (N x M)), or a node (its bytes / R). No queueing, no
  overlap between epochs, no evictions.
"""

from __future__ import annotations

import argparse
import json
import sys

GB = 1e9


def epoch_traffic(access: str, nodes: int, epoch: int, size: float, shared: bool) -> tuple[float, float, float]:
    """(bytes from the store, bytes from the shared tier, bytes each node reads) in epoch
    `epoch` (1-based)."""
    if access == "sharded":
        per_node = size / nodes
        if shared:
            return (size if epoch == 1 else 0.0), (0.0 if epoch == 1 else size), per_node
        # a node has cached the files it read before; a file is new to it with
        # probability (1 - 1/N)^(epoch-1)
        return size * (1 - 1 / nodes) ** (epoch - 1), 0.0, per_node
    # replicated, or sharded with directory read-ahead: every node reads it all at first
    if epoch > 1:
        return 0.0, 0.0, size if access == "replicated" else size / nodes
    if shared:
        return size, size * (nodes - 1), size
    return size * nodes, 0.0, size


def model(args: argparse.Namespace) -> list[dict]:
    size = args.dataset_gb * GB
    rows = []
    for access in args.access.split(","):
        for n in args.nodes:
            for shared in (False, True):
                store_total, first = 0.0, None
                for e in range(1, args.epochs + 1):
                    store, tier, per_node = epoch_traffic(access, n, e, size, shared)
                    store_total += store
                    t = max(store / (args.store_gbps * GB), tier / (n * args.memcached_gbps * GB) if tier else 0.0,
                            per_node / (args.node_gbps * GB))
                    if e == 1:
                        first = t
                rows.append({"access": access, "nodes": n, "shared": shared, "store_bytes": store_total,
                             "store_x_dataset": store_total / size, "first_epoch_s": first})
    return rows


def check(path: str) -> list[str]:
    """Compare the model with tools/cluster.py's measurements (its --json file)."""
    with open(path) as f:
        measured = json.load(f)
    lines = []
    split = measured.get("split", {})
    for label, shared in (("without the shared tier", False), ("with the shared tier", True)):
        if label in split:
            got = split[label]["store_x_dataset"]
            nodes = len(split[label]["epochs"][0]["files_per_s"])
            want = sum(epoch_traffic("sharded+readahead", nodes, e, 1.0, shared)[0]
                       for e in range(1, len(split[label]["epochs"]) + 1))
            lines.append(f"{nodes} nodes sharded, read-ahead on, {label}: model {want:.2f}x the dataset from "
                         f"the store, measured {got:.2f}x")
    pair = measured.get("pair")
    if pair:
        lines.append(f"node B after node A, shared tier: model 0% of the dataset from the store, measured "
                     f"{pair['store_share']:.1%}")
    return lines


def plot(rows: list[dict], path: str, access: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for shared, style in ((False, "o--"), (True, "s-")):
        rs = [r for r in rows if r["access"] == access and r["shared"] == shared]
        label = "with the shared tier" if shared else "without"
        left.plot([r["nodes"] for r in rs], [r["store_x_dataset"] for r in rs], style, label=label)
        right.plot([r["nodes"] for r in rs], [r["first_epoch_s"] / 60 for r in rs], style, label=label)
    for ax, title in ((left, "bytes from the store / dataset"), (right, "first epoch, minutes")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("nodes")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"cachefs cluster model ({access})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset-gb", type=float, default=140.0, help="dataset size (default: ImageNet-1k, 140 GB)")
    p.add_argument("--nodes", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8, 64, 256])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--access", default="sharded+readahead,sharded,replicated")
    p.add_argument("--store-gbps", type=float, default=2.0, help="store bandwidth, GB/s in all (default 2)")
    p.add_argument("--node-gbps", type=float, default=1.0, help="a node's own cold read rate, GB/s (default 1)")
    p.add_argument("--memcached-gbps", type=float, default=1.25, help="per memcached server, GB/s (10 GbE)")
    p.add_argument("--png", help="plot store traffic and first-epoch time against the node count")
    p.add_argument("--check", metavar="JSON", help="tools/cluster.py --json output to check the model against")
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    rows = model(args)
    print(f"dataset {args.dataset_gb:g} GB, store {args.store_gbps:g} GB/s, node {args.node_gbps:g} GB/s, "
          f"memcached {args.memcached_gbps:g} GB/s per server, {args.epochs} epochs")
    print(f"{'access':<18}{'nodes':>6}  {'store / dataset':>28}  {'first epoch (min)':>26}")
    print(f"{'':<18}{'':>6}  {'without':>13}{'shared':>15}  {'without':>12}{'shared':>14}")
    for access in args.access.split(","):
        for n in args.nodes:
            a, b = (next(r for r in rows if r["access"] == access and r["nodes"] == n and r["shared"] == s)
                    for s in (False, True))
            print(f"{access:<18}{n:>6}  {a['store_x_dataset']:>12.2f}x{b['store_x_dataset']:>14.2f}x  "
                  f"{a['first_epoch_s'] / 60:>12.1f}{b['first_epoch_s'] / 60:>14.1f}")
    if args.check:
        print("\nchecked against the measurements:")
        for line in check(args.check):
            print("  " + line)
    if args.png:
        plot(rows, args.png, args.access.split(",")[0])
        print(f"plot: {args.png}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
