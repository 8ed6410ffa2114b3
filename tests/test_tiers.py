import os
import random
import time

import pytest

from cachefs.checksum import encode_block
from cachefs.stats import Stats
from cachefs.tiers.disk import DiskTier, disk_key
from cachefs.tiers.memory import MemoryTier
from cachefs.tiers.multilevel import MultiLevelCache


def check_memory_invariants(tier: MemoryTier):
    entries = tier._entries
    assert tier.used_bytes == sum(len(v) for v in entries.values())
    assert tier.used_bytes <= tier.capacity
    tier.check()


def test_memory_tier_keep_policy_refuses_instead_of_evicting():
    stats = Stats()
    t = MemoryTier(100, stats)  # the default policy: keep what you have
    assert t.put(b"a", b"x" * 40) and t.put(b"b", b"y" * 40)
    assert not t.put(b"c", b"z" * 40)  # full, nothing idle: c is not admitted
    assert not t.put(b"d", b"w" * 40, evict=False)  # a guess: no room
    assert t.get(b"a") and t.get(b"b") and t.get(b"c") is None
    assert stats.get("ram.evictions") == 0
    assert stats.get("ram.refused") == 1 and stats.get("ram.no_room") == 1
    check_memory_invariants(t)


def test_memory_tier_lru_and_budget():
    stats = Stats()
    t = MemoryTier(100, stats, policy="lru")
    assert t.put(b"a", b"x" * 40) and t.put(b"b", b"y" * 40)
    assert t.get(b"a") == b"x" * 40            # a is now most recent
    assert t.put(b"c", b"z" * 40)              # evicts b, the least recent
    assert t.get(b"b") is None and t.get(b"a") is not None and t.get(b"c") is not None
    assert stats.get("ram.evictions") == 1
    check_memory_invariants(t)


def test_memory_tier_refuses_oversized_block_without_evicting():
    t = MemoryTier(100)
    t.put(b"a", b"x" * 60)
    assert not t.put(b"big", b"y" * 101)
    assert t.get(b"a") == b"x" * 60
    check_memory_invariants(t)


@pytest.mark.parametrize("policy", ["keep", "lru"])
def test_memory_tier_invariants_under_random_operations(policy):
    rng = random.Random(7)
    t = MemoryTier(1000, policy=policy)
    for _ in range(3000):
        key = b"k%d" % rng.randrange(50)
        op = rng.random()
        if op < 0.6:
            t.put(key, b"v" * rng.randrange(0, 400))
        elif op < 0.9:
            t.get(key)
        else:
            t.discard(key)
        check_memory_invariants(t)


@pytest.fixture
def disk(tmp_path):
    tiers = []

    def make(capacity=10 << 20, stats=None, **kw):
        t = DiskTier(str(tmp_path / "blocks"), capacity, stats or Stats(), **kw)
        tiers.append(t)
        return t

    yield make
    for t in tiers:
        t.close()


def test_disk_tier_roundtrip_and_persistence(disk, tmp_path):
    t = disk()
    t.put(b"k1", b"hello")
    t.put(b"k2", b"x" * 100_000)  # stored as a separate file by diskcache
    t.flush()
    t.close()
    t2 = disk()
    assert t2.get(b"k1") == b"hello"
    assert t2.get(b"k2") == b"x" * 100_000
    assert t2.get(b"nope") is None


def test_disk_tier_detects_corruption_counts_and_drops(disk, tmp_path):
    stats = Stats()
    t = disk(stats=stats)
    t.put_now(b"k", b"A" * 100_000)
    files = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path / "blocks") for f in fs if f.endswith(".val")]
    assert len(files) == 1
    with open(files[0], "r+b") as f:
        f.seek(50_000)
        f.write(b"B")
    assert t.get(b"k") is None
    assert stats.get("disk.checksum_failures") == 1
    assert b"k" not in t            # the bad entry is gone: the next read refetches
    assert t.get(b"k") is None
    assert stats.get("disk.checksum_failures") == 1


def test_disk_tier_blob_stored_under_wrong_key_is_a_miss(disk):
    stats = Stats()
    t = disk(stats=stats)
    t.put_now(b"k2", b"data")
    t._cache.set(disk_key(b"k2"), encode_block(b"k1", b"data"))   # k1's blob now stored under k2
    assert t.get(b"k2") is None
    assert stats.get("disk.checksum_failures") == 1


def test_disk_tier_index_answers_misses_without_the_database(disk):
    t = disk()
    t.put_now(b"old", b"x")
    t.close()
    t = disk()
    assert t._index_ready.wait(5)
    real = t._cache

    class Counting:
        calls = 0

        def get(self, *a, **k):
            Counting.calls += 1
            return real.get(*a, **k)

    t._cache = Counting()
    try:
        assert t.get(b"never-stored") is None
        assert Counting.calls == 0                  # a miss costs a set lookup only
        assert t.get(b"old") == b"x"                # a block from before the restart is found
        assert Counting.calls == 1
    finally:
        t._cache = real


@pytest.mark.parametrize("policy", ["keep", "lru"])
def test_disk_tier_never_exceeds_capacity(disk, policy):
    cap = 2 << 20
    t = disk(capacity=cap, policy=policy)
    rng = random.Random(1)
    for i in range(200):
        t.put_now(b"k%d" % i, rng.randbytes(rng.randrange(1000, 200_000)))
        assert t.used_bytes <= cap
        t.check()
    assert t.used_bytes > cap // 2       # and it is actually used
    if policy == "lru":
        assert t.get(b"k199") is not None and t.get(b"k0") is None  # the newest survives
    else:
        assert t.get(b"k0") is not None and t.get(b"k199") is None  # the first ones stay


def test_disk_tier_files_are_private(disk, tmp_path):
    old = os.umask(0o077)
    try:
        t = disk()
        t.put_now(b"k", b"x" * 100_000)
    finally:
        os.umask(old)
    root = tmp_path / "blocks"
    assert os.stat(root).st_mode & 0o777 == 0o700
    for r, _dirs, files in os.walk(root):
        for f in files:
            assert os.stat(os.path.join(r, f)).st_mode & 0o077 == 0, f


def test_disk_tier_io_error_is_a_miss(disk):
    stats = Stats()
    t = disk(stats=stats)
    t.put_now(b"k", b"x")

    class Broken:
        def get(self, *a, **k):
            raise OSError(5, "EIO")

    t._cache, real = Broken(), t._cache
    try:
        assert t.get(b"k") is None
        assert stats.get("disk.errors") == 1
    finally:
        t._cache = real


def test_multilevel_promotes_disk_hits_into_ram(disk):
    stats = Stats()
    d = disk(stats=stats)
    d.put_now(b"k", b"data")
    cache = MultiLevelCache(MemoryTier(1000, stats), d, stats)
    assert cache.ram.get(b"k") is None
    assert cache.get_disk(b"k") == b"data"
    assert cache.ram.get(b"k") == b"data"
    assert stats.get("ram.promotions") == 1 and stats.get("disk.hits") == 1
    assert cache.get_disk(b"missing") is None and stats.get("disk.misses") == 1


def test_disk_tier_reopened_with_a_smaller_budget_trims_itself(disk):
    t = disk(capacity=8 << 20)
    for i in range(40):
        t.put_now(b"k%d" % i, bytes(150_000))
    assert t.used_bytes > 4 << 20
    t.close()
    small = disk(capacity=2 << 20)
    small.flush()  # the writer trims before its first write
    deadline = time.monotonic() + 5
    while small.used_bytes > 2 << 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert small.used_bytes <= 2 << 20


def test_batched_background_writes_respect_the_budget(disk):
    cap = 3 << 20
    t = disk(capacity=cap, policy="lru")
    rng = random.Random(5)
    for i in range(120):
        t.put(b"q%d" % i, rng.randbytes(rng.randrange(10_000, 150_000)))
        if i % 10 == 0:
            assert t.used_bytes <= cap
    t.flush()
    assert t.used_bytes <= cap
    assert t.get(b"q119") is not None
    assert t._stats.get("disk.writes") == 120
    t.check()


@pytest.mark.parametrize("policy", ["keep", "lru"])
def test_disk_files_match_the_index_under_concurrent_reads(disk, tmp_path, policy):
    """Lookups racing the writer's uncommitted batches must not drop keys from the index:
    a dropped key's file would stay on disk, outside the budget's account."""
    import threading

    cap = 3 << 20
    t = disk(capacity=cap, policy=policy)
    keys = [b"key%d" % i for i in range(150)]
    stop = threading.Event()

    def reader():
        rng = random.Random()
        while not stop.is_set():
            t.get(rng.choice(keys))

    readers = [threading.Thread(target=reader) for _ in range(4)]
    for r in readers:
        r.start()
    try:
        for key in keys:
            t.put(key, os.urandom(60_000))
        t.flush()
    finally:
        stop.set()
        for r in readers:
            r.join()
    vals = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "blocks") for f in fs if f.endswith(".val")]
    assert len(vals) == len(t.policy)
    assert sum(-(-os.path.getsize(v) // 4096) * 4096 for v in vals) == t.policy.used
    t.check()


def test_orphaned_value_files_are_removed_at_start_and_young_ones_kept(disk, tmp_path):
    """A kill -9 between a value file's write and its row's commit leaves a file no row
    names; the next start deletes it (the budget could not count it), but not a file young
    enough to belong to another daemon's batch in flight."""
    t = disk()
    t.put_now(b"kept", b"k" * 50_000)
    t.close()
    blocks = tmp_path / "blocks"
    old_orphan = blocks / "3" / ("0" * 31 + ".val")
    young_orphan = blocks / "5" / ("1" * 31 + ".val")
    for f in (old_orphan, young_orphan):
        f.parent.mkdir(exist_ok=True)
        f.write_bytes(os.urandom(40_000))
    past = time.time() - 3600
    os.utime(old_orphan, (past, past))
    t2 = disk()
    t2.flush()  # the writer has finished start-up once it has written
    t2.put_now(b"other", b"o" * 1000)
    assert not old_orphan.exists()
    assert young_orphan.exists()
    assert t2.get(b"kept") == b"k" * 50_000
    vals = [f for f in blocks.rglob("*.val") if f != young_orphan]
    assert len(vals) == len(t2.policy) == 2


def test_an_index_row_whose_file_an_unclean_stop_deleted_is_dropped_at_start(disk, tmp_path, caplog):
    """Inside the writer's transaction diskcache deletes a replaced (or evicted) block's
    file at once; the row's change waits for the commit. A transaction that never commits
    (kill -9, or a failed commit rolled back, as here) leaves the old row naming a deleted
    file: a miss to readers, but counted in the budget until the next start drops it."""
    import logging

    caplog.set_level(logging.WARNING)
    t = disk()
    t.put_now(b"a", b"1" * 50_000)
    t.put_now(b"b", b"2" * 50_000)
    with pytest.raises(RuntimeError), t._cache.transact(retry=True):
        t.put_now(b"a", b"3" * 50_000)  # replaces a: its old file is deleted now
        raise RuntimeError("killed before the commit")
    assert t.get(b"a") is None              # the restored row names a deleted file: a miss
    t.close()
    t2 = disk()
    t2.flush()
    assert b"a" not in t2 and t2.get(b"b") == b"2" * 50_000
    assert len(t2.policy) == 1
    assert "dropped 1 index entries whose block files" in caplog.text
    t2.put_now(b"a", b"4" * 50_000)
    assert t2.get(b"a") == b"4" * 50_000


def test_disk_tier_reads_with_o_direct_and_falls_back_where_refused(tmp_path, monkeypatch):
    import errno
    import os

    from cachefs.tiers import disk as disk_mod

    monkeypatch.setattr(disk_mod._BlockDisk, "direct", True)
    opened, refuse = [], []
    real_open = os.open

    def spy(path, flags, *a, **k):
        if str(path).endswith(".val") and not flags & (os.O_WRONLY | os.O_RDWR):
            opened.append(bool(flags & os.O_DIRECT))
            if refuse and flags & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")   # what a filesystem without it says
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(os, "open", spy)
    data = bytes(range(256)) * 400 + b"tail"                 # not a multiple of 4096
    t = DiskTier(str(tmp_path / "blocks"), 10 << 20)
    t.put(b"k", data)
    t.flush()
    assert t.get(b"k") == data and opened == [True]
    refuse.append(True)
    opened.clear()
    assert t.get(b"k") == data and t.get(b"k") == data
    assert opened == [True, False, False]                     # tried once, then buffered
    assert disk_mod._BlockDisk.direct is False
    t.close()


def test_a_failing_cache_disk_turns_the_tier_off_with_one_warning(disk, monkeypatch, caplog):
    import errno
    import logging

    from cachefs.tiers import disk as disk_mod

    caplog.set_level(logging.WARNING)
    t = disk()
    t.put_now(b"before", b"x" * 5000)
    calls = []

    def full(*a, **k):
        calls.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    real_set = t._cache.set
    t._cache.set = full
    for i in range(disk_mod.SUSPEND_AFTER):
        assert t.put_now(b"k%d" % i, b"y" * 5000) is False
    assert t.suspended and len(calls) == disk_mod.SUSPEND_AFTER
    assert t.put(b"later", b"z" * 5000) is False and t.put_now(b"later", b"z") is False
    assert len(calls) == disk_mod.SUSPEND_AFTER                 # the disk is left alone now
    assert t.get(b"before") is None and not t.has_room(10)       # reads too: a miss, no error
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "NVMe tier off" in warnings[0].message
    assert "No space left on device" in warnings[0].message
    t._cache.set = real_set
    t._suspended_until = 0                                      # SUSPEND_FOR later
    assert t.put_now(b"again", b"w" * 5000) and t.get(b"again") == b"w" * 5000
    assert "NVMe tier working again" in caplog.text


def test_a_vanished_cache_dir_is_a_pass_through_for_the_reader(tmp_path, caplog):
    import logging
    import shutil

    from cachefs.memsource import MemorySource
    from tests.helpers import make_core

    caplog.set_level(logging.WARNING)
    source = MemorySource()
    for i in range(30):
        source.add_file(f"/f{i}", bytes([i]) * 20_000)
    tier = DiskTier(str(tmp_path / "blocks"), 10 << 20)
    core = make_core(source, ram=20_000, disk=tier)              # RAM holds one file
    for i in range(30):
        core.read(f"/f{i}", 0, 20_000)
    tier.flush()
    shutil.rmtree(tmp_path / "blocks")                          # someone cleaned up /tmp
    for _ in range(2):
        for i in range(30):
            assert core.read(f"/f{i}", 0, 20_000) == bytes([i]) * 20_000
    assert tier.suspended and not (tmp_path / "blocks").exists()  # nothing written to a ghost
    assert caplog.text.count("NVMe tier off") == 1 and "was removed" in caplog.text
    core.close()


def test_a_removed_cache_dir_is_named_as_such_when_reads_fail_first(tmp_path, caplog):
    """Reads of a removed cache dir may fail ("unable to open database file") before any
    lookup finds a row without its file: the tier must still say the dir was removed and
    stay off until the next mount, not take it for a disk error and retry in 60 s (the
    mounted test flaked on exactly this under load)."""
    import logging
    import shutil
    import sqlite3

    caplog.set_level(logging.WARNING)
    tier = DiskTier(str(tmp_path / "blocks"), 10 << 20)
    tier.put_now(b"k", b"v" * 100)
    shutil.rmtree(tmp_path / "blocks")

    class Gone:
        def get(self, *a, **k):
            raise sqlite3.OperationalError("unable to open database file")

    tier._cache, real = Gone(), tier._cache
    try:
        for _ in range(12):
            assert tier.get(b"k") is None
    finally:
        tier._cache = real
    assert tier.suspended and tier._suspended_until == float("inf")
    assert "was removed" in caplog.text and "NVMe tier off for" not in caplog.text
    tier.close()
