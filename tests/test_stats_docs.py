"""docs/stats.md documents every key a snapshot holds, as what it is (counter or gauge),
and nothing that does not exist. The mounted twin, tests/fuse/test_stats_docs.py, holds
the documentation to a live daemon's snapshot."""

import re
from pathlib import Path

from cachefs.stats import COUNTERS, GAUGES, HISTOGRAMS, Stats

DOC = Path(__file__).resolve().parent.parent / "docs" / "stats.md"
ROW = re.compile(r"^\| `([a-z_.]+)` \|(?: (counter|gauge) \|)?")


def documented() -> dict[str, str | None]:
    """key -> kind ("counter", "gauge", or None where the table has no kind column)."""
    keys: dict[str, str | None] = {}
    for line in DOC.read_text().splitlines():
        m = ROW.match(line)
        if m:
            assert m.group(1) not in keys, f"{m.group(1)} is documented twice"
            keys[m.group(1)] = m.group(2)
    return keys


def snapshot_keys(snap: dict) -> set[str]:
    """Every key of a snapshot, as docs/stats.md names them (section.key, info.x, latency.source.op)."""
    keys = set()
    for top, value in snap.items():
        keys.add(top) if not isinstance(value, dict) or top in ("info", "latency") else None
        if isinstance(value, dict):
            keys |= {f"{top}.{k}" for k in value}
    return keys


def test_every_counter_and_gauge_is_documented_as_what_it_is():
    docs = documented()
    for name in COUNTERS:
        assert docs.get(name) == "counter", f"{name}: documented as {docs.get(name)!r}, is a counter"
    for name in GAUGES:
        assert docs.get(name) == "gauge", f"{name}: documented as {docs.get(name)!r}, is a gauge"
    for name in HISTOGRAMS:
        assert f"latency.{name}" in docs


def test_nothing_documented_is_missing_from_a_snapshot():
    snap = Stats().snapshot()
    known = snapshot_keys(snap) | {"info"}
    documented_stats = {k for k in documented() if not k.startswith("info.")}
    assert documented_stats - known == set()
    assert known - set(documented()) == set()
