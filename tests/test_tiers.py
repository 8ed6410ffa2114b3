"""The tiers without a mount: entry files on tmpfs (RAM) and on the cache disk (NVMe), their
budgets, policies, index, crash recovery, verification, and failures."""

import errno
import logging
import os
import random
import shutil
import stat
import threading
import time

import pytest

from cachefs.identity import EntryInfo
from cachefs.source import Attr
from cachefs.stats import Stats
from cachefs.tiers import index
from cachefs.tiers.disk import DiskTier
from cachefs.tiers.entry import allocated
from cachefs.tiers.memory import MemoryTier, sweep_stale
from cachefs.tiers.multilevel import MultiLevelCache

BS = 64 << 10


def info(path: str, size: int, bs: int = BS, mtime: int = 1_000) -> EntryInfo:
    return EntryInfo(path, Attr(stat.S_IFREG | 0o644, 1, 0, 0, size, mtime, mtime, mtime, -(-size // 512)), bs)


def eid(n) -> bytes:
    return bytes([n % 256]) * 15 + bytes([n // 256])


def put(tier, n: int, data: bytes, index_: int = 0, size: int | None = None, evict: bool = True, bs: int = BS):
    return tier.put((eid(n), index_), data, info(f"/f{n}", len(data) if size is None else size, bs), evict)


def check(tier):
    tier.check()
    assert tier.used_bytes <= tier.capacity


# -- RAM ---------------------------------------------------------------------------------------

def test_memory_tier_keep_policy_refuses_instead_of_evicting():
    stats = Stats()
    t = MemoryTier(3 * 4096, stats)  # the default policy: keep what you have
    assert put(t, 1, b"x" * 4000) and put(t, 2, b"y" * 4000) and put(t, 3, b"z" * 4000)
    assert not put(t, 4, b"w" * 4000)                       # full, nothing idle: not admitted
    assert not put(t, 5, b"v" * 4000, evict=False)          # a guess: no room
    assert t.get((eid(1), 0)) == b"x" * 4000 and t.get((eid(4), 0)) is None
    assert stats.get("ram.evictions") == 0
    assert stats.get("ram.refused") == 1 and stats.get("ram.no_room") == 1
    check(t)
    t.close()


def test_memory_tier_lru_evicts_the_least_recent_and_frees_its_file():
    stats = Stats()
    t = MemoryTier(2 * 4096, stats, policy="lru")
    put(t, 1, b"x" * 4000)
    put(t, 2, b"y" * 4000)
    assert t.get((eid(1), 0)) == b"x" * 4000               # 1 is now most recent
    assert put(t, 3, b"z" * 4000)                           # evicts 2
    assert t.get((eid(2), 0)) is None and stats.get("ram.evictions") == 1
    assert not os.path.exists(t.file_of(eid(2).hex()))     # its memory is given back
    assert os.path.exists(t.file_of(eid(1).hex()))
    check(t)
    t.close()


def test_memory_tier_lives_on_tmpfs_and_its_directory_goes_with_it():
    t = MemoryTier(1 << 20)
    put(t, 1, b"x" * 100)
    assert t.directory.startswith(("/dev/shm/", os.environ.get("XDG_RUNTIME_DIR") or "/dev/shm/"))
    assert stat.S_IMODE(os.stat(t.directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(t.file_of(eid(1).hex())).st_mode) == 0o600
    directory = t.directory
    t.close()
    assert not os.path.exists(directory)


def test_a_killed_daemons_ram_directory_is_swept(tmp_path):
    dead = tmp_path / f"cachefs-{os.getuid()}-999999999-abc"
    alive = tmp_path / f"cachefs-{os.getuid()}-{os.getpid()}-abc"
    other = tmp_path / f"cachefs-{os.getuid() + 1}-999999999-abc"
    for d in (dead, alive, other):
        d.mkdir()
    assert sweep_stale(str(tmp_path)) == 1
    assert not dead.exists() and alive.exists() and other.exists()


def test_memory_tier_refuses_an_oversized_block_without_evicting():
    t = MemoryTier(4 * 4096)
    put(t, 1, b"x" * 6000)
    assert not put(t, 2, b"y" * 20_000)
    assert t.get((eid(1), 0)) == b"x" * 6000
    check(t)
    t.close()


@pytest.mark.parametrize("policy", ["keep", "lru"])
def test_memory_tier_invariants_under_random_operations(policy):
    rng = random.Random(7)
    t = MemoryTier(20 * 4096, policy=policy)
    contents = {}
    for _ in range(1500):
        n = rng.randrange(40)
        op = rng.random()
        if op < 0.6:
            data = bytes([n]) * rng.randrange(1, 9000)
            if (eid(n), 0) not in t and put(t, n, data):
                contents[n] = data
        elif op < 0.9:
            got = t.get((eid(n), 0))
            assert got is None or got == contents[n]
        else:
            t.discard((eid(n), 0))
        check(t)
        assert t.used_bytes == sum(allocated(len(contents[k[0][0]])) for k in list(t.policy.keys()))
    t.close()


def test_hinted_blocks_are_pinned_until_read():
    t = MemoryTier(4 * 4096, policy="keep")
    for n in range(4):
        put(t, n, b"x" * 4096)
    key = (eid(9), 0)
    assert t.put_pinned(key, b"h" * 4096, info("/h", 4096), pin_limit=8192)  # replaces the oldest
    assert t.pinned_bytes == 4096 and t.get(key) == b"h" * 4096
    assert t.get((eid(0), 0)) is None
    t.unpin(key)
    assert t.pinned_bytes == 0
    check(t)
    t.close()


# -- sparse entries and passthrough ----------------------------------------------------------

def test_a_large_file_fills_block_by_block_and_is_passed_through_when_complete():
    t = MemoryTier(1 << 20)
    size = 3 * BS + 100
    blocks = [bytes([i]) * (BS if i < 3 else 100) for i in range(4)]
    for i in (2, 0, 3):                                     # out of order
        assert put(t, 7, blocks[i], index_=i, size=size)
        assert t.backing_file(eid(7)) is None               # not complete: no passthrough
    assert put(t, 7, blocks[1], index_=1, size=size)
    path = t.backing_file(eid(7))
    with open(path, "rb") as f:
        assert f.read() == b"".join(blocks)                 # the file's bytes and nothing else
    assert os.path.getsize(path) == size
    check(t)
    t.close()


def test_an_evicted_block_of_a_large_file_is_punched_out_unless_the_file_is_open():
    t = MemoryTier(1 << 20, policy="lru")
    size = 4 * BS
    for i in range(4):
        put(t, 3, bytes([i + 1]) * BS, index_=i, size=size)
    path = t.file_of(eid(3).hex())
    used = os.stat(path).st_blocks
    t.discard((eid(3), 1))                                   # one block goes: a hole
    assert os.stat(path).st_blocks < used and t.entry(eid(3)).present == 3
    with open(path, "rb") as f:
        f.seek(BS)
        assert f.read(BS) == bytes(BS)
    assert t.get((eid(3), 2)) == b"\3" * BS
    put(t, 3, b"\2" * BS, index_=1, size=size)
    assert t.acquire(eid(3))                                 # the kernel reads it directly now
    fd = os.open(path, os.O_RDONLY)
    try:
        t.discard((eid(3), 0))                               # no hole under a reader: the entry goes
        assert t.entry(eid(3)) is None and not os.path.exists(path)
        assert t.get((eid(3), 2)) is None
        assert os.pread(fd, BS, BS) == b"\2" * BS            # the open file keeps its bytes
    finally:
        os.close(fd)
    check(t)
    t.close()


# -- NVMe -------------------------------------------------------------------------------------

@pytest.fixture
def disk(tmp_path):
    tiers = []

    def make(capacity=8 << 20, stats=None, policy="keep", name="store", **kw):
        t = DiskTier(str(tmp_path / name), capacity, stats or Stats(), policy=policy, scrub=False, **kw)
        tiers.append(t)
        return t

    yield make
    for t in tiers:
        t.close()


def test_disk_tier_roundtrip_and_persistence_without_the_source(disk):
    t = disk()
    data = os.urandom(50_000)
    assert put(t, 1, data)
    assert t.get((eid(1), 0)) == data
    t.close()
    t2 = disk()
    assert t2.info_of(eid(1)).path == "/f1"
    assert t2.attr_of("/f1")[0].size == 50_000               # what a remount answers lookups from
    assert t2.entry(eid(1)).unverified == {0}                # checked once after each start ...
    assert t2.get((eid(1), 0)) == data and t2.entry(eid(1)).unverified is None  # ... on first use
    check(t2)


def test_a_block_changed_between_two_runs_is_never_served(disk):
    stats = Stats()
    t = disk(stats=stats)
    put(t, 1, os.urandom(50_000))
    t.close()                                                 # a clean stop
    with open(t.file_of(eid(1).hex()), "r+b") as f:
        f.write(b"rot")
    t2 = disk(stats=stats)
    assert t2.backing_file(eid(1)) is None and t2.get((eid(1), 0)) is None
    assert stats.get("disk.checksum_failures") == 1


def _reads(monkeypatch) -> list[int]:
    """Count the tiers' block reads (each read of a cached block, checked or served)."""
    from cachefs.tiers import checks as checks_mod
    from cachefs.tiers import store as store_mod

    count: list[int] = []
    for mod in (store_mod, checks_mod):
        for name in ("pread", "pread_direct"):
            real = getattr(mod, name)

            def counted(fd, offset, length, _real=real):
                count.append(length)
                return _real(fd, offset, length)

            monkeypatch.setattr(mod, name, counted)
    return count


@pytest.fixture
def no_margin(monkeypatch):
    """A margin of 20 ms instead of CLEAN_MARGIN_NS, which the tests cannot wait: files
    written 50 ms before a clean stop count as written back by it. (Not 0: a file's ctime
    comes from the kernel's coarse clock, up to a tick behind the stop's own time.)"""
    from cachefs.tiers import checks as checks_mod

    monkeypatch.setattr(checks_mod, "CLEAN_MARGIN_NS", 20_000_000)


def test_after_a_clean_stop_unchanged_files_are_trusted_without_reading_them(disk, monkeypatch, no_margin):
    stats = Stats()
    t = disk(stats=stats)
    data = {n: os.urandom(50_000) for n in (1, 2, 3)}
    for n, d in data.items():
        put(t, n, d)
    time.sleep(0.05)
    t.close()                                                 # syncfs, then the clean mark
    with open(t.file_of(eid(3).hex()), "r+b") as f:           # written to while nothing runs
        f.seek(100)
        f.write(b"rot")
    reads = _reads(monkeypatch)
    t2 = disk(stats=stats)
    assert t2.backing_file(eid(1)) == t2.file_of(eid(1).hex())  # passed through: no read at all
    assert reads == [] and t2.entry(eid(1)).unverified is None
    assert t2.get((eid(2), 0)) == data[2] and reads == [50_000]  # the read it serves, no check
    assert t2.backing_file(eid(3)) is None and t2.entry(eid(3)) is None  # its ctime says changed
    assert stats.get("disk.trusted_files") == 2 and stats.get("disk.checksum_failures") == 1
    check(t2)


def test_a_clean_stop_vouches_only_for_what_it_wrote_back(disk, no_margin):
    """Files not checked during a run keep the mark of the clean stop that wrote them back,
    not the next one: a file changed during that run is still caught. Files written after
    the last clean stop (then a kill) are read and compared."""
    stats = Stats()
    t = disk(stats=stats)
    put(t, 1, os.urandom(50_000))
    put(t, 2, os.urandom(50_000))
    time.sleep(0.05)
    t.close()
    t2 = disk(stats=stats)                                    # a run that reads neither ...
    with open(t2.file_of(eid(1).hex()), "r+b") as f:          # ... while someone scribbles
        f.write(b"rot")
    time.sleep(0.05)
    t2.close()                                                # a clean stop after it
    t3 = disk(stats=stats)
    three = os.urandom(50_000)
    put(t3, 3, three)
    t3.flush()
    t3._stop.set()
    os.close(t3._log_fd)                                      # kill -9
    t3._log_fd = -1
    t4 = disk(stats=stats)
    assert type(t4.entry(eid(2)).unverified).__name__ == "Synced"
    assert type(t4.entry(eid(3)).unverified) is set           # after the last clean stop: read
    assert t4.get((eid(1), 0)) is None and stats.get("disk.checksum_failures") == 1
    assert t4.backing_file(eid(2)) is not None and stats.get("disk.trusted_files") == 1
    assert t4.get((eid(3), 0)) == three and stats.get("disk.trusted_files") == 1
    check(t4)


def test_the_restart_check_trusts_a_clean_cache_at_a_stat_per_file(tmp_path, monkeypatch, no_margin):
    stats = Stats()
    t = DiskTier(str(tmp_path / "store"), 8 << 20, stats, scrub=False)
    for n in range(20):
        put(t, n, os.urandom(20_000))
    time.sleep(0.05)
    t.close()
    reads = _reads(monkeypatch)
    t2 = DiskTier(str(tmp_path / "store"), 8 << 20, stats)  # with its background checks
    try:
        deadline = time.monotonic() + 10
        while stats.get("disk.trusted_files") < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stats.get("disk.trusted_files") == 20 and reads == []
        assert stats.get("disk.scrubbed_bytes") == 0
        assert t2._entries == {}                           # trusted in the table, none brought into memory
        assert all(t2.entry(eid(n)).unverified is None for n in range(20))
    finally:
        t2.close()


def test_a_start_after_a_clean_stop_does_not_rewrite_the_index(disk):
    """A clean stop leaves the index compact: the next start appends to it instead of
    writing it all again (2 s of a 200,000-file mount), and what it appends is read back."""
    t = disk()
    put(t, 1, b"x" * 5000)
    put(t, 2, b"y" * 5000)
    t.discard((eid(2), 0))
    t.close()
    ino = os.stat(os.path.join(t.directory, index.NAME)).st_ino
    t2 = disk()
    assert os.stat(os.path.join(t2.directory, index.NAME)).st_ino == ino  # not replaced
    put(t2, 3, b"z" * 5000)
    t2.close()
    t3 = disk()
    assert t3.get((eid(1), 0)) == b"x" * 5000 and t3.get((eid(3), 0)) == b"z" * 5000
    assert t3.entry(eid(2)) is None
    check(t3)


def test_after_an_unclean_stop_each_block_is_checked_once_before_it_is_served(disk, tmp_path):
    stats = Stats()
    t = disk(stats=stats)
    good, bad = os.urandom(50_000), os.urandom(50_000)
    put(t, 1, good)
    put(t, 2, bad)
    t.flush()                                                # the index lines reached the disk ...
    t._stop.set()
    os.close(t._log_fd)                                      # ... then a kill -9: no clean mark
    t._log_fd = -1
    with open(t.file_of(eid(2).hex()), "r+b") as f:          # a torn write, bit rot
        f.seek(1000)
        f.write(b"\xff\xfe")
    t2 = disk(stats=stats)
    assert t2.entry(eid(1)).unverified == {0} and t2.entry(eid(2)).unverified == {0}
    assert t2.get((eid(1), 0)) == good and t2.entry(eid(1)).unverified is None
    assert t2.get((eid(2), 0)) is None and t2.entry(eid(2)) is None
    assert stats.get("disk.checksum_failures") == 1
    check(t2)


def test_an_empty_file_after_a_crash_is_never_passed_through(disk):
    t = disk()
    put(t, 1, os.urandom(50_000))
    t.flush()
    t._stop.set()
    os.close(t._log_fd)
    t._log_fd = -1
    os.truncate(t.file_of(eid(1).hex()), 0)                  # renamed in, data never written back
    t2 = disk()
    assert t2.backing_file(eid(1)) is None and t2.entry(eid(1)) is None


def test_blocks_whose_index_lines_a_kill_lost_are_deleted_at_start(disk):
    t = disk()
    put(t, 1, b"x" * 5000)
    t.flush()
    put(t, 2, b"y" * 5000)                                   # its line still waits in memory
    t._stop.set()
    os.close(t._log_fd)                                      # kill -9
    t._log_fd = -1
    t2 = disk()
    assert t2.get((eid(1), 0)) == b"x" * 5000 and t2.entry(eid(2)) is None
    assert not os.path.exists(t2.file_of(eid(2).hex()))     # an unrecorded file: deleted


def test_the_scrub_finds_bit_rot_in_a_trusted_block(disk):
    stats = Stats()
    t = disk(stats=stats)
    put(t, 1, os.urandom(50_000))
    with open(t.file_of(eid(1).hex()), "r+b") as f:
        f.write(b"rot")
    assert t._check_block((eid(1), 0)) == 50_000
    assert stats.get("disk.checksum_failures") == 1 and t.entry(eid(1)) is None
    assert stats.get("disk.scrubbed_bytes") == 50_000


@pytest.mark.parametrize("path", ["scrub", "read"])
def test_a_block_evicted_or_rewritten_while_it_is_checked_is_a_miss_not_corruption(disk, monkeypatch, path):
    """The scrub (and a first read after a restart) reads a block, then compares it with its
    hash; an eviction in between punches or unlinks the file, and the bytes read are short
    or zeros. That once counted as a checksum failure on a healthy cache (and dropped the
    entry that had taken the name)."""
    from cachefs.tiers import checks as disk_mod
    from cachefs.tiers import store as store_mod

    stats = Stats()
    t = disk(stats=stats)
    t._direct = False                      # reads through pread, patched below
    put(t, 1, os.urandom(50_000))
    if path == "read":
        t.entry(eid(1)).unverified = {0}   # as after a restart: the first read checks it
    real = store_mod.pread

    def evicted_meanwhile(fd, offset, length):
        t.discard((eid(1), 0))             # another thread's eviction
        put(t, 1, os.urandom(50_000))      # and the entry cached anew under its name
        return bytes(length)

    monkeypatch.setattr(store_mod, "pread", evicted_meanwhile)
    monkeypatch.setattr(disk_mod, "pread", evicted_meanwhile)
    if path == "scrub":
        t._check_block((eid(1), 0))
    else:
        assert t.get((eid(1), 0)) is None  # a miss
    monkeypatch.setattr(store_mod, "pread", real)
    monkeypatch.setattr(disk_mod, "pread", real)
    assert stats.get("disk.checksum_failures") == 0
    assert t.entry(eid(1)) is not None and len(t.get((eid(1), 0))) == 50_000   # the new one stays


def kill(t):
    """What a kill -9 leaves: the index lines written so far, no clean stop."""
    t.flush()
    t._stop.set()
    os.close(t._log_fd)
    t._log_fd = -1


def test_damaged_index_lines_cost_their_blocks_not_the_mount(disk, caplog):
    t = disk()
    for n in range(10):
        put(t, n, bytes([n]) * 5000)
    kill(t)                                                   # (a clean stop leaves a table, below)
    path = os.path.join(t.directory, index.NAME)
    lines = open(path, "rb").read().splitlines(keepends=True)
    damaged = [lines[i] if i % 3 else lines[i].replace(b"\t", b" ", 1) for i in range(len(lines))]
    open(path, "wb").write(b"".join(damaged) + b"\x00garbage\xff\n")
    with caplog.at_level(logging.WARNING):
        t2 = disk()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "damaged index lines" in warnings[0].getMessage()
    held = [n for n in range(10) if t2.get((eid(n), 0)) == bytes([n]) * 5000]
    assert 0 < len(held) < 10                                 # what verifies is kept
    assert len(os.listdir(os.path.join(t2.directory, "data", eid(0).hex()[:2]))) >= 0
    files = [f for d, _, fs in os.walk(os.path.join(t2.directory, "data")) for f in fs]
    assert len(files) == len(held)                            # the rest were deleted as orphans
    check(t2)


def test_an_unreadable_index_is_set_aside_and_the_tier_starts_empty(disk, caplog):
    t = disk()
    put(t, 1, b"x" * 5000)
    t.close()
    path = os.path.join(t.directory, index.NAME)
    os.unlink(path)
    os.mkdir(path)                                            # reading it fails with EISDIR
    with caplog.at_level(logging.WARNING):
        t2 = disk()
    assert "set aside" in caplog.text and t2.get((eid(1), 0)) is None
    assert any(n.startswith(index.NAME + ".unreadable-") for n in os.listdir(t2.directory))
    assert put(t2, 2, b"y" * 5000) and t2.get((eid(2), 0)) == b"y" * 5000


@pytest.mark.parametrize("clean", [False, True])
def test_files_no_index_line_describes_are_deleted_at_start(disk, clean):
    t = disk()
    put(t, 1, b"x" * 5000)
    t.close() if clean else kill(t)
    orphan = t.file_of(eid(77).hex())
    os.makedirs(os.path.dirname(orphan), exist_ok=True)
    open(orphan, "wb").write(b"written, never recorded")
    os.utime(orphan, (time.time() - 60, time.time() - 60))
    recent = t.file_of(eid(78).hex())                         # written since the start: a fetch's, unadopted
    stranger = os.path.join(t.directory, "data", "zz", eid(79).hex())  # not a subdirectory of ours
    os.makedirs(os.path.dirname(stranger), exist_ok=True)
    open(stranger, "wb").write(b"someone else's")
    t2 = disk()
    os.makedirs(os.path.dirname(recent), exist_ok=True)
    open(recent, "wb").write(b"being written")
    if clean:  # a start from the table lists nothing: the background sweep finds it
        assert os.path.exists(orphan) and t2._sweep_orphans() == 1
    assert not os.path.exists(orphan) and t2.get((eid(1), 0)) == b"x" * 5000
    assert os.path.exists(recent) and os.path.exists(stranger)


def test_an_entry_whose_file_is_gone_is_dropped_at_start(disk):
    t = disk()
    put(t, 1, b"x" * 5000)
    put(t, 2, b"y" * 5000)
    t.close()
    os.unlink(t.file_of(eid(1).hex()))
    t2 = disk()                                               # (from the table: dropped once touched)
    assert t2.get((eid(1), 0)) is None and t2.entry(eid(1)) is None and t2.get((eid(2), 0)) == b"y" * 5000
    check(t2)


@pytest.mark.parametrize("policy", ["keep", "lru"])
def test_disk_tier_never_exceeds_its_budget(disk, policy):
    t = disk(capacity=1 << 20, policy=policy)
    rng = random.Random(3)
    for n in range(300):
        put(t, n, os.urandom(rng.randrange(1000, 30_000)))
        du = sum(os.lstat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(t.directory) for f in fs)
        du += sum(os.lstat(os.path.join(d, x)).st_blocks * 512 for d, xs, _ in os.walk(t.directory) for x in xs)
        assert du + 4096 <= t.capacity and t._volume() <= t.capacity, n
    check(t)


def test_disk_tier_files_are_private(disk):
    t = disk()
    put(t, 1, b"x" * 5000)
    assert stat.S_IMODE(os.stat(t.directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(t.file_of(eid(1).hex())).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.join(t.directory, index.NAME)).st_mode) == 0o600


def test_a_read_error_is_a_miss_and_counted(disk, monkeypatch):
    stats = Stats()
    t = disk(stats=stats)
    put(t, 1, b"x" * 5000)

    def broken(name):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(t._fds, "_open", broken)
    t._fds.forget(eid(1).hex())
    assert t.get((eid(1), 0)) is None
    assert stats.get("disk.errors") == 1


def test_multilevel_promotes_disk_hits_into_ram(disk):
    stats = Stats()
    d = disk(stats=stats)
    put(d, 1, b"data" * 1000)
    cache = MultiLevelCache(MemoryTier(1 << 20, stats), d, stats)
    assert cache.ram.get((eid(1), 0)) is None
    assert cache.get_local((eid(1), 0)) == (b"data" * 1000, "disk")
    assert cache.ram.get((eid(1), 0)) == b"data" * 1000
    assert stats.get("ram.promotions") == 1 and stats.get("disk.hits") == 1
    assert cache.get_local((eid(9), 0)) is None and stats.get("disk.misses") == 1
    backing = cache.acquire_backing(eid(1))
    assert backing.tier is cache.ram and backing.in_ram      # RAM first
    backing.release()
    cache.ram.close()


def test_disk_tier_reopened_with_a_smaller_budget_trims_itself(disk):
    t = disk(capacity=4 << 20)
    for n in range(40):
        put(t, n, os.urandom(50_000))
    t.close()
    t2 = disk(capacity=1 << 20)
    assert t2._volume() <= 1 << 20 and len(t2) < 40
    check(t2)


@pytest.mark.parametrize("policy", ["keep", "lru"])
def test_concurrent_readers_and_writers_see_exact_bytes(disk, policy):
    t = disk(capacity=2 << 20, policy=policy)
    contents = {n: bytes([n]) * (1000 + 997 * n) for n in range(60)}
    errors = []

    def work(seed):
        rng = random.Random(seed)
        for _ in range(300):
            n = rng.randrange(60)
            if rng.random() < 0.5:
                put(t, n, contents[n])
            else:
                got = t.get((eid(n), 0))
                if got is not None and got != contents[n]:
                    errors.append(n)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    check(t)
    t.close()
    t2 = disk(capacity=2 << 20, policy=policy)
    for key in list(t2.policy.keys()):
        assert t2.get(key) == contents[key[0][0]]


def _held_at(monkeypatch, module, name: str, first_only=lambda *a: True):
    """Patch `module.name` to stop at its first matching call until released: (reached,
    release). Another thread's step can then be put exactly into the gap."""
    real = getattr(module, name)
    reached, release, hits = threading.Event(), threading.Event(), []

    def held(*args, **kw):
        if not hits and first_only(*args):
            hits.append(1)
            reached.set()
            release.wait(5)
        return real(*args, **kw)

    monkeypatch.setattr(module, name, held)
    return reached, release


def _in_the_gap(reached, release, step) -> None:
    """Run `step` in a thread while a held call waits, give it half a second (a fix that
    makes it wait for the held call's lock shows as a step still running), then release."""
    assert reached.wait(5)
    th = threading.Thread(target=step)
    th.start()
    th.join(0.5)
    release.set()
    th.join(5)


@pytest.fixture(params=["disk", "ram"])
def either(request, disk):
    """An NVMe tier, then a RAM tier: the file store both are."""
    if request.param == "disk":
        yield disk()
        return
    t = MemoryTier(4 << 20, Stats())
    yield t
    t.close()


def test_a_dropped_file_is_unlinked_before_a_newer_entry_of_its_id_can_be_written(either, monkeypatch):
    t = either
    data = b"v" * 5000
    assert put(t, 1, data)
    path = t.file_of(eid(1).hex())
    reached, release = _held_at(monkeypatch, os, "unlink", lambda p, *a: p == path)
    dropper = threading.Thread(target=t.discard, args=((eid(1), 0),))
    dropper.start()
    _in_the_gap(reached, release, lambda: put(t, 1, data))   # the same id written again meanwhile
    dropper.join(5)
    assert os.path.exists(path)                 # the drop's unlink did not take the newer file
    assert t.get((eid(1), 0)) == data
    check(t)


def test_a_punched_block_is_punched_before_it_can_be_written_again(disk, monkeypatch):
    from cachefs.tiers import store
    t = disk()
    first, second = os.urandom(BS), os.urandom(5000)
    assert put(t, 1, first, 0, size=BS + 5000) and put(t, 1, second, 1, size=BS + 5000)
    reached, release = _held_at(monkeypatch, store, "punch_hole")
    dropper = threading.Thread(target=t.discard, args=((eid(1), 0),))
    dropper.start()
    _in_the_gap(reached, release, lambda: put(t, 1, first, 0, size=BS + 5000))
    dropper.join(5)
    assert t.get((eid(1), 0)) == first          # not the hole the drop left
    t.close()
    assert disk().get((eid(1), 0)) == first     # nor after a restart (a clean stop trusts the file)


def test_a_read_that_meets_a_block_punched_meanwhile_is_a_miss_not_zeros(either, monkeypatch):
    from cachefs.tiers import store
    t = either
    first, second = os.urandom(BS), os.urandom(5000)
    assert put(t, 1, first, 0, size=BS + 5000) and put(t, 1, second, 1, size=BS + 5000)
    t.get((eid(1), 0))                           # (checked once: the next read is a plain one)
    got = []
    reached, release = _held_at(monkeypatch, store, "pread_direct" if getattr(t, "_direct", False) else "pread")
    reader = threading.Thread(target=lambda: got.append(t.get((eid(1), 0))))
    reader.start()
    _in_the_gap(reached, release, lambda: t.discard((eid(1), 0)))
    reader.join(5)
    assert got == [None]                         # the hole read back was not served as the block
    assert t.get((eid(1), 1)) == second
    check(t)


def test_disk_tier_reads_with_o_direct_where_the_filesystem_allows(disk, tmp_path):
    t = disk()
    data = bytes(range(256)) * 400 + b"tail"                  # not a multiple of 4096
    put(t, 1, data, bs=1 << 20)
    assert t._direct is True                                  # ext4 here; tmpfs would refuse
    assert t.get((eid(1), 0)) == data
    ram = MemoryTier(1 << 20)
    assert ram._direct is False
    ram.close()


def test_a_failing_cache_disk_turns_the_tier_off_with_one_warning(disk, monkeypatch, caplog):
    from cachefs.tiers import disk as disk_mod

    stats = Stats()
    t = disk(stats=stats)
    for n in range(10):
        put(t, n, b"x" * 5000)
    monkeypatch.setattr(t, "_open_write", lambda name: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space")))
    with caplog.at_level(logging.WARNING):
        for n in range(10, 30):
            assert not put(t, n, b"y" * 5000)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "NVMe tier off" in warnings[0].getMessage()
    assert t.suspended and t.get((eid(0), 0)) is None        # off: reads miss too
    assert stats.get("disk.errors") == disk_mod.SUSPEND_AFTER and stats.get("disk.suspensions") == 1
    t._suspended_until = 0                                    # SUSPEND_FOR later
    monkeypatch.undo()
    t.get((eid(0), 0))
    assert put(t, 40, b"z" * 5000) and t.get((eid(40), 0)) == b"z" * 5000


def test_a_vanished_cache_dir_is_a_pass_through_for_the_reader(tmp_path, caplog):
    from cachefs.memsource import MemorySource
    from tests.helpers import make_core

    caplog.set_level(logging.WARNING)
    source = MemorySource()
    for i in range(30):
        source.add_file(f"/f{i}", bytes([i]) * 20_000)
    tier = DiskTier(str(tmp_path / "store"), 10 << 20, scrub=False)
    core = make_core(source, ram=20_480, disk=tier)          # RAM holds one file
    for i in range(30):
        core.read(f"/f{i}", 0, 20_000)
    shutil.rmtree(tmp_path / "store")                         # someone cleaned up /tmp
    for _ in range(2):
        for i in range(30):
            assert core.read(f"/f{i}", 0, 20_000) == bytes([i]) * 20_000
    assert tier.suspended and not (tmp_path / "store").exists()  # nothing written to a ghost
    assert caplog.text.count("NVMe tier off") == 1 and "was removed" in caplog.text
    core.close()


@pytest.mark.parametrize("tier_kind", ["ram", "disk"])
def test_a_range_of_a_block_is_read_alone_and_exact(tmp_path, tier_kind):
    """A 4 KiB page fault reads 4 KiB, not the block: ranges at every alignment, both
    tiers (the NVMe one reads with O_DIRECT, in whole pages around the range), before and
    after the block's check after a restart."""
    rng = random.Random(7)
    data = rng.randbytes(BS - 123)
    ranges = [(0, 1), (1, 4097), (4095, 4097), (4096, 8192), (BS - 5000, BS - 123), (12345, 54321), (0, None)]
    if tier_kind == "ram":
        tier = MemoryTier(1 << 20, Stats())
    else:
        first = DiskTier(str(tmp_path), 1 << 20, Stats(), scrub=False)
        put(first, 1, data)
        first.close()
        tier = DiskTier(str(tmp_path), 1 << 20, Stats(), scrub=False)  # restored: still to be checked
    if tier_kind == "ram":
        put(tier, 1, data)
    for lo, hi in ranges:
        assert tier.get((eid(1), 0), lo, hi) == data[lo:hi]
    tier.close()


def test_the_descriptor_cache_serves_many_threads_without_a_wrong_descriptor(tmp_path):
    """Entry files stay open for reading (an LRU of descriptors): threads that open, evict
    and reuse them at once never read through a closed or reused descriptor."""
    import concurrent.futures as cf

    tier = DiskTier(str(tmp_path), 8 << 20, Stats(), scrub=False)
    tier._fds._limit = 2
    blobs = {n: os.urandom(BS) for n in range(6)}
    for n, data in blobs.items():
        put(tier, n, data)

    def work(seed):
        rng = random.Random(seed)
        for _ in range(300):
            n = rng.randrange(6)
            lo = rng.randrange(0, BS - 4096)
            assert tier.get((eid(n), 0), lo, lo + 4096) == blobs[n][lo:lo + 4096]
        return True

    with cf.ThreadPoolExecutor(8) as ex:
        assert all(ex.map(work, range(8)))
    tier.close()


def test_small_blocks_cost_their_bytes_on_disk_not_a_header_each(tmp_path):
    """--block-size 4KiB: a cached file is one file holding its bytes at their own offsets
    (the earlier per-block header made each 4 KiB block an 8 KiB file: 302 MiB for 177)."""
    import random

    from cachefs.memsource import MemorySource
    from tests.helpers import make_core

    rng = random.Random(3)
    source = MemorySource()
    total = 0
    for i in range(60):
        size = rng.randint(1000, 300_000)
        source.add_file(f"/f{i}", os.urandom(size))
        total += size
    d = DiskTier(str(tmp_path / "store"), 64 << 20, Stats(), scrub=False)
    core = make_core(source, ram=64 << 10, disk=d, block_size=4096)
    for i in range(60):
        size = source.stat(f"/f{i}").size
        for off in range(0, size, 4096):
            core.read(f"/f{i}", off, 4096)
    d.flush()
    on_disk = sum(os.stat(os.path.join(dp, n)).st_blocks * 512
                  for dp, _, names in os.walk(tmp_path / "store") for n in names)
    assert total <= on_disk <= total * 1.1 + (1 << 20), (total, on_disk)
    d.close()


def test_the_scrub_passes_once_per_interval_and_not_at_all_with_0(tmp_path):
    """The scrub went round the whole tier forever (an idle mount of small files spent
    17-25% of a core on it); now it is one bounded pass per --scrub-interval, none with 0."""
    for every, passes in ((0.2, True), (0.0, False)):
        stats = Stats()
        t = DiskTier(str(tmp_path / f"s{every}"), 8 << 20, stats, scrub_every=every)
        try:
            for i in range(3):
                put(t, i, os.urandom(4096))
            if passes:
                deadline = time.monotonic() + 20
                while stats.get("disk.scrub_passes") < 1:
                    assert time.monotonic() < deadline, "no pass"
                    time.sleep(0.05)
                assert stats.get("disk.scrubbed_bytes") >= 3 * 4096
            else:
                time.sleep(1.5)  # the old loop started its next round after 1 s
                assert stats.get("disk.scrub_passes") == 0 and stats.get("disk.scrubbed_bytes") == 0
        finally:
            t.close()
