"""The --watch view's figures, from pairs of snapshots (no mount)."""

import io

import pytest

from cachefs.stats import Stats
from cachefs.watch import header, line, rates, watch
from tests.helpers import FakeClock


def snapshots():
    clock = FakeClock()
    s = Stats(clock=clock)
    first = s.snapshot()
    clock.advance(2.0)
    s.add_many({"reads.requests": 100, "reads.bytes": 10_000_000, "ram.hits": 60, "ram.misses": 40,
                "disk.hits": 30, "ram.served_bytes": 6_000_000, "disk.served_bytes": 3_000_000,
                "source.served_bytes": 1_000_000, "source.bytes": 2_000_000, "source.read_range": 10,
                "prefetch.blocks": 4})
    for _ in range(9):
        s.observe("source.read_range", 0.003)
    s.observe("source.read_range", 0.3)
    s.gauge("ram.used_bytes", lambda: 5 << 20)
    return first, s.snapshot()


def test_rates_of_an_interval():
    before, after = snapshots()
    r = rates(before, after)
    assert r["interval_s"] == 2.0
    assert r["reads_per_s"] == 50 and r["read_mb_s"] == 5.0
    assert (r["ram_mb_s"], r["disk_mb_s"], r["source_mb_s"]) == (3.0, 1.5, 1.0)
    assert r["hit_rate"] == (60 + 30) / 100     # block lookups served by RAM or NVMe
    assert r["source_req_per_s"] == 5 and r["prefetch_per_s"] == 2
    assert 0.2 < r["source_p99_s"] <= 0.5         # the slow request, within its bucket
    assert r["ram_used_bytes"] == 5 << 20


def test_files_the_kernel_reads_itself_count_under_passthrough():
    """With passthrough the daemon sees an open per file and no read: reads/s and MB/s once
    showed 0 during a DataLoader run while "ram MB/s" showed 18."""
    clock = FakeClock()
    s = Stats(clock=clock)
    first = s.snapshot()
    clock.advance(1.0)
    s.add_many({"opens.passthrough": 200, "ram.served_bytes": 18_000_000})
    r = rates(first, s.snapshot())
    assert r["reads_per_s"] == 200 and r["read_mb_s"] == 18.0


def test_an_idle_interval_has_no_hit_rate_and_a_restart_counts_from_zero():
    before, after = snapshots()
    idle = rates(after, after)
    assert idle["hit_rate"] is None and idle["source_p99_s"] is None and idle["reads_per_s"] == 0
    assert "-" in line(idle)
    restarted = rates(after, dict(before, uptime_s=after["uptime_s"] + 1))  # counters went back
    assert restarted["reads_per_s"] >= 0


def test_rows_line_up_with_the_header():
    before, after = snapshots()
    assert len(line(rates(before, after))) == len(header())


def test_watch_prints_lines_when_piped_and_redraws_on_a_terminal():
    before, after = snapshots()
    feed = iter([before, after, after, after])
    out = io.StringIO()
    assert watch(lambda: next(feed), 1.0, out=out, tty=False, sleep=lambda s: None, count=3) == 3
    lines = out.getvalue().splitlines()
    assert lines[0] == header() and len(lines) == 4 and "90.0%" in lines[1]
    feed = iter([before, after, after])
    out = io.StringIO()
    watch(lambda: next(feed), 1.0, out=out, tty=True, sleep=lambda s: None, count=2, title="cachefs /mnt/x")
    assert out.getvalue().count("\x1b[H\x1b[J") == 2 and "cachefs /mnt/x" in out.getvalue()


def test_watch_stops_on_ctrl_c_and_when_reading_fails():
    before, _ = snapshots()

    def interrupted(_):
        raise KeyboardInterrupt

    assert watch(lambda: before, 1.0, out=io.StringIO(), tty=False, sleep=interrupted) == 0

    class Gone(Exception):
        pass

    reads = iter([before])

    def read():
        try:
            return next(reads)
        except StopIteration:
            raise Gone from None

    with pytest.raises(Gone):   # the caller (the CLI) reports the mount went away
        watch(read, 1.0, out=io.StringIO(), tty=False, sleep=lambda s: None)
