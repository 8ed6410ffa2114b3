"""Listings at the users' scale through a real mount: directories of 1,022 (one past what a
reply of one vector per entry could carry), 1,281 (an ImageNet class), 10,000 and 100,000
entries, read whole, with a stat of each entry, and restarted midway with seekdir. Every
name comes exactly once, and the kernel took every reply (fuse.errors stays 0)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

import pytest

from tests.helpers import stats
from tools.epoch import list_imagefolder
from tools.slowfs import read_stats, reset_stats

SIZES = (1_022, 1_281, 10_000, 100_000)

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class _Dirent(ctypes.Structure):  # struct dirent on Linux (glibc, 64-bit)
    _fields_ = [("d_ino", ctypes.c_uint64), ("d_off", ctypes.c_int64), ("d_reclen", ctypes.c_ushort),
                ("d_type", ctypes.c_ubyte), ("d_name", ctypes.c_char * 256)]


_libc.opendir.restype = ctypes.c_void_p
_libc.opendir.argtypes = [ctypes.c_char_p]
_libc.readdir.restype = ctypes.POINTER(_Dirent)
_libc.readdir.argtypes = [ctypes.c_void_p]
_libc.telldir.restype = ctypes.c_long
_libc.telldir.argtypes = [ctypes.c_void_p]
_libc.seekdir.argtypes = [ctypes.c_void_p, ctypes.c_long]
_libc.closedir.argtypes = [ctypes.c_void_p]


def _read_rest(handle: int) -> list[str]:
    names = []
    while True:
        ctypes.set_errno(0)
        entry = _libc.readdir(handle)
        if not entry:
            assert ctypes.get_errno() == 0, os.strerror(ctypes.get_errno())
            return names
        names.append(entry.contents.d_name.decode())


def _list_with_seekdir(path: str) -> tuple[list[str], list[str], list[str]]:
    """The whole listing through libc's readdir; then the listing again from its middle
    (seekdir to the position telldir gave there). Returns (all, after the middle, again)."""
    handle = _libc.opendir(path.encode())
    assert handle, os.strerror(ctypes.get_errno())
    try:
        first: list[str] = []
        middle_pos = None
        middle_index = 0
        while True:
            ctypes.set_errno(0)
            entry = _libc.readdir(handle)
            if not entry:
                assert ctypes.get_errno() == 0, os.strerror(ctypes.get_errno())
                break
            first.append(entry.contents.d_name.decode())
            if len(first) == 700:  # inside the first reply, past a page of entries
                middle_pos, middle_index = _libc.telldir(handle), len(first)
        assert middle_pos is not None
        _libc.seekdir(handle, middle_pos)
        again = _read_rest(handle)
        return first, first[middle_index:], again
    finally:
        _libc.closedir(handle)


@pytest.fixture(scope="module")
def big_dirs(tmp_path_factory):
    src = tmp_path_factory.mktemp("listings") / "src"
    for count in SIZES:
        d = src / f"d{count}"
        d.mkdir(parents=True)
        for i in range(count):
            # names of several lengths, as datasets have
            with open(d / f"n{i:06d}{'x' * (i % 7)}.JPEG", "wb") as f:
                if i % 97 == 0:
                    f.write(b"data")
    return src


def _expected(big_dirs, count):
    return sorted(os.listdir(big_dirs / f"d{count}"))


def test_every_directory_lists_whole_with_and_without_stats_and_seekdir(big_dirs, mounts):
    mp = mounts.cachefs(str(big_dirs))
    for count in SIZES:
        expected = _expected(big_dirs, count)
        path = str(mp / f"d{count}")
        # os.listdir: READDIRPLUS first (names only), then READDIR, records packed once
        names = os.listdir(path)
        assert len(names) == len(set(names)) == count and sorted(names) == expected
        # os.scandir with a stat of each entry: LOOKUPs, until cachefs sees the pattern
        with os.scandir(path) as it:
            sizes = {e.name: e.stat().st_size for e in it}
        assert sorted(sizes) == expected
        assert sizes[expected[0]] == 4 and sizes[expected[1]] == 0
        # libc's readdir, then seekdir back to the middle: the rest again, every name once
        first, rest, again = _list_with_seekdir(path)
        assert sorted(n for n in first if n not in (".", "..")) == expected
        assert len(first) == len(set(first))
        assert again == rest
    s = stats(mp)
    assert s["fuse"]["errors"] == 0 and s["fuse"]["reply_failures"] == 0
    assert s["fuse"]["readdir"] > 0 and s["fuse"]["readdirplus"] > 0


def test_a_remounted_directory_of_1281_files_lists_from_the_index(big_dirs, mounts, tmp_path):
    cache = tmp_path / "cache-remount"
    mp = mounts.cachefs(str(big_dirs), name="first", cache_dir=cache)
    with open(mp / "d1281" / os.listdir(mp / "d1281")[0], "rb") as f:
        f.read()
    mounts.unmount(mp)
    mp = mounts.cachefs(str(big_dirs), name="second", cache_dir=cache)
    names = os.listdir(mp / "d1281")
    assert sorted(names) == _expected(big_dirs, 1_281)
    assert stats(mp)["fuse"]["errors"] == 0


def test_a_walk_over_a_store_without_attribute_caching_costs_requests_per_directory(tmp_path, mounts):
    """ImageFolder's walk (os.scandir, os.walk: d_type only) over a store whose every stat
    is a round trip: the requests that reach it grow with the directories, not the files
    (a listing stat'ed every entry in series: 4,087 requests for these 2,000 files)."""
    src = tmp_path / "src"
    for c in range(10):
        (src / f"class_{c}").mkdir(parents=True)
        for i in range(200):
            (src / f"class_{c}" / f"{i:04d}.JPEG").write_bytes(b"")
    slow = mounts.slowfs(src, latency="1ms", attr_timeout="0")
    mp = mounts.cachefs(str(slow))
    reset_stats(slow)
    assert len(list_imagefolder(str(mp))) == 2_000
    store = read_stats(slow)
    assert store["getattr"] + store["readdir"] < 20 * 11, store
    s = stats(mp)
    assert s["source"]["stat"] < 40 and s["fuse"]["lookup"] < 40, (s["source"], s["fuse"])


def _tree(root, classes: int, files: int):
    for c in range(classes):
        (root / f"c{c:02d}").mkdir(parents=True)
        for i in range(files):
            (root / f"c{c:02d}" / f"{i:04d}.JPEG").write_bytes(b"x" * (i % 50))
    return root


def test_a_walk_stats_no_file_and_ls_l_stats_through_listings(tmp_path, mounts):
    """A walk (ImageFolder's: names and types) asks the source for no file's attributes;
    once something stats what it lists (`ls -l`), listings bring the attributes and
    READDIRPLUS hands them to the kernel: the next directory's stats cost no LOOKUP."""
    src = tmp_path / "src"
    _tree(src / "walked", 12, 150)
    _tree(src / "listed", 2, 150)
    mp = mounts.cachefs(str(src))
    assert len(list_imagefolder(str(mp / "walked"))) == 12 * 150
    s = stats(mp)
    # the folders (and the few directories above them), not the 1,800 files
    assert s["latency"]["source.stat"]["count"] <= 2 * 12, s["latency"]["source.stat"]
    assert s["fuse"]["lookup"] <= 2 * 12, s["fuse"]   # and the kernel looked up no file
    # `ls -l` of a folder: lookups, until the pattern is seen...
    first = {e.name: e.stat().st_size for e in os.scandir(mp / "listed" / "c00")}
    assert first == {f"{i:04d}.JPEG": i % 50 for i in range(150)}
    before = stats(mp)["fuse"]
    assert before["lookup"] - s["fuse"]["lookup"] >= 4
    # ...then the next folder's READDIRPLUS carries every entry: no LOOKUP for its stats
    second = {e.name: e.stat().st_size for e in os.scandir(mp / "listed" / "c01")}
    assert second == first
    after = stats(mp)["fuse"]
    assert after["lookup"] == before["lookup"] + 1, (before, after)   # the folder's own
    assert after["readdirplus"] > before["readdirplus"] and after["errors"] == 0


def test_a_remounted_walk_and_epoch_within_the_ttl_ask_the_store_nothing(tmp_path, mounts):
    """After a restart, listings kept on the cache disk and attributes kept in the NVMe
    index answer the walk and the lookups of an epoch: no request reaches the store."""
    src = tmp_path / "src"
    for c in range(4):
        (src / f"c{c:02d}").mkdir(parents=True)
        for i in range(50):
            (src / f"c{c:02d}" / f"{i:04d}.JPEG").write_bytes(b"x" * (1 + i))  # none empty: those are not cached
    slow = mounts.slowfs(src, latency="1ms", attr_timeout="0")
    cache = tmp_path / "cache-kept"
    mp = mounts.cachefs(str(slow), name="first", cache_dir=cache)
    paths = list_imagefolder(str(mp))
    data = {p[len(str(mp)):]: open(p, "rb").read() for p in paths}
    mounts.unmount(mp)
    mp = mounts.cachefs(str(slow), name="second", cache_dir=cache)
    reset_stats(slow)
    again = list_imagefolder(str(mp))
    assert [p[len(str(mp)):] for p in again] == list(data)
    for p in again:
        with open(p, "rb") as f:
            assert f.read() == data[p[len(str(mp)):]]
    store = read_stats(slow)
    s = stats(mp)
    asked = {k: v["count"] for k, v in s["latency"].items() if v["count"]}
    store.pop("peak_in_flight", None)  # a gauge, not requests
    assert sum(store.values()) == 0, ({k: v for k, v in store.items() if v}, s["metadata"], asked)
    assert s["metadata"]["listings_kept"] >= 5 and s["fuse"]["errors"] == 0  # (two threads may load one)
