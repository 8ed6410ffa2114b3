"""The Prometheus collector over a stats snapshot, parsed with prometheus-client's own parser."""

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from cachefs.metrics import StatsCollector, parse_metrics_addr
from cachefs.stats import Stats


def scrape(stats):
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(stats))
    text = generate_latest(registry).decode()
    return {f.name: f for f in text_string_to_metric_families(text)}, text


def sample(families, name, **labels):
    for family in families.values():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    raise KeyError((name, labels))


def test_counters_gauges_labels_and_histograms():
    s = Stats()
    s.add_many({"ram.hits": 7, "ram.misses": 3, "source.bytes": 12345, "source.read_range": 4, "source.stat": 2,
                "fuse.read": 9, "fuse.read_us": 1_500_000, "disk.checksum_failures": 1})
    s.gauge("ram.used_bytes", lambda: 4096)
    s.set_info(version="0.1.0", source="/nfs/x", mountpoint="/mnt/x")
    for d in (0.001, 0.001, 0.004, 0.3):
        s.observe("source.read_range", d)
    families, text = scrape(s)
    assert sample(families, "cachefs_ram_hits_total") == 7
    assert sample(families, "cachefs_source_bytes_total") == 12345
    assert sample(families, "cachefs_disk_checksum_failures_total") == 1
    assert families["cachefs_ram_used_bytes"].type == "gauge"
    assert sample(families, "cachefs_ram_used_bytes") == 4096
    assert sample(families, "cachefs_source_requests_total", op="read_range") == 4
    assert sample(families, "cachefs_source_requests_total", op="stat") == 2
    assert sample(families, "cachefs_fuse_requests_total", op="read") == 9
    assert sample(families, "cachefs_fuse_request_seconds_total", op="read") == 1.5
    assert sample(families, "cachefs_info", mountpoint="/mnt/x", source="/nfs/x") == 1
    h = families["cachefs_source_request_duration_seconds"]
    assert h.type == "histogram"
    assert sample(families, "cachefs_source_request_duration_seconds_count", op="read_range") == 4
    assert sample(families, "cachefs_source_request_duration_seconds_bucket", op="read_range", le="0.002") == 2
    assert sample(families, "cachefs_source_request_duration_seconds_bucket", op="read_range", le="+Inf") == 4
    assert "cachefs_uptime_seconds" in text


def test_shared_tier_servers_are_labelled():
    s = Stats()
    s.add_many({"shared.hits": 5})
    s.gauge("shared.servers", lambda: [{"server": "10.0.0.1:11211", "up": True, "hits": 4},
                                       {"server": "10.0.0.2:11211", "up": False, "hits": 1}])
    families, _ = scrape(s)
    assert sample(families, "cachefs_shared_hits_total") == 5
    assert sample(families, "cachefs_shared_server_up", server="10.0.0.1:11211") == 1
    assert sample(families, "cachefs_shared_server_up", server="10.0.0.2:11211") == 0
    assert sample(families, "cachefs_shared_server_hits_total", server="10.0.0.1:11211") == 4


@pytest.mark.parametrize("text, expected", [
    ("9100", ("127.0.0.1", 9100)), (":9100", ("127.0.0.1", 9100)),
    ("0.0.0.0:9100", ("0.0.0.0", 9100)), ("[::1]:9200", ("::1", 9200)),
])
def test_metrics_addr_defaults_to_loopback(text, expected):
    assert parse_metrics_addr(text) == expected


@pytest.mark.parametrize("bad", ["", "host:", "host:http", "localhost:0", "x:70000", "-1"])
def test_bad_metrics_addr_is_refused(bad):
    with pytest.raises(ValueError):
        parse_metrics_addr(bad)


def test_the_tiers_counters_also_carry_the_tier_as_a_label():
    s = Stats()
    s.add_many({"ram.hits": 7, "disk.hits": 2, "shared.hits": 1, "disk.misses": 5,
                "ram.served_bytes": 700, "source.served_bytes": 30})
    families, _ = scrape(s)
    assert sample(families, "cachefs_tier_hits_total", tier="ram") == 7
    assert sample(families, "cachefs_tier_hits_total", tier="disk") == 2
    assert sample(families, "cachefs_tier_hits_total", tier="shared") == 1
    assert sample(families, "cachefs_tier_misses_total", tier="disk") == 5
    assert sample(families, "cachefs_tier_served_bytes_total", tier="source") == 30
    assert sample(families, "cachefs_ram_hits_total") == 7  # the per-section name stays
