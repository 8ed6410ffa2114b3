import errno
import random
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachefs import warm as warming
from cachefs.blocks import FileId, block_key
from cachefs.memsource import MemorySource
from tests.helpers import make_core, run_until_idle, wait_listed

BS = 64 << 10


def blob(n, seed=0):
    return random.Random(seed).randbytes(n)


def test_reads_match_source_and_second_read_touches_nothing(source):
    data = blob(300_000)
    source.add_file("/d/big.bin", data)
    core = make_core(source, block_size=BS)
    assert core.read("/d/big.bin", 0, len(data)) == data
    assert source.calls["read_range"] == 5  # 300_000 bytes / 64 KiB blocks
    calls = dict(source.calls)
    assert core.read("/d/big.bin", 0, len(data)) == data
    assert core.read("/d/big.bin", 1000, 70_000) == data[1000:71_000]
    assert dict(source.calls) == calls
    assert core.stats.get("ram.served_bytes") == len(data) + 70_000
    assert core.stats.get("source.served_bytes") == len(data)


def test_small_file_is_one_block_and_one_source_read(source):
    source.add_file("/a.jpg", blob(5000))
    core = make_core(source, block_size=BS)
    for off in range(0, 5000, 512):
        core.read("/a.jpg", off, 512)
    assert source.calls["read_range"] == 1
    assert source.bytes_read == 5000


def test_empty_file_and_reads_past_eof(source):
    source.add_file("/empty", b"")
    source.add_file("/f", b"abc")
    core = make_core(source)
    assert core.read("/empty", 0, 100) == b""
    assert core.read("/f", 3, 10) == b""
    assert core.read("/f", 100, 10) == b""
    assert core.read("/f", 1, 100) == b"bc"
    assert source.calls["read_range"] == 1


@settings(max_examples=60, deadline=None)
@given(size=st.integers(0, 5 * BS + 17), reads=st.lists(st.tuples(st.integers(0, 6 * BS), st.integers(0, 3 * BS)),
                                                        min_size=1, max_size=20))
def test_random_reads_equal_plain_bytes(size, reads):
    src = MemorySource()
    data = blob(size, seed=size)
    src.add_file("/f", data)
    core = make_core(src, block_size=BS, ram=3 * BS)  # small RAM: evictions happen too
    for off, n in reads:
        assert core.read("/f", off, n) == data[off:off + n]


def test_metadata_is_cached_for_the_ttl(source, clock):
    source.add_file("/f", b"x")
    core = make_core(source, clock=clock, metadata_ttl=10)
    core.getattr("/f")
    core.getattr("/f")
    assert source.calls["stat"] == 1
    clock.advance(11)
    core.getattr("/f")
    assert source.calls["stat"] == 2


def test_negative_entries_expire_sooner(source, clock):
    core = make_core(source, clock=clock, metadata_ttl=100, negative_ttl=5)
    for _ in range(3):
        with pytest.raises(FileNotFoundError):
            core.getattr("/later")
    assert source.calls["stat"] == 1
    source.add_file("/later", b"now")
    clock.advance(6)
    assert core.getattr("/later").size == 3


def test_readdir_is_cached_and_reports_types(source, clock):
    source.add_file("/d/a.jpg", b"1")
    source.add_dir("/d/sub")
    source.add_symlink("/d/ln", "a.jpg")
    core = make_core(source, clock=clock)
    entries = {e.name: e.type_mode for e in core.readdir("/d")}
    import stat
    assert entries == {"a.jpg": stat.S_IFREG, "sub": stat.S_IFDIR, "ln": stat.S_IFLNK}
    wait_listed(core)
    core.readdir("/d")
    core.readdir("/d/sub")  # listed ahead: a walk lists it next
    assert source.calls["listdir"] == 2 and source.calls["stat"] == 1  # /d/sub's attributes came with it


def test_changed_file_is_never_served_from_its_old_copy(source, clock):
    source.add_file("/f", b"old contents", mtime_ns=1)
    core = make_core(source, clock=clock, metadata_ttl=10)
    assert core.read("/f", 0, 100) == b"old contents"
    source.add_file("/f", b"NEW contents!", mtime_ns=2)
    clock.advance(11)  # metadata expires: the new identity is seen
    assert core.read("/f", 0, 100) == b"NEW contents!"
    # same size, new mtime: still a different file
    source.add_file("/f", b"NEW contents?", mtime_ns=3)
    clock.advance(11)
    assert core.read("/f", 0, 100) == b"NEW contents?"


def test_change_under_a_stale_identity_is_estale_not_wrong_bytes(source, clock):
    source.add_file("/f", b"a" * 10, mtime_ns=1)
    core = make_core(source, clock=clock, metadata_ttl=10)
    core.getattr("/f")                      # identity cached, block not yet read
    source.add_file("/f", b"b" * 10, mtime_ns=2)
    with pytest.raises(OSError) as info:
        core.read("/f", 0, 10)
    assert info.value.errno == errno.ESTALE
    assert core.stats.get("source.changed") == 1
    assert core.read("/f", 0, 10) == b"b" * 10   # metadata was refreshed


@pytest.mark.parametrize("err", [errno.EIO, errno.EACCES, errno.ESTALE, errno.ENOENT])
def test_source_errors_reach_the_caller_as_their_errno(source, err):
    source.add_file("/f", b"data")
    source.faults[("read_range", "/f")] = err
    core = make_core(source)
    with pytest.raises(OSError) as info:
        core.read("/f", 0, 4)
    assert info.value.errno == err
    del source.faults[("read_range", "/f")]
    assert core.read("/f", 0, 4) == b"data"   # nothing bad was cached


def test_reading_a_directory_is_eisdir(source):
    source.add_dir("/d")
    with pytest.raises(IsADirectoryError):
        make_core(source).read("/d", 0, 1)


def test_paths_that_escape_are_refused(source):
    core = make_core(source)
    for bad in ("/../etc/passwd", "/a/../../x", "relative", "/a\0b"):
        with pytest.raises(OSError) as info:
            core.getattr(bad)
        assert info.value.errno == errno.EINVAL


def test_concurrent_misses_of_one_block_fetch_it_once():
    release = threading.Event()

    class SlowSource(MemorySource):
        def read_range(self, fid, offset, size):
            release.wait(5)
            return super().read_range(fid, offset, size)

    src = SlowSource()
    data = blob(BS)
    src.add_file("/f", data)
    core = make_core(src, block_size=BS)
    results = []
    threads = [threading.Thread(target=lambda: results.append(core.read("/f", 0, BS))) for _ in range(8)]
    for t in threads:
        t.start()
    while core.stats.get("reads.inflight_waits") < 7:
        threading.Event().wait(0.001)
    release.set()
    for t in threads:
        t.join()
    assert results == [data] * 8
    assert src.calls["read_range"] == 1


def test_a_failed_fetch_is_reported_to_every_waiter_and_not_cached(source):
    source.add_file("/f", b"x" * 10)
    source.faults[("read_range", "/f")] = errno.EIO
    core = make_core(source)
    with pytest.raises(OSError):
        core.read("/f", 0, 10)
    assert core.flights.inflight == {}


def test_disk_tier_serves_a_fresh_core_without_the_source(tmp_path, source):
    from cachefs.stats import Stats
    from cachefs.tiers.disk import DiskTier

    data = blob(200_000)
    source.add_file("/f", data)
    d1 = DiskTier(str(tmp_path), 10 << 20, Stats())
    core = make_core(source, disk=d1, block_size=BS)
    core.read("/f", 0, len(data))
    d1.flush()
    d1.close()
    st = source.stat("/f")
    fid = FileId("/f", len(data), st.mtime_ns, st.ctime_ns)
    d2 = DiskTier(str(tmp_path), 10 << 20, Stats())
    core2 = make_core(source, disk=d2, block_size=BS)
    before = source.calls["read_range"]
    assert core2.read("/f", 0, len(data), fid=fid) == data
    assert source.calls["read_range"] == before
    assert core2.stats.get("disk.hits") == 4
    d2.close()


def test_a_deleted_file_keeps_its_errno_and_drops_the_stale_metadata(source, clock):
    source.add_file("/f", b"data")
    core = make_core(source, clock=clock)
    core.getattr("/f")
    source.remove("/f")
    seen = []
    core.hooks.on_source_changed = lambda p: (seen.append(p), core.invalidate(p))
    with pytest.raises(FileNotFoundError):
        core.read("/f", 0, 4)
    assert seen == ["/f"]
    with pytest.raises(FileNotFoundError):
        core.getattr("/f")                      # asked the source again: it is gone
    assert source.calls["stat"] == 2


def test_change_hook_runs_before_metadata_is_refreshed(source, clock):
    source.add_file("/f", b"a" * 10, mtime_ns=1)
    core = make_core(source, clock=clock)
    core.getattr("/f")
    source.add_file("/f", b"b" * 10, mtime_ns=2)
    held = []
    core.hooks.on_source_changed = held.append  # e.g. waiting for the kernel to drop its pages
    for _ in range(2):
        with pytest.raises(OSError) as info:
            core.read("/f", 0, 10)
        assert info.value.errno == errno.ESTALE  # never the new bytes under the old identity
    assert held == ["/f", "/f"]


# -- read-ahead and warming through the core, with the executor driven by hand --------------

from cachefs.prefetch import Prefetcher  # noqa: E402


def make_ra_core(source, readahead="dir", ram=64 << 20, **kw):
    p = Prefetcher(workers=0)
    return make_core(source, prefetcher=p, readahead=readahead, ram=ram, **kw), p


def test_sequential_reader_is_served_from_blocks_fetched_ahead(source):
    data = blob(40 * BS)
    source.add_file("/big", data)
    core, p = make_ra_core(source, readahead="file")
    demand_fetches = 0
    for off in range(0, len(data), BS):
        before = source.calls["read_range"]
        assert core.read("/big", off, BS) == data[off:off + BS]
        demand_fetches += source.calls["read_range"] - before
        run_until_idle(p)                       # the pool catches up between reads
    assert source.calls["read_range"] == 40      # every block fetched exactly once
    assert demand_fetches <= 3                   # the reader waited for only the first few
    assert core.stats.get("prefetch.used") >= 37


def test_random_reader_triggers_no_read_ahead(source):
    source.add_file("/big", blob(40 * BS))
    core, p = make_ra_core(source, readahead="file")
    for i in (17, 3, 29, 8, 35, 12):
        core.read("/big", i * BS, 100)
    assert len(p) == 0 and core.stats.get("prefetch.blocks") == 0


def test_a_random_reader_fetches_what_it_asks_for_then_the_block_on_its_second_miss(source):
    """Never more bytes from the store than a direct read for a block's first miss; the
    block whole (and cached) on its second, so the next epoch is served from the cache."""
    data = blob(40 * BS)
    source.add_file("/big", data)
    core, _ = make_ra_core(source, readahead="file")
    for i in (17, 3, 29):  # two scattered reads make a random reader
        assert core.read("/big", i * BS + 5000, 9000) == data[i * BS + 5000:i * BS + 14000]
    before = source.bytes_read
    assert core.read("/big", 8 * BS + 100, 10_000) == data[8 * BS + 100:8 * BS + 10_100]
    assert source.bytes_read - before == 12288  # the 4 KiB pages around the range
    assert core.stats.get("source.partial_reads") >= 1
    # the same block again: fetched whole, and then served from the cache
    assert core.read("/big", 8 * BS + 30_000, 5000) == data[8 * BS + 30_000:8 * BS + 35_000]
    assert source.bytes_read - before == 12288 + BS
    assert core.read("/big", 8 * BS, 777) == data[8 * BS:8 * BS + 777]
    assert source.bytes_read - before == 12288 + BS
    # a read that spans blocks, and one at the end of the file
    assert core.read("/big", 20 * BS - 50, 100) == data[20 * BS - 50:20 * BS + 50]
    assert core.read("/big", 40 * BS - 10, 100) == data[40 * BS - 10:]


def test_read_ahead_never_evicts_cached_data(source):
    source.add_file("/a", blob(BS, 1))
    source.add_file("/big", blob(20 * BS, 2))
    core, p = make_ra_core(source, readahead="file", ram=4 * BS, block_size=BS)
    core.read("/a", 0, BS)                        # the job's own data
    for off in range(0, 3 * BS, BS):
        core.read("/big", off, BS)
    run_until_idle(p)
    key = block_key(b"test", core.file_id("/a"), 0, BS)
    assert key in core.cache.ram                  # still there: guesses only used free room
    assert core.cache.ram.used_bytes <= 4 * BS
    assert core.stats.get("prefetch.no_room") >= 1


def test_demand_read_of_a_block_being_prefetched_waits_for_that_fetch():
    release, started = threading.Event(), threading.Event()

    class Gate(MemorySource):
        def read_range(self, fid, offset, size):
            started.set()
            release.wait(5)
            return super().read_range(fid, offset, size)

    src = Gate()
    data = blob(BS)
    src.add_file("/f", data)
    core, _ = make_ra_core(src)
    fid = core.file_id("/f")
    t = threading.Thread(target=core.prefetch_block, args=(fid, 0))
    t.start()
    started.wait(5)
    got = []
    reader = threading.Thread(target=lambda: got.append(core.read("/f", 0, BS)))
    reader.start()
    while core.stats.get("reads.inflight_waits") < 1:
        threading.Event().wait(0.001)
    release.set()
    t.join()
    reader.join()
    assert got == [data] and src.calls["read_range"] == 1


def test_directory_read_ahead_fetches_siblings_in_sorted_order(source):
    for name in ("e", "b", "d", "a", "c"):
        source.add_file(f"/cls/{name}.jpg", blob(1000, ord(name)))
    source.add_file("/other/x.jpg", b"x")
    order = []
    real = source.read_range

    def spy(fid, off, size):
        order.append(fid.path)
        return real(fid, off, size)

    source.read_range = spy
    core, p = make_ra_core(source)
    core.read("/cls/c.jpg", 0, 1000)              # the job reads one file of the directory
    run_until_idle(p)
    assert order == ["/cls/c.jpg", "/cls/a.jpg", "/cls/b.jpg", "/cls/d.jpg", "/cls/e.jpg"]
    before = source.calls["read_range"]
    for name in "abde":
        core.read(f"/cls/{name}.jpg", 0, 1000)
    assert source.calls["read_range"] == before   # all served from the cache
    assert core.stats.get("prefetch.used") == 4


def test_warm_loads_a_tree_in_order_and_resumes(source):
    for c in range(3):
        for i in range(4):
            source.add_file(f"/ds/c{c}/{i}.jpg", blob(3000 + i, c * 10 + i))
    core, p = make_ra_core(source, readahead="off")
    job = warming.start(core, ["/ds"])
    run_until_idle(p)
    assert job.done
    prog = job.progress()
    assert prog["state"] == "done" and prog["files_loaded"] == 12 and prog["files_total"] == 12
    assert prog["bytes_loaded"] == sum(3000 + i for i in range(4)) * 3
    warming.finish(core, job)
    reads = source.calls["read_range"]
    job2 = warming.start(core, ["/ds"])               # again: everything is cached already
    run_until_idle(p)
    assert job2.progress()["files_cached"] == 12 and source.calls["read_range"] == reads


def test_warm_stops_when_the_cache_is_full_and_says_so(source, monkeypatch):
    for i in range(10):
        source.add_file(f"/ds/{i}.bin", blob(BS, i))
    core, p = make_ra_core(source, readahead="off", ram=3 * BS, block_size=BS)
    counting = threading.Event()  # the count of the total held until the walk has stopped for room
    count_files = warming.WarmJob._count_files
    monkeypatch.setattr(warming.WarmJob, "_count_files", lambda self: (counting.wait(10), count_files(self)))
    job = warming.start(core, ["/ds"])
    run_until_idle(p)
    prog = job.progress()  # stopped short of the end: the total is not the files it saw
    assert prog["state"] == "no_room" and not prog["total_known"]
    counting.set()
    deadline = time.monotonic() + 10
    while not job.progress()["total_known"]:  # the total is counted by a thread of its own
        assert time.monotonic() < deadline
        time.sleep(0.01)
    prog = job.progress()
    assert prog["state"] == "no_room"
    assert prog["files_loaded"] == 3 and prog["files_total"] == 10
    assert core.cache.ram.used_bytes <= 3 * BS


def test_reads_that_wait_for_a_shared_nvme_fetch_count_as_hits(tmp_path, source):
    """An epoch served entirely from the cache shows a 100% hit rate, even when readers of one
    block wait for each other's NVMe lookup (it showed 75-82%: waiters counted as misses)."""
    from cachefs.stats import Stats, block_hit_rate
    from cachefs.tiers.disk import DiskTier

    data = blob(BS)
    source.add_file("/f", data)
    disk = DiskTier(str(tmp_path), 10 << 20, Stats())
    core = make_core(source, disk=disk, block_size=BS)
    core.read("/f", 0, BS)
    disk.flush()
    core.cache.ram.discard(next(iter(core.cache.ram.policy.keys())))  # RAM forgets; NVMe keeps it
    counted = core.stats
    base = {n: counted.get(n) for n in ("ram.hits", "ram.misses", "disk.hits", "reads.inflight_waits")}

    class stats:  # the counters from here on
        @staticmethod
        def get(name):
            return counted.get(name) - base.get(name, 0)

    release = threading.Event()
    real_get = disk.get

    def slow_get(key):
        release.wait(5)
        return real_get(key)

    disk.get = slow_get
    results = []
    threads = [threading.Thread(target=lambda: results.append(core.read("/f", 0, BS))) for _ in range(8)]
    for t in threads:
        t.start()
    while stats.get("ram.misses") < 1 or len(core.flights.inflight) < 1:
        threading.Event().wait(0.001)
    threading.Event().wait(0.05)  # let the others reach the in-flight fetch
    release.set()
    for t in threads:
        t.join()
    assert results == [data] * 8
    assert source.calls["read_range"] == 1  # the first read only
    waits = stats.get("reads.inflight_waits")
    assert waits >= 1
    assert stats.get("disk.hits") == 1 + waits
    assert block_hit_rate(stats.get("ram.hits"), stats.get("ram.misses"), stats.get("disk.hits")) == 1.0
    disk.close()


def test_opens_counted_from_a_report_count_as_opens_do(tmp_path):
    """count_opens (the serving processes' reports) counts each tier's hits, bytes and RAM
    promotions as open_file does for the same opens, with the entry ids given (the daemon
    passes each published node's) or computed from the files, or by entry id and size
    alone (a table node's open: FileId without a path)."""
    from cachefs.identity import FileId
    from cachefs.stats import Stats
    from cachefs.tiers.disk import DiskTier

    result = {}
    for way in ("open_file", "count_opens", "count_opens_eids", "count_opens_by_entry"):
        source = MemorySource()
        fids = []
        for i in range(5):
            source.add_file(f"/d/f{i}", blob(1000 * (i + 1)))
        disk = DiskTier(str(tmp_path / way), 10 << 20, Stats(), scrub=False)
        core = make_core(source, disk=disk, block_size=BS)
        core.hooks.connect(passthrough=True)  # whole files fetched at open go to NVMe
        for i in range(5):
            fid = core.file_id(f"/d/f{i}")
            fids.append(fid)
            backing, _ = core.open_file(fid)  # filled: NVMe
            assert backing is not None and not backing.in_ram
            backing.release()
        before = {n: core.stats.get(n) for n in ("ram.hits", "ram.misses", "disk.hits", "ram.promotions",
                                                 "ram.served_bytes", "disk.served_bytes")}
        in_ram = []
        for _ in range(2):  # queued for RAM at the first (copied behind it), a RAM hit at the second
            assert core.cache.settle_promotions(10)
            if way == "open_file":
                for fid in fids:
                    backing, _ = core.open_file(fid, fill=False)
                    assert backing is not None
                    in_ram.append(backing.in_ram)
                    backing.release()
            elif way == "count_opens":
                in_ram += core.count_opens(fids)
            elif way == "count_opens_eids":
                in_ram += core.count_opens(fids, [core.entry_id(fid) for fid in fids])
            else:
                in_ram += core.count_opens([FileId("", fid.size, 0) for fid in fids],
                                           [core.entry_id(fid) for fid in fids])
        result[way] = ({n: core.stats.get(n) - v for n, v in before.items()}, in_ram)
    assert result["count_opens"] == result["count_opens_eids"] == result["count_opens_by_entry"]
    assert result["count_opens"][0] == result["open_file"][0]
    assert result["open_file"][0]["ram.promotions"] == 5 and result["open_file"][0]["ram.hits"] == 5
    assert result["open_file"][0]["disk.served_bytes"] == result["open_file"][0]["ram.served_bytes"] == 15000
    assert result["count_opens"][1] == result["open_file"][1] == [False] * 5 + [True] * 5


def test_a_file_fetched_ahead_twice_in_one_report_is_promoted_at_its_second_open(tmp_path):
    """A report of opens counts them in order, as opens one by one would: a file fetched
    ahead stays on NVMe at its first open (its first use), and a second open of it in the
    same report queues it for RAM."""
    from cachefs.stats import Stats
    from cachefs.tiers.disk import DiskTier

    for times in (1, 2):
        source = MemorySource()
        source.add_file("/d/f", blob(3000))
        disk = DiskTier(str(tmp_path / f"disk{times}"), 10 << 20, Stats(), scrub=False)
        core = make_core(source, disk=disk, block_size=BS)
        core.hooks.connect(passthrough=True)  # a file fetched whole goes to NVMe
        assert core.prefetch_file("/d/f")[0] == "fetched"
        fid = core.file_id("/d/f")
        assert core.count_opens([fid] * times) == [False] * times
        assert core.cache.settle_promotions(10)
        assert core.cache.in_ram(core.entry_id(fid)) is (times == 2)
        core.close()


def test_the_ttl_cache_gives_its_table_back_as_it_empties_and_keeps_what_is_left():
    """A cold epoch puts each file's attributes and takes them out as the tier stores the
    file: the map is rebuilt once fewer than an eighth of its peak are left (a dict keeps
    its table's size as keys go)."""
    import sys

    from cachefs.ttlcache import TTLCache

    now = [0.0]
    c = TTLCache(1 << 20, lambda: now[0])
    for i in range(20_000):
        c.put(f"/d/{i}", i, 60.0)
    full = sys.getsizeof(c._data)
    for i in range(19_000):
        (c.pop if i % 2 else c.discard)(f"/d/{i}", *(() if i % 2 else (i,)))
    assert len(c) == 1_000 and sys.getsizeof(c._data) * 8 < full
    assert all(c.get(f"/d/{i}") == i for i in range(19_000, 20_000)) and c.get("/d/5") is None
    c.discard("/d/19999", 5)                                   # not the value it holds: kept
    now[0] = 61.0
    assert c.get("/d/19999") is None and c.get_stale("/d/19999") == 19_999
