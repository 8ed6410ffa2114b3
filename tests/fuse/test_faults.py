"""Faults through a real mount (issue 7): a source that hangs (slowfs stopped with SIGSTOP,
what a dead NFS server looks like to its clients), and source errors reaching the reader."""

import errno
import os
import signal
import time

import pytest

from tests.fuse.conftest import stats


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


def test_a_hung_source_times_out_and_cached_files_stay_readable(tmp_path, mounts):
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
    finally:
        server.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 15                                # the next probe finds it back
    while read_errno(mp / "f")[0] is not None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert read(mp / "f") == b"f" * 50_000 and stats(mp)["source"]["down"] == 0
    log = (tmp_path / "cache" / "cachefs.log").read_text()
    assert "source not answering" in log and "source answering again" in log


def test_a_file_deleted_on_the_source_after_its_stat_fails_cleanly(tmp_path, mounts):
    src = tmp_path / "src"
    src.mkdir()
    (src / "x").write_bytes(b"x" * 10_000)
    (src / "y").write_bytes(b"y" * 10_000)
    mp = mounts.cachefs(str(src), extra=("--readahead", "off"))
    os.stat(mp / "x")                                               # the kernel trusts its entry
    (src / "x").unlink()
    assert read_errno(mp / "x")[0] == errno.ESTALE                  # the handle's file is gone
    deadline = time.monotonic() + 5
    while os.path.exists(mp / "x") and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(FileNotFoundError):                          # and then it is gone
        os.stat(mp / "x")
    assert read(mp / "y") == b"y" * 10_000                         # the daemon goes on
