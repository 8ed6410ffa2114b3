"""The options of `cachefs mount`, declared once.

`MOUNT_OPTIONS` is the one table: it gives the parser (`add_mount_options`), the Config a
parsed command line becomes (`config_from`), and through the parser the names
`mount.cachefs -o` accepts (cachefs/mounthelper.py). tests/test_options.py fails when the
table, `Config`'s fields and the README's options table disagree. Checks that need more
than one option, or the machine, are cachefs/validate.py's.
"""

from __future__ import annotations

import argparse
import dataclasses
import operator
from collections.abc import Callable
from typing import Any

from cachefs.config import (
    DEFAULT_BLOCK_SIZE,
    DEFAULT_MAX_IDLE,
    DEFAULT_METADATA_TTL,
    DEFAULT_NEGATIVE_TTL,
    DEFAULT_PASSTHROUGH,
    DEFAULT_POLICY,
    DEFAULT_PREFETCH_WORKERS,
    DEFAULT_READAHEAD,
    DEFAULT_SCRUB_INTERVAL,
    DEFAULT_SOURCE_TIMEOUT,
    PASSTHROUGH_MODES,
    READAHEAD_MODES,
    ROTATIONAL_PREFETCH_WORKERS,
    Config,
    default_cache_dir,
    format_size,
    parse_duration,
    parse_servers,
    parse_size,
)
from cachefs.errors import CachefsError
from cachefs.policy import parse_policy_spec

_KEEP = object()


class Option:
    """One option: its group in --help, its flags, argparse's keywords, and the Config
    field it sets (by default the one its long flag names; None: the command's own, like
    --check), through `to_config` where the value needs turning."""

    def __init__(self, group: str, *flags: str, field: str | None | object = _KEEP,
                 to_config: Callable[[Any], Any] | None = None, **kwargs: Any):
        self.group = group
        self.flags = flags
        self.dest = flags[-1].lstrip("-").replace("-", "_")
        self.field: str | None = self.dest if field is _KEEP else field  # type: ignore[assignment]
        self.to_config = to_config
        self.kwargs = kwargs

    @property
    def long(self) -> str:
        return next(f for f in self.flags if f.startswith("--"))


def _argtype(parse: Callable[[str, str], Any], what: str) -> Callable[[str], Any]:
    """An argparse type from one of config's parsers, whose CachefsError becomes a usage error."""

    def convert(text: str) -> Any:
        try:
            return parse(text, what)
        except CachefsError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return convert


def size_type(what: str) -> Callable[[str], int]:
    return _argtype(parse_size, what)


def duration_type(what: str) -> Callable[[str], float]:
    return _argtype(parse_duration, what)


def checked_type(check: Callable[[str], object], what: str) -> Callable[[str], str]:
    """An argparse type that keeps the text once `check` (raising ValueError) accepts it."""

    def convert(text: str) -> str:
        try:
            check(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"invalid {what}: {exc}") from None
        return text

    return convert


def positive_type(what: str, kind: type = int) -> Callable[[str], Any]:
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


def _parse_metrics_addr(text: str) -> object:
    from cachefs.metrics import parse_metrics_addr  # imports no prometheus-client

    return parse_metrics_addr(text)


def _parse_namespace(text: str) -> object:
    if not text or len(text) > 100 or any(c.isspace() or not c.isprintable() for c in text):
        raise ValueError("a name of 1 to 100 printable characters without spaces")
    return text


TIERS = "cache tiers"
META = "metadata"
AHEAD = "read-ahead and warming"
SHARED = "a cache tier shared by the nodes of a cluster"
RUN = "running"

MOUNT_OPTIONS: tuple[Option, ...] = (
    Option(TIERS, "--ram-size", type=size_type("--ram-size"), metavar="SIZE",
        help="RAM tier budget, e.g. 16GiB (default: 1/4 of memory, at most 4 GiB). "
        "The kernel page cache comes on top of it."),
    Option(TIERS, "--cache-dir", default=default_cache_dir(), metavar="DIR",
        help="where the NVMe tier lives; put it on local flash (default: %(default)s)"),
    Option(TIERS, "--disk-size", type=size_type("--disk-size"), metavar="SIZE",
        help="NVMe tier budget, a hard limit, e.g. 200GiB; 0 disables the tier "
        "(default: half the free space of the cache disk, at most 64 GiB)"),
    Option(TIERS, "--min-free", type=size_type("--min-free"), metavar="SIZE",
        help="space the NVMe tier always leaves free on the cache disk, a hard limit "
        "(default: 5%% of the disk, at most 10 GiB)"),
    Option(TIERS, "--policy", default=DEFAULT_POLICY, type=checked_type(parse_policy_spec, "--policy"),
        metavar="POLICY",
        help="what each tier keeps: keep (admit until full, then keep: the best hit rate "
        "under shuffled epochs) or lru; per tier as ram=lru,disk=keep "
        "(default: %(default)s)"),
    Option(TIERS, "--max-idle", type=duration_type("--max-idle"), default=DEFAULT_MAX_IDLE, metavar="SECONDS",
        help="evict blocks unread this long before any other, e.g. 12h; 0 = never "
        f"(default: {DEFAULT_MAX_IDLE / 3600:.0f}h)"),
    Option(TIERS, "--scrub-interval", type=duration_type("--scrub-interval"), default=DEFAULT_SCRUB_INTERVAL,
           metavar="SECONDS",
           help="how often the NVMe tier re-reads every cached block to find bit rot, at most 4 MiB and 50 "
                "blocks a second; 0: never (blocks written before an unclean stop are checked after the next "
                f"start either way) (default: {DEFAULT_SCRUB_INTERVAL / 86400:.0f} days)"),
    Option(TIERS, "--block-size", type=size_type("--block-size"), default=DEFAULT_BLOCK_SIZE, metavar="SIZE",
        help="cache block size; files up to this size are one block "
        f"(default: {format_size(DEFAULT_BLOCK_SIZE)})"),
    Option(META, "--metadata-ttl", type=duration_type("--metadata-ttl"), default=DEFAULT_METADATA_TTL,
        metavar="SECONDS",
        help="how long stat results and listings are trusted, in cachefs and the kernel; "
        "changes on the source show up after this (default: %(default)gs, "
        "for an immutable dataset)"),
    Option(META, "--negative-ttl", type=duration_type("--negative-ttl"), default=DEFAULT_NEGATIVE_TTL,
        metavar="SECONDS", help="how long 'no such file' is remembered (default: %(default)gs)"),
    Option(META, "--source-timeout", type=duration_type("--source-timeout"), default=DEFAULT_SOURCE_TIMEOUT,
        metavar="SECONDS",
        help="a source request slower than this fails with ETIMEDOUT instead of hanging the "
        "reader; the source then counts as down and cached files keep being served "
        "(default: %(default)gs; 0: wait forever)"),
    Option(AHEAD, "--readahead", choices=READAHEAD_MODES, default=DEFAULT_READAHEAD,
        help="off; file: fetch ahead of sequential readers inside big files; dir: that, plus "
        "the unread files of each directory the job reads, in sorted order, into free "
        "cache space only (default: %(default)s)"),
    Option(AHEAD, "--prefetch-workers", type=int, metavar="N",
        help="parallel source fetches for read-ahead and warming; demand misses do not "
        f"wait for these (default: {DEFAULT_PREFETCH_WORKERS}, or "
        f"{ROTATIONAL_PREFETCH_WORKERS} when the source is a local spinning disk)"),
    Option(AHEAD, "--fetch-processes", type=int, metavar="N",
        help="processes that fetch small files from the source and write them to the NVMe "
        "tier when opens are passed through, beside the daemon's own threads; 0: the "
        "daemon does it itself (default: one per two cores, 1 to 4)"),
    Option(AHEAD, "--serve-processes", type=int, metavar="N",
        help="processes that answer the kernel's opens and releases of cached files when opens "
        "are passed through, each on its own copy of the FUSE connection; 0: the daemon "
        "answers every request itself (default: one per two cores, 1 to 8)"),
    Option(AHEAD, "--backing-files", type=int, metavar="N",
        help="cache files registered with the kernel for passthrough at most, each an open file "
        "(~1.5 KB of kernel memory); past it the least recently opened are closed and "
        "registered again at their next open (default: 1/64 of memory's worth, at least 16384)"),
    Option(AHEAD, "--warm", action="store_true",
        help="load the whole source into the cache in the background, below the job's own reads"),
    Option(SHARED, "--shared-cache", type=checked_type(parse_servers, "--shared-cache"),
        metavar="memcached://HOST:PORT[,HOST:PORT...]",
        help="memcached servers every node reads from after its own RAM and NVMe and before "
        "the source, and stores what it reads from the source in (needs pymemcache in "
        "cachefs's environment: pip install pymemcache)"),
    Option(SHARED, "--shared-namespace", type=checked_type(_parse_namespace, "--shared-namespace"), metavar="NAME",
        help="names this dataset in the shared tier's keys, alike on every node (default: the "
        "source directory's name)"),
    Option(RUN, "--metrics-addr", type=checked_type(_parse_metrics_addr, "--metrics-addr"), metavar="[HOST:]PORT",
        help="serve Prometheus metrics at http://HOST:PORT/metrics (HOST defaults to "
        "127.0.0.1, loopback only; needs prometheus-client in cachefs's environment: "
        "pip install prometheus-client)"),
    Option(RUN, "-f", "--foreground", action="store_true",
        help="stay in the foreground (log to stderr); Ctrl-C or SIGTERM unmounts"),
    Option(RUN, "--allow-other", action="store_true",
        help="let other users use the mount; the kernel then enforces the source's modes"),
    Option(RUN, "--log-file", metavar="FILE", help="daemon log (default: CACHE_DIR/cachefs.log)"),
    Option(RUN, "-v", "--verbose", action="count", default=0, help="-v info, -vv debug (with tracebacks)"),
    Option(RUN, "--passthrough", choices=PASSTHROUGH_MODES, default=DEFAULT_PASSTHROUGH,
        help="auto: the kernel reads cached files directly (FUSE passthrough, Linux 6.9+, "
        "root) where it can, zero-message opens otherwise; on: passthrough, falling back "
        "per open where refused; off: zero-message opens, which are faster while the "
        "page cache holds the whole dataset (default: %(default)s)"),
    Option(RUN, "--open-per-handle", action="store_true", field="zero_message_open", to_config=operator.not_,
        help="send every open() to cachefs instead of using zero-message opens "
        "(slower warm epochs; for debugging)"),
    Option(RUN, "--debug-fuse", action="store_true",
        help="log every FUSE request: operation, node, caller's pid, outcome and time (very verbose)"),
    Option(RUN, "--check", action="store_true", field=None,
        help="check the request (paths, sizes, FUSE) and say what would be mounted; "
        "mounts and writes nothing"),
)


def add_mount_options(parser: argparse.ArgumentParser) -> None:
    groups: dict[str, Any] = {}
    for option in MOUNT_OPTIONS:
        group = groups.get(option.group) or groups.setdefault(option.group, parser.add_argument_group(option.group))
        group.add_argument(*option.flags, **option.kwargs)


def config_from(args: argparse.Namespace) -> Config:
    """The Config a parsed `cachefs mount` command line asks for."""
    values = {}
    for option in MOUNT_OPTIONS:
        if option.field is not None:
            value = getattr(args, option.dest)
            values[option.field] = option.to_config(value) if option.to_config else value
    return Config(source=args.source, mountpoint=args.mountpoint, **values)


def config_fields() -> set[str]:
    """The Config fields an option sets (every one but the two positional arguments)."""
    return {f.name for f in dataclasses.fields(Config)} - {"source", "mountpoint"}
