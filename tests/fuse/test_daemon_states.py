"""The CLI against daemons that are stopped, and mounts raced: every request answers within
its timeout with one line naming the mount, a stopped daemon is never called dead, and a
mount point gets exactly one mount."""

import json
import os
import signal
import subprocess
import sys
import time

from cachefs.mounttable import list_mounts
from tests.helpers import ROOT, cli

TIMEOUT = "2"  # CACHEFS_CONTROL_TIMEOUT for these tests' CLI calls


def _mounted_at(path):
    return sum(1 for m in list_mounts() if m.mountpoint == str(path))


def _one_line_error(proc, mp, started, word="does not answer"):
    took = time.monotonic() - started
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stdout + proc.stderr
    assert str(mp) in lines[0] and word in lines[0], lines[0]
    assert "Traceback" not in proc.stderr
    return took


def test_a_stopped_daemon_gets_timeouts_not_hangs_and_is_never_called_dead(tmp_path, mounts, monkeypatch,
                                                                            fault_report):
    monkeypatch.setenv("CACHEFS_CONTROL_TIMEOUT", TIMEOUT)
    src = tmp_path / "src"
    src.mkdir()
    (src / "x").write_bytes(b"x" * 1000)
    a = mounts.cachefs(str(src), name="a", cache_dir=tmp_path / "ca")
    b = mounts.cachefs(str(src), name="b", cache_dir=tmp_path / "cb")
    pid = json.loads(os.getxattr(a, "user.cachefs.info"))["pid"]
    assert (a / "x").read_bytes() == b"x" * 1000  # the mount's first close: the kernel learns no FLUSH
    held = open(a / "x", "rb")  # a process still holds a file in the mount
    os.kill(pid, signal.SIGSTOP)
    try:
        took = []
        for args in (["stats", a], ["stats", a, "--json"], ["warm", a], ["stats", "--coverage", a]):
            start = time.monotonic()
            proc = cli(*args, timeout=30)
            took.append(_one_line_error(proc, a, start, "answer"))
        start = time.monotonic()
        listing = cli("stats", timeout=30)  # every mount: the stopped one does not hold up the others
        assert listing.returncode == 0, listing.stderr
        line_a = next(x for x in listing.stdout.splitlines() if x.startswith(f"{a} "))
        line_b = next(x for x in listing.stdout.splitlines() if x.startswith(f"{b} "))
        assert "does not answer" in line_a and "hit rate" in line_b
        took.append(time.monotonic() - start)
        # a second mount on the point is refused; nothing is stacked over the live one
        start = time.monotonic()
        again = cli("mount", src, a, "--cache-dir", tmp_path / "cc", timeout=30)
        _one_line_error(again, a, start)
        assert _mounted_at(a) == 1
        # umount says what is true: busy, and not dead
        start = time.monotonic()
        busy = cli("umount", a, timeout=30)
        _one_line_error(busy, a, start, "busy")
        assert "died" not in busy.stdout + busy.stderr and _mounted_at(a) == 1
        assert max(took) < 15, took
    finally:
        os.kill(pid, signal.SIGCONT)
        held.close()
    assert cli("stats", a).returncode == 0
    fault_report("daemon stopped (SIGSTOP) with a file held open in its mount",
                 f"stats/--json/warm/--coverage: one-line error in {max(took):.1f} s max; other mounts listed; "
                 "mount over it refused; umount: busy, not 'died'", "-")


def test_two_mounts_on_one_point_at_once_exactly_one_wins(tmp_path, mounts, fault_report):
    src = tmp_path / "src"
    src.mkdir()
    (src / "x").write_bytes(b"x")
    for attempt in range(3):
        mp = tmp_path / f"mnt{attempt}"
        mp.mkdir()
        procs = [subprocess.Popen([sys.executable, "-m", "cachefs", "mount", str(src), str(mp), "--cache-dir",
                                   str(tmp_path / f"c{attempt}{i}")], cwd=ROOT, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for i in range(2)]
        results = [(p.wait(timeout=60), p.stdout.read(), p.stderr.read()) for p in procs]
        mounts.points.append(mp)
        codes = sorted(r[0] for r in results)
        assert codes == [0, 2], results
        loser = next(r for r in results if r[0] == 2)
        assert "already a mount point" in loser[2], loser
        assert _mounted_at(mp) == 1
        assert (mp / "x").read_bytes() == b"x"
    fault_report("two cachefs mount on one mount point at the same moment (3 times)",
                 "exactly one mounts; the other: 'already a mount point', exit 2", "-")


def test_umount_through_a_symlink_to_the_mount_point(tmp_path, mounts):
    src = tmp_path / "src"
    src.mkdir()
    mp = mounts.cachefs(str(src))
    (tmp_path / "link").symlink_to(mp)
    proc = cli("umount", tmp_path / "link")
    assert proc.returncode == 0, proc.stderr
    assert f"unmounted {mp}" in proc.stdout and _mounted_at(mp) == 0
