"""tools/slowfs, the slow store every benchmark and many tests stand on: it must model a
store the way its docs say, or the figures measured over it mean nothing."""

import os
import threading

from tools.slowfs import read_stats, reset_stats


def _files(src, n=64, dirs=1):
    for d in range(dirs):
        (src / f"d{d}").mkdir(parents=True)
        for i in range(n):
            (src / f"d{d}" / f"f{i}").write_bytes(b"x" * (100 + i))


def test_lookups_in_one_directory_are_in_flight_together(tmp_path, mounts):
    """An NFS server answers many lookups of one directory at once; libfuse 3.14 alone
    would have the kernel send them one at a time."""
    src = tmp_path / "src"
    _files(src)
    slow = mounts.slowfs(str(src), latency="50ms", attr_timeout="0")
    reset_stats(slow)
    names = [slow / "d0" / f"f{i}" for i in range(32)]
    threads = [threading.Thread(target=os.stat, args=(p,)) for p in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = read_stats(slow)
    assert s["getattr"] >= 32
    assert s["peak_in_flight"] >= 4  # 32 lookups of 50 ms from 32 threads, never one by one


def test_a_listing_carries_the_attributes(tmp_path, mounts):
    """One request lists a directory with its entries' attributes (READDIRPLUS): a stat of
    every listed file costs no further request while the attributes are fresh."""
    src = tmp_path / "src"
    _files(src, n=40)
    slow = mounts.slowfs(str(src), latency="1ms", attr_timeout="60")
    os.stat(slow / "d0")
    reset_stats(slow)
    with os.scandir(slow / "d0") as it:
        sizes = {e.name: e.stat(follow_symlinks=False).st_size for e in it}
    assert sizes == {f"f{i}": 100 + i for i in range(40)}
    s = read_stats(slow)
    assert s["readdir"] >= 1 and s["getattr"] == 0
