import json
import threading

from cachefs.stats import SCHEMA_VERSION, Stats
from tests.conftest import FakeClock


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
    assert snap["ram"] == {"hits": 3, "misses": 1, "used_bytes": 42}
    assert snap["source"] == {"bytes": 100}
    assert snap["info"]["source"] == "/x" and "pid" in snap["info"]
    assert snap["uptime_s"] == 2.5
    assert json.loads(json.dumps(snap)) == snap


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
