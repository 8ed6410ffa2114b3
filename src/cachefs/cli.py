"""The cachefs command line: mount, umount, stats, warm and diagnose. `main(argv)` is callable
from tests."""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from cachefs import __version__
from cachefs.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_IDLE,
    DEFAULT_METADATA_TTL,
    DEFAULT_NEGATIVE_TTL,
    DEFAULT_PASSTHROUGH,
    DEFAULT_POLICY,
    DEFAULT_PREFETCH_WORKERS,
    DEFAULT_READAHEAD,
    DEFAULT_SOURCE_TIMEOUT,
    PASSTHROUGH_MODES,
    READAHEAD_MODES,
    ROTATIONAL_PREFETCH_WORKERS,
    Config,
    default_cache_dir,
    format_size,
    parse_duration,
    parse_size,
)
from cachefs.errors import CachefsError
from cachefs.policy import parse_policy_spec
from cachefs.stats import block_hit_rate


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2, like every other bad input."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _argtype(parse: Callable[[str, str], Any], what: str) -> Callable[[str], Any]:
    """An argparse type from one of config's parsers, whose CachefsError becomes a usage error."""

    def convert(text: str) -> Any:
        try:
            return parse(text, what)
        except CachefsError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def _size(what: str) -> Callable[[str], int]:
    return _argtype(parse_size, what)


def _duration(what: str) -> Callable[[str], float]:
    return _argtype(parse_duration, what)


def _checked(check: Callable[[str], object], what: str) -> Callable[[str], str]:
    """An argparse type that keeps the text once `check` (raising ValueError) accepts it."""

    def convert(text: str) -> str:
        try:
            check(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"invalid {what}: {exc}") from None
        return text

    return convert


def _positive(what: str, kind: type = int) -> Callable[[str], Any]:
    """An argparse type for a positive number (int: at least 1; float: above 0, finite)."""
    noun = "a whole number" if kind is int else "a number"

    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {what} {text!r}: expected {noun}") from None
        if not 0 < value < float("inf"):
            raise argparse.ArgumentTypeError(f"invalid {what} {text!r}: must be positive")
        return value

    return convert


def _check_transform(text: str) -> None:
    if text not in ("standard", "eval", "none") and not all(text.partition(":")[::2]):
        raise ValueError(f"{text!r}: use standard, eval, none or MODULE:NAME")


def _parse_metrics_addr(text: str) -> object:
    from cachefs.metrics import parse_metrics_addr  # imports no prometheus-client

    return parse_metrics_addr(text)


def _parse_shared_cache(text: str) -> object:
    from cachefs.config import parse_servers

    return parse_servers(text)


def _parse_namespace(text: str) -> object:
    if not text or len(text) > 100 or any(c.isspace() or not c.isprintable() for c in text):
        raise ValueError("a name of 1 to 100 printable characters without spaces")
    return text


def _parse_shard(text: str) -> tuple[int, int]:
    rank, sep, world = text.partition("/")
    if not sep or not rank.isdigit() or not world.isdigit() or not 0 <= int(rank) < int(world):
        raise ValueError("RANK/WORLD with 0 <= RANK < WORLD, e.g. 3/8")
    return int(rank), int(world)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="cachefs", description="A read-only FUSE cache (RAM + NVMe) in front of slow storage.")
    p.add_argument("--version", action="version", version=f"cachefs {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    m = sub.add_parser("mount", help="mirror SOURCE at MOUNTPOINT through the cache",
                       description="Mirror SOURCE read-only at MOUNTPOINT, caching blocks in RAM and on local disk.")
    m.add_argument("source", help="the slow directory (NFS, SMB, sshfs, HDD, ...)")
    m.add_argument("mountpoint", help="an existing empty directory")
    tiers = m.add_argument_group("cache tiers")
    tiers.add_argument("--ram-size", type=_size("--ram-size"), metavar="SIZE",
                       help="RAM tier budget, e.g. 16GiB (default: 1/4 of memory, at most 4 GiB). "
                            "The kernel page cache comes on top of it.")
    tiers.add_argument("--cache-dir", default=default_cache_dir(), metavar="DIR",
                       help="where the NVMe tier lives; put it on local flash (default: %(default)s)")
    tiers.add_argument("--disk-size", type=_size("--disk-size"), metavar="SIZE",
                       help="NVMe tier budget, a hard limit, e.g. 200GiB; 0 disables the tier "
                            "(default: half the free space of the cache disk, at most 64 GiB)")
    tiers.add_argument("--min-free", type=_size("--min-free"), metavar="SIZE",
                       help="space the NVMe tier always leaves free on the cache disk, a hard limit "
                            "(default: 5%% of the disk, at most 10 GiB)")
    tiers.add_argument("--policy", default=DEFAULT_POLICY, type=_checked(parse_policy_spec, "--policy"),
                       metavar="POLICY",
                       help="what each tier keeps: keep (admit until full, then keep: the best hit rate "
                            "under shuffled epochs) or lru; per tier as ram=lru,disk=keep "
                            "(default: %(default)s)")
    tiers.add_argument("--max-idle", type=_duration("--max-idle"), default=DEFAULT_MAX_IDLE, metavar="SECONDS",
                       help="evict blocks unread this long before any other, e.g. 12h; 0 = never "
                            f"(default: {DEFAULT_MAX_IDLE / 3600:.0f}h)")
    tiers.add_argument("--block-size", type=_size("--block-size"), default=DEFAULT_BLOCK_SIZE, metavar="SIZE",
                       help="cache block size; files up to this size are one block "
                            f"(default: {format_size(DEFAULT_BLOCK_SIZE)})")
    meta = m.add_argument_group("metadata")
    meta.add_argument("--metadata-ttl", type=_duration("--metadata-ttl"), default=DEFAULT_METADATA_TTL,
                      metavar="SECONDS",
                      help="how long stat results and listings are trusted, in cachefs and the kernel; "
                           "changes on the source show up after this (default: %(default)gs, "
                           "for an immutable dataset)")
    meta.add_argument("--negative-ttl", type=_duration("--negative-ttl"), default=DEFAULT_NEGATIVE_TTL,
                      metavar="SECONDS", help="how long 'no such file' is remembered (default: %(default)gs)")
    meta.add_argument("--source-timeout", type=_duration("--source-timeout"), default=DEFAULT_SOURCE_TIMEOUT,
                      metavar="SECONDS",
                      help="a source request slower than this fails with ETIMEDOUT instead of hanging the "
                           "reader; the source then counts as down and cached files keep being served "
                           "(default: %(default)gs; 0: wait forever)")
    ra = m.add_argument_group("read-ahead and warming")
    ra.add_argument("--readahead", choices=READAHEAD_MODES, default=DEFAULT_READAHEAD,
                    help="off; file: fetch ahead of sequential readers inside big files; dir: that, plus "
                         "the unread files of each directory the job reads, in sorted order, into free "
                         "cache space only (default: %(default)s)")
    ra.add_argument("--prefetch-workers", type=int, metavar="N",
                    help="parallel source fetches for read-ahead and warming; demand misses do not "
                         f"wait for these (default: {DEFAULT_PREFETCH_WORKERS}, or "
                         f"{ROTATIONAL_PREFETCH_WORKERS} when the source is a local spinning disk)")
    ra.add_argument("--fetch-processes", type=int, metavar="N",
                    help="processes that fetch small files from the source and write them to the NVMe "
                         "tier when opens are passed through, beside the daemon's own threads; 0: the "
                         "daemon does it itself (default: one per two cores, 1 to 4)")
    ra.add_argument("--warm", action="store_true",
                    help="load the whole source into the cache in the background, below the job's own reads")
    sh = m.add_argument_group("a cache tier shared by the nodes of a cluster")
    sh.add_argument("--shared-cache", type=_checked(_parse_shared_cache, "--shared-cache"),
                    metavar="memcached://HOST:PORT[,HOST:PORT...]",
                    help="memcached servers every node reads from after its own RAM and NVMe and before "
                         "the source, and stores what it reads from the source in (needs pymemcache in "
                         "cachefs's environment: pip install pymemcache)")
    sh.add_argument("--shared-namespace", type=_checked(_parse_namespace, "--shared-namespace"), metavar="NAME",
                    help="names this dataset in the shared tier's keys, alike on every node (default: the "
                         "source directory's name)")
    run = m.add_argument_group("running")
    run.add_argument("--metrics-addr", type=_checked(_parse_metrics_addr, "--metrics-addr"), metavar="[HOST:]PORT",
                     help="serve Prometheus metrics at http://HOST:PORT/metrics (HOST defaults to "
                          "127.0.0.1, loopback only; needs prometheus-client in cachefs's environment: "
                          "pip install prometheus-client)")
    run.add_argument("-f", "--foreground", action="store_true",
                     help="stay in the foreground (log to stderr); Ctrl-C or SIGTERM unmounts")
    run.add_argument("--allow-other", action="store_true",
                     help="let other users use the mount; the kernel then enforces the source's modes")
    run.add_argument("--log-file", metavar="FILE", help="daemon log (default: CACHE_DIR/cachefs.log)")
    run.add_argument("-v", "--verbose", action="count", default=0, help="-v info, -vv debug (with tracebacks)")
    run.add_argument("--passthrough", choices=PASSTHROUGH_MODES, default=DEFAULT_PASSTHROUGH,
                     help="auto: the kernel reads cached files directly (FUSE passthrough, Linux 6.9+, "
                          "root) where it can, zero-message opens otherwise; on: passthrough, falling back "
                          "per open where refused; off: zero-message opens, which are faster while the "
                          "page cache holds the whole dataset (default: %(default)s)")
    run.add_argument("--open-per-handle", action="store_true",
                     help="send every open() to cachefs instead of using zero-message opens "
                          "(slower warm epochs; for debugging)")
    run.add_argument("--debug-fuse", action="store_true",
                     help="log every FUSE request: operation, node, caller's pid, outcome and time (very verbose)")
    run.add_argument("--check", action="store_true",
                     help="check the request (paths, sizes, FUSE) and say what would be mounted; "
                          "mounts and writes nothing")

    s = sub.add_parser("stats", help="show what a mount's cache is doing",
                       description="Hits, misses and occupancy per tier, and source traffic, of a cachefs mount.")
    s.add_argument("mountpoint", nargs="?", metavar="PATH",
                   help="a cachefs mount point, or with --coverage any directory or file on one "
                        "(default: list all cachefs mounts)")
    s.add_argument("--json", action="store_true", help="print the raw snapshot as JSON (every key: docs/stats.md)")
    s.add_argument("--watch", nargs="?", const=1.0, type=_duration("--watch"), metavar="SECONDS",
                   help="a live view: per-second rates (reads, MB/s from each tier and from the source, "
                        "hit rate and source p99 over the last interval), refreshed every SECONDS "
                        "(default 1); one line per interval when not on a terminal. Ctrl-C stops it")
    s.add_argument("--coverage", action="store_true",
                   help="how much of PATH is cached, per tier, in files and bytes: is my dataset warm yet? "
                        "(looks blocks up in the tiers' indexes; reads nothing)")
    s.add_argument("--exact", action="store_true",
                   help="with --coverage: also stat, on the source, the files cachefs never looked up, so that "
                        "the byte totals count them (a request per such file, 16 at a time)")

    w = sub.add_parser("warm", help="load files into a mount's cache ahead of training",
                       description="Load PATHs (files or directories on a cachefs mount) into the cache, in the "
                                   "store's order, in parallel, below any training reads. Safe while training "
                                   "runs; run it again to resume. Ctrl-C stops it.")
    w.add_argument("paths", nargs="+", metavar="PATH")
    w.add_argument("--shard", type=_checked(_parse_shard, "--shard"), metavar="RANK/WORLD",
                   help="warm only this node's share of the files (RANK from 0 to WORLD-1): with "
                        "--shared-cache, WORLD nodes each warming their RANK fill the shared tier for all")
    w.add_argument("--json", action="store_true", help="print the final report as JSON")

    d = sub.add_parser("diagnose", help="is a training input pipeline storage-bound, CPU-bound, or fine?",
                       description="Measure, on the ImageFolder tree at PATH, raw read throughput with N processes "
                                   "and a torch DataLoader (decode + transforms, no model) with N workers, while "
                                   "sampling CPU and I/O; then name the bottleneck, with the figures and advice. "
                                   "Reads about 2 x SECONDS worth of the dataset. Needs the torch extra.")
    d.add_argument("path", metavar="PATH", help="the dataset root (PATH/<class>/<image>), on any filesystem")
    d.add_argument("--workers", type=_positive("--workers"), default=None, metavar="N",
                   help="reader processes and DataLoader workers (default: the CPU count, at most 8)")
    d.add_argument("--batch-size", type=_positive("--batch-size"), default=64, metavar="B", help="default 64")
    d.add_argument("--seconds", type=_duration("--seconds"), default=10.0, metavar="S",
                   help="length of each of the two measurements (default 10)")
    d.add_argument("--transform", default="standard", type=_checked(_check_transform, "--transform"),
                   metavar="NAME",
                   help="standard (RandomResizedCrop 224, flip, normalize; the default), eval (resize, "
                        "center crop), none (bytes only: GPU decoding), or MODULE:NAME of your own callable "
                        "taking a PIL image")
    d.add_argument("--target", type=_positive("--target", float), default=None, metavar="IMG/S",
                   help="images/s your training step consumes; the pipeline is fine at or above it "
                        "(default 1000)")
    d.add_argument("--json", action="store_true", help="print the report as JSON")

    u = sub.add_parser("umount", aliases=["unmount"], help="unmount a cachefs mount",
                       description="Unmount and wait for the daemon to finish writing the cache.")
    u.add_argument("mountpoint")
    return p


def _ratio(hits: int, misses: int) -> str:
    total = hits + misses
    return f"{hits / total:.1%}" if total else "-"


def _latency(h: dict[str, Any] | None) -> str:
    """'p50 2.1 ms, p99 9.8 ms' from an exported histogram, or 'none yet'."""
    if not h or not h.get("count"):
        return "none yet"
    return f"p50 {_ms(h['p50_s'])}, p99 {_ms(h['p99_s'])}"


def _ms(seconds: float) -> str:
    ms = seconds * 1000
    return f"{ms:.2f} ms" if ms < 10 else f"{ms:.0f} ms"


def _opens_line(info: dict[str, Any], opens: dict[str, Any]) -> str:
    """How files are opened, and why not by passthrough where it is not."""
    mode = info.get("opens", "?")
    why = f" ({info['opens_why']})" if info.get("opens_why") else ""
    if mode == "zero-message":
        return f"opens      zero-message{why}: cached files are read from the kernel's page cache"
    counts = (f": {opens.get('passthrough') or 0} passed through to a cached file, {opens.get('daemon') or 0} "
              f"served by the daemon, {opens.get('filled') or 0} filled from the source first")
    return f"opens      {mode}{why}{counts}"


def format_stats(snap: dict[str, Any]) -> str:
    """The human table of `cachefs stats`."""
    info, ram, disk, src = snap.get("info", {}), snap.get("ram", {}), snap.get("disk", {}), snap.get("source", {})
    fuse = snap.get("fuse", {})
    policy = info.get("policy") or {}
    g = lambda d, k: d.get(k) or 0
    lines = [
        f"cachefs {info.get('version', '?')}  pid {info.get('pid', '?')}  up {snap.get('uptime_s', 0):.0f}s",
        f"source     {info.get('source', '?')}",
        f"mount      {info.get('mountpoint', '?')}",
        "",
        f"{'tier':<6}{'hits':>10}{'misses':>10}{'hit rate':>10}{'served':>12}{'used':>12}"
        f"{'capacity':>12}{'entries':>9}",
    ]
    for name, t in (("ram", ram), ("disk", disk)):
        lines.append(
            f"{name:<6}{g(t, 'hits'):>10}{g(t, 'misses'):>10}{_ratio(g(t, 'hits'), g(t, 'misses')):>10}"
            f"{format_size(g(t, 'served_bytes')):>12}{format_size(g(t, 'used_bytes')):>12}"
            f"{format_size(g(t, 'capacity_bytes')):>12}{g(t, 'entries'):>9}"
        )
    latency = snap.get("latency", {})
    ahead = snap.get("prefetch", {})
    lines += [
        "",
        f"source     {g(src, 'read_range')} reads, {format_size(g(src, 'bytes'))} "
        f"({format_size(g(src, 'served_bytes'))} of it read by users); "
        f"{g(src, 'stat')} stats, {g(src, 'listdir')} listings; {g(src, 'errors')} errors",
        f"latency    read {_latency(latency.get('source.read_range'))}, "
        f"stat {_latency(latency.get('source.stat'))}",
        f"read-ahead {g(ahead, 'blocks')} blocks fetched ({format_size(g(ahead, 'bytes'))}): "
        f"{g(ahead, 'used')} used, {g(ahead, 'wasted')} evicted unread, {g(ahead, 'unused')} waiting; "
        f"{g(ahead, 'no_room')} not taken (no room)",
        f"policy     ram {policy.get('ram', '?')}, disk {policy.get('disk', '?')}",
        f"ram        {g(ram, 'evictions')} evictions, {g(ram, 'refused')} refused (policy), "
        f"{g(ram, 'promotions')} promotions from disk",
        f"disk       {g(disk, 'writes')} writes, {g(disk, 'evictions')} evictions, "
        f"{g(disk, 'refused')} refused (policy), "
        f"{g(disk, 'checksum_failures')} checksum failures, {g(disk, 'errors')} errors",
        f"requests   {g(fuse, 'read')} reads, {g(fuse, 'getattr')} getattrs, {g(fuse, 'readdir')} readdirs, "
        f"{g(fuse, 'open')} opens reached the daemon; {g(fuse, 'errors')} errors",
        _opens_line(info, snap.get("opens", {})),
    ]
    hint = snap.get("hint", {})
    if g(hint, "sessions_opened"):
        lines.append(f"hints      {g(hint, 'sessions')} sessions open ({g(hint, 'sessions_opened')} in all), "
                     f"{g(hint, 'paths')} paths: {g(hint, 'used')} used, {g(hint, 'expired')} expired, "
                     f"{g(hint, 'from_source')} fetched from the source, {format_size(g(hint, 'pinned_bytes'))} pinned")
    shared = snap.get("shared", {})
    if shared.get("servers"):
        lines += [
            "",
            f"shared     {g(shared, 'hits')} hits ({format_size(g(shared, 'bytes'))}), {g(shared, 'misses')} "
            f"misses; {g(shared, 'puts')} blocks stored ({format_size(g(shared, 'put_bytes'))}), "
            f"{g(shared, 'put_dropped')} dropped; {g(shared, 'errors')} errors, "
            f"{g(shared, 'checksum_failures')} checksum failures",
        ]
        for server in shared["servers"]:
            lines.append(f"  {server['server']:<22}{'up' if server['up'] else 'DOWN':<6}"
                         f"{server['hits']:>10} hits  {server['hit_share']:>6.1%} of the hits")
    return "\n".join(lines)


def format_coverage(report: dict[str, Any], where: str) -> str:
    """The human table of `cachefs stats PATH --coverage`."""
    files, size = report["files"], report["bytes"]
    unknown = report.get("unknown_size", 0)
    lines = [f"coverage of {where}: {files} files, {format_size(size)} in {report.get('directories', 0)} "
             f"directories ({report['elapsed_s']:.1f}s"
             + (f", {report['errors']} could not be read" if report.get("errors") else "") + ")",
             f"{'tier':<8}{'files':>12}{'':>9}{'bytes':>12}{'':>9}"]
    if unknown:
        lines.insert(1, f"{unknown} files never looked up are not cached; their bytes are not in the totals "
                        "(--exact stats them on the source)")
    for tier, label in (("ram", "ram"), ("disk", "disk"), ("cached", "either")):
        t = report[tier]
        lines.append(f"{label:<8}{t['files']:>12}{_share(t['files'], files):>9}"
                     f"{format_size(t['bytes']):>12}{_share(t['bytes'], size):>9}")
    return "\n".join(lines)


def _share(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def _follow_request(mp: str, req: dict[str, Any], what: str,
                    progress_line: Callable[[dict[str, Any]], str]) -> dict[str, Any]:
    """Send a streaming control request; show its progress on stderr (in place on a
    terminal, every 10 s otherwise) and return the final reply without its marker."""
    from cachefs.control import request
    from cachefs.mounttable import CONTROL_TIMEOUT, control_address

    tty = sys.stderr.isatty()
    final: dict[str, Any] = {}
    last_print = 0.0
    try:
        # progress comes every half second: a daemon silent for CONTROL_TIMEOUT has stopped
        for reply in request(control_address(mp), req, timeout=CONTROL_TIMEOUT):
            if "error" in reply:
                raise CachefsError(f"{what}: {reply['error']}")
            if reply.get("final"):
                final = reply
                break
            if tty:
                print("\r" + progress_line(reply).ljust(100), end="", file=sys.stderr, flush=True)
            elif reply["elapsed_s"] - last_print >= 10:
                last_print = reply["elapsed_s"]
                print(progress_line(reply), file=sys.stderr, flush=True)
    except TimeoutError:
        raise CachefsError(f"{what}: the daemon of {mp} stopped answering (nothing for "
                           f"{CONTROL_TIMEOUT:g} s; stopped or hung)") from None
    except OSError as exc:
        raise CachefsError(f"cannot reach the daemon of {mp}: {exc.strerror or exc}") from None
    if tty:
        print("\r" + " " * 100 + "\r", end="", file=sys.stderr)
    final.pop("final", None)
    return final


def _cmd_coverage(args: argparse.Namespace) -> int:
    import os

    from cachefs.mounttable import mount_of

    if not os.path.exists(args.mountpoint):
        raise CachefsError(f"{args.mountpoint} does not exist")
    mp, rel = mount_of(args.mountpoint)

    def line(reply: dict[str, Any]) -> str:
        return (f"{reply['directories']} directories, {reply['files']} files, {format_size(reply['bytes'])} "
                f"looked at, {_share(reply['cached']['bytes'], reply['bytes'])} cached, {reply['elapsed_s']:.0f}s")

    final = _follow_request(mp, {"op": "coverage", "path": rel, "exact": args.exact},
                            f"coverage of {args.mountpoint}", line)
    print(json.dumps(final, indent=2, sort_keys=True) if args.json else format_coverage(final, args.mountpoint))
    return 0


def summary_line(mountpoint: str, source: str, snap: dict[str, Any] | None, problem: str | None = None) -> str:
    """One line per mount for `cachefs stats` without an argument."""
    if snap is None:
        return f"{mountpoint}  <- {source}  ({problem})"
    ram, disk, src = snap.get("ram", {}), snap.get("disk", {}), snap.get("source", {})
    g = lambda d, k: d.get(k) or 0
    rate = block_hit_rate(g(ram, "hits"), g(ram, "misses"), g(disk, "hits"))
    return (f"{mountpoint}  <- {source}  up {_uptime(snap.get('uptime_s') or 0)}, "
            f"hit rate {'-' if rate is None else f'{rate:.1%}'}, "
            f"RAM {format_size(g(ram, 'used_bytes'))}/{format_size(g(ram, 'capacity_bytes'))}, "
            f"NVMe {format_size(g(disk, 'used_bytes'))}/{format_size(g(disk, 'capacity_bytes'))}, "
            f"{format_size(g(src, 'bytes'))} from the source")


def _uptime(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def _cmd_watch(args: argparse.Namespace) -> int:
    from cachefs.mounttable import read_control
    from cachefs.watch import watch

    if args.mountpoint is None:
        raise CachefsError("--watch needs a MOUNTPOINT")
    if args.watch <= 0:
        raise CachefsError("--watch SECONDS must be more than 0")
    if args.json:
        raise CachefsError("--watch prints a live view; for scripts, poll --json instead")
    mp = args.mountpoint
    first = read_control(mp, "user.cachefs.stats")  # not a mount: a clear error, exit 2

    def read() -> dict[str, Any]:
        return read_control(mp, "user.cachefs.stats")

    try:
        watch(read, args.watch, title=f"cachefs {mp}", first=first)
    except CachefsError:
        print(f"cachefs: {mp} went away; stopped watching", file=sys.stderr)
    except BrokenPipeError:  # piped into head
        sys.stderr.close()
    return 0


def _cmd_stats(args: argparse.Namespace) -> int:
    from cachefs.mounttable import cachefs_mounts, read_control

    if args.exact and not args.coverage:
        raise CachefsError("--exact goes with --coverage")
    if args.coverage:
        if args.mountpoint is None:
            raise CachefsError("--coverage needs a PATH on a cachefs mount")
        return _cmd_coverage(args)
    if args.watch is not None:
        return _cmd_watch(args)
    if args.mountpoint is None:
        from concurrent.futures import ThreadPoolExecutor

        mounts = cachefs_mounts()

        def ask(m: Any) -> tuple[Any, dict[str, Any] | None, str | None]:
            try:
                return m, read_control(m.mountpoint, "user.cachefs.stats"), None
            except CachefsError as exc:  # a stale mount, a stopped daemon, or another user's
                return m, None, str(exc)

        # all at once: a stopped daemon costs the listing one timeout, not one per mount
        with ThreadPoolExecutor(max(1, min(16, len(mounts)))) as pool:
            listing = list(pool.map(ask, mounts))
        if args.json:
            print(json.dumps([{"mountpoint": m.mountpoint, "source": m.source, "stats": snap, "error": problem}
                              for m, snap, problem in listing]))
            return 0
        if not mounts:
            print("no cachefs mounts")
        for m, snap, problem in listing:
            print(summary_line(m.mountpoint, m.source, snap, problem))
        return 0
    snap = read_control(args.mountpoint, "user.cachefs.stats")
    print(json.dumps(snap, indent=2, sort_keys=True) if args.json else format_stats(snap))
    return 0


def _cmd_mount(args: argparse.Namespace) -> int:
    from cachefs.mount import mount

    config = Config(
        source=args.source, mountpoint=args.mountpoint, cache_dir=args.cache_dir,
        ram_size=args.ram_size, disk_size=args.disk_size, block_size=args.block_size,
        metadata_ttl=args.metadata_ttl, negative_ttl=args.negative_ttl, foreground=args.foreground,
        source_timeout=args.source_timeout,
        allow_other=args.allow_other, log_file=args.log_file, verbose=args.verbose,
        debug_fuse=args.debug_fuse, zero_message_open=not args.open_per_handle, passthrough=args.passthrough,
        readahead=args.readahead, prefetch_workers=args.prefetch_workers, fetch_processes=args.fetch_processes,
        warm=args.warm,
        metrics_addr=args.metrics_addr, shared_cache=args.shared_cache, shared_namespace=args.shared_namespace,
        policy=args.policy, max_idle=args.max_idle, min_free=args.min_free,
    )
    return mount(config, check_only=args.check)


def _progress_line(p: dict[str, Any]) -> str:
    elapsed = max(p["elapsed_s"], 1e-6)
    rate = p["bytes_loaded"] / elapsed
    loaded = f"{format_size(p['bytes_loaded'])} loaded, {format_size(rate)}/s"
    if not p.get("total_known", True):  # still counting: no share and no ETA of a total that grows
        return f"warm: {p['files_done']} files so far of at least {p['files_total']} (counting), {loaded}"
    total = max(p["files_total"], 1)
    files_rate = p["files_done"] / elapsed
    eta = (p["files_total"] - p["files_done"]) / files_rate if files_rate > 0 else 0
    return f"warm: {p['files_done']}/{p['files_total']} files ({p['files_done'] / total:.0%}), {loaded}, ETA {eta:.0f}s"


def _cmd_warm(args: argparse.Namespace) -> int:
    import os

    from cachefs.mounttable import mount_of

    targets: dict[str, list[str]] = {}
    for path in args.paths:
        if not os.path.exists(path):
            raise CachefsError(f"{path} does not exist")
        mp, rel = mount_of(path)
        targets.setdefault(mp, []).append(rel)
    code = 0
    for mp, rels in targets.items():
        req: dict[str, Any] = {"op": "warm", "paths": rels}
        if args.shard:
            req["shard"] = list(_parse_shard(args.shard))
        final = _follow_request(mp, req, f"warm of {mp}", _progress_line)
        if args.json:
            print(json.dumps(final))
        else:
            not_fit = final["files_total"] - final["files_done"] + final["files_no_room"]
            share = f" (shard {args.shard})" if args.shard else ""
            where = " ".join(os.path.join(mp, rel.lstrip("/")).rstrip("/") for rel in rels)
            print(f"cachefs: warmed {where}{share} in {final['elapsed_s']:.1f}s: "
                  f"{final['files_loaded']} files loaded ({format_size(final['bytes_loaded'])}), "
                  f"{final['files_cached']} already cached, {not_fit} did not fit, {final['files_failed']} failed")
        if final.get("state") == "no_room":
            print("cachefs: the cache is full: raise --ram-size/--disk-size to hold the rest", file=sys.stderr)
            code = max(code, 1)
        if final.get("files_failed"):
            code = max(code, 1)
        if final.get("state") == "failed":
            print(f"cachefs: warming stopped: {final.get('error')}", file=sys.stderr)
            code = max(code, 1)
    return code


def _cmd_diagnose(args: argparse.Namespace) -> int:
    import os

    from cachefs import diagnose

    if not os.path.exists(args.path):
        raise CachefsError(f"{args.path} does not exist")
    diagnose.check_torch()
    if args.seconds <= 0:
        raise CachefsError("--seconds must be more than 0")
    workers = args.workers or min(8, os.cpu_count() or 1)
    target = args.target or diagnose.DEFAULT_TARGET
    try:
        report = diagnose.diagnose(args.path, workers, args.batch_size, args.seconds, args.transform, target)
    except ValueError as exc:  # a transform that does not load
        raise CachefsError(str(exc)) from None
    print(json.dumps(report, indent=2) if args.json else diagnose.format_report(report))
    return 0


def _cmd_umount(args: argparse.Namespace) -> int:
    from cachefs.mount import unmount

    print(f"cachefs: {unmount(args.mountpoint)}")
    return 0


def _negative_values_joined(argv: Sequence[str]) -> list[str]:
    """`--ram-size -5GiB` as `--ram-size=-5GiB`: argparse takes a value that starts with '-'
    for an option and says "expected one argument"; joined, the option's own check says
    what is wrong with the value."""
    out: list[str] = []
    for token in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and re.match(r"-[0-9.]", token):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out


def _unrecognized(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """The error for arguments no option takes, with the closest options' names."""
    options = [s for action in parser._actions for s in action.option_strings if s.startswith("--")]
    hints = []
    for token in extra:
        if token.startswith("-"):
            close = difflib.get_close_matches(token.split("=", 1)[0], options, n=1, cutoff=0.6)
            if close:
                hints.append(f"did you mean {close[0]}?")
    return f"unrecognized arguments: {' '.join(extra)}" + (f"; {' '.join(hints)}" if hints else "")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(_negative_values_joined(sys.argv[1:] if argv is None else argv))
    if extra:  # said by the command's own parser, whose --help lists its options
        commands_of = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
        command = commands_of.get(args.command or "", parser)
        command.error(_unrecognized(command, extra))
    commands = {"mount": _cmd_mount, "stats": _cmd_stats, "umount": _cmd_umount, "unmount": _cmd_umount,
                "warm": _cmd_warm, "diagnose": _cmd_diagnose}
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return commands[args.command](args)
    except CachefsError as exc:
        print(f"cachefs: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        if args.command == "warm":
            print("\ncachefs: warm stopped; run it again to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
