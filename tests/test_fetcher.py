"""Fetch processes (cachefs/fetcher.py): real child processes reading a real directory and
writing entry files, as the daemon uses them; and the core falling back to its own
threads when they are gone."""

import errno
import os
import pathlib
import signal
import time

import pytest

from cachefs.blocks import FileId, entry_id
from cachefs.fetcher import Fetchers, FetchUnavailable, Fill, NoFetchProcess
from cachefs.source import LocalSource
from cachefs.stats import Stats
from cachefs.tiers.disk import DiskTier
from cachefs.tiers.store import block_hash
from tests.helpers import make_core

BS = 1 << 20
NS = b"ns"


@pytest.fixture
def pool(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    fetchers = Fetchers(str(src), str(data_dir), NS, BS, processes=1, channels=2)
    yield src, data_dir, fetchers
    fetchers.close()


def _entry_file(data_dir, path, st):
    name = entry_id(NS, FileId(path, st.st_size, st.st_mtime_ns, st.st_ctime_ns), BS).hex()
    return data_dir / name[:2] / name


def test_a_small_file_is_read_once_and_written_as_its_entry(pool):
    src, data_dir, fetchers = pool
    payload = os.urandom(123_456)
    (src / "a.jpg").write_bytes(payload)
    reply = fetchers.fill("/a.jpg", BS, None, 5)
    kind, attr, h = reply.kind, reply.attr, reply.hash
    st = os.stat(src / "a.jpg")
    assert kind == "stored" and attr[4] == len(payload) and h == block_hash(payload)
    assert (attr[6], attr[7]) == (st.st_mtime_ns, st.st_ctime_ns)
    assert _entry_file(data_dir, "/a.jpg", st).read_bytes() == payload
    # a second fill finds the file there and leaves it alone
    assert fetchers.fill("/a.jpg", BS, None, 5).kind == "exists"


def test_large_changed_missing_and_not_a_file(pool):
    src, _, fetchers = pool
    (src / "big").write_bytes(b"x" * (BS + 1))
    (src / "d").mkdir()
    (src / "f").write_bytes(b"abc")
    assert fetchers.fill("/big", BS, None, 5).kind == "large"
    st = os.stat(src / "f")
    assert fetchers.fill("/f", BS, FileId("/f", 4, st.st_mtime_ns, st.st_ctime_ns), 5).kind == "changed"
    reply = fetchers.fill("/missing", BS, None, 5)
    assert (reply.kind, reply.errno) == ("error", errno.ENOENT)
    assert fetchers.fill("/d", BS, None, 5).kind == "changed"  # not a regular file: never read as one


def test_a_symlink_out_of_the_source_is_not_followed(pool, tmp_path):
    src, _, fetchers = pool
    (tmp_path / "secret").write_bytes(b"secret")
    os.symlink(tmp_path / "secret", src / "link")
    reply = fetchers.fill("/link", BS, None, 5)
    assert reply.kind == "error" and reply.errno == errno.ELOOP


def test_a_dead_fetch_process_is_reported_not_waited_for(pool):
    src, _, fetchers = pool
    (src / "f").write_bytes(b"abc")
    fetchers.RESTART_EVERY = 60.0
    for proc in fetchers.processes:
        proc.kill()
        proc.wait()
    with pytest.raises(FetchUnavailable):
        fetchers.fill("/f", BS, None, 5)


def test_a_killed_fetch_process_is_reaped_at_once_and_started_again(pool):
    """It stayed a zombie until the daemon exited, and its share of the work went to the
    daemon for good."""
    src, data_dir, fetchers = pool
    (src / "f").write_bytes(b"abc")
    fetchers.RESTART_EVERY = 0.2
    old = fetchers.processes[0]
    os.kill(old.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{old.pid}") or fetchers.restarts < 1:   # reaped, then replaced
        assert time.monotonic() < deadline, "not reaped, or not started again"
        time.sleep(0.02)
    assert fetchers.processes[0].pid != old.pid and fetchers.processes[0].poll() is None
    replies = []
    for _ in range(4):   # the dead process's channels are set aside as they fail
        try:
            replies.append(fetchers.fill("/f", BS, None, 5).kind)
        except FetchUnavailable:
            replies.append("unavailable")
    assert "stored" in replies and replies[-1] in ("stored", "exists") and fetchers.channels == 2


def _jpegs(tmp_path, n):
    """A source tree of `n` small files in /d: its root and {name: bytes}."""
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    files = {f"/d/{i}.jpg": os.urandom(10_000 + i) for i in range(n)}
    for name, data in files.items():
        (src / name.lstrip("/")).write_bytes(data)
    return src, files


def test_the_core_adopts_what_they_write_and_does_the_work_itself_without_them(tmp_path):
    src, files = _jpegs(tmp_path, 6)
    disk = DiskTier(str(tmp_path / "cache"), 64 << 20, Stats(), scrub=False)
    core = make_core(LocalSource(str(src)), disk=disk, block_size=BS)
    core.hooks.connect(passthrough=True)  # as the file system does at INIT
    core.use_fetchers(Fetchers(str(src), disk.data_dir, core.namespace, BS, processes=1, channels=2))
    try:
        assert [core.prefetch_small(n)[0] for n in list(files)[:3]] == ["fetched"] * 3
        core.fetchers.RESTART_EVERY = 60.0
        for proc in core.fetchers.processes:
            proc.kill()
            proc.wait()
        # while they are started again, the core fetches in its own threads
        assert [core.prefetch_small(n)[0] for n in list(files)[3:]] == ["fetched"] * 3
        for name, data in files.items():
            backing = core.cache.acquire_backing(core.entry_id(core.file_id(name)))
            assert backing is not None and open(backing.path, "rb").read() == data
        assert core.stats.get("prefetch.blocks") == 6 and core.stats.get("source.read_range") == 6
        disk.check()
    finally:
        if core.fetchers is not None:
            core.fetchers.close()
        core.close()


def test_a_request_no_fetch_process_took_is_not_counted_as_one(tmp_path):
    """With the fetch processes gone, a fill is the daemon's own visit to the source: the
    source's requests are counted as with them (the request no process took never
    reached the source), and the bytes are the same."""
    counted = []
    for gone in (False, True):
        src, files = _jpegs(tmp_path / str(gone), 3)
        disk = DiskTier(str(tmp_path / str(gone) / "cache"), 64 << 20, Stats(), scrub=False)
        _CountingSource.reads = 0
        core = make_core(_CountingSource(str(src)), disk=disk, block_size=BS)
        core.hooks.connect(passthrough=True)
        core.use_fetchers(Fetchers(str(src), disk.data_dir, core.namespace, BS, processes=1, channels=2))
        try:
            fetchers = core.fetchers
            assert fetchers is not None
            if gone:
                fetchers.close()
                with pytest.raises(NoFetchProcess):
                    fetchers.fill("/d/0.jpg", BS, None, 5)
            assert [core.prefetch_small(n)[0] for n in files] == ["fetched"] * 3
            assert _CountingSource.reads == (3 if gone else 0)
            counted.append(core.stats.get("source.stat"))
            for name, data in files.items():
                backing = core.cache.acquire_backing(core.entry_id(core.file_id(name)))
                assert backing is not None and open(backing.path, "rb").read() == data
        finally:
            core.close()
            if not gone:
                fetchers.close()
    assert counted[1] == counted[0] >= 3


class _CountingSource(LocalSource):
    """The daemon's own view of the source, counting the bytes it reads itself (a fetch
    process opens the source on its own)."""

    reads = 0

    def read_range(self, *args):
        _CountingSource.reads += 1
        return super().read_range(*args)

    def read_whole(self, *args):
        _CountingSource.reads += 1
        return super().read_whole(*args)


def _counted_core(tmp_path, n, source_timeout):
    """(files, NVMe tier, core) over `n` files of _jpegs, read through _CountingSource
    (reads zeroed), with 12 KiB of RAM and one fetch process of two channels that may
    write RAM copies."""
    src, files = _jpegs(tmp_path, n)
    disk = DiskTier(str(tmp_path / "cache"), 64 << 20, Stats(), scrub=False)
    _CountingSource.reads = 0
    core = make_core(_CountingSource(str(src)), ram=12_288, disk=disk, block_size=BS, source_timeout=source_timeout)
    core.hooks.connect(passthrough=True)
    core.use_fetchers(Fetchers(str(src), disk.data_dir, core.namespace, BS, processes=1, channels=2,
                               ram_dir=core.cache.ram_fill_dir))
    return files, disk, core


def test_a_cold_file_opened_is_filled_by_a_fetch_process_and_passed_through(tmp_path):
    """An open of a cold file of one block (no read-ahead got there first) has a fetch
    process fetch it into the NVMe tier, and RAM's while RAM has room; the daemon reads
    none of its bytes, adopts the file and hands the kernel its copy. Counted as the
    block path counts a reader's fill, not as read-ahead."""
    files, disk, core = _counted_core(tmp_path, 3, source_timeout=5)
    try:
        in_ram = []
        for name, data in files.items():
            backing, in_hand = core.open_file(core.file_id(name))
            assert in_hand is None and backing is not None and open(backing.path, "rb").read() == data
            in_ram.append(backing.in_ram)
            backing.release()
            assert disk.entry(core.entry_id(core.file_id(name))) is not None
        assert in_ram == [True, False, False]                  # RAM had room for one
        assert _CountingSource.reads == 0                      # the daemon read no byte itself
        counts = {k: core.stats.get(k) for k in ("opens.filled", "source.read_range", "source.bytes",
                                                  "source.served_bytes", "ram.misses", "disk.misses",
                                                  "prefetch.blocks", "ram.promotions")}
        total = sum(len(d) for d in files.values())
        assert counts == {"opens.filled": 3, "source.read_range": 3, "source.bytes": total,
                          "source.served_bytes": total, "ram.misses": 3, "disk.misses": 3,
                          "prefetch.blocks": 0, "ram.promotions": 0}
        # opened again: the copies in the tiers, nothing fetched
        backing, _ = core.open_file(core.file_id("/d/0.jpg"))
        assert backing is not None and backing.in_ram
        backing.release()
        assert core.stats.get("source.read_range") == 3
        disk.check()
    finally:
        core.fetchers.close()
        core.close()


def test_a_cold_open_of_a_file_changed_on_the_source_is_never_served_the_new_bytes(tmp_path):
    """The fetch process checks the version the open asked for: a file replaced since its
    lookup fails the open (ESTALE) instead of passing another version through, and no
    copy of either version is kept under the old identity."""
    src, files = _jpegs(tmp_path, 1)
    disk = DiskTier(str(tmp_path / "cache"), 64 << 20, Stats(), scrub=False)
    core = make_core(LocalSource(str(src)), disk=disk, block_size=BS, source_timeout=5)
    core.hooks.connect(passthrough=True)
    core.use_fetchers(Fetchers(str(src), disk.data_dir, core.namespace, BS, processes=1, channels=2))
    try:
        fid = core.file_id("/d/0.jpg")
        (src / "d" / "0.jpg").write_bytes(b"another version, another size")
        with pytest.raises(OSError) as err:
            core.open_file(fid)
        assert err.value.errno == errno.ESTALE
        assert disk.entry(core.entry_id(fid)) is None and core.stats.get("source.changed") >= 1
        assert core.file_id("/d/0.jpg").size == len(b"another version, another size")
    finally:
        core.fetchers.close()
        core.close()


def test_a_cold_open_fails_with_the_sources_error_or_is_done_here_with_no_channel_free(tmp_path):
    """The fetch process's answer is the open's: a file gone from the source fails it with
    ENOENT, asked once, the daemon reading nothing itself. With every channel taken (a
    busy moment, or hung files) the open does not wait for one: the daemon fetches it."""
    src, files = _jpegs(tmp_path, 2)
    disk = DiskTier(str(tmp_path / "cache"), 64 << 20, Stats(), scrub=False)
    _CountingSource.reads = 0
    core = make_core(_CountingSource(str(src)), disk=disk, block_size=BS, source_timeout=5)
    core.hooks.connect(passthrough=True)
    core.use_fetchers(Fetchers(str(src), disk.data_dir, core.namespace, BS, processes=1, channels=2))
    try:
        gone = core.file_id("/d/0.jpg")
        (src / "d" / "0.jpg").unlink()
        with pytest.raises(OSError) as err:
            core.open_file(gone)
        assert err.value.errno == errno.ENOENT
        assert _CountingSource.reads == 0 and core.stats.get("source.read_range") == 1
        assert core.stats.get("opens.fill_busy") == 0
        held = [core.fetchers._free.get(timeout=5) for _ in range(2)]
        try:
            backing, _ = core.open_file(core.file_id("/d/1.jpg"))
            assert backing is not None and open(backing.path, "rb").read() == files["/d/1.jpg"]
            backing.release()
        finally:
            for sock in held:
                core.fetchers._free.put(sock)
        assert _CountingSource.reads == 1 and core.stats.get("source.read_range") == 2
        assert core.stats.get("opens.fill_busy") == 1
    finally:
        core.fetchers.close()
        core.close()


def test_a_request_bounded_by_its_own_timeout_runs_on_the_callers_thread(tmp_path):
    """The source guard hands a request to one of its threads to bound it by
    --source-timeout, unless the request keeps the timeout itself (a fetch process's)."""
    import threading

    core = make_core(LocalSource(str(tmp_path)), source_timeout=5)
    try:
        where = []
        core.guard.call("stat", lambda: where.append(threading.current_thread()))
        core.guard.call("stat", lambda: where.append(threading.current_thread()), bounded=True)
        assert where[0] is not threading.current_thread() and where[1] is threading.current_thread()
    finally:
        core.close()


def test_a_request_that_finds_every_channel_busy_times_out(pool):
    """A fetch request keeps its timeout while it waits for a free channel too (the
    guard relies on it: see SourceGuard.call's `bounded`)."""
    src, _, fetchers = pool
    (src / "a").write_bytes(b"abc")
    held = [fetchers._free.get(timeout=5) for _ in range(2)]   # both channels taken
    try:
        start = time.monotonic()
        with pytest.raises(OSError) as err:
            fetchers.fill("/a", BS, None, 0.3)
        assert err.value.errno == errno.ETIMEDOUT and time.monotonic() - start < 5
    finally:
        for sock in held:
            fetchers._free.put(sock)
    assert fetchers.fill("/a", BS, None, 5).kind == "stored"


@pytest.mark.parametrize("batch", [False, True])
def test_a_fill_is_taken_by_ram_at_once_while_ram_has_room(tmp_path, batch):
    """The fetch process writes a RAM copy of a fill RAM has free room for: RAM takes it
    at the fill (no promotion behind a later open), within its budget; the rest are
    NVMe's alone, and nothing is left in RAM's directory that RAM did not take."""
    src, files = _jpegs(tmp_path, 8)
    disk = DiskTier(str(tmp_path / "cache"), 64 << 20, Stats(), scrub=False)
    core = make_core(LocalSource(str(src)), ram=3 * 12_288, disk=disk, block_size=BS)
    core.hooks.connect(passthrough=True)
    cache = core.cache
    core.use_fetchers(Fetchers(str(src), disk.data_dir, core.namespace, BS, processes=1, channels=2,
                               ram_dir=cache.ram_fill_dir))
    try:
        names = list(files)
        outcomes = core.prefetch_small_batch(names) if batch else [core.prefetch_small(n) for n in names]
        assert [o[0] for o in outcomes] == ["fetched"] * 8
        in_ram = []
        for name, data in files.items():
            eid = core.entry_id(core.file_id(name))
            assert disk.entry(eid) is not None                     # NVMe has every one
            backing = cache.acquire_backing(eid)
            assert backing is not None and open(backing.path, "rb").read() == data
            in_ram.append(backing.in_ram)
            backing.release()
        assert in_ram.count(True) == 3 == len(cache.ram)           # as many as RAM had room for
        assert core.stats.get("ram.writes") == 3 and core.stats.get("ram.promotions") == 0
        assert cache.ram.used_bytes <= cache.ram.capacity == 3 * 12_288
        ram_files = [p for p in pathlib.Path(cache.ram_fill_dir).rglob("*") if p.is_file()]
        assert len(ram_files) == 3
        cache.ram.check()
        disk.check()
    finally:
        core.fetchers.close()
        core.close()


@pytest.mark.parametrize("batch", [False, True])
def test_a_fill_finished_after_its_caller_stopped_waiting_is_taken_not_left_behind(tmp_path, batch):
    """A fetch process held past --source-timeout (stopped, as on a source that hangs)
    finishes its fills once it runs again: the tiers take the files it wrote (RAM's within
    its room), none is left a file nobody owns, and the next open passes each through
    without the daemon reading the source."""
    files, disk, core = _counted_core(tmp_path, 2, source_timeout=0.5)
    cache, fetchers = core.cache, core.fetchers
    assert fetchers is not None
    worker = fetchers.processes[0]
    try:
        names = list(files)
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            outcomes = core.prefetch_small_batch(names) if batch else [core.prefetch_small(n) for n in names]
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        assert [o[0] for o in outcomes] == ["error", "error"]
        deadline = time.monotonic() + 10
        while core.stats.get("source.late_fills") < 2:
            assert time.monotonic() < deadline, "the late replies were not taken"
            time.sleep(0.02)
        assert all(disk.entry(core.entry_id(core.file_id(n))) is not None for n in names)
        ram_files = [p for p in pathlib.Path(cache.ram_fill_dir).rglob("*") if p.is_file()]
        assert len(cache.ram) == 1 == len(ram_files)                # RAM's room: one of them
        for name, data in files.items():
            backing, _ = core.open_file(core.file_id(name))
            assert backing is not None and open(backing.path, "rb").read() == data
            backing.release()
        assert _CountingSource.reads == 0
        cache.ram.check()
        disk.check()
    finally:
        fetchers.close()
        core.close()


def test_a_ram_copy_that_cannot_be_written_leaves_the_fill_to_nvme_and_gives_back_its_room(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    files = {f"/{i}.jpg": os.urandom(5_000) for i in range(4)}
    for name, data in files.items():
        (src / name.lstrip("/")).write_bytes(data)
    disk = DiskTier(str(tmp_path / "cache"), 64 << 20, Stats(), scrub=False)
    core = make_core(LocalSource(str(src)), ram=1 << 20, disk=disk, block_size=BS)
    core.hooks.connect(passthrough=True)
    (tmp_path / "not-a-dir").write_bytes(b"")              # RAM's directory, as the fetch process sees it
    core.use_fetchers(Fetchers(str(src), disk.data_dir, core.namespace, BS, processes=1, channels=2,
                               ram_dir=str(tmp_path / "not-a-dir" / "data")))
    try:
        assert [o[0] for o in core.prefetch_small_batch(list(files))] == ["fetched"] * 4
        assert len(disk._entries) == 4 and len(core.cache.ram) == 0
        assert core.cache.ram.capacity == 1 << 20 and core.cache.ram.used_bytes == 0   # the held room came back
        assert core.stats.get("disk.errors") == 0                                    # NVMe's write was fine
    finally:
        core.fetchers.close()
        core.close()


def test_the_budget_holds_with_fetches_in_flight(tmp_path):
    """Files fetch processes write count against the NVMe budget before they are admitted:
    with more files than room, what is admitted fits, and nothing is left unadmitted."""
    src = tmp_path / "src"
    src.mkdir()
    files = {f"/{i}.jpg": os.urandom(40_000) for i in range(40)}
    for name, data in files.items():
        (src / name.lstrip("/")).write_bytes(data)
    budget = 600_000
    disk = DiskTier(str(tmp_path / "cache"), budget, Stats(), scrub=False)
    core = make_core(LocalSource(str(src)), disk=disk, block_size=64 << 10)
    core.hooks.connect(passthrough=True)
    core.use_fetchers(Fetchers(str(src), disk.data_dir, core.namespace, 64 << 10, processes=1, channels=4))
    try:
        import concurrent.futures as cf

        with cf.ThreadPoolExecutor(8) as ex:
            outcomes = list(ex.map(lambda n: core.prefetch_small(n)[0], files))
        assert "fetched" in outcomes and "no_room" in outcomes
        on_disk = [p for p in (tmp_path / "cache" / "data").rglob("*") if p.is_file()]
        assert len(on_disk) == outcomes.count("fetched") == len(disk._entries)
        assert sum(p.stat().st_blocks * 512 for p in on_disk) <= budget
        disk.check()
    finally:
        core.fetchers.close()
        core.close()


def test_a_batch_is_one_request_with_a_reply_per_file(pool):
    src, data_dir, fetchers = pool
    for i in range(5):
        (src / f"f{i}").write_bytes(bytes([i]) * (100 + i))
    (src / "big").write_bytes(b"x" * (BS + 1))
    reqs = []
    for name in ("f0", "f1", "f2", "f3", "f4", "big", "missing"):
        st = os.stat(src / name) if (src / name).exists() else None
        fid = FileId(f"/{name}", st.st_size, st.st_mtime_ns, st.st_ctime_ns) if st else None
        reqs.append(Fill(f"/{name}", BS, fid))
    replies, counts, servers = fetchers.fill_many(reqs, 5)
    assert counts == {} and servers == {}  # no shared tier: nothing counted
    assert [r.kind for r in replies] == ["stored"] * 5 + ["large", "error"]
    for i in range(5):
        name = entry_id(NS, FileId(f"/f{i}", *reqs[i][2][1:]), BS).hex()
        assert (data_dir / name[:2] / name).read_bytes() == bytes([i]) * (100 + i)


def test_a_file_filled_in_the_first_mount_is_looked_up_from_the_index_not_kept_twice(tmp_path):
    """The attributes a fetch process's visit brought are the cached file's: once it is
    stored they are the NVMe index's to answer (within the TTL), not a second copy in the
    attributes cache (~600 bytes a file)."""
    src, files = _jpegs(tmp_path, 4)
    disk = DiskTier(str(tmp_path / "cache"), 64 << 20, Stats(), scrub=False)
    source = _CountingSource(str(src))
    core = make_core(source, disk=disk, block_size=BS)
    core.hooks.connect(passthrough=True)
    core.use_fetchers(Fetchers(str(src), disk.data_dir, core.namespace, BS, processes=1, channels=2))
    try:
        assert [core.prefetch_small(n)[0] for n in files] == ["fetched"] * 4
        assert not any(n in core.metadata._attrs._data for n in files)       # not in the attributes cache
        stats_before = core.stats.get("source.stat")
        for name, data in files.items():
            assert core.getattr(name).size == len(data)                       # the index's answer
        assert core.stats.get("source.stat") == stats_before and core.stats.get("metadata.index_hits") >= 4
        attr, expiry = core.metadata.attr_expiry("/d/1.jpg")
        assert attr.size == len(files["/d/1.jpg"]) and expiry > time.monotonic()
        disk.check()
    finally:
        core.fetchers.close()


def test_a_fetch_process_keeps_nothing_per_file_it_wrote(tmp_path):
    """Each file's id is computed once there: the daemon's memo of ids (65,536 of them,
    with their paths and attributes: 40 MB at 200,000 files) is not filled in a fetch
    process."""
    from cachefs.fetcher import _Worker

    src, data_dir = tmp_path / "src", tmp_path / "data"
    src.mkdir()
    data_dir.mkdir()
    for i in range(50):
        (src / f"f{i}").write_bytes(b"x" * (i + 1))
    worker = _Worker(str(src), str(data_dir), NS, BS)
    before = entry_id.cache_info()
    replies = [worker.fill(Fill(f"/f{i}", BS, None)) for i in range(50)]
    assert [r.kind for r in replies] == ["stored"] * 50
    after = entry_id.cache_info()
    assert (after.currsize, after.misses, after.hits) == (before.currsize, before.misses, before.hits)
    st = os.stat(src / "f7")
    assert _entry_file(data_dir, "/f7", st).read_bytes() == b"x" * 8
