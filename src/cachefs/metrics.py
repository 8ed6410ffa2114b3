"""A Prometheus endpoint (`--metrics-addr HOST:PORT`) over the stats snapshot.

A collector reads `Stats.snapshot()` at each scrape, so the endpoint, `cachefs stats` and
the tests see the same figures. Names follow Prometheus conventions:

- counters: `cachefs_<section>_<name>_total` (bytes counters end in `_bytes_total`), e.g.
  `cachefs_ram_hits_total`, `cachefs_source_bytes_total`;
- requests per operation carry an `op` label: `cachefs_source_requests_total{op="stat"}`,
  `cachefs_fuse_requests_total{op="read"}`, `cachefs_fuse_request_seconds_total{op=...}`;
- gauges: `cachefs_<section>_<name>`, e.g. `cachefs_ram_used_bytes`,
  `cachefs_disk_capacity_bytes`, `cachefs_uptime_seconds`;
- latency histograms: `cachefs_source_request_duration_seconds{op=...}`;
- `cachefs_info{version, source, mountpoint, ...}` = 1.

prometheus-client is an optional dependency (the `metrics` extra; `pip install prometheus-client`); nothing
imports this module unless the option is given.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from cachefs.stats import SOURCE_OPS, Stats

_NAME_OK = re.compile(r"[^a-zA-Z0-9_]")


def parse_metrics_addr(text: str) -> tuple[str, int]:
    """'9100' or ':9100' -> loopback; 'HOST:PORT' as given ('[::1]:9100' for IPv6).
    Raises ValueError."""
    text = text.strip()
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = "", text
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{text!r} is not HOST:PORT (a port from 1 to 65535)")
    return host, int(port)


def _metric_name(*parts: str) -> str:
    return _NAME_OK.sub("_", "_".join(("cachefs",) + parts))


class StatsCollector:
    """A prometheus_client collector over a Stats object."""

    def __init__(self, stats: Stats):
        self.stats = stats

    def describe(self) -> list:
        return []  # unchecked collector: names come from the snapshot

    # Long (70 lines) for a reason: one pass over a snapshot, each section mapped to its
    # metric families in place (a table of small functions read worse).
    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
            InfoMetricFamily,
        )

        snap = self.stats.snapshot()
        gauges = self.stats.gauge_names()
        info = {k: str(v) for k, v in (snap.get("info") or {}).items() if not isinstance(v, dict)}
        yield InfoMetricFamily("cachefs", "cachefs version, source and mount point", value=info)
        uptime = GaugeMetricFamily("cachefs_uptime_seconds", "Seconds since the mount")
        uptime.add_metric([], snap.get("uptime_s") or 0)
        yield uptime

        fuse_req = CounterMetricFamily("cachefs_fuse_requests", "Kernel requests that reached the daemon",
                                       labels=["op"])
        fuse_time = CounterMetricFamily("cachefs_fuse_request_seconds", "Seconds the daemon spent in kernel requests",
                                        labels=["op"])
        source_req = CounterMetricFamily("cachefs_source_requests", "Requests sent to the source", labels=["op"])
        for section, values in sorted(snap.items()):
            if not isinstance(values, dict) or section in ("info", "latency"):
                continue
            for key, value in sorted(values.items()):
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    continue
                if section == "fuse" and key != "errors":
                    if key.endswith("_us"):
                        fuse_time.add_metric([key[:-3]], value / 1e6)
                    else:
                        fuse_req.add_metric([key], value)
                elif section == "source" and key in SOURCE_OPS:
                    source_req.add_metric([key], value)
                elif f"{section}.{key}" in gauges:
                    g = GaugeMetricFamily(_metric_name(section, key), f"{section}.{key}")
                    g.add_metric([], value)
                    yield g
                else:
                    c = CounterMetricFamily(_metric_name(section, key), f"{section}.{key}")
                    c.add_metric([], value)
                    yield c
        yield fuse_req
        yield fuse_time
        yield source_req
        yield from _by_tier(snap, CounterMetricFamily)

        servers = (snap.get("shared") or {}).get("servers") or []
        if servers:
            up = GaugeMetricFamily("cachefs_shared_server_up", "Shared cache server answering (1) or down (0)",
                                   labels=["server"])
            hits = CounterMetricFamily("cachefs_shared_server_hits", "Blocks found on this shared cache server",
                                       labels=["server"])
            for server in servers:
                up.add_metric([server["server"]], 1 if server["up"] else 0)
                hits.add_metric([server["server"]], server["hits"])
            yield up
            yield hits

        latency = HistogramMetricFamily("cachefs_source_request_duration_seconds",
                                        "Duration of requests to the source", labels=["op"])
        for name, h in sorted((snap.get("latency") or {}).items()):
            section, _, op = name.partition(".")
            if section != "source":
                continue
            cumulative, buckets = 0, []
            for bound, n in zip([*h["le"], float("inf")], h["buckets"], strict=True):
                cumulative += n
                buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
            latency.add_metric([op], buckets, h["sum_s"])
        yield latency


# Per-tier counters with the tier as a label (ram, disk, shared; and source for served
# bytes), beside their per-section names (cachefs_ram_hits_total...), which dashboards
# already use: `sum by (tier)` and one panel per measure need the label.
_TIERED = {
    "hits": ("Blocks found in the tier", ("ram", "disk", "shared")),
    "misses": ("Blocks looked for in the tier and not found", ("ram", "disk", "shared")),
    "served_bytes": ("Bytes served to readers, by where they came from", ("ram", "disk", "shared", "source")),
}


def _by_tier(snap: dict[str, Any], family: Any) -> Iterator[Any]:
    for key, (text, tiers) in _TIERED.items():
        f = family(_metric_name("tier", key), text, labels=["tier"])
        for tier in tiers:
            value = (snap.get(tier) or {}).get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                f.add_metric([tier], value)
        yield f


def start_metrics_server(stats: Stats, addr: str) -> Any:
    """Serve /metrics on `addr` in a daemon thread; returns the server. Raises
    RuntimeError when prometheus-client is missing, OSError when the address is taken."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise RuntimeError("--metrics-addr needs prometheus-client in cachefs's environment: "
                           "pip install prometheus-client") from None
    host, port = parse_metrics_addr(addr)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(stats))  # type: ignore[arg-type]
    try:
        server, _thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise OSError(exc.errno, f"cannot serve metrics on {host}:{port}: {exc.strerror}") from None
    return server
