"""Real clients through a real mount, cold and then from the cache, in whichever mode the
suite runs (passthrough, or zero-message with CACHEFS_TEST_PASSTHROUGH=off): LMDB over
mmap with read-ahead off (4 KiB page faults), tar shards read in a stream, HDF5 chunked
datasets read in slices, and `diff -r` over a tree with every kind of entry."""

import io
import os
import random
import subprocess
import tarfile

import pytest

from tests.helpers import stats

lmdb = pytest.importorskip("lmdb")
h5py = pytest.importorskip("h5py")
np = pytest.importorskip("numpy")


def _two_passes(mp, check):
    """Cold, then again with the page cache dropped: the second comes from the cache."""
    check()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")
    before = stats(mp)["source"]["read_range"]
    check()
    assert stats(mp)["source"]["read_range"] == before, "the second pass went back to the source"


def test_lmdb_with_readahead_off(tmp_path, mounts):
    src = tmp_path / "src"
    src.mkdir()
    rng = random.Random(1)
    records = {f"{i:06d}".encode(): rng.randbytes(rng.randrange(100, 40_000)) for i in range(600)}
    with lmdb.open(str(src / "db"), map_size=64 << 20) as env, env.begin(write=True) as txn:
        for k, v in records.items():
            txn.put(k, v)
    slow = mounts.slowfs(str(src), latency="1ms")
    mp = mounts.cachefs(str(slow))

    def check():
        with lmdb.open(str(mp / "db"), readonly=True, lock=False, readahead=False) as env, env.begin() as txn:
            keys = list(records)
            rng.shuffle(keys)
            for k in keys:
                assert txn.get(k) == records[k]
            assert sum(1 for _ in txn.cursor()) == len(records)

    _two_passes(mp, check)


def test_tar_shards_in_a_stream(tmp_path, mounts):
    src = tmp_path / "src"
    src.mkdir()
    rng = random.Random(2)
    members = {}
    for shard in range(3):
        with tarfile.open(src / f"shard-{shard:04d}.tar", "w") as tar:
            for i in range(80):
                name = f"{shard}/{i:05d}.jpg"
                data = rng.randbytes(rng.randrange(1, 60_000))
                members[name] = data
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    slow = mounts.slowfs(str(src), latency="1ms")
    mp = mounts.cachefs(str(slow))

    def check():
        seen = {}
        for shard in range(3):
            with tarfile.open(mp / f"shard-{shard:04d}.tar", "r|") as tar:  # a stream, as WebDataset reads
                for m in tar:
                    seen[m.name] = tar.extractfile(m).read()
        assert seen == members

    _two_passes(mp, check)


def test_hdf5_chunked_datasets_in_slices(tmp_path, mounts):
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(3)
    images = rng.integers(0, 255, size=(300, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 1000, size=300)
    with h5py.File(src / "train.h5", "w") as f:
        f.create_dataset("images", data=images, chunks=(16, 32, 32, 3), compression="gzip")
        f.create_dataset("labels", data=labels)
    slow = mounts.slowfs(str(src), latency="1ms")
    mp = mounts.cachefs(str(slow))
    order = rng.permutation(300)

    def check():
        with h5py.File(mp / "train.h5", "r") as f:
            for i in order[:120]:
                assert np.array_equal(f["images"][i], images[i])
            assert np.array_equal(f["images"][100:200], images[100:200])
            assert np.array_equal(f["labels"][:], labels)

    _two_passes(mp, check)


def test_diff_r_finds_no_difference(tmp_path, mounts):
    src = tmp_path / "src"
    rng = random.Random(4)
    for d in ("a", "a/b", "c", "empty-dir"):
        (src / d).mkdir(parents=True)
    for i in range(30):
        (src / ("a" if i % 2 else "a/b") / f"f{i}").write_bytes(rng.randbytes(rng.randrange(0, 3 << 20)))
    (src / "c" / "empty").write_bytes(b"")
    (src / "c" / "link").symlink_to("../a/f1")
    (src / "c" / "dangling").symlink_to("nowhere")
    (src / "c" / "mode600").write_bytes(b"private")
    os.chmod(src / "c" / "mode600", 0o600)
    mp = mounts.cachefs(str(src))
    for _ in range(2):  # cold, then cached
        proc = subprocess.run(["diff", "-r", "--no-dereference", str(src), str(mp)], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout + proc.stderr
