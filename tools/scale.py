#!/usr/bin/env python3
"""scale: the per-file costs of an ImageNet-shaped tree, through cachefs and on local disk.

    python tools/scale.py [--files 200000] [--dirs 1000] [--file-size 2048] [--baseline DIR]
                          [--serve-processes N[,N...]] [--repeat K] [--workdir DIR] [--json FILE]
                          [--remounts-only K | --colds-only K]

Makes (once, kept in --workdir) a tree of --files files in --dirs class directories
(ImageNet-1k is 1,281,167 files in 1,000; --file-size bytes each, small by default so that a
laptop disk holds it), then, each on local disk and through cachefs (and with --baseline an
older checkout, in the same run):

  scan       the ImageFolder walk (sorted listings, every name), page cache and dentries
             dropped: cold, then again within --metadata-ttl after a remount
  cold       the first shuffled epoch of 8 readers (each file opened and read once), the
             cache empty, page cache dropped
  nvme       the next epoch with the page cache dropped: every file from the NVMe tier
  pagecache  an epoch with nothing dropped
  mount      the seconds `cachefs mount` takes over the full cache
  remount    the first epoch after that mount, and the one after it, page cache dropped
  memory     the daemon's memory (PSS of all its processes) per file, after the epochs, and
             after the remount's two (all its processes, and its main one)
  idle       the daemon's CPU over --idle seconds of nothing, as a share of one core

with the daemon's CPU per file (user + system of all its processes) beside each epoch.
--serve-processes 0,1,2 adds passthrough mounts with that many serving processes each;
--repeat K takes the median of K NVMe and K page-cache epochs per mount. --remounts-only K
(over an earlier run's caches) and --colds-only K (fresh caches: the walk, the cold epoch
and the next) repeat one part K times, alternating with --baseline.
Needs root (to drop the page cache). The local disk is the source, so these are the
daemon's own costs; slowfs (tools/targets.py) measures a slow store.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.common import add_workspace_options, drop_caches, workspace, write_json
from tools.epoch import list_imagefolder, run_epochs
from tools.mounts import cachefs_stats
from tools.targets import cpu, mounted, table


def make_tree(root: str, files: int, dirs: int, size: int) -> None:
    """`files` files of `size` bytes in `dirs` class directories (n01440764-like names)."""
    marker = os.path.join(root, f".made-{files}-{dirs}-{size}")
    if os.path.exists(marker):
        return
    shutil.rmtree(root, ignore_errors=True)
    rng = random.Random(0)
    per_dir = -(-files // dirs)
    for i in range(files):
        d = os.path.join(root, f"n{i // per_dir:08d}")
        if i % per_dir == 0:
            os.makedirs(d)
            if sys.stderr.isatty():
                print(f"\r  making the tree: {i}/{files}", end="", file=sys.stderr, flush=True)
        with open(os.path.join(d, f"n{i // per_dir:08d}_{i:07d}.JPEG"), "wb") as f:
            f.write(rng.randbytes(size))
    open(marker, "w").close()
    if sys.stderr.isatty():
        print("\r" + " " * 40 + "\r", end="", file=sys.stderr)


def scan(root: str) -> tuple[float, int]:
    drop_caches()
    t0 = time.perf_counter()
    n = len(list_imagefolder(root))
    return time.perf_counter() - t0, n


def epoch(root: str, paths: list[str], seed: int, proc: psutil.Process | None, drop: bool = True) -> dict:
    """One shuffled epoch of 8 readers; through cachefs (`proc`: its daemon), the daemon's CPU
    per file and the counters that moved most in it (`stats_moved`, in the JSON: what to
    look at when one run stands out)."""
    if drop:
        drop_caches()
    before = counters(root) if proc else {}
    c0 = cpu(proc) if proc else 0.0
    r = run_epochs(root, 8, 1, seed=seed, paths=[os.path.join(root, p) for p in paths], quiet=True)[0]
    r["cpu_ms_per_file"] = (cpu(proc) - c0) / len(paths) * 1e3 if proc else None
    if proc:
        after = counters(root)
        moved = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
        r["stats_moved"] = dict(sorted(moved.items(), key=lambda kv: -abs(kv[1]))[:30])
    return r


def counters(mountpoint: str) -> dict[str, float]:
    """The daemon's counters and gauges (`cachefs stats`), as section.name -> value."""
    try:
        s = cachefs_stats(mountpoint)
    except (RuntimeError, ValueError, subprocess.TimeoutExpired):
        return {}
    return {f"{section}.{k}": v for section, d in s.items()
            if isinstance(d, dict) and section not in ("info", "latency")
            for k, v in d.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def pss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


MODES = {"passthrough": ["--passthrough", "on"], "zero-message": ["--passthrough", "off"]}


def median_epoch(runs: list[dict]) -> dict:
    """The median of repeated epochs (files/s and CPU per file each), with every run kept."""
    out = dict(runs[0])
    out["files_per_s"] = statistics.median(r["files_per_s"] for r in runs)
    if runs[0].get("cpu_ms_per_file") is not None:
        out["cpu_ms_per_file"] = statistics.median(r["cpu_ms_per_file"] for r in runs)
    out["runs"] = [(r["files_per_s"], r.get("cpu_ms_per_file")) for r in runs]
    return out


def measure_cachefs(args: argparse.Namespace, tree: str, rel: list[str], work: str, name: str, mode: str,
                    baseline: str | None, serve: str | None = None) -> dict:
    cache = os.path.join(work, f"cache-{name}")
    shutil.rmtree(cache, ignore_errors=True)
    mp = os.path.join(work, "mnt")
    out: dict = {}
    extra = mount_args(args, mode, serve, baseline)
    with mounted(tree, mp, cache, extra, baseline, ram=args.ram_size, disk=args.disk_size) as proc:
        out["scan_cold_s"] = scan(mp)[0]
        out["cold"] = epoch(mp, rel, 1, proc)
        out["nvme"] = median_epoch([epoch(mp, rel, 10 + i, proc) for i in range(args.repeat)])
        out["pagecache"] = median_epoch([epoch(mp, rel, 20 + i, proc, drop=False) for i in range(args.repeat)])
        out["pss_per_file"] = pss(proc) / len(rel)
        out["main_pss_per_file"] = proc.memory_full_info().pss / len(rel)
        c0, t0 = cpu(proc), time.monotonic()
        time.sleep(args.idle)
        out["idle_core_share"] = (cpu(proc) - c0) / (time.monotonic() - t0)
    out.update(remount(args, tree, rel, work, name, mode, baseline, serve))
    return out


def remount(args: argparse.Namespace, tree: str, rel: list[str], work: str, name: str, mode: str,
            baseline: str | None, serve: str | None = None) -> dict:
    """A mount over the cache a measure_cachefs left (its first stop clean), the walk, and
    one epoch with the page cache dropped."""
    cache, mp = os.path.join(work, f"cache-{name}"), os.path.join(work, "mnt")
    extra = mount_args(args, mode, serve, baseline)
    out: dict = {}
    t0 = time.monotonic()
    with mounted(tree, mp, cache, extra, baseline, ram=args.ram_size, disk=args.disk_size) as proc:
        out["mount_s"] = time.monotonic() - t0  # the mount command, until the mount is live
        before = counters(mp)
        out["scan_remount_s"] = scan(mp)[0]
        after = counters(mp)  # (and what moved in the daemon from the mount to the walk's end)
        out["scan_stats_moved"] = dict(sorted(((k, v - before.get(k, 0)) for k, v in after.items()
                                               if v != before.get(k, 0)), key=lambda kv: -abs(kv[1]))[:30])
        out["remount"] = epoch(mp, rel, 4, proc)
        # and all the daemon did since it started (the mount, the walk, work behind it)
        out["remount"]["cpu_ms_per_file_since_mount"] = cpu(proc) / len(rel) * 1e3
        c0 = sum(proc.cpu_times()[:2])
        out["remount_next"] = epoch(mp, rel, 5, proc)  # what the first epoch left for the next
        out["remount_next"]["main_ms_per_file"] = (sum(proc.cpu_times()[:2]) - c0) / len(rel) * 1e3
        # what the daemon holds after both: all its processes, and the main one alone
        out["remount_pss_per_file"] = pss(proc) / len(rel)
        out["remount_main_pss_per_file"] = proc.memory_full_info().pss / len(rel)
    return out


def mount_args(args: argparse.Namespace, mode: str, serve: str | None, baseline: str | None) -> list[str]:
    """The options of a measured mount (--mount-option: the current checkout's only)."""
    own = [] if baseline else [o for option in args.mount_option for o in option.split()]
    return ["--metadata-ttl", "3600", *MODES[mode], *(["--serve-processes", serve] if serve is not None else []), *own]


Measure = Callable[[argparse.Namespace, str, list[str], str, str, str, "str | None"], dict]


def alternating(args: argparse.Namespace, tree: str, work: str, rounds: int,
                measure: Measure) -> tuple[list[str], dict[str, list[dict]]]:
    """`measure` of the current checkout (and --baseline's), `rounds` rounds, the systems
    alternating: the tree's files and each system's runs."""
    rel = [os.path.relpath(x, tree) for x in list_imagefolder(tree)]
    mode = args.modes.split(",")[0] or "passthrough"
    systems = [(f"cachefs {mode}", mode, None)] + ([("baseline", "baseline", args.baseline)] if args.baseline else [])
    runs: dict[str, list[dict]] = {label: [] for label, _, _ in systems}
    for _ in range(rounds):
        for label, name, baseline in systems:
            runs[label].append(measure(args, tree, rel, work, name, mode, baseline))
    return rel, runs


def each(rs: list[dict], f: Callable[[dict], str], median: Callable[[list[dict]], dict]) -> str:
    """A figure of every run, and of their median."""
    return ", ".join(f(r) for r in rs) + f" (median {f(median(rs))})"


def cold(args: argparse.Namespace, tree: str, rel: list[str], work: str, name: str, mode: str,
         baseline: str | None) -> dict:
    """A fresh cache: the mount, the walk, the cold epoch and the one after it (page cache
    dropped before each), with the daemon's CPU per file split between its main process
    and the rest (serving and fetch processes)."""
    cache, mp = os.path.join(work, f"cache-cold-{name}"), os.path.join(work, "mnt")
    shutil.rmtree(cache, ignore_errors=True)
    out: dict = {}
    with mounted(tree, mp, cache, mount_args(args, mode, None, baseline), baseline, ram=args.ram_size,
                 disk=args.disk_size) as proc:
        out["scan_cold_s"] = scan(mp)[0]
        for key, seed in (("cold", 1), ("next", 2)):
            c0 = sum(proc.cpu_times()[:2])
            out[key] = epoch(mp, rel, seed, proc)
            out[key]["main_ms_per_file"] = (sum(proc.cpu_times()[:2]) - c0) / len(rel) * 1e3
    shutil.rmtree(cache, ignore_errors=True)
    return out


def colds_only(args: argparse.Namespace, work: str) -> int:
    """--colds-only K: fresh caches, the walk, the cold epoch and the next, K rounds, the
    systems alternating; each figure and the median."""
    tree = os.path.join(work, "tree")
    make_tree(tree, args.files, args.dirs, args.file_size)
    rel, runs = alternating(args, tree, work, args.colds_only, cold)

    def median(rs: list[dict]) -> dict:
        return {"scan_cold_s": statistics.median(r["scan_cold_s"] for r in rs),
                **{key: {k: statistics.median(r[key][k] for r in rs)
                         for k in ("files_per_s", "cpu_ms_per_file", "main_ms_per_file")} for key in ("cold", "next")}}

    rows = []
    for label, rs in runs.items():
        rows.append((label, each(rs, lambda r: f"{r['scan_cold_s']:.2f}", median),
                     *(each(rs, lambda r, k=key, f=field, sp=spec: f"{r[k][f]:{sp}}", median)
                       for key in ("cold", "next")
                       for field, spec in (("files_per_s", ".0f"), ("cpu_ms_per_file", ".3f"),
                                           ("main_ms_per_file", ".3f")))))
    table(rows, ("system", "walk s", "cold files/s", "ms/file", "main process ms/file", "next epoch files/s",
                 "ms/file", "main process ms/file"))
    write_json(args.json, {"args": vars(args), "files": len(rel), "colds": runs})
    return 0


def remounts_only(args: argparse.Namespace, work: str) -> int:
    """--remounts-only K: the remount measures again over the caches an earlier run left in
    --workdir, K rounds, the systems alternating; each figure and the median."""
    tree = os.path.join(work, "tree")
    if not os.path.isdir(tree):
        raise SystemExit(f"scale: --remounts-only needs an earlier run's --workdir ({tree} is missing)")
    rel, runs = alternating(args, tree, work, args.remounts_only, remount)
    rows = []
    for label, rs in runs.items():
        rows.append((label, each(rs, lambda r: f"{r['mount_s']:.2f}", median_row),
                     each(rs, lambda r: f"{r['scan_remount_s']:.2f}", median_row),
                     each(rs, lambda r: f"{r['remount']['files_per_s']:.0f}", median_row),
                     each(rs, lambda r: f"{r['remount']['cpu_ms_per_file']:.3f}", median_row),
                     each(rs, lambda r: f"{r['remount']['cpu_ms_per_file_since_mount']:.3f}", median_row),
                     each(rs, lambda r: f"{r['remount_next']['files_per_s']:.0f}", median_row),
                     each(rs, lambda r: f"{r['remount_next']['cpu_ms_per_file']:.3f}", median_row),
                     each(rs, lambda r: f"{r['remount_next']['main_ms_per_file']:.3f}", median_row),
                     each(rs, lambda r: f"{r['remount_pss_per_file']:.0f}", median_row),
                     each(rs, lambda r: f"{r['remount_main_pss_per_file']:.0f}", median_row)))
    table(rows, ("system", "mount s", "scan after remount s", "first epoch files/s", "ms/file",
                 "ms/file since the mount", "next epoch files/s", "ms/file", "main process ms/file",
                 "PSS B/file, all processes", "main process"))
    write_json(args.json, {"args": vars(args), "files": len(rel), "remounts": runs})
    return 0


def median_row(rs: list[dict]) -> dict:
    return {"mount_s": statistics.median(r["mount_s"] for r in rs),
            "scan_remount_s": statistics.median(r["scan_remount_s"] for r in rs),
            "remount": {k: statistics.median(r["remount"][k] for r in rs)
                        for k in ("files_per_s", "cpu_ms_per_file", "cpu_ms_per_file_since_mount")},
            "remount_next": {k: statistics.median(r["remount_next"][k] for r in rs)
                             for k in ("files_per_s", "cpu_ms_per_file", "main_ms_per_file")},
            **{k: statistics.median(r[k] for r in rs) for k in ("remount_pss_per_file", "remount_main_pss_per_file")}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workspace_options(p)
    p.add_argument("--files", type=int, default=200_000)
    p.add_argument("--dirs", type=int, default=1000)
    p.add_argument("--file-size", type=int, default=2048, help="bytes per file (ImageNet's mean is ~110 KB)")
    p.add_argument("--ram-size", default="1GiB")
    p.add_argument("--disk-size", default="32GiB")
    p.add_argument("--idle", type=float, default=30.0, help="seconds of an idle mount measured")
    p.add_argument("--modes", default="passthrough",
                   help="cachefs modes: passthrough, zero-message; empty for none (with --serve-processes)")
    p.add_argument("--baseline", metavar="DIR", help="also run the cachefs checkout in DIR")
    p.add_argument("--serve-processes", metavar="N[,N...]",
                   help="passthrough mounts with each of these --serve-processes, side by side")
    p.add_argument("--repeat", type=int, default=1, help="NVMe and page-cache epochs per mount (median)")
    p.add_argument("--mount-option", action="append", default=[], metavar="OPTIONS",
                   help="more `cachefs mount` options for the current checkout's mounts (not --baseline's)")
    p.add_argument("--remounts-only", type=int, metavar="K", default=0,
                   help="only the remount, walk and first epoch, K times alternating, over an earlier run's "
                        "caches in --workdir")
    p.add_argument("--colds-only", type=int, metavar="K", default=0,
                   help="only fresh caches: the walk, the cold epoch and the next, K times alternating")
    args = p.parse_args(argv)
    if not drop_caches():
        raise SystemExit("scale: needs root, to drop the page cache before each measurement")
    if args.colds_only:
        if not args.workdir:
            raise SystemExit("scale: --colds-only needs --workdir (where the tree is made, or was)")
        return colds_only(args, args.workdir)
    if args.remounts_only:
        if not args.workdir:
            raise SystemExit("scale: --remounts-only needs --workdir (an earlier run's)")
        return remounts_only(args, args.workdir)
    with workspace(args, "scale") as work:
        tree = os.path.join(work, "tree")
        make_tree(tree, args.files, args.dirs, args.file_size)
        rel = [os.path.relpath(x, tree) for x in list_imagefolder(tree)]
        local = {"scan_cold_s": scan(tree)[0], "cold": epoch(tree, rel, 1, None),
                 "pagecache": epoch(tree, rel, 3, None, drop=False)}
        results = {"local disk": local}
        for mode in filter(None, args.modes.split(",")):
            print(f"cachefs {mode}", file=sys.stderr)
            results[f"cachefs {mode}"] = measure_cachefs(args, tree, rel, work, mode, mode, None)
        for n in args.serve_processes.split(",") if args.serve_processes else ():
            print(f"cachefs passthrough, {n} serving processes", file=sys.stderr)
            results[f"cachefs, {n} serving"] = measure_cachefs(args, tree, rel, work, f"serve{n}", "passthrough",
                                                                None, serve=n)
        if args.baseline:
            mode = args.modes.split(",")[0]
            print(f"baseline ({mode})", file=sys.stderr)
            results["baseline"] = measure_cachefs(args, tree, rel, work, "baseline", mode, args.baseline)
    rows = []
    ref = local

    def fps(r: dict, key: str) -> str:
        e = r.get(key)
        return "-" if e is None else f"{e['files_per_s']:.0f}"

    def ms(r: dict, key: str) -> str:
        e = r.get(key)
        return "-" if e is None or e.get("cpu_ms_per_file") is None else f"{e['cpu_ms_per_file']:.3f}"

    for name, r in results.items():
        rows.append((name, f"{r['scan_cold_s']:.2f}", f"{r['scan_remount_s']:.2f}" if "scan_remount_s" in r else "-",
                     fps(r, "cold"), ms(r, "cold"), fps(r, "nvme"), ms(r, "nvme"), fps(r, "pagecache"),
                     ms(r, "pagecache"), f"{r['mount_s']:.1f}" if "mount_s" in r else "-", fps(r, "remount"),
                     f"{r['pss_per_file']:.0f}" if "pss_per_file" in r else "-",
                     f"{r['main_pss_per_file']:.0f}" if "main_pss_per_file" in r else "-",
                     f"{r['idle_core_share'] * 100:.2f}%" if "idle_core_share" in r else "-"))
    print(f"\n{len(rel)} files of {args.file_size} B in {args.dirs} directories on local disk; 8 readers, "
          "page cache dropped before each measurement but the page-cache epoch; files/s and daemon CPU ms/file")
    table(rows, ("system", "scan s", "scan after remount s", "cold", "ms", "NVMe", "ms", "page cache", "ms",
                 "mount s", "remount", "PSS B/file", "main process", "idle CPU"))
    print(f"(local: cold {ref['cold']['files_per_s']:.0f} files/s, page cache {ref['pagecache']['files_per_s']:.0f})")
    write_json(args.json, {"args": vars(args), "files": len(rel), "systems": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
