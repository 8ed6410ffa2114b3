"""Bad input: a one-line error, exit code 2, nothing mounted, nothing written."""

import os
import socket
import subprocess
import sys

import pytest

from cachefs.cli import format_stats, main


@pytest.fixture
def tree(tmp_path):
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "f").write_text("x")
    mp = tmp_path / "mnt"
    mp.mkdir()
    return tmp_path, src, mp


def listing(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


@pytest.mark.parametrize("case", [
    "missing-source", "source-is-file", "missing-mountpoint", "mountpoint-not-empty", "mountpoint-is-file",
    "mountpoint-inside-source", "source-inside-mountpoint", "cache-inside-source", "cache-inside-mountpoint",
    "cache-unwritable", "cache-is-file", "bad-block-size", "negative-prefetch-workers", "warm-without-workers",
    "log-file-in-source", "log-file-dir-missing", "log-file-fifo", "metrics-without-prometheus-client",
    "metrics-port-taken", "no-backing-files",
])
def test_bad_mount_requests(case, tree, capsys, fault_report, monkeypatch):
    tmp, src, mp = tree
    cache = tmp / "cache"
    args = {"src": src, "mp": mp, "cache": cache, "extra": []}
    if case == "missing-source":
        args["src"] = tmp / "nope"
    elif case == "source-is-file":
        args["src"] = src / "a" / "f"
    elif case == "missing-mountpoint":
        args["mp"] = tmp / "no-mnt"
    elif case == "mountpoint-not-empty":
        (mp / "junk").write_text("j")
    elif case == "mountpoint-is-file":
        args["mp"] = src / "a" / "f"
    elif case == "mountpoint-inside-source":
        (src / "empty").mkdir()
        args["mp"] = src / "empty"
    elif case == "source-inside-mountpoint":
        args["src"], args["mp"] = mp / "inner", mp
        (mp / "inner").mkdir()
    elif case == "cache-inside-source":
        args["cache"] = src / "cache"
    elif case == "cache-inside-mountpoint":
        args["cache"] = mp / "cache"
    elif case == "cache-unwritable":
        args["cache"] = "/proc/cachefs-cannot-exist/cache"
    elif case == "cache-is-file":
        args["cache"] = src / "a" / "f"
    elif case == "bad-block-size":
        args["extra"] = ["--block-size", "1000"]
    elif case == "negative-prefetch-workers":
        args["extra"] = ["--prefetch-workers=-3"]
    elif case == "warm-without-workers":
        args["extra"] = ["--warm", "--prefetch-workers", "0"]
    elif case == "no-backing-files":
        args["extra"] = ["--backing-files", "0"]
    elif case == "log-file-in-source":
        args["extra"] = ["--log-file", str(src / "a" / "log")]
    elif case == "log-file-dir-missing":
        args["extra"] = ["--log-file", str(tmp / "nope" / "x.log")]
    elif case == "log-file-fifo":
        os.mkfifo(tmp / "log.fifo")
        args["extra"] = ["--log-file", str(tmp / "log.fifo")]
    elif case == "metrics-without-prometheus-client":
        import sys

        monkeypatch.setitem(sys.modules, "prometheus_client", None)  # what an environment without it imports
        args["extra"] = ["--metrics-addr", "127.0.0.1:9"]
    elif case == "metrics-port-taken":               # failed after the cache dir was made
        taken = socket.socket()
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        args["extra"] = ["--metrics-addr", str(taken.getsockname()[1])]
    before = listing(tmp)
    code = main(["mount", str(args["src"]), str(args["mp"]), "--cache-dir", str(args["cache"]),
                 "--ram-size", "64MiB", "--disk-size", "64MiB", *args["extra"]])
    out, err = capsys.readouterr()
    assert code == 2, (case, out, err)
    assert err.startswith("cachefs: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert listing(tmp) == before          # nothing written: no cache dir, no files
    assert not os.path.ismount(mp)
    fault_report("impossible mount request (paths inside each other, missing, unwritable)",
                 "one-line error, exit 2; nothing mounted, nothing written", "-")


@pytest.mark.parametrize("argv,needle", [
    (["mount", "s", "m", "--ram-size", "12XB"], "invalid --ram-size '12XB'"),
    (["mount", "s", "m", "--disk-size=-1G"], "must not be negative"),
    (["mount", "s", "m", "--metadata-ttl", "soon"], "invalid --metadata-ttl"),
    (["mount", "s"], "required"),
    (["frobnicate"], "invalid choice"),
    (["mount", "s", "m", "--no-such-option"], "unrecognized arguments"),
    (["mount", "s", "m", "--readahead", "always"], "invalid choice"),
    (["mount", "s", "m", "--ram-size", "9" * 400 + "GiB"], "too large"),
    (["mount", "s", "m", "--metrics-addr", "localhost:http"], "invalid --metrics-addr"),
    (["stats", "m", "--watch", "soon"], "invalid --watch"),
    (["mount", "s", "m", "--policy", "fifo"], "invalid --policy"),
    (["mount", "s", "m", "--source-timeout", "-3"], "invalid --source-timeout"),
    (["mount", "s", "m", "--source-timeout", "soon"], "invalid --source-timeout"),
    (["mount", "s", "m", "--source-timeout", "3000000h"], "at most 8760h"),
    (["mount", "s", "m", "--metadata-ttl", "1" + "0" * 30], "at most 8760h"),
    (["diagnose", "d", "--workers", "0"], "invalid --workers '0'"),
    (["diagnose", "d", "--batch-size", "many"], "invalid --batch-size"),
    (["diagnose", "d", "--target", "-5"], "invalid --target"),
    (["diagnose", "d", "--transform", "sepia"], "invalid --transform"),
    (["diagnose", "d", "--seconds", "forever"], "invalid --seconds"),
    (["mount", "s", "m", "--ram-size", "-5GiB"], "invalid --ram-size '-5GiB': must not be negative"),
    (["mount", "s", "m", "--ramsize", "1G"], "did you mean --ram-size? (see cachefs mount --help)"),
    (["stats", "m", "--jsn"], "did you mean --json? (see cachefs stats --help)"),
])
def test_usage_errors_are_one_line_and_exit_2(argv, needle, capsys, fault_report):
    with pytest.raises(SystemExit) as info:
        main(argv)
    _, err = capsys.readouterr()
    assert info.value.code == 2
    assert needle in err and err.count("\n") == 1, err
    fault_report("nonsense option value (negative, unknown unit, huge, not a number)",
                 "one-line error, exit 2", "-")


def test_stats_of_a_plain_directory_is_a_clear_error(tmp_path, capsys):
    assert main(["stats", str(tmp_path)]) == 2
    assert "is not a cachefs mount point" in capsys.readouterr().err


def test_umount_of_a_plain_directory_is_a_clear_error(tmp_path, capsys):
    assert main(["umount", str(tmp_path)]) == 2
    assert "is not mounted" in capsys.readouterr().err


def test_format_stats_shows_every_tier_and_the_source():
    snap = {"schema": 1, "info": {"version": "0.1.0", "pid": 1, "source": "/nfs/x", "mountpoint": "/mnt/x"},
            "uptime_s": 5,
            "ram": {"hits": 90, "misses": 10, "served_bytes": 1 << 30, "used_bytes": 1 << 20,
                    "capacity_bytes": 1 << 30, "entries": 3},
            "disk": {"hits": 5, "misses": 5, "checksum_failures": 2},
            "source": {"read_range": 5, "bytes": 5 << 20}, "fuse": {"read": 100},
            "prefetch": {"blocks": 40, "used": 31, "wasted": 2, "unused": 7},
            "latency": {"source.read_range": {"count": 5, "p50_s": 0.0021, "p99_s": 0.0185}}}
    text = format_stats(snap)
    assert "read p50 2.10 ms, p99 18 ms" in text and "stat none yet" in text
    assert "40 blocks fetched" in text and "31 used, 2 evicted unread, 7 waiting" in text
    assert "90.0%" in text and "50.0%" in text
    assert "1.0 GiB" in text and "2 checksum failures" in text and "/nfs/x" in text


def test_watch_and_coverage_need_a_path(capsys):
    assert main(["stats", "--coverage"]) == 2
    assert "--coverage needs a PATH" in capsys.readouterr().err
    assert main(["stats", "/", "--watch", "0"]) == 2
    assert "cachefs: error:" in capsys.readouterr().err


def test_a_daemon_that_died_silently_is_reported_with_its_last_logged_error(tmp_path):
    from cachefs.mount import _last_error_line

    log = tmp_path / "cachefs.log"
    log.write_text("2026-01-01 00:00:00,000 ERROR cachefs.mount: daemon failed: an older mount's failure\n")
    start = log.stat().st_size
    with open(log, "a") as f:
        f.write("2026-01-01 00:00:01,000 WARNING cachefs.core: something odd\n"
                "2026-01-01 00:00:02,000 ERROR cachefs.mount: daemon failed: cannot allocate the RAM tier\n"
                "2026-01-01 00:00:02,001 INFO cachefs.mount: bye\n")
    assert _last_error_line(str(log), start) == "daemon failed: cannot allocate the RAM tier"
    with open(log, "a") as f:
        f.write("Traceback (most recent call last):\n  File \"x\", line 1\nMemoryError: out of memory\n")
    assert _last_error_line(str(log), start) == "MemoryError: out of memory"
    assert _last_error_line(str(tmp_path / "missing.log"), 0) == ""
    assert _last_error_line(str(log), log.stat().st_size) == ""  # nothing new: no stale reason


def test_warm_shard_must_be_rank_of_world(capsys):
    for bad in ("2/2", "x/3", "1", "-1/4"):
        with pytest.raises(SystemExit) as info:
            main(["warm", "/x", f"--shard={bad}"])
        assert info.value.code == 2 and "invalid --shard" in capsys.readouterr().err


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to become another user")
def test_a_source_the_user_cannot_reach_is_permission_denied_not_missing(tmp_path):
    import shutil
    import tempfile
    from pathlib import Path

    from tests.helpers import as_user, portable_python

    base = Path(tempfile.mkdtemp(prefix="cachefs-user-"))   # under /tmp: pytest's dirs are root's only
    os.chmod(base, 0o755)
    try:
        _unreachable_source(base, as_user, portable_python)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _unreachable_source(base, as_user, portable_python):
    python, env = portable_python(base)
    locked = base / "locked"
    (locked / "data").mkdir(parents=True)
    os.chmod(locked, 0o700)                          # root's: nobody may not search it
    mp = base / "mnt"
    mp.mkdir()
    os.chown(mp, 65534, 65534)
    proc = as_user([python, "-m", "cachefs", "mount", str(locked / "data"), str(mp), "--cache-dir",
                    str(base / "cache")], env=env)
    assert proc.returncode == 2, proc.stderr
    assert "permission denied" in proc.stderr and "does not exist" not in proc.stderr
    assert proc.stderr.count("\n") == 1


def _checked_mount(tmp_path, *options: str) -> str:
    """What `cachefs mount SRC MNT --check OPTIONS` prints (it must pass): nothing mounted."""
    src = tmp_path / "src"
    src.mkdir()
    mp = tmp_path / "mnt"
    mp.mkdir()
    proc = subprocess.run([sys.executable, "-m", "cachefs", "mount", str(src), str(mp), "--check",
                           "--cache-dir", str(tmp_path / "c"), *options], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def test_ram_size_0_says_what_it_means(tmp_path):
    assert "--ram-size 0: no RAM tier" in _checked_mount(tmp_path, "--ram-size", "0")


def test_a_disk_size_beyond_the_cache_disk_is_cut_to_it_and_said_in_one_line(tmp_path):
    """It mounted with a warning and reported "NVMe 1000.0 TiB" in every view."""
    import shutil

    from cachefs.config import format_size

    out = _checked_mount(tmp_path, "--disk-size", "1000TiB", "--min-free", "1GiB")
    total = shutil.disk_usage(tmp_path).total
    assert "is more than the cache disk can ever hold" in out
    assert f"the NVMe tier's budget is {format_size(total - (1 << 30))}" in out
    assert "1000.0 TiB in" not in out
