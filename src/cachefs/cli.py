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
    format_size,
)
from cachefs.errors import CachefsError
from cachefs.options import add_mount_options, checked_type, config_from, duration_type, positive_type
from cachefs.stats import block_hit_rate


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line and exit code 2, like every other bad input."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _check_transform(text: str) -> None:
    if text not in ("standard", "eval", "none") and not all(text.partition(":")[::2]):
        raise ValueError(f"{text!r}: use standard, eval, none or MODULE:NAME")


def _parse_shard(text: str) -> tuple[int, int]:
    rank, sep, world = text.partition("/")
    if not sep or not rank.isdigit() or not world.isdigit() or not 0 <= int(rank) < int(world):
        raise ValueError("RANK/WORLD with 0 <= RANK < WORLD, e.g. 3/8")
    return int(rank), int(world)


# Long (63 lines) for a reason: the commands' arguments, declared in one place in --help order.
def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="cachefs", description="A read-only FUSE cache (RAM + NVMe) in front of slow storage.")
    p.add_argument("--version", action="version", version=f"cachefs {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    m = sub.add_parser("mount", help="mirror SOURCE at MOUNTPOINT through the cache",
                       description="Mirror SOURCE read-only at MOUNTPOINT, caching blocks in RAM and on local disk.")
    m.add_argument("source", help="the slow directory (NFS, SMB, sshfs, HDD, ...)")
    m.add_argument("mountpoint", help="an existing empty directory")
    add_mount_options(m)

    s = sub.add_parser("stats", help="show what a mount's cache is doing",
                       description="Hits, misses and occupancy per tier, and source traffic, of a cachefs mount.")
    s.add_argument("mountpoint", nargs="?", metavar="PATH",
                   help="a cachefs mount point, or with --coverage any directory or file on one "
                        "(default: list all cachefs mounts)")
    s.add_argument("--json", action="store_true", help="print the raw snapshot as JSON (every key: docs/stats.md)")
    s.add_argument("--watch", nargs="?", const=1.0, type=duration_type("--watch"), metavar="SECONDS",
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
    w.add_argument("--shard", type=checked_type(_parse_shard, "--shard"), metavar="RANK/WORLD",
                   help="warm only this node's share of the files (RANK from 0 to WORLD-1): with "
                        "--shared-cache, WORLD nodes each warming their RANK fill the shared tier for all")
    w.add_argument("--json", action="store_true", help="print the final report as JSON")

    d = sub.add_parser("diagnose", help="is a training input pipeline storage-bound, CPU-bound, or fine?",
                       description="Measure, on the ImageFolder tree at PATH, raw read throughput with N processes "
                                   "and a torch DataLoader (decode + transforms, no model) with N workers, while "
                                   "sampling CPU and I/O; then name the bottleneck, with the figures and advice. "
                                   "Reads about 2 x SECONDS worth of the dataset. Needs the torch extra.")
    d.add_argument("path", metavar="PATH", help="the dataset root (PATH/<class>/<image>), on any filesystem")
    d.add_argument("--workers", type=positive_type("--workers"), default=None, metavar="N",
                   help="reader processes and DataLoader workers (default: the CPU count, at most 8)")
    d.add_argument("--batch-size", type=positive_type("--batch-size"), default=64, metavar="B", help="default 64")
    d.add_argument("--seconds", type=duration_type("--seconds"), default=10.0, metavar="S",
                   help="length of each of the two measurements (default 10)")
    d.add_argument("--transform", default="standard", type=checked_type(_check_transform, "--transform"),
                   metavar="NAME",
                   help="standard (RandomResizedCrop 224, flip, normalize; the default), eval (resize, "
                        "center crop), none (bytes only: GPU decoding), or MODULE:NAME of your own callable "
                        "taking a PIL image")
    d.add_argument("--target", type=positive_type("--target", float), default=None, metavar="IMG/S",
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


def _opens_line(info: dict[str, Any], opens: dict[str, Any], serve: dict[str, Any]) -> str:
    """How files are opened, and why not by passthrough where it is not."""
    mode = info.get("opens", "?")
    why = f" ({info['opens_why']})" if info.get("opens_why") else ""
    if mode == "zero-message":
        return f"opens      zero-message{why}: cached files are read from the kernel's page cache"
    counts = (f": {opens.get('passthrough') or 0} passed through to a cached file, {opens.get('daemon') or 0} "
              f"served by the daemon, {opens.get('filled') or 0} filled from the source first")
    if serve.get("processes"):
        n = serve["processes"]
        counts += (f"; {n} serving process{'es' if n != 1 else ''} answered {serve.get('answered') or 0} requests "
                   f"and handed {serve.get('forwarded') or 0} to the daemon")
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
        _opens_line(info, snap.get("opens", {}), snap.get("serve", {})),
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

    config = config_from(args)
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
