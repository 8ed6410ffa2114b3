"""Files that change on the source while mounted: a descriptor, a mapping or a new open reads
one version of a file whole, or fails with ESTALE; never a byte of another version. In both
data-path modes: passthrough (the kernel reads the cache file) and zero-message opens (the
daemon answers every read)."""

import errno
import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests.helpers import cli, is_mounted, stats

MODES = {"passthrough": ["--passthrough", "on"], "zero-message": ["--passthrough", "off"]}
MTIME = 1_704_067_200 * 10**9  # 2024-01-01, as a tarball re-extracted with fixed mtimes has


def _mount(mounts, src, mode, ttl):
    mp = mounts.cachefs(str(src), extra=[*MODES[mode], *(["--metadata-ttl", str(ttl)] if ttl else [])])
    if mode == "passthrough" and stats(mp)["info"]["opens"] != "passthrough":
        pytest.skip("this kernel or user cannot use FUSE passthrough")
    return mp


def _replace(path, data, how, mtime_ns=None):
    """Give `path` new content as a writer on the source would: in place, or a new file
    renamed over it (tar, cp, rsync)."""
    if how == "in-place":
        with open(path, "r+b") as f:
            f.write(data)
            f.truncate()
    else:
        tmp = path.with_name("." + path.name + ".new")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    if mtime_ns is not None:
        os.utime(path, ns=(mtime_ns, mtime_ns))


@pytest.mark.parametrize("how", ["rename", "in-place"])
@pytest.mark.parametrize("mode", MODES)
def test_same_size_and_mtime_but_new_content_is_served_whole(tmp_path, mounts, mode, how, fault_report):
    src = tmp_path / "src"
    src.mkdir()
    old, new = os.urandom(8 << 20), os.urandom(8 << 20)
    (src / "x.bin").write_bytes(old)
    os.utime(src / "x.bin", ns=(MTIME, MTIME))
    mp = _mount(mounts, src, mode, ttl=1)
    with open(mp / "x.bin", "rb") as f:
        assert f.read(1 << 20) == old[:1 << 20]
    _replace(src / "x.bin", new, how, MTIME)  # only the ctime tells the versions apart
    time.sleep(2.5)
    got = (mp / "x.bin").read_bytes()
    assert got == new, f"{sum(a != b for a, b in zip(got[::4096], new[::4096], strict=False))} of 2048 pages wrong"
    fault_report("file replaced with the same size and mtime (--metadata-ttl 1), in place or renamed",
                 "the new file whole after the TTL", "-")


@pytest.mark.parametrize("mode", MODES)
def test_a_descriptor_reads_the_file_it_opened_or_estale_after_a_rename(tmp_path, mounts, mode, fault_report):
    src = tmp_path / "src"
    src.mkdir()
    old, new = os.urandom(8 << 20), os.urandom(6 << 20)
    (src / "x.bin").write_bytes(old)
    mp = _mount(mounts, src, mode, ttl=1)
    seen = "the old file to its end"
    with open(mp / "x.bin", "rb", buffering=0) as f:
        assert f.read(64 << 10) == old[:64 << 10]
        _replace(src / "x.bin", new, "rename")
        time.sleep(1.5)
        assert (mp / "x.bin").read_bytes() == new  # another reader sees the new file
        pos = 64 << 10
        while True:
            try:
                chunk = f.read(256 << 10)
            except OSError as exc:
                assert exc.errno == errno.ESTALE, exc
                seen = f"the old file up to {pos >> 20} MiB, then ESTALE"
                break
            if not chunk:
                assert pos == len(old)
                break
            assert chunk == old[pos:pos + len(chunk)], f"bytes of another version at {pos}"
            pos += len(chunk)
    fault_report(f"file renamed over while a descriptor reads it ({mode})",
                 f"the descriptor: {seen}; new opens: the new file", "-")


MAPPER = textwrap.dedent("""
    import mmap, os, sys, hashlib
    fd = os.open(sys.argv[1], os.O_RDONLY)
    size = os.fstat(fd).st_size
    m = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    first = hashlib.sha256(m[:]).hexdigest()     # every page touched once
    print(first, flush=True)
    sys.stdin.readline()                         # the source changes meanwhile
    m.madvise(mmap.MADV_DONTNEED)                # drop the mapping's pages and the page cache's:
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the next touches are page faults
    print(hashlib.sha256(m[:]).hexdigest(), flush=True)
""")


@pytest.mark.parametrize("ttl", [1, None])
@pytest.mark.parametrize("how", ["rename", "in-place"])
@pytest.mark.parametrize("mode", MODES)
def test_a_mapping_survives_a_change_on_the_source(tmp_path, mounts, mode, how, ttl, fault_report):
    import hashlib

    src = tmp_path / "src"
    src.mkdir()
    old, new = os.urandom(6 << 20), os.urandom(6 << 20)
    (src / "x.bin").write_bytes(old)
    mp = _mount(mounts, src, mode, ttl)
    proc = subprocess.Popen([sys.executable, "-c", MAPPER, str(mp / "x.bin")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == hashlib.sha256(old).hexdigest()
        _replace(src / "x.bin", new, how)
        if ttl:
            time.sleep(1.5)
        # someone else opens the file meanwhile, and with a short TTL sees the new version
        got = (mp / "x.bin").read_bytes()
        assert got == (new if ttl else old) or got == new
        proc.stdin.write("\n")
        proc.stdin.flush()
        after = proc.stdout.readline().strip()
        assert proc.wait(timeout=30) == 0, "the mapping's process died (SIGBUS)"
    finally:
        proc.kill()
    assert after in (hashlib.sha256(old).hexdigest(), hashlib.sha256(new).hexdigest()), "a mix of versions"
    fault_report("file changed on the source under a mapping (in place or renamed, TTL 1 s or default, both modes)",
                 "no SIGBUS; the mapping reads its version whole", "-")


def _tree(root, files):
    for name, data in files.items():
        (root / name).write_bytes(data)


@pytest.mark.parametrize("how", ["remounted", "renamed"])
def test_a_source_path_that_names_another_tree_later_serves_one_tree(tmp_path, mounts, how, fault_report):
    if how == "remounted" and os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    src = tmp_path / "src"
    src.mkdir()
    old = {"a": os.urandom(1000), "b": os.urandom(200_000)}
    new = {"a": os.urandom(500), "c": os.urandom(10)}
    if how == "remounted":
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(src)], check=True)
    try:
        _tree(src, old)
        mp = _mount(mounts, src, "zero-message", ttl=1)
        assert (mp / "a").read_bytes() == old["a"]
        assert sorted(os.listdir(mp)) == sorted(old)
        if how == "remounted":
            subprocess.run(["umount", "-l", str(src)], check=True)
            subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(src)], check=True)
        else:
            src.rename(tmp_path / "src.old")
            src.mkdir()
        _tree(src, new)
        time.sleep(1.5)
        assert sorted(os.listdir(mp)) == sorted(old)  # one tree: names, sizes and bytes
        assert not (mp / "c").exists()
        for name, data in old.items():
            assert (mp / name).stat().st_size == len(data)
            assert (mp / name).read_bytes() == data
        log = (tmp_path / "cache" / "cachefs.log").read_text()
        assert "now names another directory" in log
    finally:
        if how == "remounted":
            mounts.unmount(tmp_path / "mnt")
            subprocess.run(["umount", "-l", str(src)], check=False)
    fault_report(f"the source path {how} to another tree under the daemon",
                 "the mounted tree, whole (names, sizes, bytes); one warning", "-")


READ_ALL = textwrap.dedent("""
    import concurrent.futures, errno, os, sys
    def read(p):
        # O_NONBLOCK: once the mount shows a FIFO, opening it waits for a writer, as on the source
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
            try:
                return len(os.read(fd, 1 << 20))
            finally:
                os.close(fd)
        except OSError as e:
            return errno.errorcode[e.errno]
    with concurrent.futures.ThreadPoolExecutor(len(sys.argv) - 1) as pool:
        print(" ".join(map(str, pool.map(read, sys.argv[1:]))))
""")


@pytest.mark.parametrize("mode", MODES)
def test_files_swapped_for_fifos_never_hang_a_reader_the_daemon_or_the_cli(tmp_path, mounts, mode, fault_report):
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    for i in range(70):
        (src / "d" / f"f{i}").write_bytes(os.urandom(3000))
    (src / "healthy").write_bytes(b"h" * 5000)
    mp = _mount(mounts, src, mode, ttl=None)
    for i in range(70):
        assert (mp / "d" / f"f{i}").stat().st_size == 3000  # the stat is cached: a regular file
    for i in range(70):
        (src / "d" / f"f{i}").unlink()
        os.mkfifo(src / "d" / f"f{i}")  # no writer, ever
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", READ_ALL, *[str(mp / "d" / f"f{i}") for i in range(70)]],
                          capture_output=True, text=True, timeout=60)
    outcomes = set(proc.stdout.split())
    # the daemon never reads a FIFO as the file it was: an error, or (once the name is
    # looked up again) the mount's own FIFO, empty without a writer
    assert outcomes <= {"ESTALE", "ENOENT", "EINVAL", "EAGAIN", "0"}, proc.stdout + proc.stderr
    assert (mp / "healthy").read_bytes() == b"h" * 5000  # a file nobody read yet: the daemon is free
    warm = cli("warm", mp, timeout=60)
    assert warm.returncode in (0, 1), warm.stdout + warm.stderr
    took = time.monotonic() - start
    assert cli("umount", mp, timeout=30).returncode == 0
    assert not is_mounted(mp)
    fault_report(f"70 cached files swapped for FIFOs with no writer ({mode})",
                 f"{'/'.join(sorted(outcomes))} at once; other files served; warm and umount finish ({took:.1f} s)",
                 "-")


@pytest.mark.parametrize("mode", MODES)
def test_a_tree_deeper_than_path_max_reads_through_the_mount(tmp_path, mounts, mode):
    from tests.test_source import make_deep_tree

    src = tmp_path / "src"
    src.mkdir()
    deep = make_deep_tree(src, data=b"deep" * 1000)
    mp = _mount(mounts, src, mode, ttl=None)
    fd = os.open(mp, os.O_RDONLY | os.O_DIRECTORY)  # as a program that walks with openat does
    try:
        for name in deep.strip("/").split("/"):
            nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = nfd
        assert sorted(os.listdir(fd)) == ["leaf", "link"]
        assert os.readlink("link", dir_fd=fd) == "leaf"
        leaf = os.open("leaf", os.O_RDONLY, dir_fd=fd)
        try:
            assert os.read(leaf, 1 << 20) == b"deep" * 1000
        finally:
            os.close(leaf)
    finally:
        os.close(fd)
