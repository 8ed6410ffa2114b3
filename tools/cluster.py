#!/usr/bin/env python3
"""cluster: N cachefs mounts stand for N nodes over one slow store, sharing a tier on real
memcached servers (extstore on local files), side by side with the same nodes without it.

    python tools/cluster.py pair   [--repeats 3]   node B's cold epoch after node A's
    python tools/cluster.py split  [--nodes 4]     each node reads its own share per epoch
    python tools/cluster.py faults                 servers killed, stopped, items corrupted
    python tools/cluster.py all --json results.json

The store is tools/slowfs (2 ms per request by default); each node has its own cache dir
and RAM tier, 8 reader processes read as a DataLoader does, and the page cache is dropped
before every epoch. Store bytes are what slowfs served; shared-tier bytes what the nodes'
stats count. Prints tables; --json keeps every figure.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import random
import shutil
import sys
from collections.abc import Iterator

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cachefs.config import format_size
from tools.common import add_workspace_options, drop_caches, ensure_dataset, median, workspace, write_json
from tools.epoch import list_imagefolder, run_epochs
from tools.memcached import MemcachedServers, available
from tools.mounts import cachefs_stats, slowfs
from tools.slowfs import read_stats, reset_stats
from tools.targets import cpu, mounted, table

DAEMONS: dict[str, psutil.Process] = {}  # mount point -> its daemon


@contextlib.contextmanager
def nodes(slow: str, work: str, count: int, shared: str | None, ram: str, tag: str) -> Iterator[list[str]]:
    """`count` fresh mounts (empty caches) of the store; yields their mount points."""
    with contextlib.ExitStack() as stack:
        points = []
        for i in range(count):
            cache = os.path.join(work, f"cache-{tag}-{i}")
            shutil.rmtree(cache, ignore_errors=True)
            mp = os.path.join(work, f"node-{tag}-{i}")
            extra = ["--shared-cache", shared] if shared else []
            DAEMONS[mp] = stack.enter_context(mounted(slow, mp, cache, extra, ram=ram))
            points.append(mp)
        yield points


def epoch(mp: str, rel: list[str], seed: int, workers: int) -> dict:
    drop_caches()
    proc = DAEMONS.get(mp)
    c0 = cpu(proc) if proc else 0.0
    r = run_epochs(mp, workers, 1, seed=seed, paths=[os.path.join(mp, x) for x in rel], quiet=True)[0]
    r["cpu_ms_per_file"] = (cpu(proc) - c0) / len(rel) * 1e3 if proc else None
    return r


def settle(mp: str) -> None:
    """Wait until a node's puts to the shared tier are stored."""
    import time

    deadline = time.monotonic() + 60
    while cachefs_stats(mp)["shared"]["pending_bytes"] and time.monotonic() < deadline:
        time.sleep(0.1)


def shared_bytes(mp: str) -> int:
    return int(cachefs_stats(mp)["shared"]["bytes"])


def rss_mib(servers: MemcachedServers) -> float:
    total = 0
    for proc in servers.procs:
        if proc is not None:
            with contextlib.suppress(psutil.NoSuchProcess):
                total += psutil.Process(proc.pid).memory_info().rss
    return total / 2**20


# -- node B's cold epoch after node A's ---------------------------------------------------------

def cmd_pair(args: argparse.Namespace, work: str, slow: str, rel: list[str], total: int) -> dict:
    runs: dict[str, list[dict]] = {"direct": [], "alone": [], "shared": []}
    for rep in range(args.repeats):
        print(f"pair: repeat {rep + 1}/{args.repeats}", file=sys.stderr)
        runs["direct"].append(epoch(slow, rel, 10 + rep, args.workers))
        with nodes(slow, work, 1, None, args.ram_size, "alone") as (b,):
            reset_stats(slow)
            r = epoch(b, rel, 10 + rep, args.workers)
            r["store_bytes"] = read_stats(slow)["bytes"]
            runs["alone"].append(r)
        with MemcachedServers(args.servers, os.path.join(work, "mc")) as servers, \
                nodes(slow, work, 2, servers.url, args.ram_size, "pair") as (a, b):
            epoch(a, rel, 20 + rep, args.workers)
            settle(a)
            reset_stats(slow)
            r = epoch(b, rel, 10 + rep, args.workers)
            r["store_bytes"] = read_stats(slow)["bytes"]
            r["shared_bytes"] = shared_bytes(b)
            r["memcached_rss_mib"] = rss_mib(servers)
            runs["shared"].append(r)
    direct = median(r["files_per_s"] for r in runs["direct"])
    alone = median(r["files_per_s"] for r in runs["alone"])
    shared = median(r["files_per_s"] for r in runs["shared"])
    from_store = median(r["store_bytes"] for r in runs["shared"]) / total
    from_shared = median(r["shared_bytes"] for r in runs["shared"]) / total
    print(f"\nnode B's cold epoch: {len(rel)} files ({format_size(total)}), {args.workers} readers, store "
          f"{args.latency}/request, {args.servers} memcached servers; median of {args.repeats}")
    cpu_alone = median(r["cpu_ms_per_file"] for r in runs["alone"])
    cpu_shared = median(r["cpu_ms_per_file"] for r in runs["shared"])
    table([("direct from the store", f"{direct:.0f}", "-", "100%", "-", "-"),
           ("node B alone (cold cache)", f"{alone:.0f}", "1.00",
            f"{median(r['store_bytes'] for r in runs['alone']) / total:.0%}", "-", f"{cpu_alone:.3f}"),
           ("node B after node A, shared tier", f"{shared:.0f}", f"{shared / alone:.2f}", f"{from_store:.1%}",
            f"{from_shared:.1%}", f"{cpu_shared:.3f}")],
          ("epoch", "files/s", "x alone", "bytes from store", "bytes from shared", "daemon ms/file"))
    return {"direct_files_per_s": direct, "alone_files_per_s": alone, "shared_files_per_s": shared,
            "x_alone": shared / alone, "store_share": from_store, "shared_share": from_shared, "runs": runs}


# -- N nodes, each its own share per epoch ------------------------------------------------------

def shares(rel: list[str], count: int, epoch_no: int) -> list[list[str]]:
    """A DistributedSampler-style split: one shuffle per epoch, node i takes every count-th."""
    order = list(rel)
    random.Random(1000 + epoch_no).shuffle(order)
    return [order[i::count] for i in range(count)]


def cmd_split(args: argparse.Namespace, work: str, slow: str, rel: list[str], total: int) -> dict:
    out: dict[str, dict] = {}
    for label, with_shared in (("without the shared tier", False), ("with the shared tier", True)):
        print(f"split: {args.nodes} nodes {label}", file=sys.stderr)
        with contextlib.ExitStack() as stack:
            url = None
            if with_shared:
                url = stack.enter_context(MemcachedServers(args.servers, os.path.join(work, "mc"))).url
            points = stack.enter_context(nodes(slow, work, args.nodes, url, args.ram_size, "split"))
            reset_stats(slow)
            per_epoch = []
            for e in range(args.epochs):
                parts = shares(rel, args.nodes, e)
                rates = []
                for mp, part in zip(points, parts, strict=True):  # one after another: 2 cores here
                    rates.append(epoch(mp, part, e, args.workers)["files_per_s"])
                    if with_shared:
                        settle(mp)
                per_epoch.append({"store_bytes": read_stats(slow)["bytes"], "files_per_s": rates})
            out[label] = {"epochs": per_epoch, "store_x_dataset": per_epoch[-1]["store_bytes"] / total}
    print(f"\n{args.nodes} nodes, each reading its own share per epoch (reshuffled), {args.epochs} epochs: "
          f"store bytes over the dataset ({format_size(total)}), after each epoch")
    table([(label, *[f"{ep['store_bytes'] / total:.2f}x" for ep in r["epochs"]]) for label, r in out.items()],
          ("nodes", *[f"epoch {e + 1}" for e in range(args.epochs)]))
    return out


# -- faults -------------------------------------------------------------------------------------

def verify(mp: str, data: str, rel: list[str], during: callable | None = None) -> tuple[int, int]:
    """Read every file through the mount and compare with the source: (errors, wrong files).
    `during` is called once, a third of the way through."""
    errors = wrong = 0
    for i, r in enumerate(rel):
        if during is not None and i == len(rel) // 3:
            during()
        try:
            with open(os.path.join(mp, r), "rb") as f:
                got = hashlib.sha256(f.read()).digest()
        except OSError:
            errors += 1
            continue
        with open(os.path.join(data, r), "rb") as f:
            wrong += got != hashlib.sha256(f.read()).digest()
    return errors, wrong


def cmd_faults(args: argparse.Namespace, work: str, slow: str, rel: list[str], total: int, data: str) -> dict:
    from pymemcache.client.base import Client

    from cachefs.blocks import FileId
    from cachefs.config import DEFAULT_BLOCK_SIZE
    from cachefs.tiers.shared import item_key

    rows, out = [], {}
    namespace = os.path.basename(slow.rstrip("/"))
    for fault in ("killed mid-epoch, then restarted", "stopped (SIGSTOP) mid-epoch", "items corrupted"):
        print(f"faults: {fault}", file=sys.stderr)
        with MemcachedServers(args.servers, os.path.join(work, "mc")) as servers, \
                nodes(slow, work, 2, servers.url, args.ram_size, "faults") as (a, b):
            epoch(a, rel, 1, args.workers)
            settle(a)
            during = None
            if fault.startswith("killed"):
                def during() -> None:
                    servers.kill(0)
                    servers.start(0)
            elif fault.startswith("stopped"):
                def during() -> None:
                    servers.stop(0)
            else:
                client = Client(("127.0.0.1", servers.ports[0]))
                for r in rel[:200]:
                    st = os.stat(os.path.join(data, r))
                    key = item_key(namespace, DEFAULT_BLOCK_SIZE,
                                   FileId("/" + r, st.st_size, st.st_mtime_ns, st.st_ctime_ns), 0)
                    value = client.get(key)
                    if value is not None:
                        client.set(key, value[:-8] + os.urandom(8))
                client.close()
            reset_stats(slow)
            drop_caches()
            errors, wrong = verify(b, data, rel, during)
            if fault.startswith("stopped"):
                servers.cont(0)
            s = cachefs_stats(b)["shared"]
            store = read_stats(slow)["bytes"]
        counted = (f"shared.errors={s['errors']}, checksum_failures={s['checksum_failures']}, "
                   f"down_events={s['down_events']}, hits={s['hits']}; store {store / total:.1%} of the dataset")
        rows.append((f"a server {fault}", str(errors), str(wrong), counted))
        out[fault] = {"errors": errors, "wrong": wrong, "shared": s, "store_bytes": store}
    print(f"\nfaults on node B's epoch ({len(rel)} files, {args.servers} servers, read and compared one by one)")
    table(rows, ("fault", "read errors", "wrong files", "what the stats counted"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("pair", "split", "faults", "all"))
    add_workspace_options(p, repeats=3)
    p.add_argument("--files", type=int, default=2000)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--servers", type=int, default=2)
    p.add_argument("--latency", default="2ms")
    p.add_argument("--ram-size", default="64MiB")
    args = p.parse_args(argv)
    if not available():
        print("cluster: needs memcached (make dev installs it)", file=sys.stderr)
        return 2
    results: dict[str, dict] = {}
    with workspace(args, "cluster") as work:
        data = os.path.join(work, "dataset")
        total = ensure_dataset(data, args.classes, args.files // args.classes)
        rel = [os.path.relpath(x, data) for x in list_imagefolder(data)]
        with slowfs(data, os.path.join(work, "dataset-slow"), latency=args.latency) as slow:
            if args.what in ("pair", "all"):
                results["pair"] = cmd_pair(args, work, slow, rel, total)
            if args.what in ("split", "all"):
                results["split"] = cmd_split(args, work, slow, rel, total)
            if args.what in ("faults", "all"):
                results["faults"] = cmd_faults(args, work, slow, rel, total, data)
    write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
