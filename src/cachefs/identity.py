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
from array import array
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
# An entry's attributes kept with a listing: Attr's STAT_FIELDS integers (mode first)
ATTRS = struct.Struct("<IIIIQqqqQQQ")


class Listing(Collection[DirEntry]):
    """A directory's entries, packed as the kept listings store them (ENTRY and the name's
    bytes, one after another): ~31 bytes an entry of ImageNet's names, where a list of
    DirEntry tuples took ~220. The daemon keeps every directory a job lists for
    --metadata-ttl (1,000 of them, 1.28 million entries, for ImageNet), and reads each about
    once an epoch (the kernel keeps what it was given), so they are unpacked as they are
    read. `with_attrs`: whether the listing they came in had the entries' attributes.

    With `keep_attrs` (Listing.of), those attributes are kept packed with it too (ATTRS, 72
    bytes an entry, in order) with a table to find an entry by its name (`attr_of`): an
    open-addressed hash table of entry numbers (`array('I')`, at most half full) and each
    name's offset in the packed data, about 12 bytes an entry more. A listing with
    attributes answers its files' lookups for its TTL: as an `Attr` per path in the
    attributes cache they had cost ~700 bytes each (the tuple, its integers, the path, the
    cache's entry), and a first mount lists every directory so before its files are cached.
    (A `find` of the name in the packed names had taken 10-19 us at 1,300 ImageNet names,
    which share their first ten characters; the table, about 1.)"""

    __slots__ = ("_data", "_count", "with_attrs", "_offsets", "_table", "_attrs", "_left")

    def __init__(self, data: bytes, count: int, with_attrs: bool = False,
                 offsets: array[int] | None = None, table: array[int] | None = None,
                 attrs: bytearray | None = None, left: int = 0):
        self._data = data
        self._count = count
        self.with_attrs = with_attrs
        self._offsets = offsets  # where each entry's name starts in `data`
        self._table = table  # hash(name) -> entry number + 1 (0: empty), probed linearly
        self._attrs = attrs  # ATTRS per entry, in order; a mode of 0: not known (attr_of: None)
        self._left = left  # the entries with a mode: once none, `attrs` go (forget)

    @classmethod
    def of(cls, entries: Iterable[DirEntry], keep_attrs: bool = False) -> Listing:
        """`entries` packed; `keep_attrs`: with their attributes (unless one has a
        version token, or does not fit ATTRS: then `has_attrs` is False)."""
        if isinstance(entries, Listing):
            return entries
        parts: list[bytes] = []
        names: list[bytes] = []
        offsets: array[int] = array("I")  # where each name starts in the packed entries
        attrs: list[bytes] | None = [] if keep_attrs else None
        pack, pack_attr, none, size = ENTRY.pack, ATTRS.pack, bytes(ATTRS.size), ENTRY.size
        with_attrs, left, pos = False, 0, 0
        for e in entries:
            name = e.name.encode(FS_ENCODING, FS_ERRORS)
            parts += (pack(e.type_mode >> 12, e.ino, len(name)), name)
            a = e.attr
            with_attrs = with_attrs or a is not None
            if attrs is not None:
                names.append(name)
                offsets.append(pos + size)
                pos += size + len(name)
                if a is None:
                    attrs.append(none)
                elif a.version:
                    attrs = None  # (a store's version token: not packed)
                else:
                    try:
                        attrs.append(pack_attr(*a[:STAT_FIELDS]))
                    except struct.error:
                        attrs = None
                    left += a[0] != 0
        data = b"".join(parts)
        if attrs is None:
            return cls(data, len(parts) // 2, with_attrs)
        mask = (1 << max(3, (2 * len(names)).bit_length())) - 1
        table = array("I", bytes(4 * (mask + 1)))
        for i, name in enumerate(names):
            h = hash(name) & mask
            while table[h]:
                h = (h + 1) & mask
            table[h] = i + 1
        return cls(data, len(names), with_attrs, offsets, table, bytearray(b"".join(attrs)), left)

    @property
    def has_attrs(self) -> bool:
        """Whether its entries' attributes are kept with it (attr_of)."""
        return self._attrs is not None

    def _index(self, text: str) -> int:
        """Entry `text`'s number, or -1."""
        table, offsets, data = self._table, self._offsets, self._data
        if table is None or offsets is None:
            return -1
        name = text.encode(FS_ENCODING, FS_ERRORS)
        mask, n = len(table) - 1, len(name)
        h = hash(name) & mask
        while True:
            i = table[h] - 1
            if i < 0:
                return -1
            at = offsets[i]
            if data[at - 2] | data[at - 1] << 8 == n and data.startswith(name, at):
                return i
            h = (h + 1) & mask

    def attr_of(self, name: str) -> Attr | None:
        """The attributes the listing brought for entry `name`, if kept (None: not
        kept, not an entry, or forgotten)."""
        attrs = self._attrs
        i = self._index(name) if attrs is not None else -1
        if i < 0:
            return None
        fields = ATTRS.unpack_from(attrs, i * ATTRS.size)  # type: ignore[arg-type]
        return Attr(*fields) if fields[0] else None

    def forget(self, name: str) -> None:
        """Entry `name`'s attributes no longer answer (attr_of: None): it changed, or the
        NVMe tier's index answers it from now. Once no entry's do, the listing lets go of
        them all (`has_attrs`: False; 90 of its ~123 bytes an entry)."""
        attrs = self._attrs
        i = self._index(name) if attrs is not None else -1
        if attrs is None or i < 0 or not ATTRS.unpack_from(attrs, i * ATTRS.size)[0]:
            return
        attrs[i * ATTRS.size:(i + 1) * ATTRS.size] = bytes(ATTRS.size)
        self._left -= 1  # (a decrement lost to a race keeps them: memory, not an answer)
        if self._left <= 0:
            self._attrs = self._table = self._offsets = None

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
