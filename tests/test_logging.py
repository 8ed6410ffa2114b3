"""A failing source request is logged as one line with the path and errno; a traceback
only at debug level (no mount: the FUSE operations object is called directly)."""

import errno
import logging

import pytest

from cachefs.config import Config
from cachefs.fs import CachefsFS
from cachefs.fuse import FuseError
from cachefs.fuse import protocol as p
from cachefs.fuse.ops import Request
from cachefs.memsource import MemorySource
from tests.helpers import make_core

REQ = Request(1, 1, 0, 0, 0)


class Ops:
    """The file system, called as the kernel would: a lookup, then reads of the node."""

    def __init__(self, fs: CachefsFS):
        self.fs, self.core = fs, fs.core

    def read(self, path, size, offset, fh):
        entry = self.fs.lookup(REQ, 1, path.lstrip("/").encode())          # packed fuse_entry_out
        nodeid = p.ENTRY_OUT.unpack_from(entry)[0]
        return self.fs.read(REQ, nodeid, 0, offset, size)


def ops_over(source):
    config = Config(source="/src", mountpoint="/mnt", cache_dir="/tmp/unused")
    return Ops(CachefsFS(make_core(source), config))


def failing_read(caplog, level):
    src = MemorySource()
    src.add_file("/bad.jpg", b"x" * 100)
    src.faults[("read_range", "/bad.jpg")] = errno.EIO
    ops = ops_over(src)
    caplog.clear()
    with caplog.at_level(level, logger="cachefs"), pytest.raises(FuseError) as exc:
        ops.read("/bad.jpg", 100, 0, None)
    assert exc.value.errno == errno.EIO
    records = [r for r in caplog.records if r.levelno >= logging.WARNING]
    return ops, records


def test_a_source_error_is_one_warning_line_with_path_and_errno(caplog):
    ops, records = failing_read(caplog, logging.INFO)
    assert len(records) == 1
    message = records[0].getMessage()
    assert "/bad.jpg" in message and "errno 5 EIO" in message and "\n" not in message
    assert not records[0].exc_info and "Traceback" not in caplog.text  # none at info level
    assert ops.core.stats.get("source.errors") == 1 and ops.core.stats.get("fuse.errors") == 1


def test_debug_level_adds_the_traceback(caplog):
    _, records = failing_read(caplog, logging.DEBUG)
    assert records and records[0].exc_info and "Traceback" in caplog.text


def test_a_file_that_keeps_failing_is_logged_once_and_counted_each_time(caplog):
    src = MemorySource()
    for name in ("/bad.jpg", "/worse.jpg"):
        src.add_file(name, b"x" * 100)
        src.faults[("read_range", name)] = errno.EIO
    ops = ops_over(src)
    with caplog.at_level(logging.INFO, logger="cachefs"):
        for _ in range(5):                                   # five epochs retry the same file
            with pytest.raises(FuseError):
                ops.read("/bad.jpg", 100, 0, None)
        with pytest.raises(FuseError):
            ops.read("/worse.jpg", 100, 0, None)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 2 and "/bad.jpg" in warnings[0] and "/worse.jpg" in warnings[1]
    assert ops.core.stats.get("fuse.errors") == 6 and ops.core.stats.get("source.errors") == 6


def test_the_error_log_warns_once_an_hour_per_path_and_caps_each_kind(clock):
    from cachefs.nodes import ErrorLog

    elog = ErrorLog(max_paths=50, per_kind=10, window=3600, clock=clock)
    W, D = logging.WARNING, logging.DEBUG
    assert elog.level("read", "/a", errno.EIO) == (W, None)
    assert elog.level("read", "/a", errno.EIO) == (D, None)            # a repeat
    assert elog.level("read", "/a", errno.EACCES)[0] == W               # another errno
    assert elog.level("open", "/a", errno.EIO)[0] == W                  # another operation
    clock.advance(3601)
    assert elog.level("read", "/a", errno.EIO) == (W, None)             # an hour later, again
    levels = [elog.level("read", f"/many/{i}", errno.EACCES) for i in range(30)]
    assert [lv for lv, _ in levels].count(W) == 10                     # 10 per kind an hour
    summaries = [s for _, s in levels if s]
    assert len(summaries) == 1 and "more than 10 files failed with EACCES" in summaries[0]
    assert elog.level("read", "/other", errno.EIO)[0] == W              # other kinds go on
    assert len(elog._warned) <= 50
