"""cachefs's FUSE layer against a fake kernel: a SOCK_SEQPACKET socket pair delivers one
message per read, as /dev/fuse does. Every opcode, the INIT negotiation, short, malformed
and unknown requests, interrupts, forgets of unknown nodes, notifications, and the
threads that take over while a request blocks. No mount."""

from __future__ import annotations

import errno
import os
import socket
import stat
import struct
import threading

import pytest

from cachefs.fuse import protocol as p
from cachefs.fuse.ops import DirItem, Entry, FuseError, Opened, Operations
from cachefs.fuse.session import Session

ATTR = p.Attr(ino=7, mode=stat.S_IFREG | 0o644, nlink=1, uid=1000, gid=1000, size=5,
              atime_ns=1_500_000_000, mtime_ns=2_000_000_001, ctime_ns=3_000_000_002)


class FakeFS(Operations):
    want_passthrough = True

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.conn = None
        self.release_read = threading.Event()

    def init(self, conn, session):
        self.conn = conn

    def lookup(self, req, parent, name):
        self.calls.append(("lookup", parent, name))
        if name == b"missing":
            raise FuseError(errno.ENOENT)
        return Entry(100 + len(name), ATTR, 2.5, 1.0)

    def forget(self, nodeid, nlookup):
        self.calls.append(("forget", nodeid, nlookup))

    def getattr(self, req, nodeid, fh):
        if nodeid == 13:
            raise RuntimeError("a bug in the file system")
        return ATTR, 60.0

    def readlink(self, req, nodeid):
        return b"target"

    def open(self, req, nodeid, flags):
        return Opened(fh=9, flags=p.FOPEN_KEEP_CACHE, backing_id=0)

    def read(self, req, nodeid, fh, offset, size):
        if nodeid == 42:
            with self.session.blocking():      # a slow source
                self.release_read.wait(10)
        return b"hello world"[offset:offset + size]

    def readdir(self, req, nodeid, fh):
        return [DirItem(b".", stat.S_IFDIR), DirItem(b"..", stat.S_IFDIR)] + \
            [DirItem(f"file{i}".encode(), stat.S_IFREG, 1000 + i) for i in range(20)]

    def getxattr(self, req, nodeid, name):
        if name == b"user.none":
            raise FuseError(errno.ENODATA)
        return b"value!"

    def listxattr(self, req, nodeid):
        return [b"user.a", b"user.bb"]


class Kernel:
    """The kernel's side of the connection."""

    def __init__(self) -> None:
        self.ours, self.theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.ours.settimeout(5)
        self.unique = 0

    @property
    def fd(self) -> int:
        return self.theirs.fileno()

    def send(self, opcode: int, payload: bytes = b"", nodeid: int = 1, length: int | None = None,
             uid: int = 1000) -> int:
        self.unique += 2
        size = p.IN_HEADER.size + len(payload) if length is None else length
        self.ours.send(p.IN_HEADER.pack(size, opcode, self.unique, nodeid, uid, 1000, 4242, 0, 0) + payload)
        return self.unique

    def reply(self) -> tuple[int, int, bytes]:
        """(error, unique, payload) of the next message from the server."""
        msg = self.ours.recv(1 << 20)
        length, error, unique = p.OUT_HEADER.unpack_from(msg)
        assert length == len(msg)
        return error, unique, msg[p.OUT_HEADER.size:]

    def nothing(self) -> bool:
        self.ours.settimeout(0.2)
        try:
            self.ours.recv(1 << 20)
            return False
        except TimeoutError:
            return True
        finally:
            self.ours.settimeout(5)

    def init(self, major=7, minor=45, flags=p.ASYNC_READ | p.MAX_PAGES | p.INIT_EXT | p.DO_READDIRPLUS,
             flags2=p.PASSTHROUGH >> 32) -> int:
        return self.send(p.INIT, p.INIT_IN.pack(major, minor, 131072, flags) + struct.pack("<I", flags2) + bytes(44))


@pytest.fixture
def kernel():
    k = Kernel()
    yield k
    k.ours.close()
    k.theirs.close()


@pytest.fixture
def session(kernel):
    fs = FakeFS()
    s = Session(kernel.fd, fs, readers=1, max_threads=4, clone=False)
    fs.session = s
    kernel.init()
    s.negotiate()
    kernel.reply()
    return s


def call(kernel, session, opcode, payload=b"", nodeid=1, **kw):
    unique = kernel.send(opcode, payload, nodeid, **kw)
    msg = kernel.ours  # the request is waiting in the socket: have the session answer it
    buf = bytearray(1 << 20)
    n = os.readv(session.fd, [buf])
    session.handle(session.fd, memoryview(buf)[:n])
    error, got, out = kernel.reply()
    assert got == unique
    del msg
    return error, out


def answer(kernel, session, opcode, payload=b"", nodeid=1) -> bool:
    """Deliver a request that gets no reply; True if none came."""
    kernel.send(opcode, payload, nodeid)
    buf = bytearray(1 << 20)
    n = os.readv(session.fd, [buf])
    session.handle(session.fd, memoryview(buf)[:n])
    return kernel.nothing()


# -- INIT ----------------------------------------------------------------------------------

def test_init_settles_the_minor_version_and_the_flags_both_sides_have(kernel):
    fs = FakeFS()
    s = Session(kernel.fd, fs, max_read=1 << 20, clone=False)
    unique = kernel.init()
    s.negotiate()
    error, got, out = kernel.reply()
    assert (error, got) == (0, unique) and len(out) == 64
    major, minor, ra, flags, bg, congestion, max_write, gran, pages, _, flags2, depth, _ = p.INIT_OUT.unpack(out)
    assert (major, minor, ra, pages, gran) == (7, 45, 131072, 256, 1)
    assert flags & p.ASYNC_READ and flags & p.MAX_PAGES and flags & p.DO_READDIRPLUS
    assert not flags & p.PARALLEL_DIROPS      # wanted, but this kernel did not offer it
    assert flags2 == p.PASSTHROUGH >> 32 and depth == 1
    assert fs.conn.passthrough and s.initialized.is_set()


def test_an_older_kernel_is_answered_in_its_own_minor_version(kernel):
    s = Session(kernel.fd, FakeFS(), clone=False)
    kernel.init(minor=36, flags2=0)
    s.negotiate()
    _, _, out = kernel.reply()
    assert p.INIT_OUT.unpack(out)[1] == 36 and p.INIT_OUT.unpack(out)[10] == 0  # no passthrough


def test_a_kernel_too_old_is_refused(kernel):
    s = Session(kernel.fd, FakeFS(), clone=False)
    kernel.init(minor=20)
    with pytest.raises(OSError, match="too old"):
        s.negotiate()
    assert kernel.reply()[0] == -errno.EPROTO


def test_a_newer_major_version_gets_ours_and_a_new_init(kernel):
    s = Session(kernel.fd, FakeFS(), clone=False)
    kernel.init(major=8)
    kernel.init()
    s.negotiate()
    error, _, out = kernel.reply()
    assert error == 0 and struct.unpack("<II", out) == (7, 45)  # the short answer: our major
    assert p.INIT_OUT.unpack(kernel.reply()[2])[:2] == (7, 45)


def test_requests_before_init_are_refused(kernel):
    s = Session(kernel.fd, FakeFS(), clone=False)
    early = kernel.send(p.LOOKUP, b"x\0")
    kernel.init()
    s.negotiate()
    assert kernel.reply()[:2] == (-errno.EIO, early)
    assert kernel.reply()[0] == 0


# -- every opcode ---------------------------------------------------------------------------

def test_lookup_packs_an_entry(kernel, session):
    error, out = call(kernel, session, p.LOOKUP, b"abc\0", nodeid=1)
    assert error == 0 and len(out) == 128
    nodeid, gen, ev, av, evn, avn = p.ENTRY_OUT.unpack_from(out)
    assert (nodeid, gen, ev, av, evn, avn) == (103, 0, 2, 1, 500_000_000, 0)
    fields = p.ATTR.unpack_from(out, p.ENTRY_OUT.size)
    assert fields[0] == 7 and fields[1] == 5 and fields[4] == 2 and fields[7] == 1 and fields[9] == ATTR.mode
    assert session.ops.calls[-1] == ("lookup", 1, b"abc")


def test_a_lookup_error_is_its_errno(kernel, session):
    assert call(kernel, session, p.LOOKUP, b"missing\0")[0] == -errno.ENOENT


def test_getattr_readlink_open_read_release_statfs(kernel, session):
    error, out = call(kernel, session, p.GETATTR, p.GETATTR_IN.pack(0, 0, 0), nodeid=5)
    assert error == 0 and p.ATTR_OUT.unpack_from(out)[0] == 60 and len(out) == 104
    assert call(kernel, session, p.READLINK, nodeid=5) == (0, b"target")
    error, out = call(kernel, session, p.OPEN, p.OPEN_IN.pack(os.O_RDONLY, 0), nodeid=5)
    assert error == 0 and p.OPEN_OUT.unpack(out) == (9, p.FOPEN_KEEP_CACHE, 0)
    assert call(kernel, session, p.READ, p.READ_IN.pack(9, 6, 100, 0, 0, 0, 0), nodeid=5) == (0, b"world")
    assert call(kernel, session, p.RELEASE, p.RELEASE_IN.pack(9, 0, 0, 0), nodeid=5) == (0, b"")
    error, out = call(kernel, session, p.STATFS)
    assert error == 0 and len(out) == 80 and p.STATFS_OUT.unpack(out)[5] == 4096


def test_the_trace_logs_every_request_with_its_outcome(kernel, session, caplog):
    session.trace = True
    with caplog.at_level("INFO", logger="cachefs.fuse.session"):
        call(kernel, session, p.LOOKUP, b"missing\0")
        call(kernel, session, p.GETATTR, p.GETATTR_IN.pack(0, 0, 0), nodeid=5)
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("lookup") and "ENOENT" in line for line in lines), lines
    assert any(line.startswith("getattr") and "node=5" in line and ": ok in" in line for line in lines), lines


def test_opens_for_writing_and_every_write_request_are_read_only(kernel, session):
    for flags in (os.O_WRONLY, os.O_RDWR, os.O_RDONLY | os.O_TRUNC, os.O_WRONLY | os.O_APPEND):
        assert call(kernel, session, p.OPEN, p.OPEN_IN.pack(flags, 0), nodeid=5)[0] == -errno.EROFS
    for opcode in sorted(p.WRITE_OPS):
        assert call(kernel, session, opcode, bytes(64), nodeid=5)[0] == -errno.EROFS, p.OPCODE_NAMES[opcode]


def test_flush_fsync_access_and_the_isatty_ioctl(kernel, session):
    assert call(kernel, session, p.FLUSH, bytes(24), nodeid=5)[0] == -errno.ENOSYS  # then never again
    assert call(kernel, session, p.FSYNC, bytes(16), nodeid=5)[0] == 0
    assert call(kernel, session, p.ACCESS, p.ACCESS_IN.pack(4, 0), nodeid=5)[0] == 0
    assert call(kernel, session, p.IOCTL, bytes(32), nodeid=5)[0] == -errno.ENOTTY


def test_unknown_and_unsupported_opcodes_get_enosys(kernel, session):
    for opcode in (7, 19, 31, p.BMAP, p.POLL, p.LSEEK, p.SYNCFS, p.STATX, 54, 999, 4096):
        assert call(kernel, session, opcode, bytes(16), nodeid=5)[0] == -errno.ENOSYS, opcode


def test_readdir_hands_out_the_listing_by_offset_and_size(kernel, session):
    error, out = call(kernel, session, p.OPENDIR, p.OPEN_IN.pack(0, 0))
    fh = p.OPEN_OUT.unpack(out)[0]
    names, offset = [], 0
    while True:
        error, out = call(kernel, session, p.READDIR, p.READ_IN.pack(fh, offset, 200, 0, 0, 0, 0))
        assert error == 0 and len(out) <= 200
        if not out:
            break
        pos = 0
        while pos < len(out):
            ino, off, namelen, kind = p.DIRENT.unpack_from(out, pos)
            names.append(out[pos + 24:pos + 24 + namelen])
            offset = off
            pos += p.dirent_size(names[-1], plus=False)
    assert names == [b".", b".."] + [f"file{i}".encode() for i in range(20)]
    assert call(kernel, session, p.RELEASEDIR, p.RELEASE_IN.pack(fh, 0, 0, 0))[0] == 0
    assert call(kernel, session, p.READDIR, p.READ_IN.pack(fh, 0, 4096, 0, 0, 0, 0))[0] == -errno.EBADF


def test_readdirplus_looks_up_exactly_the_entries_it_returns(kernel, session):
    _, out = call(kernel, session, p.OPENDIR, p.OPEN_IN.pack(0, 0))
    fh = p.OPEN_OUT.unpack(out)[0]
    session.ops.calls.clear()
    size = 3 * p.dirent_size(b"file10", plus=True)  # ".", ".." and one file fit
    error, out = call(kernel, session, p.READDIRPLUS, p.READ_IN.pack(fh, 0, size, 0, 0, 0, 0))
    assert error == 0 and session.ops.calls == [("lookup", 1, b"file0")]  # not "." nor ".."
    first = p.ENTRY_OUT.unpack_from(out)[0]
    assert first == 0  # "." carries no entry: the kernel must not count a lookup


def _list_all(kernel, session, opcode, fh, size, start=0):
    """Every (name, next offset) a listing hands out from `start`, read `size` bytes at a time."""
    plus = opcode == p.READDIRPLUS
    got, offset = [], start
    while True:
        error, out = call(kernel, session, opcode, p.READ_IN.pack(fh, offset, size, 0, 0, 0, 0))
        assert error == 0 and len(out) <= size
        if not out:
            return got
        pos = 0
        while pos < len(out):
            base = pos + (p.ENTRY_OUT.size + p.ATTR.size if plus else 0)
            ino, off, namelen, kind = p.DIRENT.unpack_from(out, base)
            name = out[base + p.DIRENT.size:base + p.DIRENT.size + namelen]
            got.append((name, off))
            offset = off
            pos += p.dirent_size(name, plus=plus)


@pytest.mark.parametrize("opcode", [p.READDIR, p.READDIRPLUS])
@pytest.mark.parametrize("count", [1_022, 1_281, 10_000, 100_000])
def test_a_directory_of_any_size_lists_whole_in_big_pieces(kernel, session, opcode, count):
    # A reply of more than IOV_MAX parts failed with EINVAL when each entry was a vector of
    # its own; a 128 KiB piece holds ~4,000 short names (the fake kernel's socket takes
    # ~200 KiB a message; the real kernel asks for up to max_pages, 1 MiB).
    names = [f"n{i:06d}".encode() for i in range(count)]
    session.ops.readdir = lambda req, nodeid, fh: [DirItem(n, stat.S_IFREG, 10 + i) for i, n in enumerate(names)]
    session.ops.lookup = lambda req, parent, name: Entry(5, ATTR, 1.0, 1.0)
    _, out = call(kernel, session, p.OPENDIR, p.OPEN_IN.pack(0, 0))
    fh = p.OPEN_OUT.unpack(out)[0]
    got = _list_all(kernel, session, opcode, fh, 128 << 10)
    assert [n for n, _ in got] == names
    # seekdir to the middle: the rest comes again, every name once
    middle = len(got) // 2
    again = _list_all(kernel, session, opcode, fh, 128 << 10, start=got[middle][1])
    assert again == got[middle + 1:]
    assert session.reply_failures == 0


def test_a_reply_the_kernel_refuses_is_counted_logged_and_answered_with_an_error(kernel, session, caplog):
    failed = []
    session.on_reply_failed = lambda op, code: failed.append((op, code))
    real_writev = os.writev

    def refuse(fd, vectors):  # what the kernel says to a reply it cannot take
        raise OSError(errno.EINVAL, "Invalid argument")

    unique = kernel.send(p.GETATTR, p.GETATTR_IN.pack(0, 0, 0))
    buf = bytearray(1 << 20)
    n = os.readv(session.fd, [buf])
    os.writev = refuse
    try:
        session.handle(session.fd, memoryview(buf)[:n])
    finally:
        os.writev = real_writev
    error, got, _ = kernel.reply()
    assert (error, got) == (-errno.EIO, unique)   # the caller does not wait forever
    assert failed == [("getattr", errno.EINVAL)] and session.reply_failures == 1
    assert any(r.levelname == "WARNING" and "refused the reply" in r.getMessage() for r in caplog.records)


def test_an_interrupted_request_whose_reply_is_dropped_is_not_a_failure(kernel, session):
    real_writev = os.writev
    kernel.send(p.GETATTR, p.GETATTR_IN.pack(0, 0, 0))
    buf = bytearray(1 << 20)
    n = os.readv(session.fd, [buf])

    def gone(fd, vectors):
        raise OSError(errno.ENOENT, "No such file or directory")

    os.writev = gone
    try:
        session.handle(session.fd, memoryview(buf)[:n])
    finally:
        os.writev = real_writev
    assert session.reply_failures == 0 and kernel.nothing()


def test_xattrs_size_query_and_erange(kernel, session):
    name = b"user.x\0"
    assert call(kernel, session, p.GETXATTR, p.GETXATTR_IN.pack(0, 0) + name) == (0, p.GETXATTR_OUT.pack(6, 0))
    assert call(kernel, session, p.GETXATTR, p.GETXATTR_IN.pack(64, 0) + name) == (0, b"value!")
    assert call(kernel, session, p.GETXATTR, p.GETXATTR_IN.pack(3, 0) + name)[0] == -errno.ERANGE
    assert call(kernel, session, p.GETXATTR, p.GETXATTR_IN.pack(64, 0) + b"user.none\0")[0] == -errno.ENODATA
    assert call(kernel, session, p.LISTXATTR, p.GETXATTR_IN.pack(64, 0)) == (0, b"user.a\0user.bb\0")


def test_forgets_and_interrupts_get_no_reply_even_for_unknown_nodes(kernel, session):
    assert answer(kernel, session, p.FORGET, p.FORGET_IN.pack(3), nodeid=123456)
    batch = p.BATCH_FORGET_IN.pack(2, 0) + p.FORGET_ONE.pack(77, 1) + p.FORGET_ONE.pack(78, 2)
    assert answer(kernel, session, p.BATCH_FORGET, batch)
    assert ("forget", 77, 1) in session.ops.calls and ("forget", 78, 2) in session.ops.calls
    lying = p.BATCH_FORGET_IN.pack(1000, 0) + p.FORGET_ONE.pack(79, 1)   # claims more than it holds
    assert answer(kernel, session, p.BATCH_FORGET, lying)
    assert answer(kernel, session, p.INTERRUPT, p.INTERRUPT_IN.pack(5))
    assert answer(kernel, session, p.FORGET, b"")   # too short: dropped, no crash


# -- malformed requests ---------------------------------------------------------------------

@pytest.mark.parametrize("opcode, payload", [
    (p.LOOKUP, b"no terminating nul"),
    (p.OPEN, b"\1"),
    (p.READ, bytes(12)),
    (p.RELEASE, bytes(3)),
    (p.GETXATTR, p.GETXATTR_IN.pack(10, 0) + b"unterminated"),
    (p.READDIR, bytes(8)),
    (p.ACCESS, b""),
])
def test_a_short_or_malformed_request_is_einval_and_the_session_goes_on(kernel, session, opcode, payload):
    assert call(kernel, session, opcode, payload, nodeid=5)[0] == -errno.EINVAL
    assert call(kernel, session, p.LOOKUP, b"abc\0")[0] == 0


def test_a_header_that_lies_about_the_length_is_einval(kernel, session):
    assert call(kernel, session, p.LOOKUP, b"abc\0", length=400)[0] == -errno.EINVAL
    kernel.ours.send(b"\1\2\3")                           # shorter than any header: dropped
    buf = bytearray(1 << 16)
    session.handle(session.fd, memoryview(buf)[:os.readv(session.fd, [buf])])
    assert kernel.nothing()


def test_an_exception_in_the_file_system_is_eio(kernel, session):
    assert call(kernel, session, p.GETATTR, p.GETATTR_IN.pack(0, 0, 0), nodeid=13)[0] == -errno.EIO
    assert call(kernel, session, p.GETATTR, p.GETATTR_IN.pack(0, 0, 0), nodeid=5)[0] == 0


def test_destroy_replies_and_stops(kernel, session):
    assert call(kernel, session, p.DESTROY) == (0, b"")
    assert session.destroyed and session.stopped


# -- notifications, threads ---------------------------------------------------------------

def test_notifications_carry_their_code_and_no_unique(kernel, session):
    assert session.notify_inval_entry(1, b"name")
    error, unique, out = kernel.reply()
    assert error == p.NOTIFY_INVAL_ENTRY and out == p.NOTIFY_INVAL_ENTRY_OUT.pack(1, 4, 0) + b"name\0"


def test_a_blocked_request_hands_its_place_to_another_thread(kernel, session):
    """One reader: while a READ waits on the source (inside blocking()), another thread
    takes requests, so a LOOKUP is answered before the READ."""
    session.start()
    slow = kernel.send(p.READ, p.READ_IN.pack(1, 0, 5, 0, 0, 0, 0), nodeid=42)
    fast = kernel.send(p.LOOKUP, b"abc\0")
    error, unique, _ = kernel.reply()
    assert (error, unique) == (0, fast)
    session.ops.release_read.set()
    error, unique, out = kernel.reply()
    assert (error, unique, out) == (0, slow, b"hello")
    assert len(session._workers) == 2
    kernel.ours.shutdown(socket.SHUT_RDWR)  # the kernel goes away: every thread ends
    session.wait(poll=0.05)
    assert session.stopped


def test_past_max_threads_waiting_a_request_that_would_wait_is_refused_and_the_rest_answered(kernel):
    fs = FakeFS()
    s = Session(kernel.fd, fs, readers=1, max_threads=3, clone=False)   # two may wait, one reads
    fs.session = s
    kernel.init()
    s.negotiate()
    kernel.reply()
    s.start()
    slow = [kernel.send(p.READ, p.READ_IN.pack(1, 0, 5, 0, 0, 0, 0), nodeid=42) for _ in range(3)]
    fast = kernel.send(p.LOOKUP, b"abc\0")
    replies = {}
    for _ in range(2):   # a READ waits in each of two threads; the third is refused
        error, unique, _ = kernel.reply()
        replies[unique] = error
    assert replies == {slow[2]: -errno.EAGAIN, fast: 0}
    assert s.busy_refusals == 1
    fs.release_read.set()
    assert sorted(kernel.reply()[1] for _ in range(2)) == slow[:2]
    kernel.ours.shutdown(socket.SHUT_RDWR)
    s.wait(poll=0.05)
