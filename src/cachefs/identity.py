"""What a file is, for every layer: its attributes (`Attr`), a directory entry (`DirEntry`)
and the identity of one version of a file (`FileId`).

A neutral module: the sources, the tiers, the core and the FUSE layer's adapter all import
it, and it imports nothing of cachefs. A version is its size, mtime and ctime, plus a
`version` token for a store that names versions itself (an S3 ETag, a GCS generation
number); a POSIX source leaves it empty, and the cache keys of a file without one are
what they were before the token existed.
"""

from __future__ import annotations

import os
import stat as stat_mod
import sys
from typing import NamedTuple


class Attr(NamedTuple):
    """The stat fields cachefs mirrors; times in nanoseconds. `version`: the store's own
    name for this version of the file (ETag, generation), "" where it has none."""

    mode: int
    nlink: int
    uid: int
    gid: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    blocks: int = 0
    rdev: int = 0
    ino: int = 0
    version: str = ""

    @classmethod
    def from_stat(cls, st: os.stat_result) -> Attr:
        return cls(st.st_mode, st.st_nlink, st.st_uid, st.st_gid, st.st_size,
                   st.st_atime_ns, st.st_mtime_ns, st.st_ctime_ns, st.st_blocks, st.st_rdev, st.st_ino)

    @property
    def is_file(self) -> bool:
        return stat_mod.S_ISREG(self.mode)

    @property
    def is_dir(self) -> bool:
        return stat_mod.S_ISDIR(self.mode)


STAT_FIELDS = 11  # the integer fields of Attr (all but `version`), as the index stores them

# os.fsencode's codec, for loops over names where a call of os.fsencode per name costs
FS_ENCODING, FS_ERRORS = sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()


class DirEntry(NamedTuple):
    name: str
    type_mode: int  # only the S_IFMT bits: what readdir reports as d_type
    ino: int = 0
    attr: Attr | None = None  # with listdir(path, attrs=True)


class FileId(NamedTuple):
    """A source file's identity. A change of size, mtime, ctime or version token is a new
    file to the cache.

    ctime catches a file replaced by another of the same size and mtime (cp -p, a tarball
    re-extracted with fixed mtimes); a chmod also changes it, which only costs a refetch.
    """

    path: str
    size: int
    mtime_ns: int
    ctime_ns: int = 0
    version: str = ""

    @classmethod
    def of(cls, path: str, attr: Attr) -> FileId:
        return cls(path, attr.size, attr.mtime_ns, attr.ctime_ns, attr.version)

    def matches(self, attr: Attr) -> bool:
        """Whether `attr` describes this version of the file."""
        return (attr.size, attr.mtime_ns, attr.ctime_ns, attr.version) == (
            self.size, self.mtime_ns, self.ctime_ns, self.version)


BlockKey = tuple[bytes, int]  # a cached block: (entry id of the file version, block index)


class EntryInfo(NamedTuple):
    """What a tier records with a cached file version: its path and attributes (kept so
    that a remounted cache answers lookups without asking the source), and the block size
    it was cut in."""

    path: str
    attr: Attr
    block_size: int

    @property
    def fid(self) -> FileId:
        return FileId.of(self.path, self.attr)
