import json
import threading

from cachefs.stats import COUNTERS, GAUGES, HISTOGRAMS, LATENCY_BUCKETS, SCHEMA_VERSION, Histogram, Stats
from tests.helpers import FakeClock


def test_snapshot_is_plain_nested_data():
    clock = FakeClock()
    s = Stats(clock=clock)
    s.incr("ram.hits", 3)
    s.add_many({"ram.misses": 1, "source.bytes": 100})
    s.gauge("ram.used_bytes", lambda: 42)
    s.set_info(source="/x")
    clock.advance(2.5)
    snap = s.snapshot()
    assert snap["schema"] == SCHEMA_VERSION
    assert snap["ram"]["hits"] == 3 and snap["ram"]["misses"] == 1 and snap["ram"]["used_bytes"] == 42
    assert snap["source"]["bytes"] == 100
    assert snap["info"]["source"] == "/x" and "pid" in snap["info"]
    assert snap["uptime_s"] == 2.5
    assert json.loads(json.dumps(snap)) == snap


def test_every_counter_gauge_and_histogram_is_present_from_the_start():
    """Scripts index the snapshot (d["disk"]["misses"]): a key must not appear only once
    its counter has moved, nor be missing because the mount runs without that part."""
    snap = Stats().snapshot()
    for name in COUNTERS + GAUGES:
        section, _, key = name.partition(".")
        assert snap[section][key] == ([] if name == "shared.servers" else 0), name
    for name in HISTOGRAMS:
        assert snap["latency"][name]["count"] == 0 and snap["latency"][name]["p99_s"] is None


def test_a_failing_gauge_does_not_break_stats():
    s = Stats()
    s.gauge("disk.used_bytes", lambda: 1 / 0)
    assert s.snapshot()["disk"]["used_bytes"] is None


def test_no_increment_is_lost_across_threads():
    s = Stats()

    def work():
        for _ in range(10_000):
            s.incr("x.n")

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert s.get("x.n") == 80_000


def test_latency_histogram_counts_every_observation_and_estimates_quantiles():
    s = Stats()
    for _ in range(98):
        s.observe("source.read_range", 0.003)   # in the (2 ms, 5 ms] bucket
    s.observe("source.read_range", 0.4)         # (0.2 s, 0.5 s]
    s.observe("source.read_range", 60.0)        # beyond the last bound
    h = s.snapshot()["latency"]["source.read_range"]
    assert h["count"] == 100 and sum(h["buckets"]) == 100
    assert len(h["buckets"]) == len(LATENCY_BUCKETS) + 1 and h["buckets"][-1] == 1
    assert h["sum_s"] == round(98 * 0.003 + 0.4 + 60.0, 6)
    assert 0.002 < h["p50_s"] <= 0.005
    assert 0.2 < h["p99_s"] <= 0.5


def test_quantiles_of_an_empty_histogram_are_none_and_the_snapshot_stays_json():
    h = Histogram()
    assert h.quantile(0.5) is None
    assert h.export()["p99_s"] is None
    s = Stats()
    s.observe("source.stat", 0.0001)
    snap = s.snapshot()
    assert json.loads(json.dumps(snap)) == snap


def test_quantile_interpolates_inside_the_bucket():
    h = Histogram()
    for _ in range(10):
        h.observe(0.0015)  # all in (1 ms, 2 ms]
    assert h.quantile(0.5) == 0.001 + (0.002 - 0.001) * 0.5
    assert h.quantile(1.0) == 0.002
