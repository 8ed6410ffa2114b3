"""Exceptions and the one errno mapping every layer above uses."""

from __future__ import annotations

import errno


class CachefsError(Exception):
    """A user-facing error: the CLI prints it on one line and exits with code 2."""

    exit_code = 2


class SourceChanged(OSError):
    """The source file no longer has the identity (size, mtime_ns) the caller expected.

    Raised instead of returning bytes of another version of the file; it reaches a reader
    as ESTALE, and the metadata for the path is refreshed so the next open sees the new file.
    """

    def __init__(self, path: str):
        super().__init__(errno.ESTALE, "source file changed while cached", path)


def to_errno(exc: BaseException) -> int:
    """Map any exception to the positive errno a FUSE reply should carry.

    OSError keeps its own errno (ENOENT, EACCES, ESTALE, ...); anything else, including a
    bug in cachefs, becomes EIO so that one bad request never kills the mount and a reader
    never sees a misleading EINVAL.
    """
    if isinstance(exc, OSError) and isinstance(exc.errno, int) and exc.errno > 0:
        return exc.errno
    if isinstance(exc, TimeoutError):
        return errno.ETIMEDOUT
    if isinstance(exc, MemoryError):
        return errno.ENOMEM
    return errno.EIO
