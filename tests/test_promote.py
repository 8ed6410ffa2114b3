"""Promotions: an open of a file on NVMe gets the NVMe copy and queues the file for RAM,
which one background thread copies (the kernel's copy for a file of one block)."""

from __future__ import annotations

import errno
import os
import threading
import time

import pytest

from cachefs.stats import Stats
from cachefs.tiers import promote as promote_mod
from cachefs.tiers.disk import DiskTier
from cachefs.tiers.entry import allocated
from cachefs.tiers.memory import MemoryTier
from cachefs.tiers.multilevel import MultiLevelCache
from cachefs.tiers.promote import Promoter
from tests.test_tiers import BS, eid, info, no_margin, put  # noqa: F401  (no_margin: a fixture)


def _cache(tmp_path, ram_size: int = 1 << 20) -> tuple[MultiLevelCache, Stats]:
    stats = Stats()
    disk = DiskTier(str(tmp_path / "store"), 8 << 20, stats, scrub=False)
    return MultiLevelCache(MemoryTier(ram_size, stats), disk, stats), stats


def _on_disk(cache: MultiLevelCache, n: int, data: bytes) -> None:
    assert cache.disk is not None
    for index in range(-(-len(data) // BS)):
        assert put(cache.disk, n, data[index * BS:(index + 1) * BS], index, size=len(data))


def _ram_bytes(cache: MultiLevelCache, n: int) -> bytes:
    path = cache.ram.backing_file(eid(n))
    assert path is not None
    with open(path, "rb") as f:
        return f.read()


def test_an_open_gets_the_nvme_copy_and_the_file_is_copied_into_ram_behind_it(tmp_path):
    cache, stats = _cache(tmp_path)
    data = os.urandom(BS - 5)
    _on_disk(cache, 1, data)
    heard: list[bytes] = []
    cache.on_promoted(heard.append)
    found, from_ram = cache.open_backing(eid(1), len(data), promote=True)
    assert found is not None and not found.in_ram and not from_ram   # this open: NVMe
    found.release()
    assert cache.settle_promotions(10)
    assert _ram_bytes(cache, 1) == data and heard == [eid(1)]
    assert cache.ram.entry(eid(1)).hashes == cache.disk.entry(eid(1)).hashes   # the NVMe tier's hash
    assert stats.get("ram.promotions") == 1 and cache.ram.used_bytes == allocated(len(data))
    found, from_ram = cache.open_backing(eid(1), len(data), promote=True)
    assert found is not None and found.in_ram and from_ram           # the next: RAM
    found.release()
    cache.ram.check()
    cache.close()


def test_a_file_of_several_blocks_is_copied_block_by_block(tmp_path):
    cache, stats = _cache(tmp_path)
    data = os.urandom(2 * BS + 100)
    _on_disk(cache, 2, data)
    assert cache.count_opens([(eid(2), len(data), True)]) == ["disk"]
    assert cache.settle_promotions(10)
    assert _ram_bytes(cache, 2) == data and stats.get("ram.promotions") == 1
    assert cache.count_opens([(eid(2), len(data), True)]) == ["ram"]
    cache.close()


def test_nothing_is_queued_without_room_in_ram_and_nothing_evicted_for_it(tmp_path):
    cache, stats = _cache(tmp_path, ram_size=8192)
    assert put(cache.ram, 7, b"x" * 5000)   # RAM full (two pages)
    _on_disk(cache, 3, b"y" * 3000)
    found, _ = cache.open_backing(eid(3), 3000, promote=True)
    found.release()
    assert cache.settle_promotions(10)
    assert cache.ram.backing_file(eid(3)) is None and cache.ram.backing_file(eid(7)) is not None
    assert stats.get("ram.promotions") == 0
    cache.close()


def test_the_queue_is_bounded_and_a_file_is_queued_once(tmp_path):
    stats = Stats()
    disk = DiskTier(str(tmp_path / "store"), 8 << 20, stats, scrub=False)
    ram = MemoryTier(1 << 20, stats)
    promoter = Promoter(ram, disk, stats, limit=1)
    for n in range(4):
        assert put(disk, n, bytes([n]) * 100)
    copying, go_on = threading.Event(), threading.Event()
    promoter.listeners.append(lambda _: (copying.set(), go_on.wait(10)))
    promoter.want(eid(0))
    assert copying.wait(10)            # the thread holds file 0 (in its listener)
    promoter.want(eid(1))              # queued
    promoter.want(eid(1))              # queued already: nothing
    promoter.want(eid(2))              # the queue is full: skipped
    assert stats.get("ram.promotions_skipped") == 1
    go_on.set()
    assert promoter.drain(10)
    assert [ram.backing_file(eid(n)) is not None for n in range(3)] == [True, True, False]
    promoter.close()
    promoter.want(eid(3))              # closed: nothing
    assert ram.backing_file(eid(3)) is None
    disk.close()
    ram.close()


def test_a_file_dropped_from_nvme_or_being_written_to_ram_is_not_copied(tmp_path):
    stats = Stats()
    disk = DiskTier(str(tmp_path / "store"), 8 << 20, stats, scrub=False)
    ram = MemoryTier(1 << 20, stats)
    promoter = Promoter(ram, disk, stats)
    assert put(disk, 1, b"a" * 100) and put(disk, 2, b"b" * 100)
    disk.clear()
    assert not promoter.promote(eid(1))
    assert put(disk, 3, b"c" * 100)
    dest = ram.file_of(eid(3).hex())
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    open(dest, "wb").close()           # someone else's write of the same file
    assert not promoter.promote(eid(3))
    assert ram.used_bytes == 0 and ram.reserve(1 << 20)   # no room left held
    ram.unreserve(1 << 20)
    assert stats.get("ram.promotions") == 0
    disk.close()
    ram.close()


def test_where_the_kernel_refuses_the_copy_the_bytes_go_through_the_process(tmp_path, monkeypatch):
    stats = Stats()
    disk = DiskTier(str(tmp_path / "store"), 8 << 20, stats, scrub=False)
    ram = MemoryTier(1 << 20, stats)
    data = os.urandom(3000)
    assert put(disk, 4, data)

    def refused(*args):
        raise OSError(errno.EINVAL, "sendfile refused")

    monkeypatch.setattr(promote_mod.os, "sendfile", refused)
    assert Promoter(ram, disk, stats).promote(eid(4))
    with open(ram.backing_file(eid(4)), "rb") as f:
        assert f.read() == data
    assert ram.entry(eid(4)).hashes == disk.entry(eid(4)).hashes
    disk.close()
    ram.close()


def test_a_file_promoted_keeps_its_attributes_for_the_ram_tier(tmp_path):
    cache, _ = _cache(tmp_path)
    _on_disk(cache, 5, b"z" * 10)
    assert cache.count_opens([(eid(5), 10, True)]) == ["disk"]
    assert cache.settle_promotions(10)
    assert cache.ram.info_of(eid(5)) == info("/f5", 10)
    cache.close()


def test_a_report_counts_each_open_in_the_tier_that_holds_its_file(tmp_path):
    """count_opens takes a serving process's whole report (one lock per tier): a file in
    RAM is RAM's hit, one on NVMe only NVMe's (and queued for RAM), one in neither tier
    nothing, each in its place in the answer."""
    cache, stats = _cache(tmp_path)
    data = os.urandom(BS - 7)
    _on_disk(cache, 1, data)
    _on_disk(cache, 2, data)
    assert cache.count_opens([(eid(1), len(data), True)]) == ["disk"]
    assert cache.settle_promotions(10) and cache.in_ram(eid(1))
    before = stats.get("ram.promotions")
    report = [(eid(9), 10, True), (eid(2), len(data), True), (eid(1), len(data), True), (eid(2), len(data), False)]
    assert cache.count_opens(report) == [None, "disk", "ram", "disk"]
    assert cache.settle_promotions(10)
    assert stats.get("ram.promotions") == before + 1 and _ram_bytes(cache, 2) == data
    assert cache.count_opens([(eid(2), len(data), True), (eid(1), len(data), True)]) == ["ram", "ram"]
    cache.close()


def test_a_failed_copy_leaves_a_file_a_write_of_ram_s_own_made_meanwhile(tmp_path, monkeypatch):
    """The copy's file is deleted when the kernel's copy fails, unless an entry of RAM's
    own owns the path by then (a read's fill of the same file shares the file it created)."""
    cache, _ = _cache(tmp_path)
    data = os.urandom(5000)
    _on_disk(cache, 1, data)

    def copy_fails(src, out, size):
        assert put(cache.ram, 1, data)          # meanwhile: RAM's own write of the same file
        raise OSError(errno.EIO, "copy failed")

    monkeypatch.setattr(promote_mod, "_kernel_copy", copy_fails)
    assert not Promoter(cache.ram, cache.disk, Stats()).promote(eid(1))
    assert _ram_bytes(cache, 1) == data and cache.ram.get((eid(1), 0)) == data
    cache.ram.check()
    cache.close()


@pytest.mark.usefixtures("no_margin")
def test_a_file_left_in_the_entry_table_is_promoted_from_its_record_and_stays_there(tmp_path):
    """After a remount, a promotion of a whole file of one block restored from the table
    copies it from its record (checked at one stat if the restart check has not reached it),
    without bringing it into the NVMe tier's memory; a file written to while nothing ran is
    not copied from its record, and never with its new bytes."""
    stats = Stats()
    disk = DiskTier(str(tmp_path / "store"), 8 << 20, stats, scrub=False)
    data = {n: os.urandom(3000 + n) for n in range(6)}
    for n, d in data.items():
        assert put(disk, n, d)
    time.sleep(0.05)
    disk.close()
    with open(disk.file_of(eid(5).hex()), "r+b") as f:   # written to while nothing runs
        f.write(b"X")
    disk = DiskTier(str(tmp_path / "store"), 8 << 20, stats, scrub=True)
    cache = MultiLevelCache(MemoryTier(1 << 20, stats), disk, stats)
    assert cache.count_opens([(eid(n), len(d), True) for n, d in data.items()]) == ["disk"] * 6
    assert cache.settle_promotions(10)
    assert [cache.in_ram(eid(n)) for n in data] == [True] * 5 + [False]
    assert all(_ram_bytes(cache, n) == data[n] for n in range(5))
    assert stats.get("ram.promotions") == 5 and stats.get("disk.trusted_files") >= 5
    assert set(disk._entries) <= {eid(5)}                 # the five copied stayed in the table
    assert cache.ram.entry(eid(2)).hashes == disk._restored.table.row(disk._restored.table.find(eid(2))).hashes
    assert cache.ram.info_of(eid(2)) == info("/f2", 3002)
    cache.ram.check()
    cache.close()
