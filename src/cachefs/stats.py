"""One stats object: counters, gauges and latency histograms, read as a snapshot of plain data.

Every component increments named counters ("ram.hits", "source.bytes"), registers gauges
(a callable read at snapshot time, for occupancy and capacity) and observes durations
("source.read_range" seconds) into histograms with fixed buckets. The CLI, the tests and a
Prometheus endpoint all read `snapshot()`; nothing else is exported.
"""

from __future__ import annotations

import bisect
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

# Version of the snapshot's layout, shown as "schema" in `cachefs stats --json`.
# 2: adds "latency" (histograms, with p50/p99 estimates).
# 3: every counter, gauge and histogram is present from the start, zero until used.
SCHEMA_VERSION = 3

# Upper bounds (seconds) of the latency buckets: 50 us to 30 s, about 2.2 per decade
# step, fine enough for a p99 within a bucket's width (the last bucket is +Inf).
LATENCY_BUCKETS: tuple[float, ...] = (
    0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05,
    0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0,
)


# Every counter, gauge and latency histogram a snapshot holds. They are all present from
# the start (zero until used, and a gauge of a part the mount runs without, such as the
# NVMe tier with --disk-size 0, reads 0), so `d["disk"]["misses"]` never raises in a
# script. docs/stats.md documents each; tests/test_stats_docs.py holds the two together.
SOURCE_OPS = ("read_range", "stat", "listdir", "readlink", "statfs", "getxattr", "listxattr")
FUSE_OPS = ("lookup", "forget", "batch_forget", "getattr", "readlink", "open", "read", "release", "flush",
            "opendir", "readdir", "readdirplus", "releasedir", "statfs", "getxattr", "listxattr", "access",
            "interrupt", "other")
COUNTERS: tuple[str, ...] = (
    "ram.hits", "ram.misses", "ram.served_bytes", "ram.evictions", "ram.promotions", "ram.promotions_skipped",
    "ram.refused", "ram.no_room",
    "ram.writes", "ram.written_bytes", "ram.checksum_failures", "ram.errors",
    "disk.hits", "disk.misses", "disk.served_bytes", "disk.evictions", "disk.writes", "disk.written_bytes",
    "disk.refused", "disk.no_room", "disk.checksum_failures", "disk.errors", "disk.scrubbed_bytes", "disk.scrub_passes",
    "disk.trusted_files", "disk.vouched_files", "disk.cooled_files",
    "disk.suspensions", "disk.suspended_writes",
    "source.served_bytes", "source.bytes", "source.errors", "source.changed", "source.timeouts", "source.late_fills",
    "source.down_events", "source.fast_failures", "source.partial_reads", "source.background_waits",
    "shared.hits", "shared.misses", "shared.bytes", "shared.served_bytes", "shared.puts", "shared.put_bytes",
    "shared.put_dropped", "shared.errors", "shared.checksum_failures", "shared.down_events",
    *(f"source.{op}" for op in SOURCE_OPS),
    "metadata.hits", "metadata.misses", "metadata.stale_served", "metadata.index_hits", "metadata.index_stale",
    "metadata.listings_kept", "metadata.dirs_checked",
    "fuse.errors", "fuse.reply_failures", "fuse.busy_refusals", "fuse.descriptor_trims",
    *(f"fuse.{op}" for op in FUSE_OPS), *(f"fuse.{op}_us" for op in FUSE_OPS),
    "prefetch.blocks", "prefetch.bytes", "prefetch.used", "prefetch.wasted", "prefetch.no_room",
    "prefetch.dropped", "prefetch.errors", "prefetch.dirs", "prefetch.dir_cached",
    "warm.files_loaded", "warm.bytes_loaded",
    "reads.requests", "reads.bytes", "reads.inflight_waits",
    "opens.passthrough", "opens.daemon", "opens.fallback", "opens.filled", "opens.fill_busy", "serve.answered",
    "serve.forwarded",
    "serve.published_ahead", "serve.table_registrations",
    "serve.table_registrations_ram", "serve.table_switches", "serve.table_switches_back",
    "serve.table_nodes_taken", "serve.table_backings_closed",
    "serve.checkpoints", "serve.checkpoint_backings_closed", "serve.names_tabled",
    "serve.names_dropped",
    "hint.sessions_opened", "hint.paths", "hint.from_ram", "hint.from_disk", "hint.from_source", "hint.bytes",
    "hint.from_shared", "hint.used", "hint.expired", "hint.skipped", "hint.window_full", "hint.errors",
    "hint.left_on_disk", "hint.passed",
)
GAUGES: tuple[str, ...] = (
    "ram.used_bytes", "ram.capacity_bytes", "ram.entries", "ram.files",
    "disk.used_bytes", "disk.capacity_bytes", "disk.entries", "disk.files", "disk.files_in_memory", "disk.suspended",
    "disk.checkpoint_bytes",
    "source.down", "source.background_limit", "metadata.entries", "metadata.checks_waiting", "prefetch.queued",
    "prefetch.unused",
    "hint.sessions", "hint.pinned_bytes", "hint.queued", "opens.backing_files", "opens.backing_files_ram",
    "serve.processes", "serve.published", "serve.names", "fuse.nodes",
    "shared.servers_down", "shared.pending_bytes", "shared.servers",
)
HISTOGRAMS: tuple[str, ...] = tuple(f"source.{op}" for op in SOURCE_OPS)


def block_hit_rate(ram_hits: float, ram_misses: float, disk_hits: float) -> float | None:
    """Share of block lookups served by a tier: RAM or NVMe hits over RAM lookups (every
    lookup starts in RAM); None without lookups."""
    lookups = ram_hits + ram_misses
    return (ram_hits + disk_hits) / lookups if lookups else None


class Histogram:
    """Counts of observations per bucket (cumulative only when exported), their sum."""

    __slots__ = ("counts", "sum", "count")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.sum = 0.0
        self.count = 0

    @classmethod
    def from_counts(cls, counts: list[int]) -> Histogram:
        """A histogram of per-bucket counts (e.g. the difference of two exports); no sum."""
        h = cls()
        h.counts = list(counts)
        h.count = sum(counts)
        return h

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.sum += seconds
        self.count += 1

    def quantile(self, q: float) -> float | None:
        """The q-quantile, interpolated linearly inside its bucket (as Prometheus's
        histogram_quantile does); None without observations."""
        if self.count == 0:
            return None
        rank = q * self.count
        seen = 0
        for i, n in enumerate(self.counts):
            if n and seen + n >= rank:
                lo = LATENCY_BUCKETS[i - 1] if i > 0 else 0.0
                if i == len(LATENCY_BUCKETS):
                    return lo  # above the last bound: report the bound
                hi = LATENCY_BUCKETS[i]
                return lo + (hi - lo) * (rank - seen) / n
            seen += n
        return LATENCY_BUCKETS[-1]

    def export(self) -> dict[str, Any]:
        p50, p99 = self.quantile(0.5), self.quantile(0.99)
        return {
            "count": self.count,
            "sum_s": round(self.sum, 6),
            "le": list(LATENCY_BUCKETS),
            "buckets": list(self.counts),  # per bucket, not cumulative; the last is +Inf
            "p50_s": None if p50 is None else round(p50, 6),
            "p99_s": None if p99 is None else round(p99, 6),
        }


class Stats:
    """Counters are kept per thread and summed when read: an increment takes no lock (every
    file costs a dozen of them, from several threads at once), and none is ever lost, since
    each thread's counts are written by that thread only."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._lock = threading.Lock()
        self._base: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._shards: list[defaultdict[str, int]] = []
        self._local = threading.local()
        self._gauges: dict[str, Callable[[], Any]] = dict.fromkeys(GAUGES, lambda: 0)
        self._gauges["shared.servers"] = list  # one entry per shared cache server; none without
        self._info: dict[str, Any] = {}
        self._histograms: dict[str, Histogram] = {name: Histogram() for name in HISTOGRAMS}
        self._clock = clock
        self._started = clock()

    def _shard(self) -> defaultdict[str, int]:
        try:
            return self._local.shard  # type: ignore[no-any-return]
        except AttributeError:
            shard: defaultdict[str, int] = defaultdict(int)
            with self._lock:
                self._shards.append(shard)
            self._local.shard = shard
            return shard

    def incr(self, name: str, n: int = 1) -> None:
        self._shard()[name] += n

    def add_many(self, pairs: dict[str, int]) -> None:
        shard = self._shard()
        for name, n in pairs.items():
            shard[name] += n

    def _totals(self) -> dict[str, int]:
        with self._lock:
            shards = list(self._shards)
        totals = dict(self._base)
        for shard in shards:
            for name, n in dict(shard).items():  # a copy: its thread may add a key meanwhile
                totals[name] = totals.get(name, 0) + n
        return totals

    def thread_counts(self) -> dict[str, int]:
        """What the calling thread has counted so far (its own shard): the difference of
        two calls is what that thread did in between, whatever other threads did."""
        return dict(self._shard())

    def get(self, name: str) -> int:
        return self._totals().get(name, 0)

    def observe(self, name: str, seconds: float) -> None:
        """Record one duration in the histogram `name` (created on first use)."""
        with self._lock:
            h = self._histograms.get(name)
            if h is None:
                h = self._histograms[name] = Histogram()
            h.observe(seconds)

    def gauge(self, name: str, fn: Callable[[], Any]) -> None:
        self._gauges[name] = fn

    def gauge_names(self) -> set[str]:
        """Names that are gauges (levels); every other number is a counter (a running total)."""
        return set(self._gauges)

    def set_info(self, **info: Any) -> None:
        self._info.update(info)

    def snapshot(self) -> dict[str, Any]:
        """Plain nested data: {"schema", "info", "uptime_s", <section>: {<name>: value}}."""
        flat: dict[str, Any] = dict(self._totals())
        with self._lock:
            latency = {name: h.export() for name, h in sorted(self._histograms.items())}
        for name, fn in self._gauges.items():
            try:
                flat[name] = fn()
            except Exception:  # a gauge must never break stats
                flat[name] = None
        out: dict[str, Any] = {
            "schema": SCHEMA_VERSION,
            "info": dict(self._info, pid=os.getpid()),
            "uptime_s": round(self._clock() - self._started, 3),
            "latency": latency,
        }
        for name, value in sorted(flat.items()):
            section, _, key = name.partition(".")
            out.setdefault(section, {})[key] = value
        return out
