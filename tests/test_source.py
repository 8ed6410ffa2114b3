import errno
import os
import stat

import pytest

from cachefs.blocks import FileId
from cachefs.errors import SourceChanged
from cachefs.mounttable import _unescape
from cachefs.source import LocalSource

# Every test runs with both ways of resolving a path under the root: openat2 with
# RESOLVE_BENEATH (Linux 5.6+), and the /proc/self/fd check used where openat2 is missing.
RESOLVERS = ["openat2", "procfd"]


def make_source(root, resolver):
    source = LocalSource(str(root))
    if resolver == "procfd":
        source._openat2 = False
    return source


@pytest.fixture(params=RESOLVERS)
def src(tmp_path, request):
    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    (root / "d" / "f").write_bytes(b"0123456789")
    os.symlink("d/f", root / "ln")
    os.symlink(str(tmp_path / "outside"), root / "escape")
    (tmp_path / "outside").write_text("secret outside the source")
    return make_source(root, request.param)


def test_openat2_is_used_on_this_kernel(tmp_path):
    (tmp_path / "f").write_bytes(b"x")
    source = LocalSource(str(tmp_path))
    assert source.stat("/f").size == 1
    assert source._openat2, "openat2 was given up: paths take the slower /proc/self/fd route"


def test_a_relative_symlink_inside_the_source_is_not_an_escape(src, tmp_path):
    os.symlink("d", tmp_path / "root" / "dl")
    assert src.stat("/dl/f").size == 10


def fid_of(src, path):
    a = src.stat(path)
    return FileId(path, a.size, a.mtime_ns, a.ctime_ns)


def test_stat_does_not_follow_symlinks(src):
    assert stat.S_ISLNK(src.stat("/ln").mode)
    assert src.readlink("/escape").endswith("outside")


def test_listdir_reports_types_without_stat(src):
    types = {e.name: e.type_mode for e in src.listdir("/")}
    assert types == {"d": stat.S_IFDIR, "ln": stat.S_IFLNK, "escape": stat.S_IFLNK}


def test_read_range_exact_and_identity_checked(src):
    fid = fid_of(src, "/d/f")
    assert src.read_range(fid, 2, 5) == b"23456"
    with pytest.raises(SourceChanged):
        src.read_range(fid._replace(size=11), 0, 5)
    with pytest.raises(SourceChanged):
        src.read_range(fid._replace(mtime_ns=fid.mtime_ns + 1), 0, 5)


def test_read_range_never_follows_a_symlink_out_of_the_source(src):
    target = src.stat("/escape")
    with pytest.raises(OSError) as info:
        src.read_range(FileId("/escape", target.size, target.mtime_ns, target.ctime_ns), 0, 5)
    assert info.value.errno == errno.ELOOP


def test_truncated_file_is_source_changed_not_short_bytes(src, tmp_path):
    fid = fid_of(src, "/d/f")
    with open(tmp_path / "root" / "d" / "f", "r+b") as f:
        f.truncate(4)
    os.utime(tmp_path / "root" / "d" / "f", ns=(fid.mtime_ns, fid.mtime_ns))  # same mtime, other size
    with pytest.raises(SourceChanged):
        src.read_range(fid, 0, 10)


@pytest.mark.parametrize("bad", ["/../x", "/d/../../x", "d/f", "/d/./f", "/d//f"])
def test_escaping_or_malformed_paths_are_einval(src, bad):
    with pytest.raises(OSError) as info:
        src.stat(bad)
    assert info.value.errno == errno.EINVAL


def test_statfs_has_the_fields_fuse_needs(src):
    st = src.statfs()
    assert st["f_blocks"] > 0 and st["f_bsize"] > 0 and "f_namemax" in st


def test_mountinfo_unescaping():
    assert _unescape(r"/mnt/with\040space") == "/mnt/with space"
    assert _unescape(r"/a\011tab\012nl\134bs") == "/a\ttab\nnl\\bs"


@pytest.mark.parametrize("resolver", RESOLVERS)
def test_a_directory_swapped_for_a_symlink_cannot_lead_outside(tmp_path, resolver):
    root = tmp_path / "root"
    (root / "a").mkdir(parents=True)
    (root / "a" / "secret").write_text("inside")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("OUTSIDE")
    src = make_source(root, resolver)
    fid = fid_of(src, "/a/secret")
    assert src.read_range(fid, 0, 6) == b"inside"
    # the source changes under us: /a becomes a symlink to a directory outside
    (root / "a" / "secret").unlink()
    (root / "a").rmdir()
    os.symlink(str(outside), root / "a")
    for call in (lambda: src.stat("/a/secret"), lambda: src.listdir("/a"),
                 lambda: src.read_range(fid_of_outside(outside), 0, 7),
                 lambda: src.getxattr("/a/secret", "user.x")):
        with pytest.raises(OSError) as info:
            call()
        assert info.value.errno in (errno.EACCES, errno.ENOTDIR, errno.ELOOP), info.value


def fid_of_outside(outside):
    st = os.stat(outside / "secret")
    return FileId("/a/secret", st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def test_big_files_kept_open_serve_many_threads_without_a_wrong_descriptor(tmp_path, monkeypatch):
    """Big files stay open between block reads (a small LRU of descriptors): threads that
    open, evict and reuse them at once never read through a closed or reused descriptor."""
    import concurrent.futures as cf
    import random

    from cachefs import source as source_mod
    from cachefs.blocks import FileId

    monkeypatch.setattr(source_mod, "KEPT_FILES", 2)
    files = {}
    for i in range(6):
        data = os.urandom(64 << 10)
        (tmp_path / f"f{i}").write_bytes(data)
        st = os.stat(tmp_path / f"f{i}")
        files[f"/f{i}"] = (FileId(f"/f{i}", len(data), st.st_mtime_ns, st.st_ctime_ns), data)
    src = source_mod.LocalSource(str(tmp_path))

    def work(seed):
        rng = random.Random(seed)
        for _ in range(300):
            fid, data = files[rng.choice(list(files))]
            offset = rng.randrange(0, 60) * 1024
            assert src.read_range(fid, offset, 4096) == data[offset:offset + 4096]
        return True

    with cf.ThreadPoolExecutor(8) as ex:
        assert all(ex.map(work, range(8)))


def _within(seconds, fn, *args):
    """fn(*args) in a thread: its exception or result, or a failure if it hangs."""
    import threading

    out = []

    def run():
        try:
            out.append(("ok", fn(*args)))
        except BaseException as exc:
            out.append(("raised", exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"{fn.__name__} hung"
    return out[0]


@pytest.mark.parametrize("swap", ["fifo", "directory"])
def test_a_file_swapped_for_a_fifo_or_a_directory_is_changed_never_read_or_waited_on(tmp_path, swap):
    root = tmp_path / "src"
    root.mkdir()
    (root / "f").write_bytes(b"x" * 8192)
    source = LocalSource(str(root))
    st = source.stat("/f")
    fid = FileId("/f", st.size, st.mtime_ns, st.ctime_ns)
    (root / "f").unlink()
    if swap == "fifo":
        os.mkfifo(root / "f")  # no writer: a blocking open would wait forever
    else:
        (root / "f").mkdir()
    direct = source._direct
    for call, args in ((source.read_range, (fid, 0, 4096)), (source.read_whole, ("/f", 1 << 20))):
        kind, exc = _within(5, call, *args)
        assert kind == "raised" and isinstance(exc, SourceChanged), exc
    assert source._direct == direct  # a directory's EINVAL is not the file system refusing O_DIRECT


def test_big_direct_reads_keep_no_big_buffers(tmp_path):
    from cachefs import directio

    data = os.urandom(9 << 20)
    (tmp_path / "f").write_bytes(data)
    (tmp_path / "small").write_bytes(b"s" * 8192)
    fd = os.open(tmp_path / "small", os.O_RDONLY)
    try:
        assert directio.pread_direct(fd, 0, 8192) == b"s" * 8192
    finally:
        os.close(fd)
    for direct in (True, False):
        try:
            fd = os.open(tmp_path / "f", os.O_RDONLY | (os.O_DIRECT if direct else 0))
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            continue
        try:
            got = directio.pread_direct(fd, 0, len(data)) if direct else directio.pread(fd, 0, len(data))
        finally:
            os.close(fd)
        assert got == data
    assert directio._buffers and all(len(b) <= directio.BUFFER_KEPT_MAX for b in directio._buffers)
    assert sum(len(b) for b in directio._buffers) <= directio._BUFFERS_KEPT * directio.BUFFER_KEPT_MAX


def make_deep_tree(root, depth=25, width=200, data=b"deep"):
    """A tree deeper than PATH_MAX (25 levels of 200-character names), made a level at a time."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    names = []
    for i in range(depth):
        name = (f"{i:02d}" + "d" * width)[:width]
        os.mkdir(name, dir_fd=fd)
        nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
        os.close(fd)
        fd = nfd
        names.append(name)
    wfd = os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd)
    os.write(wfd, data)
    os.close(wfd)
    os.symlink("leaf", "link", dir_fd=fd)
    os.close(fd)
    return "/" + "/".join(names)


def test_paths_longer_than_path_max_are_served(tmp_path):
    deep = make_deep_tree(tmp_path)
    assert len(deep) > 4096
    source = LocalSource(str(tmp_path))
    attr = source.stat(deep + "/leaf")
    assert attr.size == 4
    assert sorted(e.name for e in source.listdir(deep)) == ["leaf", "link"]
    assert source.read_whole(deep + "/leaf", 1 << 20)[1] == b"deep"
    assert source.read_range(FileId(deep + "/leaf", 4, attr.mtime_ns, attr.ctime_ns), 0, 4) == b"deep"
    assert source.readlink(deep + "/link") == "leaf"
