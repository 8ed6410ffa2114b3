"""Listings over a source whose stats are round trips: the attributes a listing does not
bring cheaply are fetched in parallel, in the background, and never hold the listing."""

from __future__ import annotations

import stat
import time

from cachefs import source as source_mod
from cachefs.memsource import MemorySource
from cachefs.source import LocalSource
from cachefs.stats import Stats
from cachefs.tiers.disk import DiskTier
from tests.helpers import make_core


def _wait(predicate, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_local_listing_brings_every_attribute_while_stats_are_cheap(tmp_path):
    root = tmp_path / "src"
    (root / "d").mkdir(parents=True)
    for i in range(2_000):
        (root / "d" / f"f{i}").write_bytes(b"x" * (i % 5))
    entries = LocalSource(str(root)).listdir("/d", attrs=True)
    assert len(entries) == 2_000 and all(e.attr is not None for e in entries)
    assert {e.name: e.attr.size for e in entries} == {f"f{i}": i % 5 for i in range(2_000)}


def test_a_listing_stops_stat_ing_in_series_once_each_stat_is_a_round_trip(tmp_path, monkeypatch):
    root = tmp_path / "src"
    root.mkdir()
    for i in range(50):
        (root / f"f{i}").write_bytes(b"")
    clock = [0.0]

    def slow_clock() -> float:  # every reading 1 ms after the one before: a 1 ms stat
        clock[0] += 0.001
        return clock[0]

    monkeypatch.setattr(source_mod.time, "perf_counter", slow_clock)
    entries = LocalSource(str(root)).listdir("/", attrs=True)
    with_attrs = [e for e in entries if e.attr is not None]
    assert len(entries) == 50 and len(with_attrs) == 3   # past 2 ms of stats, no more
    assert all(e.type_mode == stat.S_IFREG for e in entries)   # d_type still comes with each


def test_a_listing_over_slow_stats_holds_none_and_lookups_ask_on_demand():
    source = MemorySource()
    for i in range(100):
        source.add_file(f"/d/f{i:03d}", bytes(i))
    source.listing_attrs = 3
    core = make_core(source)
    source.hang(*(f"/d/f{i:03d}" for i in range(3, 100)))   # a stat of any of the rest would hang
    try:
        entries = core.readdir("/d")
        assert len(entries) == 100 and source.calls["stat"] == 0
        assert core.known_attr("/d/f002").size == 2 and core.known_attr("/d/f050") is None
    finally:
        source.release()
    assert core.getattr("/d/f077").size == 77 and source.calls["stat"] == 1   # on demand
    core.close()


def test_after_stats_were_slow_listings_bring_none_but_a_probe_a_second(tmp_path, monkeypatch):
    root = tmp_path / "src"
    root.mkdir()
    for i in range(50):
        (root / f"f{i}").write_bytes(b"")
    src = LocalSource(str(root))
    clock = [0.0]
    step = [0.002]   # a stat: 2 ms
    now = [100.0]

    def clock_fn() -> float:
        clock[0] += step[0]
        return clock[0]

    monkeypatch.setattr(source_mod.time, "perf_counter", clock_fn)
    monkeypatch.setattr(source_mod.time, "monotonic", lambda: now[0])

    def with_attrs() -> int:
        return sum(e.attr is not None for e in src.listdir("/", attrs=True))

    assert with_attrs() == 2       # past 2 ms of stats: slow
    assert with_attrs() == 0       # within the second: none
    now[0] += 1.5
    assert with_attrs() == 1       # a probe: still slow
    step[0] = 10e-6                # the store became fast
    assert with_attrs() == 0
    now[0] += 1.5
    assert with_attrs() == 50      # the probe finds it cheap: all of them again


def test_after_a_restart_the_check_of_a_directory_fetches_every_missing_attribute(tmp_path):
    source = MemorySource()
    files = {f"/d/f{i}": bytes([i]) * (100 + i) for i in range(30)}
    for name, data in files.items():
        source.add_file(name, data)
    first = DiskTier(str(tmp_path), 10 << 20, Stats(), scrub=False)
    core = make_core(source, disk=first)
    for name, data in files.items():
        assert core.read(name, 0, len(data)) == data
    core.close()
    source.add_file("/d/f7", b"changed")   # changed while the daemon was down
    source.listing_attrs = 2
    changed = []
    core = make_core(source, disk=DiskTier(str(tmp_path), 10 << 20, Stats(), scrub=False))
    core.hooks.on_source_changed = changed.append
    assert core.getattr("/d/f7").size == 107   # answered from the index ...
    core.readdir("/d")                          # ... and the listing's check finds the change
    assert changed == ["/d/f7"] and core.stats.get("metadata.index_stale") == 1
    core.close()


def test_subdirectories_listed_without_attributes_are_stat_ed_ahead():
    source = MemorySource()
    for c in range(12):
        source.add_file(f"/root/c{c:02d}/x.jpg", b"x")
    source.add_file("/root/readme", b"hi")
    source.listing_attrs = 0
    core = make_core(source)
    core.readdir("/root")
    deadline = time.monotonic() + 10
    while any(core.known_attr(f"/root/c{c:02d}") is None for c in range(12)):
        assert time.monotonic() < deadline, "the subdirectories were never stat'ed"
        time.sleep(0.01)
    assert core.known_attr("/root/readme") is None   # files wait for their own lookup
    assert source.calls["stat"] == 12
    core.close()
