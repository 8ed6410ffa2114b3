"""One row per mapping: what a reader sees for each kind of failure."""

import errno

import pytest

from cachefs.errors import SourceChanged, to_errno


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
