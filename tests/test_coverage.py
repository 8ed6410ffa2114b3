"""Coverage of a subtree, through the core without a mount."""

import errno

import pytest

from cachefs.coverage import coverage
from cachefs.memsource import MemorySource
from cachefs.stats import Stats
from cachefs.tiers.disk import DiskTier
from tests.helpers import make_core, wait_listed

BS = 64 << 10


def tree():
    src = MemorySource()
    src.add_dir("/train")
    src.add_dir("/train/a")
    src.add_dir("/train/b")
    src.add_file("/train/a/1.jpg", b"x" * 1000)
    src.add_file("/train/a/2.jpg", b"y" * (2 * BS + 10))    # three blocks
    src.add_file("/train/b/3.jpg", b"z" * 500)
    src.add_file("/train/b/empty", b"")
    src.add_symlink("/train/link", "a/1.jpg")                 # not a regular file: not counted
    src.add_file("/val.jpg", b"v" * 100)
    return src


def test_nothing_read_nothing_cached():
    core = make_core(tree(), block_size=BS)
    r = coverage(core, "/train")
    # listings bring no sizes: files never looked up count without their bytes...
    assert (r["files"], r["bytes"], r["unknown_size"]) == (4, 0, 4)
    assert r["ram"] == r["disk"] == r["cached"] == {"files": 0, "bytes": 0}
    r = coverage(core, "/train", exact=True)  # ...unless stat'ed
    assert (r["files"], r["bytes"], r["unknown_size"]) == (4, 1000 + 2 * BS + 10 + 500, 0)
    # the empty file needs nothing from the source: it counts as cached everywhere
    assert r["ram"] == r["disk"] == r["cached"] == {"files": 1, "bytes": 0}
    assert r["errors"] == 0


def test_counts_whole_files_and_partial_bytes_per_tier():
    src = tree()
    core = make_core(src, block_size=BS)
    core.read("/train/a/1.jpg", 0, 1000)
    core.read("/train/a/2.jpg", BS, 10)                        # only the middle block
    reads_before = core.stats.get("source.read_range")
    r = coverage(core, "/train", exact=True)                   # the empty file's size known too
    assert r["ram"] == {"files": 2, "bytes": 1000 + BS}        # 1.jpg, and the empty file
    assert r["cached"] == r["ram"]
    assert r["disk"] == {"files": 1, "bytes": 0}               # only the empty file is "whole" on a missing tier
    assert core.stats.get("source.read_range") == reads_before  # coverage reads no block
    assert coverage(core, "/val.jpg")["files"] == 1 and coverage(core, "/val.jpg")["cached"]["files"] == 0


def test_disk_tier_and_either_tier(tmp_path):
    src = tree()
    stats = Stats()
    disk = DiskTier(str(tmp_path / "blocks"), 10 << 20, stats)
    try:
        core = make_core(src, block_size=BS, ram=BS, disk=disk)   # RAM holds one block
        for path, size in (("/train/a/2.jpg", 2 * BS + 10), ("/train/b/3.jpg", 500)):
            core.read(path, 0, size)
        disk.flush()
        r = coverage(core, "/train/b", exact=True)
        assert r["disk"] == {"files": 2, "bytes": 500}          # 3.jpg and the empty file
        assert r["cached"] == {"files": 2, "bytes": 500}
        whole = coverage(core, "/train")
        assert whole["cached"]["bytes"] == 2 * BS + 10 + 500
        assert whole["ram"]["bytes"] < whole["cached"]["bytes"]
    finally:
        disk.close()


def test_missing_root_raises_and_progress_is_reported():
    core = make_core(tree(), block_size=BS)
    with pytest.raises(OSError) as exc:
        coverage(core, "/nope")
    assert exc.value.errno == errno.ENOENT
    ticks = iter(range(1000))  # a clock that moves one second per look
    seen = []
    final = coverage(core, "/train", progress=lambda r: seen.append(r["files"]), every=0.5,
                     clock=lambda: float(next(ticks)))
    assert len(seen) >= 4 and seen == sorted(seen) and seen[-1] <= final["files"] == 4


def test_a_cold_tree_on_a_slow_source_costs_a_listing_per_directory_and_no_stat():
    src = MemorySource()
    for c in range(5):
        for i in range(200):
            src.add_file(f"/t/c{c}/{i}.jpg", b"j" * (100 + i))
    core = make_core(src, block_size=BS)
    core.read("/t/c1/7.jpg", 0, 107)       # looked up and cached, and its folder's attributes with it
    wait_listed(core)
    stats_before = src.calls["stat"]
    r = coverage(core, "/t")
    assert src.calls["stat"] - stats_before <= 6 and src.calls["listdir"] == 6   # directories only
    assert (r["files"], r["directories"], r["unknown_size"]) == (1000, 6, 800)
    assert r["bytes"] == sum(100 + i for i in range(200)) and r["cached"] == {"files": 1, "bytes": 107}
    stats_before = src.calls["stat"]
    exact = coverage(core, "/t", exact=True)   # the rest stat'ed, in parallel
    assert exact["unknown_size"] == 0 and exact["bytes"] == sum(5 * (100 + i) for i in range(200))
    assert exact["cached"] == {"files": 1, "bytes": 107}
    assert 800 <= src.calls["stat"] - stats_before <= 800 + 6   # and the directories stat'ed ahead
    core.close()
