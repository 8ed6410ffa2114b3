"""Listings: names and types without a stat per entry, every attribute for a directory's
check after a restart, and the directories a walk lists next listed ahead, once each."""

from __future__ import annotations

import os
import shutil
import stat
import threading
import time

from cachefs.config import LIST_AHEAD
from cachefs.identity import Attr, DirEntry, Listing, dirents
from cachefs.listahead import ATTRS_AHEAD_AFTER
from cachefs.listings import ListingStore
from cachefs.memsource import MemorySource
from cachefs.source import LocalSource
from cachefs.stats import Stats
from cachefs.tiers.disk import DiskTier
from tests.helpers import make_core, wait_listed


def _wait(predicate, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_local_listing_with_attributes_brings_every_one(tmp_path):
    root = tmp_path / "src"
    (root / "d").mkdir(parents=True)
    for i in range(2_000):
        (root / "d" / f"f{i}").write_bytes(b"x" * (i % 5))
    entries = LocalSource(str(root)).listdir("/d", attrs=True)
    assert len(entries) == 2_000 and all(e.attr is not None for e in entries)
    assert {e.name: e.attr.size for e in entries} == {f"f{i}": i % 5 for i in range(2_000)}
    plain = LocalSource(str(root)).listdir("/d")  # names and types only
    assert all(e.attr is None and e.type_mode == stat.S_IFREG for e in plain) and len(plain) == 2_000


def test_a_listing_asks_the_source_for_no_attribute_and_lookups_ask_on_demand():
    source = MemorySource()
    for i in range(100):
        source.add_file(f"/d/f{i:03d}", bytes(i))
    core = make_core(source)
    entries = core.readdir("/d")
    assert len(entries) == 100 and source.calls["stat"] == 0 and source.calls["listdir"] == 1
    assert core.known_attr("/d/f050") is None
    assert core.getattr("/d/f077").size == 77 and source.calls["stat"] == 1   # on demand
    core.close()


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
    shutil.rmtree(tmp_path / "listings")   # no listing kept (see the next test)
    source.add_file("/d/f7", b"changed")   # changed while the daemon was down
    changed = []
    core = make_core(source, disk=DiskTier(str(tmp_path), 10 << 20, Stats(), scrub=False))
    core.hooks.on_source_changed = changed.append
    assert core.getattr("/d/f7").size == 107   # answered from the index ...
    core.readdir("/d")                          # ... and the listing's check finds the change
    assert changed == ["/d/f7"] and core.stats.get("metadata.index_stale") == 1
    core.close()


def test_a_listing_while_the_background_checks_its_directory_returns_after_the_check(tmp_path):
    """A lookup answered from the index has its directory checked in the background; a
    listing meanwhile must not return before that check has invalidated what changed."""
    source = MemorySource()
    for i in range(5):
        source.add_file(f"/d/f{i}", bytes([i]) * 100)
    core = make_core(source, disk=DiskTier(str(tmp_path), 10 << 20, Stats(), scrub=False))
    for i in range(5):
        assert core.read(f"/d/f{i}", 0, 100) == bytes([i]) * 100
    core.close()
    shutil.rmtree(tmp_path / "listings")
    source.add_file("/d/f3", b"changed")
    core = make_core(source, disk=DiskTier(str(tmp_path), 10 << 20, Stats(), scrub=False))
    changed: list[str] = []
    core.hooks.on_source_changed = changed.append
    comparing, go_on = threading.Event(), threading.Event()
    compare = core.metadata._compare

    def held(*args):
        comparing.set()
        go_on.wait(10)
        compare(*args)

    core.metadata._compare = held
    assert core.getattr("/d/f3").size == 100   # from the index: its directory checked behind
    assert comparing.wait(10)
    seen: list[list[str]] = []
    lister = threading.Thread(target=lambda: (core.readdir("/d"), seen.append(list(changed))))
    lister.start()
    lister.join(0.5)
    go_on.set()
    lister.join(10)
    assert seen == [["/d/f3"]]
    core.close()


def test_a_restarted_walk_within_the_ttl_asks_the_source_nothing(tmp_path):
    source = MemorySource()
    for c in range(3):
        for i in range(10):
            source.add_file(f"/t/c{c}/f{i}", bytes([i]) * (10 + i))
    core = make_core(source, disk=DiskTier(str(tmp_path), 10 << 20, Stats(), scrub=False))
    for c in range(3):
        assert [e.name for e in core.readdir(f"/t/c{c}")] == [f"f{i}" for i in range(10)]
        assert core.read(f"/t/c{c}/f3", 0, 13) == bytes([3]) * 13
    core.readdir("/t")
    wait_listed(core)
    core.metadata._listings.flush()
    core.close()
    source2 = MemorySource()   # the same tree, asked by the second core alone (the first's
    source2._nodes = source._nodes   # threads may still finish what they were doing)
    source = source2
    calls = dict(source.calls)
    listed = _recording(source)
    core = make_core(source, disk=DiskTier(str(tmp_path), 10 << 20, Stats(), scrub=False))
    walked = {c: [e.name for e in core.readdir(f"/t/c{c}")] for c in range(3)}
    assert walked == {c: [f"f{i}" for i in range(10)] for c in range(3)}
    assert [e.name for e in core.readdir("/t")] == ["c0", "c1", "c2"]
    assert core.getattr("/t/c1/f3").size == 13   # from the NVMe index
    wait_listed(core)
    core.metadata.stop_checking()
    assert listed == [] and dict(source.calls) == calls   # nothing asked of the source
    assert core.stats.get("metadata.listings_kept") == 4
    # a kept listing older than --metadata-ttl is not used: listed (and checked) again
    old = core.readdir("/t/c2")
    core.metadata.invalidate("/t/c2")   # forgotten, the kept copy too...
    assert core.metadata._listings.load("/t/c2") is None
    core.metadata._listings.save("/t/c2", old, time.time() - 2 * core.metadata.metadata_ttl)   # ...and an old one
    core.metadata._listings.flush()
    assert [e.name for e in core.readdir("/t/c2")] == [f"f{i}" for i in range(10)]
    assert listed == ["/t/c2"]
    core.close()


def _recording(source: MemorySource) -> list[str]:
    """The paths `source` is asked to list, in order."""
    listed: list[str] = []
    plain = source.listdir

    def listdir(path, attrs=False):
        listed.append(path)
        return plain(path, attrs)
    source.listdir = listdir
    return listed


def test_a_walk_s_next_directories_are_stat_ed_and_listed_ahead_in_name_order():
    source = MemorySource()
    for c in reversed(range(100)):  # made in reverse: the window follows names, not the source's order
        source.add_file(f"/root/c{c:03d}/x.jpg", b"x")
    source.add_file("/root/readme", b"hi")
    listed = _recording(source)
    core = make_core(source)
    core.readdir("/root")
    wait_listed(core)
    ahead = [f"/root/c{c:03d}" for c in range(LIST_AHEAD)]
    # the first LIST_AHEAD in name order, each once (started in that order, by several
    # threads: which of two calls the source first is the scheduler's)
    assert listed[0] == "/root" and sorted(listed[1:]) == ahead and len(listed) == 1 + LIST_AHEAD
    assert all(core.known_attr(d) is not None for d in ahead)   # and their attributes (a walk looks them up)
    assert core.known_attr("/root/readme") is None and source.calls["stat"] == LIST_AHEAD   # files: on demand
    core.readdir("/root/c010")   # a reader at the 11th: the window moves to the 43rd
    wait_listed(core)
    assert sorted(listed[1 + LIST_AHEAD:]) == [f"/root/c{c:03d}" for c in range(LIST_AHEAD, 11 + LIST_AHEAD)]
    core.close()


def test_a_reader_waits_for_a_listing_in_flight_instead_of_asking_again():
    source = MemorySource()
    for c in range(3):
        source.add_file(f"/root/c{c}/x.jpg", b"x")
    listed = _recording(source)
    core = make_core(source)
    source.hang("/root/c0")   # the store stops answering for c0: its listing ahead waits
    core.readdir("/root")
    got = []
    reader = threading.Thread(target=lambda: got.append(core.readdir("/root/c0")))
    reader.start()
    time.sleep(0.2)
    assert reader.is_alive() and not got   # waiting for the listing ahead, not asking itself
    source.release()
    reader.join(10)
    assert [e.name for e in got[0]] == ["x.jpg"]
    wait_listed(core)
    assert sorted(listed) == ["/root", "/root/c0", "/root/c1", "/root/c2"]   # c0 once
    core.close()


def test_a_lookup_brings_its_directory_s_attributes_and_lookups_in_a_row_listings_with_them():
    source = MemorySource()
    for d in ("a", "b"):
        for i in range(20):
            source.add_file(f"/t/{d}/f{i:02d}", bytes(i))
    listed = _recording(source)
    core = make_core(source)
    core.readdir("/t")
    core.readdir("/t/a")
    wait_listed(core)
    assert not core.metadata.listing_attrs_wanted()
    for c in ("/t/a", "/t/b"):   # a walk looks directories up: no pattern
        core.getattr(c)
    assert not core.metadata.listing_attrs_wanted()
    stats_before = source.calls["stat"]
    assert core.getattr("/t/a/f00").size == 0   # the first file looked up: a stat...
    wait_listed(core)
    assert listed[-1] == "/t/a" and source.calls["stat"] - stats_before == 1   # ...and the directory's
    assert all(core.known_attr(f"/t/a/f{i:02d}").size == i for i in range(20))   # attributes with it
    assert not core.metadata.listing_attrs_wanted()
    core.getattr("/t/a/f00")   # the same file again (an open) is not a second one
    for i in range(1, ATTRS_AHEAD_AFTER):   # `ls -l`: different files, one after another
        assert core.getattr(f"/t/a/f{i:02d}").size == i
    assert core.metadata.listing_attrs_wanted() and source.calls["stat"] - stats_before == 1
    # the next listing brings its entries' attributes, though /t/b was listed ahead without
    entries = core.readdir("/t/b")
    assert all(e.attr is not None for e in entries) and listed[-1] == "/t/b"
    assert core.known_attr("/t/b/f07").size == 7
    core.close()


def test_a_listing_is_kept_packed_and_unpacks_to_what_was_listed():
    """The daemon keeps each directory a job lists, for --metadata-ttl: ImageNet's 1,000 of
    1,281 files each, held packed (~31 bytes an entry, not a ~220-byte tuple)."""
    source = MemorySource()
    names = [f"n01440764_{i}.JPEG" for i in range(1_300)] + ["a\nb", "caf\udce9", "x" * 255]
    for name in names:
        source.add_file(f"/d/{name}", b"j")
    source.add_file("/d/sub/f", b"")
    core = make_core(source)
    listed = list(core.readdir("/d"))   # from the source
    kept = core.metadata.known_listing("/d", kept=False)
    assert isinstance(kept, Listing) and len(kept) == len(names) + 1 and not kept.with_attrs
    assert list(kept) == listed and {e.name for e in kept} == set(names) | {"sub"}
    assert {e.name: e.type_mode for e in kept}["sub"] == stat.S_IFDIR and all(e.attr is None for e in kept)
    assert core.readdir("/d") is kept   # the next reader's, from memory
    # READDIR's answer: the names' bytes as kept, the same as encoding each entry's name
    assert dirents(kept) == dirents(listed) and (os.fsencode("caf\udce9"), stat.S_IFREG) in \
        [item[:2] for item in dirents(kept)]
    room = sum(11 + len(os.fsencode(n)) for n in names) + 11 + 3
    assert len(kept.packed) == room and len(kept.packed) < 40 * len(kept)   # 11 bytes an entry and its name
    for damaged, count in ((kept.packed[:-1], len(kept)), (kept.packed, len(kept) + 1),
                           (kept.packed, len(kept) - 1), (kept.packed + b"\0", len(kept))):
        assert Listing.parse(damaged, count) is None
    assert Listing.parse(kept.packed, len(kept)) == kept
    # a listing with its entries' attributes is kept as one that had them: `ls -l` does not list it again
    source.add_file("/e/f", b"12")
    core.metadata._list("/e", attrs=True)
    assert core.metadata.known_listing("/e", kept=False).with_attrs
    core.close()


def test_a_listing_is_kept_with_its_directory_s_attributes_though_the_cache_let_them_go(tmp_path):
    """The attributes cache is bounded: at 200,000 files the files' lookups had pushed most
    class directories' own attributes out before they were listed, and 154 of 200 kept
    listings had none, so every remount's walk stat'ed those directories on the source."""
    source = MemorySource()
    for d in range(3):
        source.add_file(f"/t/c{d}/f", b"x")
    core = make_core(source, disk=DiskTier(str(tmp_path), 10 << 20, Stats(), scrub=False))
    for d in range(3):
        assert core.getattr(f"/t/c{d}").is_dir
        core.metadata._attrs.pop(f"/t/c{d}")   # let go (as the bounded cache does under many files)
        assert [e.name for e in core.readdir(f"/t/c{d}")] == ["f"]
    core.metadata._listings.flush()
    assert all(core.metadata._listings.load(f"/t/c{d}").attr.is_dir for d in range(3))
    core.close()
    stats = source.calls["stat"]
    core = make_core(source, disk=DiskTier(str(tmp_path), 10 << 20, Stats(), scrub=False))
    assert all(core.getattr(f"/t/c{d}").is_dir for d in range(3))   # a restarted walk's lookups...
    assert source.calls["stat"] == stats                              # ...ask the source nothing
    core.close()


def test_kept_listings_round_trip_odd_names_refuse_damage_and_stay_in_budget(tmp_path):
    held = [0]

    def reserve(n: int) -> bool:
        if held[0] + n > 64 << 10:   # a budget of 64 KiB
            return False
        held[0] += n
        return True

    def unreserve(n: int) -> None:
        held[0] -= n

    store = ListingStore(str(tmp_path / "l"), reserve, unreserve)
    odd = ["a\nb", "caf\udce9", "x" * 255, " "]   # a newline, a name that is not UTF-8, the longest
    entries = [DirEntry(name, stat.S_IFREG, 7 + i) for i, name in enumerate(odd)] + [DirEntry("sub", stat.S_IFDIR, 99)]
    own = Attr(stat.S_IFDIR | 0o755, 3, 1000, 1000, 4096, 1, 2, 3, 8, 0, 77)
    store.save("/d\nir", entries, 1234.5, own)
    store.flush()
    assert store.load("/d\nir") == (1234.5, entries, own) and store.load("/other") is None
    assert held[0] == 2 * 4096   # the file and its directory, in 4 KiB blocks
    sub, name = store._file("/d\nir")
    with open(os.path.join(sub, name), "r+b") as f:   # a flipped byte: not used, and deleted
        f.seek(40)
        byte = f.read(1)
        f.seek(40)
        f.write(bytes([byte[0] ^ 1]))
    assert store.load("/d\nir") is None and not os.path.exists(os.path.join(sub, name)) and held[0] == 4096
    big = [DirEntry(f"{i:0100d}", stat.S_IFREG, i) for i in range(1000)]   # ~110 KB: over the budget
    store.save("/big", big)
    store.flush()
    assert store.load("/big") is None and held[0] == 4096
    store.save("/d", entries)
    store.flush()
    store.close()
    held[0] = 0   # a new start holds what the last one kept, and deletes leftovers
    open(os.path.join(sub, "junk.tmp"), "wb").close()
    os.utime(os.path.join(sub, "junk.tmp"), (time.time() - 60, time.time() - 60))   # a run cut short
    again = ListingStore(str(tmp_path / "l"), reserve, unreserve)
    open(os.path.join(sub, "writing.tmp"), "wb").close()   # this run's write, in flight
    again.adopt_existing()
    subdirs = len(os.listdir(tmp_path / "l"))   # each a 4 KiB block, beside /d's file
    assert held[0] == 4096 * (subdirs + 1) and again.load("/d")[1] == entries
    assert not os.path.exists(os.path.join(sub, "junk.tmp")) and os.path.exists(os.path.join(sub, "writing.tmp"))
    again.close()


def test_a_listing_written_as_a_start_counts_the_kept_ones_is_kept(tmp_path, monkeypatch):
    """The start's count (adopt_existing, in the background) leaves this run's writes in
    flight alone: it deleted their temporary file, the write failed and the listing went
    with it (the first directory a walk listed was listed from the source again after the
    next restart: seen under load)."""
    store = ListingStore(str(tmp_path / "l"), lambda n: True, lambda n: None)
    entries = [DirEntry("f0", stat.S_IFREG, 1)]
    written = threading.Event()
    counted = threading.Event()
    replace = os.replace

    def replace_after_the_count(src, dst):   # the write waits, its .tmp there, for the count
        written.set()
        counted.wait(10)
        return replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_after_the_count)
    store.save("/t/c0", entries)
    assert written.wait(10)
    store.adopt_existing()
    counted.set()
    store.flush()
    monkeypatch.undo()
    assert store.load("/t/c0")[1] == entries and store.has("/t/c0")
    store.close()


def test_a_kept_listing_is_found_while_a_start_counts_them(tmp_path):
    """has() asked just as adopt_existing (the start's count, in the background) ends: the
    listing is kept either way. (Seen once in a full run: the first directory a restarted
    walk listed was listed from the source again.)"""
    store = ListingStore(str(tmp_path / "l"), lambda n: True, lambda n: None)
    store.save("/t/c0", [DirEntry("f0", stat.S_IFREG, 1)])
    store.flush()
    store.close()
    again = ListingStore(str(tmp_path / "l"), lambda n: True, lambda n: None)

    class EndsAsLookedIn(dict):
        def __contains__(self, key):   # not counted yet, and the count ends right after
            found = dict.__contains__(self, key)
            again._adopted = True
            return found

    again._sizes = EndsAsLookedIn()
    assert again.has("/t/c0")
    again.close()
