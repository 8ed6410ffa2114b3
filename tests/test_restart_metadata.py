"""After a restart, the NVMe tier's index answers lookups with the attributes each file was
cached under, and each directory is checked once, by one listing with attributes: a
restarted job costs the source a request per directory, not one per file (none where its
listing was kept on the cache disk within the TTL: test_listings_core.py)."""

import errno
import shutil
import threading
import time

import pytest

from cachefs.memsource import MemorySource
from cachefs.prefetch import Prefetcher
from cachefs.stats import Stats
from cachefs.tiers.disk import DiskTier
from tests.helpers import make_core, run_until_idle
from tests.test_tiers import no_margin  # noqa: F401  (a fixture)

BS = 64 << 10


def _restarted(tmp_path, source: MemorySource, files: dict[str, bytes], checked: bool = False, **kw):
    for name, data in files.items():
        source.add_file(name, data)
    first = DiskTier(str(tmp_path), 10 << 20, Stats(), scrub=False)
    core = make_core(source, disk=first, block_size=BS)
    for name, data in files.items():
        assert core.read(name, 0, len(data)) == data
    if checked:
        time.sleep(0.05)  # older than the clean stop by its margin (the no_margin fixture's)
    core.close()
    # Without the listings the first run kept (within the TTL they are trusted and nothing is
    # checked: see test_listings_core.py): as after a TTL, or a cache from before them.
    shutil.rmtree(tmp_path / "listings")
    if not checked:
        return make_core(source, disk=DiskTier(str(tmp_path), 10 << 20, Stats(), scrub=False), block_size=BS, **kw)
    # `checked`: the restart check's pass run (no scrub after it), every file trusted at one stat
    stats = Stats()
    core = make_core(source, disk=DiskTier(str(tmp_path), 10 << 20, stats, scrub_every=0), block_size=BS,
                     stats=stats, **kw)
    deadline = time.monotonic() + 10
    while stats.get("disk.trusted_files") < len(files):
        assert time.monotonic() < deadline, "the restart check never trusted the files"
        time.sleep(0.01)
    return core


def _checked(core, directory: str) -> None:
    """Wait until the directory's check has compared its listing with the index."""
    deadline = time.monotonic() + 10
    while directory not in core.metadata._checked_dirs or directory in core.metadata._checking:
        assert time.monotonic() < deadline, "the directory was never checked"
        time.sleep(0.01)


FILES = {f"/d/f{i}": bytes([i]) * (1000 + i) for i in range(20)}


def test_lookups_come_from_the_index_and_one_listing_checks_the_directory(tmp_path):
    source = MemorySource()
    core = _restarted(tmp_path, source, FILES)
    before = dict(source.calls)
    for name, data in FILES.items():
        assert core.getattr(name).size == len(data)
        assert core.read(name, 0, len(data)) == data
    _checked(core, "/d")
    # not one per file: the directory's own, which nothing here looked up, is kept with
    # its listing (a restarted walk's lookup of it then asks nothing)
    assert source.calls["stat"] == before["stat"] + 1
    assert source.calls["read_range"] == before["read_range"]
    assert source.calls["listdir"] == before.get("listdir", 0) + 1
    # the lookups came from the index (its answers are not copied into the attributes
    # cache: each is the index's), the listing the first set off confirmed them
    assert core.stats.get("metadata.index_hits") >= len(FILES)
    assert core.stats.get("metadata.index_stale") == 0
    core.close()


def test_a_listing_first_brings_the_attributes_and_confirms_the_index(tmp_path):
    """A listing before any lookup checks the directory: every file the index holds is
    confirmed, and its lookups are the index's (its attributes are not kept twice)."""
    source = MemorySource()
    core = _restarted(tmp_path, source, FILES)
    before = dict(source.calls)
    assert sorted(e.name for e in core.readdir("/d")) == sorted(n[3:] for n in FILES)
    for name, data in FILES.items():
        assert core.getattr(name).size == len(data)
    assert source.calls["stat"] == before["stat"] + 1  # the directory's own (not looked up), kept with it
    assert source.calls["listdir"] == before.get("listdir", 0) + 1
    assert core.stats.get("metadata.index_hits") == len(FILES) and core.stats.get("metadata.hits") == 0
    core.close()


def test_the_check_finds_files_changed_or_gone_and_invalidates_them(tmp_path):
    source = MemorySource()
    core = _restarted(tmp_path, source, FILES)
    source.add_file("/d/f3", b"rewritten")
    source.remove("/d/f4")
    changed = []
    core.hooks.on_source_changed = lambda path: (changed.append(path), core.invalidate(path))
    source.hang("/d")  # the check waits until every lookup was answered
    for name in FILES:
        core.getattr(name)  # answered from the index: the version that was cached
    assert core.stats.get("metadata.index_hits") == len(FILES)
    source.release()
    _checked(core, "/d")
    assert sorted(changed) == ["/d/f3", "/d/f4"]
    assert core.stats.get("metadata.index_stale") == 2
    assert core.getattr("/d/f3").size == len(b"rewritten")
    assert core.read("/d/f3", 0, 100) == b"rewritten"
    core.close()


def test_attributes_older_than_the_metadata_ttl_are_not_trusted(tmp_path):
    source = MemorySource()
    core = _restarted(tmp_path, source, FILES, metadata_ttl=0.01)
    time.sleep(0.05)
    before = source.calls_by_path["stat", "/d/f1"]
    core.getattr("/d/f1")
    # the file's own stat (the listing it sets off in the background may stat the directory)
    assert source.calls_by_path["stat", "/d/f1"] == before + 1
    assert core.stats.get("metadata.index_hits") == 0
    core.close()


def test_after_its_check_a_directory_is_answered_from_the_index_for_what_the_check_confirmed(tmp_path):
    """The attributes cache holds fewer files than a big tree (500,000 by default; ImageNet
    has 1.28 million): once its directory is checked, a lookup of a file the cache let go
    is answered from the index if the check confirmed the file (or it was cached since),
    not with a stat on the source; a file the check found changed is the source's."""
    source = MemorySource()
    core = _restarted(tmp_path, source, FILES, metadata_entries=8)
    source.add_file("/d/f3", b"rewritten")  # changed before the check, not looked up before it
    core.getattr("/d/f0")  # from the index; the check follows
    _checked(core, "/d")
    before = source.calls["stat"]
    for _ in range(2):  # 19 files through a cache of 8: each is let go before it comes again
        for name, data in FILES.items():
            if name != "/d/f3":
                assert core.getattr(name).size == len(data)
    assert source.calls["stat"] == before
    assert core.stats.get("metadata.index_hits") >= 2 * 19
    assert core.getattr("/d/f3").size == len(b"rewritten")  # the check's attributes
    for n in range(8):  # files not cached push the check's attributes of f3 out
        source.add_file(f"/e/x{n}", b"x")
        core.getattr(f"/e/x{n}")
    before = source.calls["stat"]
    assert core.getattr("/d/f3").size == len(b"rewritten")
    assert source.calls["stat"] == before + 1  # (let go by the cache: asked again, not the index)
    assert core.read("/d/f3", 0, 100) == b"rewritten"
    core.close()


def test_a_first_mount_answers_lookups_the_attributes_cache_let_go_from_the_index(tmp_path):
    """In the mount that cached them too: a file's attributes stored with its cached copy
    answer its lookup once the attributes cache let them go (no stat on the source),
    unless the source was since found to have another version of the file."""
    source = MemorySource()
    for name, data in FILES.items():
        source.add_file(name, data)
    core = make_core(source, disk=DiskTier(str(tmp_path), 10 << 20, Stats(), scrub=False), block_size=BS,
                     metadata_entries=8)
    for name, data in FILES.items():
        assert core.read(name, 0, len(data)) == data
    source.add_file("/d/f3", b"rewritten")
    core.metadata.invalidate("/d/f3")
    assert core.getattr("/d/f3").size == len(b"rewritten")  # the source's new version, learnt
    before = source.calls["stat"]
    for _ in range(2):  # 19 files through a cache of 8
        for name, data in FILES.items():
            if name != "/d/f3":
                assert core.getattr(name).size == len(data)
    assert source.calls["stat"] == before and core.stats.get("metadata.index_hits") >= 2 * (19 - 8)
    assert core.getattr("/d/f3").size == len(b"rewritten")  # not the cached version's attributes
    for n in range(8):  # files not cached push f3's attributes out
        source.add_file(f"/e/x{n}", b"x")
        core.getattr(f"/e/x{n}")
    hits = core.stats.get("metadata.index_hits")
    # not the index's: asked again, or its directory's listing's (listed with attributes
    # behind its lookup on the source)
    assert core.getattr("/d/f3").size == len(b"rewritten")
    assert core.stats.get("metadata.index_hits") == hits
    assert core.read("/d/f3", 0, 100) == b"rewritten"
    core.close()


def test_past_the_ttl_a_file_found_unchanged_is_trusted_for_another(tmp_path):
    """Past --metadata-ttl a cached file's lookup asks the source; an answer that is the
    cached version renews it: once the attributes cache let it go, the index answers for
    another TTL, not a stat each lookup. A file found changed is not."""
    source = MemorySource()
    for name, data in FILES.items():
        source.add_file(name, data)
    ttl = 2.0
    core = make_core(source, disk=DiskTier(str(tmp_path), 10 << 20, Stats(), scrub=False), block_size=BS,
                     metadata_entries=8, metadata_ttl=ttl)
    for name, data in FILES.items():
        assert core.read(name, 0, len(data)) == data
    source.add_file("/d/f3", b"rewritten")
    time.sleep(ttl + 0.1)
    before = source.calls["stat"]
    for name, data in FILES.items():
        assert core.getattr(name).size == (len(b"rewritten") if name == "/d/f3" else len(data))
    asked = source.calls["stat"] - before
    assert asked >= 1  # (the directory's listing with attributes, set off by the first, may answer the rest)
    for _ in range(2):  # 19 files through a cache of 8: each is let go before it comes again
        for name, data in FILES.items():
            if name != "/d/f3":
                assert core.getattr(name).size == len(data)
    assert source.calls["stat"] - before == asked
    assert core.getattr("/d/f3").size == len(b"rewritten")
    core.close()


def test_after_a_restart_each_file_found_unchanged_renews_its_table_record(tmp_path):
    """After a start from the entry table, a file the source still has as cached (found by
    its directory's check, or by a stat past the TTL) is told to the file system by its
    entry id, which names its record (KernelHooks.on_confirmed: the serving processes
    answer its table node for another TTL); a file changed or gone is not."""
    source = MemorySource()
    core = _restarted(tmp_path, source, FILES, metadata_ttl=2.0)
    confirmed: list[int] = []
    found: list[tuple[bytes, int]] = []
    core.hooks.connect(on_confirmed=lambda eid, n: (found.append((eid, n)),
                                                    confirmed.append(core.cache.table_record_of_entry(eid))))
    source.add_file("/d/f3", b"rewritten")
    source.remove("/d/f4")
    core.getattr("/d/f0")  # from the index; the directory's check follows
    _checked(core, "/d")
    unchanged = sorted(name for name in FILES if name not in ("/d/f3", "/d/f4"))
    assert sorted(core.cache.table_file(n).path for n in confirmed) == unchanged  # type: ignore[union-attr]
    assert all(core.cache.table_record_of(core.cache.table_file(n).path) == n for n in confirmed)  # type: ignore[union-attr]
    assert [n for _, n in found] == confirmed  # (the record, as the confirmation found it: no search by id)
    time.sleep(2.1)
    confirmed.clear()
    core.metadata.invalidate("/d/f1")
    assert core.getattr("/d/f1").size == len(FILES["/d/f1"])  # past the TTL: a stat
    assert confirmed[:1] == [core.cache.table_record_of("/d/f1")]
    core.close()


def test_a_confirmation_holds_when_another_thread_brings_the_entry_in_meanwhile(tmp_path):
    """A directory's check confirms a restored entry while another thread (a read, an open)
    may bring it into memory between the check's look at the table and its own bring-in: the
    confirmation lands on the entry brought in (its attributes good as of now, its record
    named for the serving processes), not lost (the file's next lookup a stat again)."""
    source = MemorySource()
    core = _restarted(tmp_path, source, FILES)
    disk = core.cache.disk
    real = disk._restored_row
    raced = []

    def bring_in_meanwhile(path):
        found = real(path)
        if found is not None and not raced:
            with disk._lock:
                disk._restored.take(*found)  # as a reader would, just before this caller's
            raced.append(path)
            return None
        return found

    disk._restored_row = bring_in_meanwhile
    before = time.time()
    eid = core.cache.confirm("/d/f5")[0]  # type: ignore[index]
    assert raced == ["/d/f5"]
    assert eid is not None and core.cache.table_record_of_entry(eid) == core.cache.table_record_of("/d/f5")
    assert core.cache.indexed_attr("/d/f5")[1] >= before  # type: ignore[index]
    core.close()


def test_the_index_s_answers_are_not_kept_twice_and_serve_while_the_source_is_down(tmp_path):
    """After a restart a cached file's lookups are the index's every time: nothing is
    copied into the attributes cache (it held an `Attr` per file, ~600 bytes with its
    tuple and path), yet its attributes say how long they stay good (for the names the
    file system publishes), and past that, while the source does not answer, they are
    served as the attributes cache's stale ones are."""
    source = MemorySource()
    core = _restarted(tmp_path, source, FILES, metadata_ttl=2.0)
    meta = core.metadata
    for name, data in FILES.items():
        assert core.getattr(name).size == len(data)
    _checked(core, "/d")
    assert not any(path in meta._attrs._data for path in FILES)        # the directory's, at most
    attr, expiry = meta.attr_expiry("/d/f5")
    assert attr.size == len(FILES["/d/f5"]) and 0 < expiry - time.monotonic() <= 2.0
    assert meta.last_known("/d/f5") == attr                              # (a shared tier's reply takes it)
    time.sleep(2.1)                                                     # past the TTL
    source.faults[("stat", "*")] = errno.ETIMEDOUT
    source.faults[("listdir", "*")] = errno.ETIMEDOUT
    assert core.getattr("/d/f5").size == len(FILES["/d/f5"])           # the index's, however old
    assert core.stats.get("metadata.stale_served") >= 1
    assert core.read("/d/f5", 0, 100) == FILES["/d/f5"][:100]
    del source.faults[("stat", "*")]
    source.faults[("stat", "/d/f6")] = errno.EIO                        # an answer, not the source down
    with pytest.raises(OSError):
        core.getattr("/d/f6")
    core.close()


def test_where_the_serving_processes_answer_the_check_counts_every_name_kept(tmp_path):
    """In a directory whose files the serving processes answer from the entry table, every
    name of its kept listing counts as answered at its check (the kernel may hold any):
    the daemon's own answers there are not recorded one by one (~110 bytes a file), and
    a file changed or gone since is still told to the kernel."""
    source = MemorySource()
    for name, data in FILES.items():
        source.add_file(name, data)
    core = make_core(source, disk=DiskTier(str(tmp_path), 10 << 20, Stats(), scrub=False), block_size=BS,
                     metadata_ttl=60)
    assert len(core.readdir("/d")) == len(FILES)  # kept on the cache disk
    for name, data in FILES.items():
        assert core.read(name, 0, len(data)) == data
    core.close()
    core = make_core(source, disk=DiskTier(str(tmp_path), 10 << 20, Stats(), scrub=False), block_size=BS,
                     metadata_ttl=60)
    changed: list[str] = []
    core.hooks.on_source_changed = lambda path: (changed.append(path), core.invalidate(path))
    core.metadata.rows_serving("/d")
    for name in FILES:
        assert core.getattr(name).size == len(FILES[name])                # the index's
    assert core.metadata._answered["/d"] == set()
    source.add_file("/d/f3", b"rewritten")
    source.remove("/d/f4")
    # the kept listing's TTL passed (kept again as listed long ago: no wall-clock race with
    # a 1-second TTL, which a slow start of the test had passed before the lookups above),
    # once the background check has passed /d by (trusted within its kept listing's TTL)
    core.metadata.stop_checking(wait=10)
    kept = core.metadata.known_listing("/d")
    core.metadata._dirs.pop("/d")
    core.metadata._listings.save("/d", kept, time.time() - 120)
    core.metadata._listings.flush()
    assert len(core.readdir("/d")) == len(FILES) - 1                       # listed again: the check
    _checked(core, "/d")
    assert sorted(changed) == ["/d/f3", "/d/f4"]
    assert core.getattr("/d/f3").size == len(b"rewritten")
    core.close()


@pytest.mark.usefixtures("no_margin")
def test_after_a_restart_directory_read_ahead_passes_by_the_files_held_and_fills_the_rest(tmp_path):
    """A restarted job's read in a directory takes the directory on for read-ahead: the
    files the NVMe tier holds whole, with attributes a lookup would be answered with, are
    passed by with a probe of the index each (no fetch task: no attributes, identity or
    claim made for them); the files not cached, and one the directory's check found
    changed, are fetched as before."""
    source = MemorySource()
    p = Prefetcher(workers=0)
    core = _restarted(tmp_path, source, FILES, checked=True, prefetcher=p, readahead="dir")
    new = {f"/d/new{i}": bytes([100 + i]) * 3000 for i in range(3)}
    for name, data in new.items():
        source.add_file(name, data)
    source.add_file("/d/f7", b"rewritten")  # held, but not the source's version any more
    fetched: list[str] = []
    fetch = core.dir_readahead._fetch
    core.dir_readahead._fetch = lambda path: fetched.append(path) or fetch(path)  # type: ignore[method-assign]
    assert core.read("/d/f0", 0, 10) == FILES["/d/f0"][:10]
    run_until_idle(p)
    assert sorted(fetched) == sorted([*new, "/d/f7"])
    assert core.stats.get("prefetch.dir_cached") == len(FILES) - 2  # all but f7 and f0 (the job's)
    assert core.stats.get("prefetch.dirs") == 1
    before = source.calls["read_range"]
    for name, data in {**FILES, "/d/f7": b"rewritten", **new}.items():  # all from the cache now
        assert core.read(name, 0, len(data)) == data
    assert source.calls["read_range"] == before
    core.close()


@pytest.mark.usefixtures("no_margin")
def test_opens_the_kernel_passed_through_take_no_directory_on_and_a_miss_does(tmp_path):
    """The serving processes' reports of opens (files cached whole, their siblings most
    likely too) take no directory on for read-ahead, whatever they name, a path or an
    entry id: each would cost a probe of the index per sibling. The first sibling that is
    not cached comes to the daemon, and its read takes the directory on."""
    from cachefs.identity import FileId

    source = MemorySource()
    p = Prefetcher(workers=0)
    core = _restarted(tmp_path, source, FILES, checked=True, prefetcher=p, readahead="dir")
    fids = [core.file_id(name) for name in sorted(FILES)[:4]]
    core.count_opens(fids)
    core.count_opens([FileId("", fid.size, 0) for fid in fids], [core.entry_id(fid) for fid in fids])
    run_until_idle(p)
    assert core.stats.get("prefetch.dirs") == 0 and core.stats.get("prefetch.dir_cached") == 0
    source.add_file("/d/new", b"n" * 3000)
    assert core.read("/d/new", 0, 10) == b"n" * 10
    run_until_idle(p)
    assert core.stats.get("prefetch.dirs") == 1 and core.stats.get("prefetch.dir_cached") == len(FILES)
    core.close()


def _first_mount_stored(tmp_path, **kw):
    source = MemorySource()
    for name, data in FILES.items():
        source.add_file(name, data)
    p = Prefetcher(workers=0)
    core = make_core(source, disk=DiskTier(str(tmp_path), 10 << 20, Stats(), scrub=False), block_size=BS,
                     prefetcher=p, readahead="dir", **kw)
    stored = sorted(FILES)[:12]
    for name in stored:  # cached without the job's reads (which would take the directory on)
        assert core.fills.fill(name)[0] == "fetched"  # type: ignore[index]
    fetched: list[str] = []
    fetch = core.dir_readahead._fetch
    core.dir_readahead._fetch = lambda path: fetched.append(path) or fetch(path)  # type: ignore[method-assign]
    return core, p, stored, fetched


def test_in_a_first_mount_directory_read_ahead_passes_by_the_files_stored_in_it(tmp_path):
    """The same for entries in memory (stored in this mount, whole): passed by, not fetched."""
    core, p, stored, fetched = _first_mount_stored(tmp_path)
    last = sorted(FILES)[-1]
    assert core.read(last, 0, 10) == FILES[last][:10]
    run_until_idle(p)
    assert sorted(fetched) == sorted(set(FILES) - set(stored) - {last})
    assert core.stats.get("prefetch.dir_cached") == len(stored)
    core.close()


@pytest.mark.usefixtures("no_margin")
def test_the_tier_says_when_a_whole_file_s_attributes_were_last_known_good(tmp_path):
    """What directory read-ahead compares: the time the NVMe tier's whole copy of a path was
    last known good (a restored record's, an entry's in memory; never for a copy in part or
    one still to check since the start, none for a path not cached), against the time since
    which the index answers a lookup in its directory (--metadata-ttl, the directory's check)."""
    start = time.time()
    source = MemorySource()
    core = _restarted(tmp_path / "restarted", source, FILES, checked=True, metadata_ttl=600.0)
    at = core.cache.held_at("/d/f1")
    assert at is not None and start - 1 <= at <= time.time()
    assert core.metadata.index_good_since("/d") == pytest.approx(time.time() - 600.0, abs=1)
    assert core.cache.held_at("/d/none") is None
    core.metadata.invalidate("/d/f1")  # not known good any more
    assert core.cache.held_at("/d/f1") == 0.0
    checking = time.time()
    core.getattr("/d/f2")  # the directory's check follows
    _checked(core, "/d")
    assert core.metadata.index_good_since("/d") >= checking
    core.close()
    core = _restarted(tmp_path / "unchecked", MemorySource(), FILES)  # no restart check
    assert core.cache.held_at("/d/f1") is None  # to check first: not passed by
    core.close()
    core, _, stored, _ = _first_mount_stored(tmp_path / "first", metadata_ttl=0.5)
    assert core.cache.held_at(stored[0]) == pytest.approx(time.time(), abs=5)
    assert core.metadata.index_good_since("/d") == pytest.approx(time.time() - 0.5, abs=0.2)
    big = blob_of(3 * BS)
    core.metadata.source.add_file("/d/big", big)
    assert core.read("/d/big", 0, 10) == big[:10]  # its first block only
    assert core.cache.held_at("/d/big") is None
    core.close()


def blob_of(n: int) -> bytes:
    return bytes(i % 251 for i in range(n))


def test_a_lookup_that_meets_its_directory_s_check_comparing_waits_for_it_not_the_source(tmp_path):
    """A lookup that read the index's entry before the directory's check set its time, and
    meets the check still comparing, waits for the check (which confirms the file), then
    answers from the index: no stat of the file on the source (it had cost one, a flaky
    count in the test above under load)."""
    source = MemorySource()
    core = _restarted(tmp_path, source, FILES)
    statted: list[str] = []
    stat = source.stat
    source.stat = lambda path: statted.append(path) or stat(path)  # type: ignore[method-assign]
    compared, release, reading = threading.Event(), threading.Event(), threading.Event()
    compare = core.metadata._compare
    core.metadata._compare = lambda *a: (compared.set(), release.wait(10), compare(*a))  # type: ignore[method-assign]
    indexed = core.cache.indexed_attr

    def indexed_then_checked(path):
        known = indexed(path)
        if path == "/d/f1" and threading.current_thread().name == "reader":
            reading.set()
            assert compared.wait(10)  # the check set its time meanwhile, and compares
        return known

    core.cache.indexed_attr = indexed_then_checked  # type: ignore[method-assign]
    got: list = []
    reader = threading.Thread(target=lambda: got.append(core.getattr("/d/f1")), name="reader")
    reader.start()
    assert reading.wait(10)
    core.metadata._checks.submit("/d")
    assert compared.wait(10)
    time.sleep(0.2)
    assert not got  # waiting for the check
    release.set()
    reader.join(10)
    assert got and got[0].size == len(FILES["/d/f1"])
    assert "/d/f1" not in statted
    core.close()


def _kept_fresh(tmp_path, source: MemorySource, ttl: float, age: float):
    """A remount whose files' records were stored `age` seconds ago and whose listing of /d
    was kept just now (as a later run's listing keeps it): the directory is trusted
    without the source until the first of the two runs out."""
    for name, data in FILES.items():
        source.add_file(name, data)
    core = make_core(source, disk=DiskTier(str(tmp_path), 10 << 20, Stats(), scrub=False), block_size=BS,
                     metadata_ttl=ttl)
    listing = list(core.readdir("/d"))
    for name, data in FILES.items():
        assert core.read(name, 0, len(data)) == data
    stored = time.time()
    core.close()
    time.sleep(age)
    core = make_core(source, disk=DiskTier(str(tmp_path), 10 << 20, Stats(), scrub=False), block_size=BS,
                     metadata_ttl=ttl)
    core.metadata._listings.save("/d", listing, time.time())
    core.metadata._listings.flush()
    return core, stored


def _files_statted(source: MemorySource) -> int:
    return sum(n for (op, path), n in source.calls_by_path.items() if op == "stat" and path in FILES)


@pytest.mark.parametrize("first", ["walk", "lookup"])
def test_a_directory_whose_listing_was_kept_but_whose_records_are_past_the_ttl_is_checked_at_once(tmp_path, first):
    """Its kept listing is within the TTL, its files' records are not: the walk's listing
    of it is its check (from the source, with attributes), and so is the check its lookup
    queues, at once (the kept listing was taken, and the directory passed by until its
    TTL: every file's first lookup was a stat, 15,000 of 200,000 in an epoch after a
    remount, at a third of the speed); the files' lookups are then the index's."""
    source = MemorySource()
    core, _ = _kept_fresh(tmp_path, source, ttl=3.0, age=3.1)
    listed = source.calls["listdir"]
    if first == "walk":
        assert sorted(e.name for e in core.readdir("/d")) == sorted(n[3:] for n in FILES)
        assert "/d" in core.metadata._checked_dirs and core.stats.get("metadata.listings_kept") == 0
    else:
        core.metadata.rows_serving("/d")  # as a lookup of the directory publishes it
    _checked(core, "/d")
    assert source.calls["listdir"] == listed + 1
    statted, missed = _files_statted(source), core.stats.get("metadata.misses")  # (the walk's listing: one)
    for name, data in FILES.items():
        assert core.getattr(name).size == len(data)
    assert _files_statted(source) == statted
    assert core.stats.get("metadata.index_hits") == len(FILES) and core.stats.get("metadata.misses") == missed
    core.close()


def test_a_trusted_directory_is_checked_before_its_files_records_run_out(tmp_path):
    """Within the TTL of both its kept listing and its records the directory costs the
    source nothing; it is checked before the records run out (less a tenth of the TTL),
    so that the job's lookups past their time are still the index's, not a stat each."""
    source = MemorySource()
    ttl = 3.0
    core, stored = _kept_fresh(tmp_path, source, ttl=ttl, age=0.0)
    listed = source.calls["listdir"]
    core.metadata.rows_serving("/d")
    for name in FILES:
        core.getattr(name)
    _checked(core, "/d")
    assert source.calls["listdir"] == listed + 1 and core.stats.get("metadata.dirs_checked") == 1
    assert core.stats.snapshot()["metadata"]["checks_waiting"] == 0
    time.sleep(max(0.0, stored + ttl + 0.1 - time.time()))  # the records as stored are past the TTL
    statted = _files_statted(source)
    for name, data in FILES.items():
        assert core.getattr(name).size == len(data)
    assert _files_statted(source) == statted
    assert core.stats.get("metadata.misses") == 0
    core.close()


def test_a_directory_s_check_reads_each_record_once_and_confirms_only_what_the_source_has(tmp_path):
    """The check compares each listed file with its record and confirms it in one read of
    the record (two reads, and each file's attributes put in the attributes cache and taken
    out again, had been 5/6 of a remounted walk's time); a file changed on the source keeps
    its record's time (not confirmed), and its attributes are the source's."""
    source = MemorySource()
    core = _restarted(tmp_path, source, FILES)
    disk = core.cache.disk
    stored = {name: core.cache.indexed_attr(name)[1] for name in FILES}  # type: ignore[index]
    source.add_file("/d/f3", b"rewritten")
    reads: list[str] = []
    real = disk._restored_row
    disk._restored_row = lambda path: (reads.append(path), real(path))[1]
    before = time.time()
    assert len(core.readdir("/d")) == len(FILES)  # its first listing since the start: the check
    assert "/d" in core.metadata._checked_dirs
    assert sorted(reads) == sorted(FILES)
    disk._restored_row = real
    assert core.cache.indexed_attr("/d/f3")[1] == stored["/d/f3"]  # type: ignore[index]
    assert all(core.cache.indexed_attr(name)[1] >= before for name in FILES if name != "/d/f3")  # type: ignore[index]
    assert not any(name in core.metadata._attrs._data for name in FILES if name != "/d/f3")
    assert core.getattr("/d/f3").size == len(b"rewritten")
    core.close()
