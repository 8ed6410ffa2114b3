"""Faults through a real mount (issue 7): a source that hangs (slowfs stopped with SIGSTOP,
what a dead NFS server looks like to its clients), and source errors reaching the reader."""

import errno
import hashlib
import os
import random
import shutil
import signal
import subprocess
import threading
import time

import pytest

from cachefs.config import DEFAULT_BLOCK_SIZE
from cachefs.tiers import index
from tests.helpers import cli, stats
from tools.slowfs import read_stats as slowfs_stats
from tools.slowfs import reset_stats as slowfs_reset


def drop_pages(path):
    """Forget the kernel's cached pages of one file, so its next read reaches cachefs."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def wait_stopped(pid, timeout=10.0):
    """SIGSTOP takes effect when each thread is next scheduled: on a loaded machine a
    thread can serve a request or two after kill() returns."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:
                pass
        if states and all(state in "Tt" for state in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop")


def read(path):
    with open(path, "rb") as f:
        return f.read()


def read_errno(path):
    start = time.monotonic()
    try:
        read(path)
    except OSError as exc:
        return exc.errno, time.monotonic() - start
    return None, time.monotonic() - start


def test_a_hung_source_times_out_and_cached_files_stay_readable(tmp_path, mounts, fault_report):
    src = tmp_path / "src"
    src.mkdir()
    for name in "abcdef":
        (src / name).write_bytes(name.encode() * 50_000)
    slow = mounts.slowfs(src, latency="0.1ms")
    mp = mounts.cachefs(str(slow), extra=("--source-timeout", "1", "--metadata-ttl", "3",
                                          "--readahead", "off"))
    assert read(mp / "a") == b"a" * 50_000                          # cached in full
    for name in "bcdef":
        os.stat(mp / name)                                          # metadata cached, data not
    server = mounts.procs[-1]
    server.send_signal(signal.SIGSTOP)                              # the store stops answering
    try:
        wait_stopped(server.pid)
        drop_pages(mp / "a")
        assert read(mp / "a") == b"a" * 50_000
        # each waits out the timeout (the kernel retries a failed read-ahead once: 1-2 s)
        timed_out = [read_errno(mp / name) for name in "bc"]
        assert [code for code, _ in timed_out] == [errno.ETIMEDOUT] * 2, timed_out
        assert all(0.8 < took < 5 for _, took in timed_out), timed_out
        assert read_errno(mp / "d")[0] == errno.ETIMEDOUT
        code, took = read_errno(mp / "e")                           # the source is down now:
        assert code == errno.ETIMEDOUT and took < 0.5               # no waiting any more
        time.sleep(3.2)                                             # every TTL has expired
        drop_pages(mp / "a")
        assert read(mp / "a") == b"a" * 50_000                      # served on stale metadata
        s = stats(mp)
        assert s["source"]["timeouts"] >= 3 and s["source"]["down"] == 1
        assert s["source"]["fast_failures"] >= 1 and s["metadata"]["stale_served"] >= 1
        fault_report("source hangs (slowfs SIGSTOPped), --source-timeout 1",
                     "cached file byte-exact; others ETIMEDOUT after "
                     f"{', '.join(f'{t:.1f}' for _, t in timed_out)} s, then at once ({took:.2f} s)",
                     f"source.timeouts={s['source']['timeouts']}, down=1, "
                     f"fast_failures={s['source']['fast_failures']}, "
                     f"metadata.stale_served={s['metadata']['stale_served']}")
    finally:
        server.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 15                                # the next probe finds it back
    while read_errno(mp / "f")[0] is not None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert read(mp / "f") == b"f" * 50_000 and stats(mp)["source"]["down"] == 0
    log = (tmp_path / "cache" / "cachefs.log").read_text()
    assert "source not answering" in log and "source answering again" in log


def test_a_file_deleted_on_the_source_after_its_stat_fails_cleanly(tmp_path, mounts, fault_report):
    src = tmp_path / "src"
    src.mkdir()
    (src / "x").write_bytes(b"x" * 10_000)
    (src / "y").write_bytes(b"y" * 10_000)
    mp = mounts.cachefs(str(src), extra=("--readahead", "off"))
    os.stat(mp / "x")                                               # the kernel trusts its entry
    (src / "x").unlink()
    # zero-message opens: the read finds it gone (ESTALE); passthrough: the open does (ENOENT)
    assert read_errno(mp / "x")[0] in (errno.ESTALE, errno.ENOENT)
    deadline = time.monotonic() + 5
    while os.path.exists(mp / "x") and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(FileNotFoundError):                          # and then it is gone
        os.stat(mp / "x")
    assert read(mp / "y") == b"y" * 10_000                         # the daemon goes on
    fault_report("file deleted on the source after the kernel cached its stat",
                 "ESTALE or ENOENT, then ENOENT; other files served",
                 f"source.changed={stats(mp)['source'].get('changed', 0)}")


def _sha(data):
    return hashlib.sha256(data).hexdigest()


def _reader(paths, expected, seen, wrong, stop):
    """Read the files in random order until stopped or the mount dies: any bytes a read
    returns must be the source's (an error is allowed: the daemon is about to be killed)."""
    rng = random.Random()
    while not stop.is_set():
        path = rng.choice(paths)
        try:
            data = read(path)
        except OSError:
            if not os.path.exists(os.path.dirname(path)):
                return
            continue
        seen.append(path)
        if _sha(data) != expected[path.name]:
            wrong.append(path)


def test_kill_9_during_heavy_cache_writes_serves_no_partial_block_after_remount(tmp_path, mounts, fault_report):
    """Readers are filling the NVMe tier when the daemon is killed; the next mount clears
    the stale mount, serves what was recorded from the cache (each block checked against its
    hash first), and every byte read before and after the crash is the source's."""
    src = tmp_path / "src"
    src.mkdir()
    rng = random.Random(7)
    expected = {}
    for i in range(120):  # small files and files of a few blocks: 76 MiB in all
        size = rng.choice((40_000, 300_000, 1_500_000)) if i % 4 else 3 * DEFAULT_BLOCK_SIZE + 12_345
        data = rng.randbytes(size)
        (src / f"f{i:03d}").write_bytes(data)
        expected[f"f{i:03d}"] = _sha(data)
    total_blocks = sum(-(-(src / n).stat().st_size // DEFAULT_BLOCK_SIZE) for n in expected)
    slow = mounts.slowfs(src, latency="1ms", bandwidth="40MB")
    mp = mounts.cachefs(str(slow), extra=("--ram-size", "16MiB"))
    paths = [mp / n for n in expected]
    seen, wrong, stop = [], [], threading.Event()
    readers = [threading.Thread(target=_reader, args=(paths, expected, seen, wrong, stop)) for _ in range(6)]
    for t in readers:
        t.start()
    try:
        # a good part written, more on the way
        deadline = time.monotonic() + 60
        while (s := stats(mp))["disk"].get("writes", 0) < 96:
            assert time.monotonic() < deadline, "the NVMe writer never got going"
            time.sleep(0.02)
        written = s["disk"]["writes"]
        os.kill(s["info"]["pid"], signal.SIGKILL)
        # the blocks whose index lines had reached the file (they are written in batches)
        recorded = sum(isinstance(r, index.BlockRecord)
                       for r in index.read(str(tmp_path / "cache" / "store" / index.NAME)))
    finally:
        stop.set()
        for t in readers:
            t.join(timeout=60)
    assert written < total_blocks, "the cache was complete before the kill: nothing was tested"
    assert not wrong and seen, (len(wrong), len(seen))
    # no read-ahead now: each block is read once, from the cache if it was committed
    start = time.monotonic()
    proc = cli("mount", slow, mp, "--cache-dir", tmp_path / "cache", "--ram-size", "16MiB", "--disk-size", "1GiB",
               "--readahead", "off")
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr
    assert "cleared a stale cachefs mount" in proc.stderr
    slowfs_reset(str(slow))
    for name, digest in expected.items():
        assert _sha(read(mp / name)) == digest, name
    s = stats(mp)
    assert s["disk"].get("checksum_failures", 0) == 0   # no torn block was ever indexed
    hits = s["disk"].get("hits", 0)
    assert recorded > 0 and hits >= recorded            # every block recorded is served from the cache
    fetched = slowfs_stats(str(slow)).get("read", 0)
    assert fetched <= total_blocks - hits
    fault_report(f"kill -9 with 6 readers filling the NVMe tier ({written}+ of {total_blocks} blocks written, "
                 f"{recorded} recorded)",
                 f"{len(seen)} reads before: all exact; remount {took:.1f} s, cleared the stale mount; "
                 f"all {len(expected)} files exact",
                 f"disk.checksum_failures=0, disk.hits={hits}, source reads {fetched} (= the rest)")


@pytest.fixture
def small_disk(request, tmp_path):
    """A 48 MiB file system for the cache dir, one that can fill up (tmpfs) or go
    read-only under the daemon (ext4 on a loop device with errors=remount-ro: the kernel's
    answer to a failing disk). Requested before `mounts`, so it goes after cachefs does."""
    if os.getuid() != 0:
        pytest.skip("needs root to mount a file system")
    path = tmp_path / "nvme"
    path.mkdir()
    if request.param == "ext4":
        image = tmp_path / "nvme.img"
        with open(image, "wb") as f:
            f.truncate(48 << 20)
        subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True)
        cmd = ["mount", "-o", "loop,errors=remount-ro", str(image), str(path)]
    else:
        cmd = ["mount", "-t", "tmpfs", "-o", "size=48m,mode=0700", "tmpfs", str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot mount a {request.param} cache disk here: {done.stderr.strip()}")
    yield path
    if subprocess.run(["umount", str(path)], capture_output=True).returncode:
        subprocess.run(["umount", "-l", str(path)], check=True)


def _fill(path):
    """Another program takes every free byte of the cache disk."""
    fd = os.open(path / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * (1 << 20))
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)


def _fail_ext4(path):
    """What ext4 does on an I/O error with errors=remount-ro: read-only at once, open
    files or not (the kernel's test hook for a file-system error)."""
    device = os.path.basename(os.path.realpath(subprocess.run(
        ["findmnt", "-no", "SOURCE", str(path)], capture_output=True, text=True, check=True).stdout.strip()))
    with open(f"/sys/fs/ext4/{device}/trigger_fs_error", "w") as f:
        f.write("cachefs test: the cache disk failed")
    with pytest.raises(OSError) as exc:
        (path / "probe").write_bytes(b"x")
    assert exc.value.errno == errno.EROFS


CACHE_DISK_FAULTS = {"full": _fill, "read-only": _fail_ext4, "removed": lambda path: shutil.rmtree(path / "cache")}


@pytest.mark.parametrize("small_disk, fault", [("tmpfs", "full"), ("ext4", "read-only"), ("tmpfs", "removed")],
                         indirect=["small_disk"])
def test_a_failing_cache_disk_is_a_pass_through_for_the_reader(tmp_path, small_disk, mounts, fault, fault_report):
    """Issue 7, item 4: the cache disk fills up (another program took the space), is
    remounted read-only, or the cache dir is deleted under the daemon. Readers see the
    source's bytes and never an error; the tier turns itself off with one warning."""
    src = tmp_path / "src"
    src.mkdir()
    files = {f"f{i:02d}": os.urandom(DEFAULT_BLOCK_SIZE) for i in range(40)}
    for name, data in files.items():
        (src / name).write_bytes(data)
    log = tmp_path / "cachefs.log"
    # --min-free 0: the tier would otherwise see the filler coming and give the space back
    mp = mounts.cachefs(str(src), cache_dir=small_disk / "cache",
                        extra=("--ram-size", "4MiB", "--min-free", "0", "--readahead", "off",
                               "--log-file", str(log)))
    names = sorted(files)
    for name in names[:10]:
        assert read(mp / name) == files[name]
    deadline = time.monotonic() + 30
    while stats(mp)["disk"].get("writes", 0) < 10:
        assert time.monotonic() < deadline, stats(mp)["disk"]
        time.sleep(0.05)
    CACHE_DISK_FAULTS[fault](small_disk)
    for _ in range(2):
        for name in names:
            drop_pages(mp / name)
            assert read(mp / name) == files[name], name
    # the NVMe writer (a background thread at low priority) meets the failures: wait for it
    deadline = time.monotonic() + 30
    while (s := stats(mp)["disk"])["suspended"] != 1:
        assert time.monotonic() < deadline, s
        time.sleep(0.05)
    assert s.get("suspensions") == 1, s
    if fault != "removed":
        assert s.get("errors", 0) >= 8, s              # SUSPEND_AFTER failures, then no more
    text = log.read_text()
    assert text.count("NVMe tier off") == 1, text
    assert "Traceback" not in text
    fault_report(f"cache disk {fault} under the daemon" + (" (ext4 errors=remount-ro)" if fault == "read-only" else ""),
                 f"{2 * len(files)} reads, all exact, no error; one warning in the log",
                 f"disk.errors={s.get('errors', 0)}, suspensions=1, suspended_writes={s.get('suspended_writes', 0)}")


@pytest.mark.parametrize("same_file", [True, False], ids=["one-uncached-file", "different-files"])
def test_opens_waiting_on_a_stopped_source_never_stop_the_mount(tmp_path, mounts, fault_report, same_file):
    """Opens of uncached files that wait on a store that stopped answering (any number of
    them, of one file or of many) leave the session reading: a cached file still reads at
    once. They used to wait for a node lock while counted as the session's readers, and
    the mount froze until the source timeout."""
    src = tmp_path / "src"
    src.mkdir()
    for i in range(100):
        (src / f"f{i:02d}").write_bytes(bytes([i]) * 20_000)
    slow = mounts.slowfs(src, latency="0.1ms")
    mp = mounts.cachefs(str(slow), extra=("--readahead", "off", "--source-timeout", "60"))
    assert read(mp / "f00") == bytes([0]) * 20_000                   # cached
    for i in range(1, 100):
        os.stat(mp / f"f{i:02d}")                                    # looked up, not read
    server = mounts.procs[-1]
    server.send_signal(signal.SIGSTOP)
    readers = []
    try:
        wait_stopped(server.pid)
        # more files than the 64 lock stripes there were: some shared one
        names = ["f01"] * 3 if same_file else [f"f{i:02d}" for i in range(1, 100)]
        for name in names:
            t = threading.Thread(target=read_errno, args=(mp / name,), daemon=True)
            t.start()
            readers.append(t)
        time.sleep(1.0)                                              # they wait on the store
        done = threading.Event()
        got = []

        def cached_read():
            drop_pages(mp / "f00")
            got.append(read(mp / "f00"))
            done.set()

        start = time.monotonic()
        threading.Thread(target=cached_read, daemon=True).start()
        finished = done.wait(20)                                     # the bug: 58 s (the timeout)
        took = time.monotonic() - start
        assert finished and got == [bytes([0]) * 20_000], f"the cached read waited {took:.1f} s"
        refused = stats(mp)["fuse"]["busy_refusals"]
        assert (refused == 0) if same_file else (refused > 0)   # 99 waiting: past the 64 threads
        fault_report(f"{len(names)} opens of {'one uncached file' if same_file else 'different uncached files'} "
                     "waiting on a stopped source (passthrough as the mode allows)",
                     f"a cached file read in {took:.2f} s; {refused} opens refused with EAGAIN",
                     f"fuse.busy_refusals={refused}")
    finally:
        server.send_signal(signal.SIGCONT)
    for t in readers:
        t.join(30)
