"""Read-ahead and warming through real mounts over tools/slowfs."""

import os

from cachefs.config import DEFAULT_BLOCK_SIZE
from tests.helpers import cli, stats
from tools.slowfs import read_stats as slowfs_stats
from tools.slowfs import reset_stats as slowfs_reset


def test_sequential_read_of_a_big_file_waits_for_few_round_trips(tmp_path, mounts):
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(64 << 20)
    (src / "big.bin").write_bytes(data)
    slow = mounts.slowfs(str(src), latency="2ms")
    mp = mounts.cachefs(str(slow), extra=["--readahead", "file"])
    with open(mp / "big.bin", "rb", buffering=0) as f:
        chunks = []
        while chunk := f.read(128 << 10):           # like cat
            chunks.append(chunk)
    assert b"".join(chunks) == data
    s = stats(mp)
    blocks = len(data) // DEFAULT_BLOCK_SIZE
    fetched = s["source"]["read_range"]
    ahead = s["prefetch"].get("blocks", 0)
    assert fetched == blocks                          # each block once, none twice
    # Without read-ahead, the reader waits for one source round trip per block (64);
    # with it, the reader's own misses are the few before the pattern is confirmed.
    assert fetched - ahead <= blocks // 8, s["prefetch"]
    assert s["prefetch"]["used"] >= ahead - 2


def test_warm_then_an_epoch_reads_nothing_from_the_source(tmp_path, mounts):
    src = tmp_path / "src"
    files = {}
    for c in range(3):
        for i in range(20):
            path = src / f"class_{c}" / f"{i:03d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            files[path.relative_to(src)] = os.urandom(5_000 + 997 * i)
            path.write_bytes(files[path.relative_to(src)])
    (src / "big.bin").write_bytes(os.urandom(3 * DEFAULT_BLOCK_SIZE + 5))
    slow = mounts.slowfs(str(src), latency="1ms")
    mp = mounts.cachefs(str(slow))
    proc = cli("warm", mp, "--json")
    assert proc.returncode == 0, proc.stderr
    import json
    report = json.loads(proc.stdout)
    assert report["state"] == "done" and report["files_loaded"] == 61 and report["files_total"] == 61
    cov = json.loads(cli("stats", mp / "class_1", "--coverage", "--json", check=True).stdout)
    sizes = sum(len(d) for rel, d in files.items() if str(rel).startswith("class_1/"))
    assert (cov["files"], cov["bytes"]) == (20, sizes)
    assert cov["cached"] == {"files": 20, "bytes": sizes}              # warm: 100% covered
    table = cli("stats", mp, "--coverage", check=True).stdout
    assert "61 files" in table and "100.0%" in table
    again = json.loads(cli("warm", mp / "class_1", "--json", check=True).stdout)
    assert again["files_cached"] == 20 and again["files_loaded"] == 0      # resumable: nothing refetched
    slowfs_reset(str(slow))
    before = stats(mp)["source"].get("read_range", 0)
    for rel, data in files.items():
        assert (mp / rel).read_bytes() == data
    assert len((mp / "big.bin").read_bytes()) == 3 * DEFAULT_BLOCK_SIZE + 5
    assert slowfs_stats(str(slow))["read"] == 0
    assert stats(mp)["source"].get("read_range", 0) == before


def test_warm_rejects_paths_outside_cachefs(tmp_path):
    proc = cli("warm", tmp_path)
    assert proc.returncode == 2 and "not on a cachefs mount" in proc.stderr
    proc = cli("warm", tmp_path / "missing")
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_warm_at_mount_time_loads_the_tree_in_the_background(tmp_path, mounts):
    import time

    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    for i in range(30):
        (src / "d" / f"{i}.bin").write_bytes(os.urandom(20_000 + i))
    slow = mounts.slowfs(str(src), latency="1ms")
    mp = mounts.cachefs(str(slow), extra=["--warm"])
    deadline = time.monotonic() + 30
    while stats(mp).get("warm", {}).get("files_loaded", 0) < 30 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert stats(mp)["warm"]["files_loaded"] == 30
    slowfs_reset(str(slow))
    for i in range(30):
        assert len((mp / "d" / f"{i}.bin").read_bytes()) == 20_000 + i
    assert slowfs_stats(str(slow))["read"] == 0
