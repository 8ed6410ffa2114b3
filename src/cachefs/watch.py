"""`cachefs stats MOUNTPOINT --watch`: per-interval rates from two stats snapshots.

`rates(before, after)` is pure (two snapshots in, one row of figures out) and is what the
tests check; `watch()` is the loop around it: on a terminal it redraws one panel in place,
otherwise it prints one line per interval (for logs and scripts), like dstat.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from cachefs.config import format_size
from cachefs.stats import LATENCY_BUCKETS, Histogram, block_hit_rate

MB = 1_000_000

# (column title, key in the row, width, format of a number; "" for text cells)
COLUMNS: tuple[tuple[str, str, int, str], ...] = (
    ("reads/s", "reads_per_s", 9, ".0f"),
    ("MB/s", "read_mb_s", 8, ".1f"),
    ("ram MB/s", "ram_mb_s", 10, ".1f"),
    ("nvme MB/s", "disk_mb_s", 11, ".1f"),
    ("shared MB/s", "shared_mb_s", 13, ".1f"),
    ("src MB/s", "source_mb_s", 10, ".1f"),
    ("hit", "hit_rate", 8, ""),
    ("src req/s", "source_req_per_s", 11, ".0f"),
    ("src p99", "source_p99", 10, ""),
    ("ahead/s", "prefetch_per_s", 9, ".0f"),
    ("ram used", "ram_used", 11, ""),
    ("nvme used", "disk_used", 11, ""),
)


def _get(snap: dict[str, Any], section: str, key: str) -> float:
    return (snap.get(section) or {}).get(key) or 0


def _delta(before: dict[str, Any], after: dict[str, Any], section: str, key: str) -> float:
    # A restarted daemon starts its counters again: a negative step counts from zero.
    d = _get(after, section, key) - _get(before, section, key)
    return d if d >= 0 else _get(after, section, key)


def _interval_p99(before: dict[str, Any], after: dict[str, Any], name: str) -> float | None:
    a = (after.get("latency") or {}).get(name)
    if not a or "buckets" not in a:
        return None
    b = (before.get("latency") or {}).get(name) or {}
    old = b.get("buckets") or []
    if len(old) != len(a["buckets"]):
        old = [0] * len(a["buckets"])  # no earlier histogram (or another daemon's)
    return Histogram.from_counts([max(0, x - y) for x, y in zip(a["buckets"], old, strict=True)]).quantile(0.99)


def rates(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Figures of the interval between two snapshots: per-second rates, the block hit rate
    of the interval (RAM or NVMe hits over all block lookups), the source's p99 latency over
    the interval, and the tiers' occupancy at its end."""
    dt = max(1e-6, (after.get("uptime_s") or 0) - (before.get("uptime_s") or 0))
    p99 = _interval_p99(before, after, "source.read_range")
    return {
        "interval_s": round(dt, 3),
        # Under passthrough the kernel reads cached files itself: each such open counts as
        # one read of the whole file, and the bytes as what the tiers served.
        "reads_per_s": (_delta(before, after, "reads", "requests") + _delta(before, after, "opens", "passthrough"))
        / dt,
        "read_mb_s": sum(_delta(before, after, tier, "served_bytes") for tier in ("ram", "disk", "shared", "source"))
        / dt / MB,
        "ram_mb_s": _delta(before, after, "ram", "served_bytes") / dt / MB,
        "disk_mb_s": _delta(before, after, "disk", "served_bytes") / dt / MB,
        "shared_mb_s": _delta(before, after, "shared", "bytes") / dt / MB,
        "source_mb_s": _delta(before, after, "source", "bytes") / dt / MB,
        "hit_rate": block_hit_rate(_delta(before, after, "ram", "hits"), _delta(before, after, "ram", "misses"),
                                   _delta(before, after, "disk", "hits")),
        "source_req_per_s": _delta(before, after, "source", "read_range") / dt,
        "source_p99_s": p99,
        "prefetch_per_s": _delta(before, after, "prefetch", "blocks") / dt,
        "ram_used_bytes": _get(after, "ram", "used_bytes"),
        "disk_used_bytes": _get(after, "disk", "used_bytes"),
    }


def _cells(row: dict[str, Any]) -> dict[str, Any]:
    p99 = row["source_p99_s"]
    return dict(
        row,
        hit_rate="-" if row["hit_rate"] is None else f"{100 * row['hit_rate']:.1f}%",
        source_p99="-" if p99 is None else (f"{p99 * 1000:.1f}ms" if p99 < LATENCY_BUCKETS[-1] else ">30s"),
        ram_used=format_size(row["ram_used_bytes"]),
        disk_used=format_size(row["disk_used_bytes"]),
    )


def header() -> str:
    return "".join(f"{title:>{width}}" for title, _, width, _ in COLUMNS)


def line(row: dict[str, Any]) -> str:
    cells = _cells(row)
    return "".join(f"{cells[key]:>{width}{fmt}}" for _, key, width, fmt in COLUMNS)


def watch(read: Callable[[], dict[str, Any]], interval: float, out: TextIO = sys.stdout,
          tty: bool | None = None, sleep: Callable[[float], None] = time.sleep,
          count: int | None = None, title: str = "", first: dict[str, Any] | None = None) -> int:
    """Print a row every `interval` seconds until `read` raises (the mount went away),
    Ctrl-C, or `count` rows; `first` is a snapshot the caller already read. Returns the
    number of rows printed."""
    tty = out.isatty() if tty is None else tty
    before = read() if first is None else first
    rows = 0
    history: list[str] = []
    try:
        while count is None or rows < count:
            sleep(interval)
            after = read()
            text = line(rates(before, after))
            before = after
            rows += 1
            if tty:
                history = (history + [text])[-10:]
                panel = [f"{title}  every {interval:g}s, Ctrl-C to stop", "", header(), *history]
                out.write("\x1b[H\x1b[J" + "\n".join(panel) + "\n")  # home, clear, redraw
            else:
                if rows % 20 == 1:
                    out.write(header() + "\n")
                out.write(text + "\n")
            out.flush()
    except KeyboardInterrupt:
        pass
    return rows
