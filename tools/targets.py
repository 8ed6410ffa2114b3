#!/usr/bin/env python3
"""targets: the figures the passthrough design is held to, side by side in one run.

    python tools/targets.py warm    [--files 2000] [--repeats 3] [--baseline DIR]
    python tools/targets.py cold    [--latency 2ms] [--repeats 3] [--baseline DIR] [--walk]
    python tools/targets.py remount [--latency 2ms]
    python tools/targets.py seq     [--size 1GiB] [--latency 2ms] [--bandwidth 300MB]
    python tools/targets.py random  [--size 1GiB] [--latency 2.4ms] [--bandwidth 110MB]
    python tools/targets.py walk    [--files 2000] [--flat 3200] [--latency 2ms] [--baseline DIR]
    python tools/targets.py idle    [--files 20000] [--file-size 2048] [--seconds 30] [--baseline DIR]

Every epoch reads an ImageFolder of JPEGs (tools/mkdataset.py) with 8 worker processes the
way a DataLoader does (tools/epoch.py), with the page cache dropped before it (root), so
that every byte comes from where the system under test keeps it. Per system and epoch:
files/s, the ratio to the reference row, and the daemon's CPU seconds per file (psutil:
user + system of the daemon process, its steadiest figure on a shared machine). Medians
over --repeats.

warm    the same files read from local disk, and through cachefs whose NVMe tier holds them
        (the RAM tier is smaller than the set): passthrough, zero-message opens (--passthrough
        off, the path of a mount without CAP_SYS_ADMIN), and with --baseline an older cachefs
        checkout (DIR with its own .venv) in the same run.
cold    the first epoch over slowfs (--latency per request): the store read directly, and
        cachefs with a fresh cache (each mode, and the baseline).
remount one cold epoch through cachefs over slowfs, a clean unmount, a new mount over the same
        cache dir, and an epoch: bytes and requests that reached the store, against the
        dataset and the number of directories, and the epoch's files/s against a warm one.
seq     one large file, read cold and warm from start to end in 128 KiB reads (cat): slowfs
        directly, through cachefs; warm against the same file on local disk.
random  random 128 KiB reads of one large file on slowfs set up like an sshfs store, cold:
        directly and through cachefs; then py-lmdb with readahead=False over an LMDB of
        --lmdb-size on the same store, a full cold pass, directly and through cachefs.
idle    a tree of --files small files (--file-size bytes, directories of 1,000) read once
        through cachefs, a clean unmount, a new mount over the full cache, and then nothing:
        the daemon's CPU (all its processes) over --seconds, as a share of one core, and
        what its background work read meanwhile.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import math
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from cachefs.config import format_size, parse_size
from tools.common import (
    add_workspace_options,
    drop_caches,
    ensure_dataset,
    median,
    workspace,
    write_json,
)
from tools.epoch import list_imagefolder, read_sequentially, run_epochs
from tools.mounts import ROOT, cachefs_stats, is_mounted, slowfs, unmount
from tools.slowfs import read_stats, reset_stats

MODES = {"passthrough": ["--passthrough", "on"], "zero-message": ["--passthrough", "off"]}


# -- mounting any cachefs (this checkout or an older one) ------------------------------------

@contextlib.contextmanager
def mounted(source: str, mp: str, cache: str, extra: Sequence[str] = (), baseline: str | None = None,
            ram: str = "32MiB", disk: str = "8GiB") -> Iterator[psutil.Process]:
    """cachefs (or the baseline checkout's) mounted at `mp`; yields the daemon process."""
    os.makedirs(mp, exist_ok=True)
    python = os.path.join(baseline, ".venv", "bin", "python") if baseline else sys.executable
    env = dict(os.environ, FUSE_LIBRARY_NAME="fuse3")  # an older cachefs needed this beside libfuse2
    if baseline and not os.path.exists(python):  # a checkout without a venv of its own: ours, its code
        python = sys.executable
        env["PYTHONPATH"] = os.path.join(baseline, "src")
    cmd = [python, "-m", "cachefs", "mount", source, mp, "--cache-dir", cache, "--ram-size", ram,
           "--disk-size", disk, "--min-free", "0", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=baseline or ROOT, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"mount failed: {proc.stderr.strip()}")
    try:
        yield psutil.Process(cachefs_stats(mp)["info"]["pid"])
    finally:
        subprocess.run([python, "-m", "cachefs", "umount", mp], capture_output=True, cwd=baseline or ROOT, env=env)
        if is_mounted(mp):
            unmount(mp)


def cpu(proc: psutil.Process) -> float:
    """CPU seconds of the daemon and its child processes: those alive (fetch and serving
    processes), and those that ended and were waited for (a short-lived helper's)."""
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += t.user + t.system
        if p is proc:
            total += t.children_user + t.children_system
    return total


def epoch(root: str, rel: list[str], seed: int, workers: int) -> dict:
    drop_caches()
    return run_epochs(root, workers, 1, seed=seed, paths=[os.path.join(root, r) for r in rel], quiet=True)[0]


def measured_epoch(root: str, rel: list[str], seed: int, workers: int, proc: psutil.Process | None,
                   walk: bool = False) -> dict:
    """One epoch, with the daemon's CPU per file; `walk`: as a job starts, the ImageFolder
    walk first, counted in the epoch's time and in the time to its first batch."""
    c0 = cpu(proc) if proc else 0.0
    if walk:
        drop_caches()
        t0 = time.perf_counter()
        found = list_imagefolder(root)
        walked = time.perf_counter() - t0
        assert len(found) == len(rel), f"the walk found {len(found)} files, not {len(rel)}"
        r = run_epochs(root, workers, 1, seed=seed, paths=found, quiet=True)[0]
        r.update(walk_s=walked, seconds=r["seconds"] + walked, first_batch_s=r["first_batch_s"] + walked)
        r["files_per_s"] = r["files"] / r["seconds"]
    else:
        r = epoch(root, rel, seed, workers)
    r["cpu_ms_per_file"] = (cpu(proc) - c0) / len(rel) * 1e3 if proc else None
    return r


def systems(args: argparse.Namespace) -> list[tuple[str, list[str], str | None]]:
    out = [(name, opts, None) for name, opts in MODES.items() if name in args.modes.split(",")]
    if args.baseline:
        out.append(("baseline", [], args.baseline))
    return out


def table(rows: list[tuple[str, ...]], header: tuple[str, ...]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    for row in (header, *rows):
        print("  ".join(str(x).rjust(w) if i else str(x).ljust(w) for i, (x, w) in enumerate(zip(row, widths,
                                                                                                  strict=True))))


# -- warm ------------------------------------------------------------------------------------

def cmd_warm(args: argparse.Namespace, work: str) -> dict:
    data = os.path.join(work, "dataset")
    total = ensure_dataset(data, args.classes, args.files // args.classes)
    rel = [os.path.relpath(p, data) for p in list_imagefolder(data)]
    results: dict[str, list[dict]] = {"local": []}
    for rep in range(args.repeats):
        results["local"].append(epoch(data, rel, 100 + rep, args.workers))
        for name, opts, baseline in systems(args):
            cache = os.path.join(work, f"cache-{name}")
            shutil.rmtree(cache, ignore_errors=True)
            print(f"repeat {rep + 1}/{args.repeats}: {name}", file=sys.stderr)
            with mounted(data, os.path.join(work, "mnt"), cache, opts, baseline, ram=args.ram_size) as proc:
                epoch(os.path.join(work, "mnt"), rel, 1, args.workers)  # cold: fills the NVMe tier
                rows = [measured_epoch(os.path.join(work, "mnt"), rel, 100 + rep * 10 + e, args.workers, proc)
                        for e in range(args.epochs)]
                stats = cachefs_stats(os.path.join(work, "mnt"))
            for r in rows:
                r["opens"] = stats.get("info", {}).get("opens", "?")
            results.setdefault(name, []).extend(rows)
    local = median(r["files_per_s"] for r in results["local"])
    out = {"dataset_bytes": total, "files": len(rel), "local_files_per_s": local, "systems": {}}
    rows = [("local disk", f"{local:.0f}", "1.00", "-", "-")]
    for name, rs in results.items():
        if name == "local":
            continue
        fps = median(r["files_per_s"] for r in rs)
        cpu_ms = median(r["cpu_ms_per_file"] for r in rs)
        out["systems"][name] = {"files_per_s": fps, "x_local": fps / local, "cpu_ms_per_file": cpu_ms,
                                "opens": rs[0]["opens"], "runs": rs}
        rows.append((f"cachefs {name}", f"{fps:.0f}", f"{fps / local:.2f}", f"{cpu_ms:.3f}", rs[0]["opens"]))
    print(f"\nwarm epochs from the NVMe tier: {len(rel)} JPEGs ({format_size(total)}), RAM tier {args.ram_size}, "
          f"{args.workers} readers, page cache dropped before each epoch; median of {args.repeats} x {args.epochs}")
    table(rows, ("system", "files/s", "x local", "daemon ms/file", "opens"))
    return out


# -- cold ------------------------------------------------------------------------------------

def cmd_cold(args: argparse.Namespace, work: str) -> dict:
    data = os.path.join(work, "dataset")
    total = ensure_dataset(data, args.classes, args.files // args.classes)
    rel = [os.path.relpath(p, data) for p in list_imagefolder(data)]
    results: dict[str, list[dict]] = {"direct": []}
    store = {"latency": args.latency, "bandwidth": args.bandwidth, "attr_timeout": args.attr_timeout}
    with slowfs(data, os.path.join(work, "slow"), **store) as slow:
        for rep in range(args.repeats):
            results["direct"].append(measured_epoch(slow, rel, 200 + rep, args.workers, None, args.walk))
            for name, opts, baseline in systems(args):
                cache = os.path.join(work, f"cache-{name}")
                shutil.rmtree(cache, ignore_errors=True)
                print(f"repeat {rep + 1}/{args.repeats}: {name}", file=sys.stderr)
                reset_stats(slow)
                with mounted(slow, os.path.join(work, "mnt"), cache, opts, baseline, ram=args.ram_size) as proc:
                    r = measured_epoch(os.path.join(work, "mnt"), rel, 200 + rep, args.workers, proc, args.walk)
                    r["store"] = read_stats(slow)
                    r["opens"] = cachefs_stats(os.path.join(work, "mnt")).get("info", {}).get("opens", "?")
                results.setdefault(name, []).append(r)
    direct = median(r["files_per_s"] for r in results["direct"])
    first = median(r["first_batch_s"] for r in results["direct"])
    out = {"dataset_bytes": total, "files": len(rel), "direct_files_per_s": direct, "systems": {},
           "direct_first_batch_s": first, "walk": args.walk}
    rows = [("direct from the store", f"{direct:.0f}", "1.00", f"{first:.3f}", "1.00", "-", "-")]
    for name, rs in results.items():
        if name == "direct":
            continue
        fps = median(r["files_per_s"] for r in rs)
        cpu_ms = median(r["cpu_ms_per_file"] for r in rs)
        fb = median(r["first_batch_s"] for r in rs)
        out["systems"][name] = {"files_per_s": fps, "x_direct": fps / direct, "cpu_ms_per_file": cpu_ms,
                                "first_batch_s": fb, "runs": rs}
        rows.append((f"cachefs {name}", f"{fps:.0f}", f"{fps / direct:.2f}", f"{fb:.3f}", f"{fb / first:.2f}",
                     f"{cpu_ms:.3f}", rs[0]["opens"]))
    cap = f", {args.bandwidth}/s" if args.bandwidth != "0" else ""
    walk = ", the ImageFolder walk included" if args.walk else ""
    print(f"\ncold epoch over slowfs ({args.latency}/request{cap}, attributes kept {args.attr_timeout}s): "
          f"{len(rel)} JPEGs ({format_size(total)}), {args.workers} readers{walk}; median of {args.repeats}")
    table(rows, ("system", "files/s", "x direct", "first batch s", "x direct", "daemon ms/file", "opens"))
    return out


# -- remount ----------------------------------------------------------------------------------

def cmd_remount(args: argparse.Namespace, work: str) -> dict:
    data = os.path.join(work, "dataset")
    total = ensure_dataset(data, args.classes, args.files // args.classes)
    rel = [os.path.relpath(p, data) for p in list_imagefolder(data)]
    dirs = len({os.path.dirname(r) for r in rel}) + 1
    out: dict = {"dataset_bytes": total, "files": len(rel), "directories": dirs, "systems": {}}
    mp = os.path.join(work, "mnt")
    rows = []
    with slowfs(data, os.path.join(work, "slow"), latency=args.latency, bandwidth=args.bandwidth) as slow:
        for name, opts, baseline in systems(args):
            runs = []
            for rep in range(args.repeats):
                cache = os.path.join(work, f"cache-{name}")
                shutil.rmtree(cache, ignore_errors=True)
                print(f"repeat {rep + 1}/{args.repeats}: {name}", file=sys.stderr)
                with mounted(slow, mp, cache, opts, baseline, ram=args.ram_size):
                    epoch(mp, rel, 1, args.workers)                  # cold
                    warm = epoch(mp, rel, 2, args.workers)          # the warm rate, same mount
                reset_stats(slow)
                with mounted(slow, mp, cache, opts, baseline, ram=args.ram_size) as proc:
                    r = measured_epoch(mp, rel, 3, args.workers, proc)
                    s = read_stats(slow)
                runs.append({"warm_files_per_s": warm["files_per_s"], "remount": r, "store": s,
                             "requests": sum(v for k, v in s.items() if k not in ("bytes", "seeks"))})
            fps = median(x["remount"]["files_per_s"] for x in runs)
            warm_fps = median(x["warm_files_per_s"] for x in runs)
            store_bytes = median(x["store"]["bytes"] for x in runs)
            requests = median(x["requests"] for x in runs)
            out["systems"][name] = {"files_per_s": fps, "warm_files_per_s": warm_fps, "store_bytes": store_bytes,
                                    "store_requests": requests, "runs": runs}
            rows.append((f"cachefs {name}", f"{fps:.0f}", f"{fps / warm_fps:.2f}",
                         f"{store_bytes / total:.2%}", f"{requests:.0f}", f"{requests / dirs:.1f}"))
    print(f"\nremount after one cold epoch: {len(rel)} JPEGs ({format_size(total)}) in {dirs} directories, "
          f"slowfs {args.latency}/request; median of {args.repeats}")
    table(rows, ("system", "files/s", "x warm", "store bytes / dataset", "store requests", "per directory"))
    return out


# -- walk --------------------------------------------------------------------------------------

def _flat_folder(work: str, count: int) -> str:
    path = os.path.join(work, "flat", "train")
    if not os.path.isdir(path) or len(os.listdir(path)) != count:
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)
        os.makedirs(path)
        for i in range(count):
            with open(os.path.join(path, f"img_{i:05d}_of_{count}.npz"), "wb") as f:
                f.write(b"\0" * 64)
    return os.path.dirname(path)


def _timed(fn: Callable[[], object]) -> float:
    """Seconds `fn` took (the page cache dropped first); NaN if it failed (said on stderr)."""
    drop_caches()
    t0 = time.perf_counter()
    try:
        fn()
    except OSError as exc:
        print(f"failed: {exc}", file=sys.stderr)
        return math.nan
    return time.perf_counter() - t0


def _ls_lr(root: str) -> int:
    """What `ls -lR` does: list each directory and lstat every entry."""
    n = 0
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            os.lstat(os.path.join(dirpath, name))
            n += 1
    return n


def cmd_walk(args: argparse.Namespace, work: str) -> dict:
    data = os.path.join(work, "dataset")
    ensure_dataset(data, args.classes, args.files // args.classes)
    flat = _flat_folder(work, args.flat)
    mp = os.path.join(work, "mnt")
    runs: dict[str, list[float]] = {}
    cpu_ms: dict[str, list[float]] = {}
    requests: dict[str, list[float]] = {}

    def add(key: str, seconds: float) -> None:
        runs.setdefault(key, []).append(seconds)

    store = {"latency": args.latency, "attr_timeout": args.attr_timeout}
    with slowfs(data, os.path.join(work, "slow"), **store) as slow, \
            slowfs(flat, os.path.join(work, "slowflat"), **store) as slow_flat:
        for rep in range(args.repeats):
            print(f"repeat {rep + 1}/{args.repeats}: direct", file=sys.stderr)
            add("imagefolder direct", _timed(lambda: list_imagefolder(slow)))
            add("flat direct", _timed(lambda: os.listdir(os.path.join(slow_flat, "train"))))
            add("ls -lR local", _timed(lambda: _ls_lr(data)))
            for name, opts, baseline in systems(args):
                print(f"repeat {rep + 1}/{args.repeats}: {name}", file=sys.stderr)
                for key, source, walk in (("imagefolder", slow, list_imagefolder),
                                          ("flat", slow_flat, lambda r: os.listdir(os.path.join(r, "train")))):
                    cache = os.path.join(work, f"cache-{name}")
                    shutil.rmtree(cache, ignore_errors=True)
                    reset_stats(source)
                    with mounted(source, mp, cache, opts, baseline, ram=args.ram_size) as proc:
                        c0 = cpu(proc)
                        add(f"{key} {name}", _timed(lambda w=walk: w(mp)))  # type: ignore[misc]
                        cpu_ms.setdefault(f"{key} {name}", []).append((cpu(proc) - c0) * 1e3)
                        st = read_stats(source)
                        requests.setdefault(f"{key} {name}", []).append(
                            sum(v for k, v in st.items() if k not in ("bytes", "seeks")))
                cache = os.path.join(work, f"cache-{name}")
                shutil.rmtree(cache, ignore_errors=True)
                with mounted(data, mp, cache, opts, baseline, ram=args.ram_size):
                    add(f"ls -lR {name}", _timed(lambda: _ls_lr(mp)))
    med = {k: median(v) for k, v in runs.items()}
    print(f"\nlisting as a job starts: ImageFolder walk of {args.files} files in {args.classes} folders and "
          f"os.listdir of {args.flat} files in one folder over slowfs ({args.latency}/request, attributes "
          f"kept {args.attr_timeout}s), `ls -lR` of the "
          f"{args.files} files on local disk; page cache dropped before each; median of {args.repeats}")
    rows = []
    for key, ref in (("imagefolder", "imagefolder direct"), ("flat", "flat direct"), ("ls -lR", "ls -lR local")):
        rows.append((ref, f"{med[ref]:.3f}", "1.00", "-", "-"))
        for name, _, _ in systems(args):
            k = f"{key} {name}"
            if math.isnan(med[k]):
                rows.append((f"{key} cachefs {name}", "failed", "-", "-", "-"))
                continue
            rows.append((f"{key} cachefs {name}", f"{med[k]:.3f}", f"{med[k] / med[ref]:.2f}",
                         f"{median(cpu_ms[k]):.0f}" if k in cpu_ms else "-",
                         f"{median(requests[k]):.0f}" if k in requests else "-"))
    table(rows, ("walk", "seconds", "x reference", "daemon CPU ms", "store requests"))
    return {"medians": med, "runs": runs, "cpu_ms": cpu_ms, "store_requests": requests}


# -- seq ---------------------------------------------------------------------------------------

def _big_file(work: str, size: int) -> str:
    src = os.path.join(work, "big")
    os.makedirs(src, exist_ok=True)
    path = os.path.join(src, "big.bin")
    if not os.path.exists(path) or os.path.getsize(path) != size:
        with open(path, "wb") as f:
            for _ in range(size >> 20):
                f.write(os.urandom(1 << 20))
    return src


def cmd_seq(args: argparse.Namespace, work: str) -> dict:
    size = parse_size(args.size)
    src = _big_file(work, size)
    cap = parse_size(args.bandwidth)
    res: dict[str, list[float]] = {}
    mp = os.path.join(work, "mnt")
    with slowfs(src, os.path.join(work, "slow"), latency=args.latency, bandwidth=args.bandwidth) as slow:
        for rep in range(args.repeats):
            drop_caches()
            res.setdefault("local warm", []).append(size / read_sequentially(os.path.join(src, "big.bin"), 128 << 10))
            drop_caches()
            res.setdefault("direct", []).append(size / read_sequentially(os.path.join(slow, "big.bin"), 128 << 10))
            for name, opts, baseline in systems(args):
                cache = os.path.join(work, f"cache-{name}")
                shutil.rmtree(cache, ignore_errors=True)
                print(f"repeat {rep + 1}/{args.repeats}: {name}", file=sys.stderr)
                with mounted(slow, mp, cache, opts, baseline, ram="64MiB") as proc:
                    drop_caches()
                    c0 = cpu(proc)
                    res.setdefault(f"{name} cold", []).append(size / read_sequentially(os.path.join(mp, "big.bin"),
                                                                                       128 << 10))
                    res.setdefault(f"{name} cold cpu", []).append(cpu(proc) - c0)
                    drop_caches()
                    c0 = cpu(proc)
                    res.setdefault(f"{name} warm", []).append(size / read_sequentially(os.path.join(mp, "big.bin"),
                                                                                       128 << 10))
                    res.setdefault(f"{name} warm cpu", []).append(cpu(proc) - c0)
    med = {k: median(v) for k, v in res.items()}
    print(f"\nsequential read of {args.size} in 128 KiB reads; store slowfs {args.latency}/request, "
          f"{args.bandwidth}/s cap; median of {args.repeats}")
    rows = [("local disk, page cache dropped", f"{med['local warm'] / 1e6:.0f}", "-", "-", "-"),
            ("slowfs directly (cold)", f"{med['direct'] / 1e6:.0f}", f"{med['direct'] / cap:.0%}", "-", "-")]
    for name, _, _ in systems(args):
        rows.append((f"cachefs {name} cold", f"{med[name + ' cold'] / 1e6:.0f}", f"{med[name + ' cold'] / cap:.0%}",
                     f"{med[name + ' cold'] / med['direct']:.2f}x direct", f"{med[name + ' cold cpu']:.2f}"))
        rows.append((f"cachefs {name} warm", f"{med[name + ' warm'] / 1e6:.0f}", "-",
                     f"{med[name + ' warm'] / med['local warm']:.2f}x local", f"{med[name + ' warm cpu']:.2f}"))
    table(rows, ("read", "MB/s", "of cap", "ratio", "daemon CPU s"))
    return {"size": size, "cap": cap, "medians": med, "runs": res}


# -- random and LMDB -----------------------------------------------------------------------

def _random_reads(path: str, size: int, count: int, seed: int, chunk: int = 128 << 10) -> float:
    rng = random.Random(seed)
    offsets = [rng.randrange(0, size // chunk) * chunk for _ in range(count)]
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # as fio's randread does (fadvise_hint)
        t0 = time.perf_counter()
        for off in offsets:
            os.pread(fd, chunk, off)
        return count / (time.perf_counter() - t0)
    finally:
        os.close(fd)


def _make_lmdb(path: str, size: int) -> int:
    import lmdb

    if os.path.exists(os.path.join(path, "data.mdb")):
        with lmdb.open(path, readonly=True, lock=False) as env:
            return env.stat()["entries"]
    os.makedirs(path, exist_ok=True)
    rng = random.Random(5)
    n = size // 110_000
    with lmdb.open(path, map_size=size * 2 + (64 << 20)) as env, env.begin(write=True) as txn:
        for i in range(n):
            txn.put(f"{i:08d}".encode(), rng.randbytes(rng.randrange(60_000, 160_000)))
    return n


def _lmdb_pass(path: str) -> tuple[float, int]:
    """A full pass over an LMDB opened as a DataLoader does (readahead off): items/s."""
    import lmdb

    with lmdb.open(path, readonly=True, lock=False, readahead=False, meminit=False) as env:
        t0 = time.perf_counter()
        n = 0
        with env.begin() as txn:
            for _, value in txn.cursor():
                n += len(value) > 0
        return n / (time.perf_counter() - t0), n


def cmd_random(args: argparse.Namespace, work: str) -> dict:
    size = parse_size(args.size)
    src = _big_file(work, size)
    items = _make_lmdb(os.path.join(src, "db"), parse_size(args.lmdb_size))
    res: dict[str, list[float]] = {}
    mp = os.path.join(work, "mnt")
    with slowfs(src, os.path.join(work, "slow"), latency=args.latency, bandwidth=args.bandwidth) as slow:
        for rep in range(args.repeats):
            drop_caches()
            res.setdefault("random direct", []).append(_random_reads(os.path.join(slow, "big.bin"), size,
                                                                       args.reads, rep))
            drop_caches()
            res.setdefault("lmdb direct", []).append(_lmdb_pass(os.path.join(slow, "db"))[0])
            for name, opts, baseline in systems(args):
                cache = os.path.join(work, f"cache-{name}")
                shutil.rmtree(cache, ignore_errors=True)
                print(f"repeat {rep + 1}/{args.repeats}: {name}", file=sys.stderr)
                with mounted(slow, mp, cache, opts, baseline, ram="64MiB"):
                    drop_caches()
                    res.setdefault(f"random {name}", []).append(_random_reads(os.path.join(mp, "big.bin"), size,
                                                                                args.reads, rep))
                shutil.rmtree(cache, ignore_errors=True)
                with mounted(slow, mp, cache, opts, baseline, ram="64MiB"):
                    drop_caches()
                    res.setdefault(f"lmdb {name}", []).append(_lmdb_pass(os.path.join(mp, "db"))[0])
    med = {k: median(v) for k, v in res.items()}
    print(f"\ncold reads over slowfs as an sshfs store ({args.latency}/request, {args.bandwidth}/s): {args.reads} "
          f"random 128 KiB reads of a {args.size} file; a pass over an LMDB of {items} items with "
          f"readahead=False; median of {args.repeats}")
    rows = [("random 128 KiB, direct", f"{med['random direct']:.0f} reads/s", "1.00"),
            ("LMDB pass, direct", f"{med['lmdb direct']:.0f} items/s", "1.00")]
    for name, _, _ in systems(args):
        rows.append((f"random 128 KiB, cachefs {name}", f"{med['random ' + name]:.0f} reads/s",
                     f"{med['random ' + name] / med['random direct']:.2f}"))
        rows.append((f"LMDB pass, cachefs {name}", f"{med['lmdb ' + name]:.0f} items/s",
                     f"{med['lmdb ' + name] / med['lmdb direct']:.2f}"))
    table(rows, ("read", "rate", "x direct"))
    return {"medians": med, "runs": res, "lmdb_items": items}


# -- idle ------------------------------------------------------------------------------------

def _small_tree(work: str, files: int, size: int) -> str:
    """`files` files of `size` bytes in directories of 1,000 (kept between runs)."""
    root = os.path.join(work, f"small-{files}x{size}")
    marker = os.path.join(root, ".made")
    if os.path.exists(marker):
        return root
    shutil.rmtree(root, ignore_errors=True)
    for i in range(files):
        d = os.path.join(root, f"d{i // 1000:04d}")
        if i % 1000 == 0:
            os.makedirs(d)
        with open(os.path.join(d, f"{i:07d}.jpg"), "wb") as f:
            f.write(random.randbytes(size))
    open(marker, "w").close()
    return root


def _read_tree(root: str, threads: int = 8) -> int:
    paths = [os.path.join(d, n) for d, _, names in os.walk(root) for n in names]
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(lambda path: len(open(path, "rb").read()), paths))


def cmd_idle(args: argparse.Namespace, work: str) -> dict:
    data = _small_tree(work, args.files, args.file_size)
    mp = os.path.join(work, "mnt")
    out: dict = {"files": args.files, "file_size": args.file_size, "seconds": args.seconds, "systems": {}}
    rows = []
    for name, opts, baseline in systems(args):
        cache = os.path.join(work, f"cache-{name}")
        shutil.rmtree(cache, ignore_errors=True)
        print(f"{name}: filling the cache", file=sys.stderr)
        with mounted(data, mp, cache, opts, baseline, ram=args.ram_size):
            _read_tree(mp)
        with mounted(data, mp, cache, opts, baseline, ram=args.ram_size) as proc:  # over the full cache
            time.sleep(args.settle)
            before = cachefs_stats(mp).get("disk", {}).get("scrubbed_bytes", 0)
            c0, t0 = cpu(proc), time.monotonic()
            time.sleep(args.seconds)
            share = (cpu(proc) - c0) / (time.monotonic() - t0)
            scrubbed = cachefs_stats(mp).get("disk", {}).get("scrubbed_bytes", 0) - before
        out["systems"][name] = {"core_share": share, "scrubbed_bytes": scrubbed}
        rows.append((f"cachefs {name}", f"{share * 100:.2f}%", f"{scrubbed / 1e6:.1f}"))
    print(f"\nan idle mount over a full cache: {args.files} files of {args.file_size} B, after a clean remount "
          f"({args.settle:g} s to settle), {args.seconds:g} s measured")
    table(rows, ("system", "CPU, share of a core", "MB read meanwhile"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="mode", required=True)
    for name in ("warm", "cold", "remount", "seq", "random", "walk", "idle"):
        s = sub.add_parser(name)
        add_workspace_options(s, repeats=3)
        s.add_argument("--modes", default="passthrough,zero-message", help="cachefs modes to run, of: "
                       + ", ".join(MODES))
        s.add_argument("--baseline", metavar="DIR", help="also run the cachefs checkout in DIR (with DIR/.venv)")
        s.add_argument("--workers", type=int, default=8)
        s.add_argument("--files", type=int, default=20000 if name == "idle" else 2000)
        s.add_argument("--file-size", type=int, default=2048, help="bytes per file (idle)")
        s.add_argument("--seconds", type=float, default=30.0, help="idle time measured (idle)")
        s.add_argument("--settle", type=float, default=5.0, help="seconds after the mount before measuring (idle)")
        s.add_argument("--classes", type=int, default=10)
        s.add_argument("--epochs", type=int, default=2, help="warm epochs per repeat (warm)")
        s.add_argument("--ram-size", default="32MiB")
        s.add_argument("--latency", default="2.4ms" if name == "random" else "2ms")
        s.add_argument("--bandwidth", default={"seq": "300MB", "random": "110MB"}.get(name, "0"))
        s.add_argument("--size", default="1GiB")
        s.add_argument("--reads", type=int, default=400, help="random reads (random)")
        s.add_argument("--lmdb-size", default="224MB", help="LMDB size (random)")
        s.add_argument("--flat", type=int, default=3200, help="files in the one flat folder (walk)")
        s.add_argument("--attr-timeout", default="0" if name == "walk" else "1",
                       help="seconds the store's client keeps attributes (walk, cold): 0, each stat a round "
                            "trip (attribute caching off, or a listing without them)")
        s.add_argument("--walk", action="store_true",
                       help="cold: time the ImageFolder walk with the epoch, as a job starting does")
    args = p.parse_args(argv)
    if not drop_caches():
        raise SystemExit("targets: needs root, to drop the page cache before each epoch")
    cmd = {"warm": cmd_warm, "cold": cmd_cold, "remount": cmd_remount, "seq": cmd_seq, "random": cmd_random,
           "walk": cmd_walk, "idle": cmd_idle}
    with workspace(args, "targets") as work:
        out = cmd[args.mode](args, work)
    write_json(args.json, {"args": vars(args), **out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
