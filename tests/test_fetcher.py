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
from cachefs.fetcher import Fetchers, FetchUnavailable, Fill
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
