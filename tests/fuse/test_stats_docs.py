"""A live daemon's snapshot against docs/stats.md: every key it holds is documented, every
documented key is in it, before any read and after some."""

import os
import socket

from tests.helpers import stats
from tests.test_stats_docs import documented, snapshot_keys
from tools.memcached import MemcachedServers, available


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_live_snapshot_holds_exactly_the_documented_keys(tmp_path, mounts):
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(os.urandom(100_000))
    assert available(), "memcached is installed by make dev"
    with MemcachedServers(1, str(tmp_path / "mc")) as servers:
        _check_keys(tmp_path, mounts, src, servers.url)


def _check_keys(tmp_path, mounts, src, shared):
    mp = mounts.cachefs(str(src), extra=["--metrics-addr", f"127.0.0.1:{_free_port()}", "--shared-cache", shared])
    docs = set(documented())
    fresh = snapshot_keys(stats(mp))
    assert fresh - docs == set(), "undocumented"
    assert docs - fresh == set(), "documented, not in the snapshot"
    assert (mp / "f").read_bytes() == (src / "f").read_bytes()
    assert snapshot_keys(stats(mp)) == fresh  # reading adds no key
    mounts.unmount(mp)
    mp = mounts.cachefs(str(src), name="mnt2", extra=["--disk-size", "0", "--prefetch-workers", "0"])
    # parts it runs without read 0; the settings it was not given are not there
    assert snapshot_keys(stats(mp)) == fresh - {"info.metrics", "info.shared_cache", "info.shared_namespace"}
