"""The NVMe tier's index: an append-only log of text lines, one change per line.

    E <entry> <block size> <stored at> <mode> <nlink> <uid> <gid> <size>
      <atime> <mtime> <ctime> <blocks> <rdev> <ino> <path hex> <crc>          (one line)
    B <entry> <index> <xxh3_64 of the block> <crc>
    D <entry> <index, or -1 for the whole entry> <crc>
    C <wall time> <crc>
    T <table id> <crc>

Fields are separated by one tab. <entry> is the 32-hex-digit entry id (the xxh3_128 of the
file version's key, which is also its file name under data/), <stored at> and <wall time>
are seconds since the epoch, times in the attributes are nanoseconds, the path is the
source path's bytes in hex, and <crc> is the zlib CRC-32 of everything before it on the
line (with the tab), in 8 hex digits. A line whose CRC does not match is skipped (a torn
last write, bit rot): the blocks it described are then simply not cached.

E opens an entry (the file version's path and attributes, kept so that a remounted cache
can answer lookups without the source), B records a block written to the entry's file
(after the write), D one removed (before the file changes), C a clean stop (everything
written back with syncfs first): the blocks recorded before a C line, since the previous
one, were on the disk at its <wall time>. After a start, an entry whose blocks all come
before a C line and whose file has not changed since (ctime older than that time, less a
margin; the recorded size) is trusted at one stat; every other block is checked against
its hash once before it is first served: a crash can leave a file empty on ext4, and a
file can be changed behind the daemon's back between two runs. A rewritten (compacted)
index repeats an earlier stop's C line after the entries not checked since, so that they
stay measured against the stop that wrote them back.

T, only ever the first line, names the entry table (cachefs/tiers/table.py) a clean stop
wrote, `entries-<table id>.v1` beside the index, in 16 hex digits: the state is that table,
then the lines after it. A clean stop writes the table and a log of that one line; an
index without a T line (an older version's, or one compacted during a run) is the whole
state by itself.

`tests/test_index.py` pins these bytes; change the layout only with a new file name.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from typing import NamedTuple

from cachefs.identity import STAT_FIELDS, Attr

NAME = "index.v1"


class EntryRecord(NamedTuple):
    entry: str
    block_size: int
    stored_at: float
    attr: Attr
    path: str


class BlockRecord(NamedTuple):
    entry: str
    block: int
    xxh3: int


class DropRecord(NamedTuple):
    entry: str
    block: int  # -1: the whole entry


class CleanRecord(NamedTuple):
    at: float


class TableRecord(NamedTuple):
    table: int


Record = EntryRecord | BlockRecord | DropRecord | CleanRecord | TableRecord


def _line(fields: list[str]) -> bytes:
    body = "\t".join(fields) + "\t"
    return f"{body}{zlib.crc32(body.encode()):08x}\n".encode()


def entry_line(entry: str, block_size: int, stored_at: float, attr: Attr, path: str) -> bytes:
    return _line(["E", entry, str(block_size), f"{stored_at:.3f}", *(str(int(x)) for x in attr[:STAT_FIELDS]),
                  os.fsencode(path).hex()])


def block_line(entry: str, index: int, xxh3: int) -> bytes:
    return _line(["B", entry, str(index), f"{xxh3:016x}"])


def drop_line(entry: str, index: int = -1) -> bytes:
    return _line(["D", entry, str(index)])


def clean_line(at: float) -> bytes:
    return _line(["C", f"{at:.3f}"])


def table_line(table_id: int) -> bytes:
    return _line(["T", f"{table_id:016x}"])


def table_name(table_id: int) -> str:
    return f"entries-{table_id:016x}.v1"


def parse(line: bytes) -> Record | None:
    """One line as a record; None if it is damaged (bad CRC, bad fields)."""
    try:
        text = line.decode()
        body, _, crc = text.rstrip("\n").rpartition("\t")
        if not body or int(crc, 16) != zlib.crc32((body + "\t").encode()):
            return None
        f = body.split("\t")
        kind = f[0]
        if kind == "B" and len(f) == 4:
            return BlockRecord(f[1], int(f[2]), int(f[3], 16))
        if kind == "E" and len(f) == 16:
            attr = Attr(*[int(x) for x in f[4:15]])  # type: ignore[arg-type]  # the 11 integer fields
            return EntryRecord(f[1], int(f[2]), float(f[3]), attr, os.fsdecode(bytes.fromhex(f[15])))
        if kind == "D" and len(f) == 3:
            return DropRecord(f[1], int(f[2]))
        if kind == "C" and len(f) == 2:
            return CleanRecord(float(f[1]))
        if kind == "T" and len(f) == 2 and len(f[1]) == 16:
            return TableRecord(int(f[1], 16))
    except (ValueError, UnicodeDecodeError):
        return None
    return None


def read(path: str) -> Iterator[Record | None]:
    """The records of an index file in order (None for each damaged line)."""
    with open(path, "rb") as f:
        for line in f:
            yield parse(line)
