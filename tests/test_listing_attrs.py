"""A listing that brought its entries' attributes keeps them packed with it (Listing), and
answers its files' lookups for its TTL: no `Attr` per path in the attributes cache, no
stat on the source, the source's attributes recorded with a file the tier stores."""

from __future__ import annotations

import stat

import pytest

from cachefs.identity import Attr, DirEntry, Listing
from cachefs.memsource import MemorySource
from cachefs.stats import Stats
from cachefs.tiers.disk import DiskTier
from tests.helpers import make_core, wait_listed


def _attr(i: int, **kw) -> Attr:
    base = dict(mode=stat.S_IFREG | 0o640, nlink=1, uid=1000 + i, gid=2000, size=i * 7, atime_ns=-5 * i,
                mtime_ns=10**18 + i, ctime_ns=10**18 + 2 * i, blocks=i, rdev=0, ino=2**63 + i)
    base.update(kw)
    return Attr(**base)


NAMES = ["a", "b", "ab", "\udcff-not-utf8", "x" * 255, "sp ace", "é"]


def test_a_listing_keeps_every_entrys_attributes_and_finds_each_by_its_whole_name():
    entries = [DirEntry(n, stat.S_IFREG, i, _attr(i)) for i, n in enumerate(NAMES)]
    entries.append(DirEntry("sub", stat.S_IFDIR, 99, _attr(99, mode=stat.S_IFDIR | 0o755)))
    entries.append(DirEntry("nostat", stat.S_IFREG, 100, None))  # (its stat failed)
    listing = Listing.of(entries, keep_attrs=True)
    assert listing.has_attrs and listing.with_attrs and len(listing) == len(entries)
    for e in entries:
        assert listing.attr_of(e.name) == e.attr
    for absent in ("", "c", "a\0b", "a/b", "abc", "x" * 254, "/a"):  # a part of a name is none
        assert listing.attr_of(absent) is None
    assert list(listing) == [e._replace(attr=None) for e in entries]  # the entries as before
    listing.forget("ab")
    assert listing.attr_of("ab") is None and listing.attr_of("a") == entries[0].attr
    assert listing.attr_of("b") == entries[1].attr


def test_a_listing_lets_its_attributes_go_once_none_of_its_entries_answers():
    entries = [DirEntry(n, stat.S_IFREG, i, _attr(i)) for i, n in enumerate(["a", "b", "c"])]
    entries.append(DirEntry("nostat", stat.S_IFREG, 9, None))  # (none kept: not counted)
    listing = Listing.of(entries, keep_attrs=True)
    for name in ("a", "a", "zz", "nostat", "b"):  # twice, not an entry, none kept: not counted again
        listing.forget(name)
    assert listing.has_attrs and listing.attr_of("c") == entries[2].attr
    listing.forget("c")
    assert not listing.has_attrs and listing.with_attrs and listing.attr_of("c") is None
    assert list(listing) == [e._replace(attr=None) for e in entries]  # its names stay
    listing.forget("c")
    with_dir = Listing.of([entries[0], DirEntry("sub", stat.S_IFDIR, 5, _attr(5, mode=stat.S_IFDIR | 0o755))],
                          keep_attrs=True)
    with_dir.forget("a")  # a directory's attributes still answer (the index holds files only)
    assert with_dir.has_attrs and with_dir.attr_of("sub").is_dir


@pytest.mark.parametrize("count", [1, 1_300, 20_000])
def test_every_entry_of_a_big_directory_is_found_by_its_name_and_no_other(count):
    names = [f"n01440764_{i:07d}.JPEG" for i in range(count)]
    listing = Listing.of((DirEntry(n, stat.S_IFREG, i, _attr(i)) for i, n in enumerate(names)), keep_attrs=True)
    assert all(listing.attr_of(n) == _attr(i) for i, n in enumerate(names))
    for absent in ("n01440764_", names[-1] + "x", names[-1][:-1], "x" + names[0], f"n01440764_{count:07d}.JPEG"):
        assert listing.attr_of(absent) is None


@pytest.mark.parametrize("odd", [{"version": "etag-1"}, {"nlink": 2**40}])
def test_attributes_that_do_not_pack_are_not_kept_with_the_listing(odd):
    entries = [DirEntry("f", stat.S_IFREG, 1, _attr(1, **odd)), DirEntry("g", stat.S_IFREG, 2, _attr(2))]
    listing = Listing.of(entries, keep_attrs=True)
    assert not listing.has_attrs and listing.with_attrs and listing.attr_of("g") is None
    assert not Listing.of(entries).has_attrs  # (and none unless asked)


def _core(tmp_path, **kw):
    source = MemorySource()
    for i in range(50):
        source.add_file(f"/d/f{i:02d}", bytes([i]) * (100 + i))
    disk = DiskTier(str(tmp_path / "cache"), 16 << 20, Stats(), scrub=False)
    return source, make_core(source, disk=disk, block_size=4096, **kw)


def test_a_listing_with_attributes_answers_its_files_lookups_without_a_copy_per_file(tmp_path):
    source, core = _core(tmp_path)
    assert core.getattr("/d/f00").size == 100     # a stat, and its directory listed with attributes
    wait_listed(core)
    assert core.metadata.known_listing("/d", kept=False).has_attrs
    expected = {f"/d/f{i:02d}": source.stat(f"/d/f{i:02d}") for i in range(50)}
    stats = source.calls["stat"]
    for path, attr in expected.items():
        assert core.getattr(path) == attr
    assert source.calls["stat"] == stats          # no lookup asked the source
    assert not any(p.startswith("/d/") for p in core.metadata._attrs._data)  # the listing holds them all
    attr, expiry = core.metadata.attr_expiry("/d/f07")
    assert attr.size == 107 and expiry > core.metadata._clock()
    core.close()


def test_a_file_stored_from_a_listing_records_the_sources_attributes(tmp_path):
    """What the tier records with a file (its lookups' answers after a restart) is the
    source's mode and owner as the listing brought them, not made up."""
    source, core = _core(tmp_path)
    core.getattr("/d/f00")
    wait_listed(core)
    assert core.read("/d/f09", 0, 1000) == bytes([9]) * 109
    recorded = core.cache.indexed_attr("/d/f09")
    assert recorded is not None and recorded[0] == source.stat("/d/f09")
    core.close()


def test_a_change_found_on_the_source_is_not_answered_from_the_listing(tmp_path):
    source, core = _core(tmp_path)
    core.getattr("/d/f00")
    wait_listed(core)
    source.add_file("/d/f05", b"rewritten")
    core.metadata.invalidate("/d/f05")            # (as a change the daemon found)
    stats = source.calls["stat"]
    assert core.getattr("/d/f05").size == len(b"rewritten") and source.calls["stat"] == stats + 1
    assert core.getattr("/d/f06").size == 106     # the rest still answered from the listing
    assert source.calls["stat"] == stats + 1
    core.close()


def test_under_allow_other_a_listings_attributes_are_cut_down_per_file_not_kept_packed(tmp_path):
    source, core = _core(tmp_path, check_acls=True)
    core.getattr("/d/f00")
    wait_listed(core)
    listing = core.metadata.known_listing("/d", kept=False)
    assert listing.with_attrs and not listing.has_attrs
    stats = source.calls["stat"]
    assert core.getattr("/d/f03").size == 103 and source.calls["stat"] == stats
    core.close()


def test_a_directory_whose_files_are_all_stored_keeps_no_attributes_with_its_listing(tmp_path):
    """Once the NVMe tier stores a file its lookups are the index's: the listing's copy of
    its attributes goes, and once every file's has, the listing keeps none (90 of its ~123
    bytes an entry, for its TTL). Lookups still ask the source nothing; a file the tier
    then lets go of is asked for (one stat), not made up."""
    source, core = _core(tmp_path)
    core.getattr("/d/f00")
    wait_listed(core)
    listing = core.metadata.known_listing("/d", kept=False)
    assert listing.has_attrs
    for i in range(49):
        assert core.prefetch_small(f"/d/f{i:02d}")[0] == "fetched"
    assert listing.has_attrs and listing.attr_of("f49") == source.stat("/d/f49")
    assert listing.attr_of("f10") is None  # (the index's now)
    assert core.prefetch_small("/d/f49")[0] == "fetched"
    assert not listing.has_attrs
    expected = {f"/d/f{i:02d}": source.stat(f"/d/f{i:02d}") for i in range(50)}
    stats = source.calls["stat"]
    for path, attr in expected.items():
        assert core.getattr(path) == attr
    assert source.calls["stat"] == stats
    assert core.metadata.entry_info(core.metadata.file_id("/d/f07")).attr == expected["/d/f07"]
    core.metadata.invalidate("/d/f07")  # (as a change found: neither the index nor the listing answers)
    assert core.getattr("/d/f07") == expected["/d/f07"] and source.calls["stat"] == stats + 1
    core.close()


def test_a_listing_of_files_already_stored_keeps_none_of_their_attributes(tmp_path):
    source, core = _core(tmp_path)
    core.getattr("/d/f00")
    wait_listed(core)
    for i in range(50):
        core.prefetch_small(f"/d/f{i:02d}")
    core.metadata._dirs.pop("/d")  # (its TTL over: listed again, with attributes)
    core.metadata._list("/d", attrs=True)
    listing = core.metadata.known_listing("/d", kept=False)
    assert listing.with_attrs and not listing.has_attrs
    expected = source.stat("/d/f03")
    stats = source.calls["stat"]
    assert core.getattr("/d/f03") == expected and source.calls["stat"] == stats
    core.close()
