"""One row per mapping: what a reader sees for each kind of failure."""

import errno

import pytest

from cachefs.errors import QUIET, SourceChanged, TierError, invalidates, source_failure, to_errno


@pytest.mark.parametrize("exc,expected", [
    (FileNotFoundError(errno.ENOENT, "x"), errno.ENOENT),
    (PermissionError(errno.EACCES, "x"), errno.EACCES),
    (OSError(errno.EIO, "x"), errno.EIO),
    (OSError(errno.ESTALE, "x"), errno.ESTALE),
    (OSError(errno.EROFS, "x"), errno.EROFS),
    (SourceChanged("/a"), errno.ESTALE),
    (TimeoutError(), errno.ETIMEDOUT),
    (MemoryError(), errno.ENOMEM),
    (OSError("no errno"), errno.EIO),
    (OSError(-3, "negative errno"), errno.EIO),
    (ValueError("a bug"), errno.EIO),
    (KeyError("a bug"), errno.EIO),
    (AssertionError(), errno.EIO),
])
def test_to_errno(exc, expected):
    assert to_errno(exc) == expected


# The one errno table (cachefs/errors.py): which source failures mean "not answering",
# which count as source errors, which make a file's cached identity wrong, and which a
# reader is told without a log line.
@pytest.mark.parametrize("exc,down,counted,invalidated", [
    (OSError(errno.ETIMEDOUT, "x"), True, True, False),
    (OSError(errno.ENOTCONN, "x"), True, True, False),
    (FileNotFoundError(errno.ENOENT, "x"), False, False, True),
    (OSError(errno.ENODATA, "x"), False, False, False),
    (OSError(errno.ENOTSUP, "x"), False, False, False),
    (OSError(errno.EINVAL, "x"), False, False, False),
    (SourceChanged("/a"), False, False, False),
    (OSError(errno.ELOOP, "x"), False, True, True),
    (OSError(errno.EISDIR, "x"), False, True, True),
    (OSError(errno.ENOTDIR, "x"), False, True, True),
    (OSError(errno.EIO, "x"), False, True, False),
    (OSError(errno.EACCES, "x"), False, True, False),
    (OSError(errno.ESTALE, "x"), False, True, False),
])
def test_the_source_failure_table(exc, down, counted, invalidated):
    assert source_failure(exc) == (down, counted)
    assert invalidates(exc) == invalidated


@pytest.mark.parametrize("code,quiet", [
    (errno.ENOENT, True), (errno.ENODATA, True), (errno.EROFS, True), (errno.ENOSYS, True), (errno.ENOTTY, True),
    (errno.EIO, False), (errno.EACCES, False), (errno.ESTALE, False), (errno.ETIMEDOUT, False), (errno.EAGAIN, False),
])
def test_what_a_reader_is_told_without_a_log_line(code, quiet):
    assert (code in QUIET) == quiet


def test_a_tier_failure_is_an_oserror_the_cache_turns_into_a_miss():
    assert issubclass(TierError, OSError)
