"""The shared tier against a fake memcached client: keys, verification, split items, servers
that fail, and two cores ("nodes") sharing one tier."""

import logging
import os
import threading

import pytest

from cachefs.blocks import FileId
from cachefs.config import parse_servers
from cachefs.memsource import MemorySource
from cachefs.stats import Stats
from cachefs.tiers.shared import SharedTier
from tests.helpers import FakeClock, make_core


class FakeServer:
    """One memcached server's items, shared by the clients of every "node"."""

    def __init__(self, item_max=1 << 20):
        self.items = {}
        self.item_max = item_max
        self.fail = None  # an exception to raise on every request (down, timing out)
        self.requests = 0


class FakeClient:
    def __init__(self, server):
        self.server = server

    def _enter(self):
        self.server.requests += 1
        if self.server.fail is not None:
            raise self.server.fail

    def get_many(self, keys):
        self._enter()
        return {k: self.server.items[k] for k in keys if k in self.server.items}

    def set_many(self, values, expire=0, noreply=None):
        self._enter()
        failed = []
        for k, v in values.items():
            if len(v) + 256 > self.server.item_max:
                failed.append(k)  # what memcached answers: SERVER_ERROR object too large
            else:
                self.server.items[k] = v
        return failed

    def stats(self, *args):
        self._enter()
        return {b"item_size_max": self.server.item_max}

    def close(self):
        pass


def tier(servers, namespace="ds", block_size=1 << 20, clock=None, **kw):
    addrs = [(f"10.0.0.{i}", 11211) for i in range(len(servers))]
    by_addr = dict(zip(addrs, servers, strict=True))
    t = SharedTier(addrs, namespace, block_size, kw.pop("stats", None) or Stats(),
                   connect=lambda a, timeout: FakeClient(by_addr[a]), clock=clock or FakeClock(), **kw)
    t.check()
    return t


FID = FileId("/train/n01/a.jpg", 3000, 1_700_000_000_123_456_789, 1)


def test_parse_servers():
    assert parse_servers("memcached://a:11211,10.1.2.3:5") == [("a", 11211), ("10.1.2.3", 5)]
    assert parse_servers("memcached://[::1]:11211") == [("::1", 11211)]
    assert parse_servers("memcached://a:1+b:2") == [("a", 1), ("b", 2)]  # as mount -o and fstab need it
    for bad in ("a:1", "memcached://a", "memcached://a:0", "memcached://a:1,a:1", "memcached://:5"):
        with pytest.raises(ValueError):
            parse_servers(bad)


def test_a_block_put_by_one_node_is_got_verified_by_another():
    server = FakeServer()
    a, b = tier([server]), tier([server])
    data = os.urandom(3000)
    assert a.put_block(FID, 0, data, len(data)) and a.drain()
    assert b.get_block(FID, 0, 3000) == data
    assert b.stats.get("shared.hits") == 1 and b.stats.get("shared.bytes") == 3000
    assert a.stats.get("shared.puts") == 1 and a.stats.get("shared.put_bytes") == 3000
    a.close()
    b.close()


def test_keys_are_the_same_on_every_node_and_name_the_version():
    a, b = tier([FakeServer()]), tier([FakeServer()])
    # the same path under the source root, size and mtime: the same key (ctime and inode
    # numbers differ between NFS clients and are not part of it)
    assert a.key(FID, 0) == b.key(FileId(FID.path, FID.size, FID.mtime_ns, 999), 0)
    assert a.key(FID, 0) != a.key(FID, 1)
    assert a.key(FID, 0) != a.key(FileId(FID.path, FID.size, FID.mtime_ns + 1, 1), 0)
    assert a.key(FID, 0) != a.key(FileId(FID.path, FID.size + 1, FID.mtime_ns, 1), 0)
    assert a.key(FID, 0) != tier([FakeServer()], namespace="other").key(FID, 0)
    assert a.key(FID, 0) != tier([FakeServer()], block_size=4 << 20).key(FID, 0)
    assert len(a.key(FID, 10**6)) < 250 and b" " not in a.key(FID, 0)  # a valid memcached key


def test_damaged_or_misfiled_items_are_misses_never_bytes():
    server = FakeServer()
    t = tier([server])
    data = os.urandom(3000)
    t.put_block(FID, 0, data, len(data))
    t.drain()
    key = t.key(FID, 0)
    good = server.items[key]
    server.items[key] = good[:-1] + bytes([good[-1] ^ 1])  # one bit flipped
    assert t.get_block(FID, 0, 3000) is None
    server.items[key] = good[:40]  # truncated
    assert t.get_block(FID, 0, 3000) is None
    other = FileId("/train/n01/b.jpg", 3000, FID.mtime_ns, 1)
    server.items[t.key(other, 0)] = good  # another block's item under this key
    assert t.get_block(other, 0, 3000) is None
    assert t.stats.get("shared.checksum_failures") == 3 and t.stats.get("shared.hits") == 0
    server.items[key] = good
    assert t.get_block(FID, 0, 3000) == data
    t.close()


def test_a_block_bigger_than_an_item_is_split_on_one_server_and_checked_whole():
    servers = [FakeServer(item_max=64 << 10) for _ in range(3)]
    t = tier(servers, block_size=1 << 20)
    big = FileId("/big.bin", 5 << 20, 1, 1)
    data = os.urandom(1 << 20)
    t.put_block(big, 2, data, len(data))
    t.drain()
    holders = [s for s in servers if s.items]
    assert len(holders) == 1 and len(holders[0].items) == 17  # 1 MiB in items of under 64 KiB
    assert t.get_block(big, 2, 1 << 20) == data
    part = next(k for k in holders[0].items if k.endswith(b"/9"))
    holders[0].items[part] = os.urandom(len(holders[0].items[part]))
    assert t.get_block(big, 2, 1 << 20) is None and t.stats.get("shared.checksum_failures") == 1
    del holders[0].items[part]
    assert t.get_block(big, 2, 1 << 20) is None  # an evicted part: a plain miss
    t.close()


def test_keys_spread_over_servers_and_a_down_server_sends_only_its_keys_to_the_source(caplog):
    servers = [FakeServer() for _ in range(4)]
    clock = FakeClock()
    t = tier(servers, clock=clock)
    fids = [FileId(f"/f{i}", 100, 1, 1) for i in range(400)]
    for f in fids:
        t.put_block(f, 0, b"x" * 100, 100)
    t.drain()
    counts = [len(s.items) for s in servers]
    assert sum(counts) == 400 and min(counts) > 60, counts  # rendezvous hashing spreads them
    servers[1].fail = TimeoutError("timed out")
    servers[1].requests = 0
    with caplog.at_level(logging.WARNING):
        got = [t.get_block(f, 0, 100) for f in fids]
    lost = sum(1 for g in got if g is None)
    assert lost == counts[1] and all(g == b"x" * 100 for g in got if g is not None)
    assert t.stats.get("shared.errors") == 1  # one timeout; then its keys skip it
    assert t.servers_down() == 1 and servers[1].requests == 1
    assert sum("does not answer" in r.message for r in caplog.records) == 1
    servers[1].fail = None
    clock.advance(t.down_for + 0.1)
    with caplog.at_level(logging.WARNING):
        assert all(t.get_block(f, 0, 100) == b"x" * 100 for f in fids)  # the probe brings it back
    assert t.servers_down() == 0 and any("answering again" in r.message for r in caplog.records)
    lines = t.servers()
    assert [x["up"] for x in lines] == [True] * 4 and abs(sum(x["hit_share"] for x in lines) - 1) < 0.01
    t.close()


def test_a_full_put_queue_drops_and_counts_instead_of_waiting():
    server = FakeServer()
    server.fail = None
    t = tier([server], pending_bytes=10_000)
    t._pending = 9_000  # as if 9 KB were still queued
    assert not t.put_block(FID, 0, b"y" * 3000, 3000)
    assert t.stats.get("shared.put_dropped") == 1
    t._pending = 0
    t.close()


def test_two_nodes_over_one_tier_the_second_reads_nothing_from_its_source():
    server = FakeServer()
    files = {f"/d/{i}.jpg": os.urandom(5000 + i) for i in range(20)}
    files["/big.bin"] = os.urandom(300_000)
    nodes = []
    for _ in range(2):
        src = MemorySource()
        for path, data in files.items():
            src.add_file(path, data, mtime_ns=1_000_000_000)
        stats = Stats()
        core = make_core(src, block_size=64 << 10, stats=stats, shared=tier([server], block_size=64 << 10, stats=stats))
        nodes.append((src, core))
    (src_a, a), (src_b, b) = nodes
    for path, data in files.items():
        assert a.read(path, 0, len(data)) == data
    a.cache.drain_shared()
    for path, data in files.items():
        assert b.read(path, 0, len(data)) == data
    assert src_b.calls["read_range"] == 0 and src_a.calls["read_range"] == 20 + 5
    assert b.stats.get("shared.hits") == 25 and b.stats.get("shared.served_bytes") == sum(map(len, files.values()))
    for _, core in nodes:
        core.close()


def test_a_file_a_fetch_process_fills_on_its_own_is_shared_too(tmp_path):
    """Small files filled one at a time by a fetch process (their attributes were not known
    for a batch) went to the NVMe tier and never to the shared tier: only batches, whose
    fetch process stores in the shared tier itself, were shared."""
    from cachefs.fetcher import Fetchers
    from cachefs.source import LocalSource
    from cachefs.tiers.disk import DiskTier

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jpg").write_bytes(os.urandom(20_000))
    server, stats = FakeServer(), Stats()
    disk = DiskTier(str(tmp_path / "cache"), 64 << 20, stats, scrub=False)
    core = make_core(LocalSource(str(src)), disk=disk, block_size=1 << 20, stats=stats,
                     shared=tier([server], block_size=1 << 20, stats=stats))
    core.hooks.connect(passthrough=True)
    # the fetch process's own shared tier answers nothing (no server there): only the
    # daemon's can store the file
    core.use_fetchers(Fetchers(str(src), disk.data_dir, core.namespace, 1 << 20, processes=1, channels=1,
                               shared="memcached://127.0.0.1:9", shared_namespace="ds"))
    try:
        assert core.prefetch_small("/a.jpg") == ("fetched", 20_000)
        assert core.cache.drain_shared(10)
        assert stats.get("shared.puts") == 1 and len(server.items) == 1
    finally:
        core.close()


def test_a_thread_s_server_counts_are_its_own():
    """A fetch process answers batches in several threads and reports each batch's hits per
    server: what another thread counted meanwhile is not this batch's (it was counted twice)."""
    t = tier([FakeServer(), FakeServer()])
    fids = [FileId(f"/d/{i}.jpg", 100, 1_700_000_000_000_000_000 + i, 1) for i in range(40)]
    assert t.store_many([(fid, 0, bytes([i]) * 100) for i, fid in enumerate(fids)]) == 40
    other = threading.Thread(target=lambda: t.get_many([(fid, 0, 100) for fid in fids[:30]]))
    other.start()
    other.join()
    assert t.server_counts(this_thread=True) == {}   # the other thread's hits are not this one's
    got = t.get_many([(fid, 0, 100) for fid in fids[30:]])
    assert all(x is not None for x in got)
    mine = t.server_counts(this_thread=True)
    assert sum(h for h, _ in mine.values()) == 10 and sum(m for _, m in mine.values()) == 0
    assert sum(h for h, _ in t.server_counts().values()) == 40   # all threads'
