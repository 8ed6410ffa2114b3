"""Exceptions and the one errno mapping every layer above uses."""

from __future__ import annotations

import errno


class CachefsError(Exception):
    """A user-facing error: the CLI prints it on one line and exits with code 2."""

    exit_code = 2


class NotSent(Exception):
    """A request for the source that never left cachefs (no fetch process was there to take
    it): its caller asks the source another way, and only that counts as a request."""


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


# -- the one errno table ------------------------------------------------------------------
#
# What a failure means, decided here and nowhere else (cachefs/guard.py asks about source
# failures, cachefs/fs.py about what a reader is told and what is logged; tests/test_errors.py
# holds the table):
#
#   failure                                  reader gets   counted            source    log
#   ---------------------------------------  ------------  -----------------  --------  -------
#   source gave no answer (our timeout, a    ETIMEDOUT     source.errors      may go    warning,
#     soft NFS mount's, a dead FUSE server)                                   down      once
#   source answered "no such file/attribute" ENOENT ...    -                  answers   none
#   source file changed while cached         ESTALE        source.changed     answers   warning
#   source file gone or replaced under a     ENOENT ...    source.errors      answers   warning
#     read (the cached identity is wrong)    (invalidated)
#   any other source error (EIO, EACCES...)  its errno     source.errors      answers   warning
#   a cache tier failed (read, write, check) -             <tier>.errors ...  -         the tier's
#                                            (a miss: served from below)                 own, once
#   a bug in cachefs                         EIO           fuse.errors        -         warning
#   a reply the kernel refused               EIO           fuse.reply_failures          warning
#   refused while 64 requests wait           EAGAIN        fuse.busy_refusals           warning, once

# The source is not answering at all; anything else is an answer about one file.
SOURCE_DOWN = frozenset({errno.ETIMEDOUT, errno.ENOTCONN})
# Answers that are no failure of the source: not counted in source.errors.
SOURCE_ANSWERS = frozenset({errno.ENOENT, errno.ENODATA, errno.ENOTSUP, errno.EINVAL})
# A read found the file gone or replaced by something else: its cached identity is wrong.
SOURCE_GONE = frozenset({errno.ENOENT, errno.ELOOP, errno.EISDIR, errno.ENOTDIR})
# What a reader is told without a log line (expected in normal use: a lookup of a missing
# name, an absent xattr, a write to a read-only mirror, an unimplemented request).
QUIET = frozenset({errno.ENOENT, errno.ENODATA, errno.EROFS, errno.ENOSYS, errno.ENOTTY})


def source_failure(exc: OSError) -> tuple[bool, bool]:
    """(whether the source is not answering, whether it counts in source.errors)."""
    if exc.errno in SOURCE_DOWN:
        return True, True
    if isinstance(exc, SourceChanged) or exc.errno in SOURCE_ANSWERS:
        return False, False
    return False, True


def invalidates(exc: OSError) -> bool:
    """Whether a failed read of a file means its cached identity is wrong (SourceChanged
    is handled on its own: its blocks are stale too)."""
    return exc.errno in SOURCE_GONE


class TierError(OSError):
    """A cache tier could not do what it was asked (I/O error, damaged entry, full disk).
    The composite cache turns it into a miss, or a put not taken: never a reader's error."""
