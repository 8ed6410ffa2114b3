"""Two mounts ("nodes") sharing a tier on real memcached servers (extstore on local files):
the second reads nothing from the source, and killed, stopped or corrupted servers cost
source reads, never a read error or a wrong byte."""

import os
import time

import pytest
from pymemcache.client.base import Client

from cachefs.blocks import FileId
from cachefs.config import DEFAULT_BLOCK_SIZE
from cachefs.tiers.shared import item_key
from tests.helpers import stats
from tools.memcached import MemcachedServers, available

pytestmark = pytest.mark.skipif(not available(), reason="needs memcached (make dev installs it)")


@pytest.fixture
def servers(tmp_path):
    with MemcachedServers(2, str(tmp_path / "mc")) as s:
        yield s


def make_tree(src):
    files = {}
    for d in range(3):
        (src / f"c{d}").mkdir(parents=True)
        for i in range(20):
            data = os.urandom(5_000 + 9_000 * i)
            (src / f"c{d}" / f"{i}.jpg").write_bytes(data)
            files[f"c{d}/{i}.jpg"] = data
    big = os.urandom(3 * DEFAULT_BLOCK_SIZE + 12_345)
    (src / "big.bin").write_bytes(big)
    files["big.bin"] = big
    return files


def read_all(mp, files):
    for rel, data in files.items():
        assert (mp / rel).read_bytes() == data, rel


def blocks_of(files):
    return sum(-(-len(d) // DEFAULT_BLOCK_SIZE) for d in files.values())


def node(mounts, tmp_path, src, name, servers, extra=()):
    return mounts.cachefs(str(src), name=name, cache_dir=tmp_path / f"cache-{name}",
                          extra=["--shared-cache", servers.url, *extra])


def filled(mounts, tmp_path, servers):
    """A tree, and node a, which has read all of it and stored it in the shared tier."""
    src = tmp_path / "src"
    files = make_tree(src)
    a = node(mounts, tmp_path, src, "a", servers)
    read_all(a, files)
    settle(a, blocks_of(files))
    return src, files


def settle(mp, puts, timeout=30.0):
    """Wait until the node has stored `puts` blocks in the shared tier."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = stats(mp)["shared"]
        if s["puts"] >= puts and s["pending_bytes"] == 0:
            return s
        time.sleep(0.1)
    raise AssertionError(f"shared puts stuck at {stats(mp)['shared']}")


def test_the_second_node_reads_nothing_from_the_source(tmp_path, mounts, servers, fault_report):
    src, files = filled(mounts, tmp_path, servers)
    b = node(mounts, tmp_path, src, "b", servers)
    read_all(b, files)
    s = stats(b)
    assert s["source"]["read_range"] == 0 and s["source"]["bytes"] == 0, s["source"]
    assert s["shared"]["hits"] == blocks_of(files) and s["shared"]["checksum_failures"] == 0
    assert [x["up"] for x in s["shared"]["servers"]] == [True, True]
    assert all(x["hits"] > 0 for x in s["shared"]["servers"])  # the keys spread over both
    # per server, the fetch processes' hits too (they fetch most of a read-ahead epoch)
    assert sum(x["hits"] for x in s["shared"]["servers"]) == s["shared"]["hits"]
    # what node b got from the shared tier is stored locally as any fill: a remount of b
    # serves it from its own NVMe with the servers gone
    mounts.unmount(b)
    servers.kill(0)
    servers.kill(1)
    b = node(mounts, tmp_path, src, "b", servers)
    read_all(b, files)
    assert stats(b)["source"]["read_range"] == 0


def test_a_server_killed_mid_epoch_then_restarted(tmp_path, mounts, servers, fault_report):
    src, files = filled(mounts, tmp_path, servers)
    # no read-ahead: the files after the kill are read after it (directory read-ahead could
    # fetch them all from the shared tier first on a loaded machine, and nothing would
    # ask the killed server)
    b = node(mounts, tmp_path, src, "b", servers, extra=["--readahead", "off"])
    rels = list(files)
    for rel in rels[:20]:
        assert (b / rel).read_bytes() == files[rel]
    servers.kill(0)
    for rel in rels[20:]:
        assert (b / rel).read_bytes() == files[rel]
    s = stats(b)
    assert s["shared"]["servers_down"] == 1 and s["shared"]["errors"] >= 1
    assert 0 < s["source"]["read_range"] < blocks_of(files)  # server 0's keys, from the source
    servers.start(0)  # empty again, as a restarted memcached is
    time.sleep(6)  # past the time a down server is left alone
    c = node(mounts, tmp_path, src, "c", servers)
    read_all(c, files)
    read_all(b, files)
    assert stats(b)["shared"]["servers_down"] == 0 or stats(c)["shared"]["servers_down"] == 0
    fault_report("a shared cache server killed mid-epoch, then restarted",
                 f"all {len(files)} files exact, 0 errors",
                 f"shared.errors={s['shared']['errors']}, servers_down=1, source.read_range="
                 f"{s['source']['read_range']} (its keys)")


def test_a_stopped_server_and_a_corrupted_item(tmp_path, mounts, servers, fault_report):
    src, files = filled(mounts, tmp_path, servers)
    # overwrite the items of three files on server 0, through the memcached protocol
    client = Client(("127.0.0.1", servers.ports[0]))
    corrupted = 0
    for rel in files:
        st = os.stat(src / rel)
        key = item_key("src", DEFAULT_BLOCK_SIZE, FileId("/" + rel, st.st_size, st.st_mtime_ns, st.st_ctime_ns), 0)
        value = client.get(key)
        if value is not None and corrupted < 3:
            client.set(key, value[:-10] + os.urandom(10))
            corrupted += 1
    client.close()
    assert corrupted == 3
    servers.stop(1)
    try:
        b = node(mounts, tmp_path, src, "b", servers)
        start = time.monotonic()
        read_all(b, files)
        took = time.monotonic() - start
        s = stats(b)
    finally:
        servers.cont(1)
    assert s["shared"]["checksum_failures"] == 3 and s["shared"]["servers_down"] == 1
    assert s["fuse"]["errors"] == 0
    fault_report("a shared cache server stopped (SIGSTOP); an item overwritten through the memcached protocol",
                 f"all {len(files)} files exact, 0 errors, {took:.1f} s for the epoch",
                 f"shared.errors={s['shared']['errors']}, checksum_failures={s['shared']['checksum_failures']}, "
                 f"servers_down={s['shared']['servers_down']}")


def test_nodes_warm_their_shards_and_a_third_node_reads_nothing_from_the_source(tmp_path, mounts, servers):
    from tests.helpers import cli

    src = tmp_path / "src"
    files = make_tree(src)
    shards = []
    for rank in range(2):
        mp = node(mounts, tmp_path, src, f"n{rank}", servers)
        proc = cli("warm", mp, "--shard", f"{rank}/2", "--json", timeout=120)
        assert proc.returncode == 0, proc.stderr
        report = __import__("json").loads(proc.stdout)
        shards.append(report["files_loaded"])
        assert stats(mp)["shared"]["pending_bytes"] == 0  # warm returns once the cluster can read it
    assert sum(shards) == len(files) and all(n > 0 for n in shards), shards
    c = node(mounts, tmp_path, src, "c", servers)
    read_all(c, files)
    assert stats(c)["source"]["read_range"] == 0
