"""What a file is, for every layer: its attributes (`Attr`), a directory entry (`DirEntry`),
a directory's entries packed (`Listing`) and the identity of one version of a file (`FileId`).

A neutral module: the sources, the tiers, the core and the FUSE layer's adapter all import
it, and it imports nothing of cachefs. A version is its size, mtime and ctime, plus a
`version` token for a store that names versions itself (an S3 ETag, a GCS generation
number); a POSIX source leaves it empty, and the cache keys of a file without one are
what they were before the token existed.
"""

from __future__ import annotations

import os
import stat as stat_mod
import struct
import sys
from collections.abc import Collection, Iterable, Iterator
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


# A packed entry: d_type (S_IFMT >> 12), inode number, name length; then the name's bytes
ENTRY = struct.Struct("<BQH")


class Listing(Collection[DirEntry]):
    """A directory's entries, packed as the kept listings store them (ENTRY and the name's
    bytes, one after another): ~31 bytes an entry of ImageNet's names, where a list of
    DirEntry tuples took ~220. The daemon keeps every directory a job lists for
    --metadata-ttl (1,000 of them, 1.28 million entries, for ImageNet), and reads each about
    once an epoch (the kernel keeps what it was given), so they are unpacked as they are
    read. Without the entries' attributes; `with_attrs`: whether the listing they came in
    had them (its files' attributes were cached from it)."""

    __slots__ = ("_data", "_count", "with_attrs")

    def __init__(self, data: bytes, count: int, with_attrs: bool = False):
        self._data = data
        self._count = count
        self.with_attrs = with_attrs

    @classmethod
    def of(cls, entries: Iterable[DirEntry]) -> Listing:
        if isinstance(entries, Listing):
            return entries
        parts: list[bytes] = []
        pack = ENTRY.pack
        with_attrs = False
        for e in entries:
            name = e.name.encode(FS_ENCODING, FS_ERRORS)
            parts += (pack(e.type_mode >> 12, e.ino, len(name)), name)
            with_attrs = with_attrs or e.attr is not None
        return cls(b"".join(parts), len(parts) // 2, with_attrs)

    @classmethod
    def parse(cls, data: bytes, count: int) -> Listing | None:
        """The listing of `count` entries packed in `data`; None if they are not that."""
        pos, size, end = 0, ENTRY.size, len(data)
        for _ in range(count):
            if pos + size > end:
                return None
            pos += size + (data[pos + 9] | data[pos + 10] << 8)  # the name's length
        return cls(data, count) if pos == end else None

    @property
    def packed(self) -> bytes:
        return self._data

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[DirEntry]:
        data, pos, unpack, size, new = self._data, 0, ENTRY.unpack_from, ENTRY.size, tuple.__new__
        for _ in range(self._count):
            kind, ino, n = unpack(data, pos)
            pos += size
            yield new(DirEntry, (data[pos:pos + n].decode(FS_ENCODING, FS_ERRORS), kind << 12, ino, None))
            pos += n

    def items(self) -> list[tuple[bytes, int, int]]:
        """Each entry's name (bytes), S_IFMT bits and inode number: what READDIR answers,
        with no name decoded and encoded again."""
        data, pos, unpack, size, out = self._data, 0, ENTRY.unpack_from, ENTRY.size, []
        for _ in range(self._count):
            kind, ino, n = unpack(data, pos)
            pos += size
            out.append((data[pos:pos + n], kind << 12, ino))
            pos += n
        return out

    def __contains__(self, entry: object) -> bool:
        return any(e == entry for e in self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Listing):
            return self._data == other._data
        if isinstance(other, (list, tuple)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Listing({list(self)!r})"


def dirents(entries: Iterable[DirEntry]) -> list[tuple[bytes, int, int]]:
    """`entries` as READDIR answers them (Listing.items), packed or not."""
    if isinstance(entries, Listing):
        return entries.items()
    return [(e.name.encode(FS_ENCODING, FS_ERRORS), e.type_mode, e.ino) for e in entries]


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
