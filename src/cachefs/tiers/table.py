"""The NVMe tier's entry table: what a clean stop held, in one binary file that a start opens
and reads an entry at a time, so that a mount costs the same at 2,000 cached files as at
1.28 million (replaying the index log into an object per file had cost 4-5 s per 200,000).

    header   HEADER (64 bytes)
    records  count x RECORD (160 bytes each), in the order the policy restores them
             (oldest `stored at` first: the first victims, as the log's replay had them)
    by id    buckets x u32: record number + 1 (0: empty), linear probing from the entry
             id's first 8 bytes
    by path  buckets x u32: the same, from the xxh3_64 of the path's bytes (only the newest
             entry of each path)
    heap     paths' bytes; for an entry of more than one block, its hashes (u64 each, 0 for
             a block not held) and a bitmap of the blocks held

A record holds an entry's id, `stored at`, the clean stop that vouches for its blocks
(`synced`, ns; 0: read each block before it is served), block size, number of blocks, its
path and hashes (inline for one block), a flag for the newest entry of its path, the 11
integer stat fields, and a CRC-32 of the record with its path and heap part. Entries with
no block held (one being written at the stop) are left out. A record that fails its CRC is not there (its blocks
are fetched again); a header that fails its CRC makes the table unreadable (the tier then
starts as from a damaged index). The bucket arrays carry no CRC: a damaged bucket makes a
lookup miss or land on a record whose id or path does not match, never a wrong entry.

The table is written whole, at a clean stop, to a temporary name, fsync'd and renamed; the
index log (cachefs/tiers/index.py) then names it in its first line (T) and records what
changes after it. `tests/test_table.py` pins the layout; change it only with a new name.
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
import zlib
from array import array
from collections.abc import Iterable, Iterator
from typing import NamedTuple, TypeGuard

import xxhash

from cachefs.config import CLEAN_MARGIN_NS
from cachefs.identity import FS_ENCODING, FS_ERRORS, STAT_FIELDS, Attr
from cachefs.tiers.entry import allocated
from cachefs.tiers.layout import SUBDIR_CHARS, block_hash, replace_durably

NAME = "entries.v1"
MAGIC = b"cachefT1"
HEADER = struct.Struct("<8sQQqQQQI4x")  # magic, count, buckets, stop ns, used bytes, blocks, id, crc
RECORD = struct.Struct("<16sdqIIQHHIQQ" + "q" * STAT_FIELDS)
# eid, stored_at, synced_ns, block_size, nblocks, path_off, path_len, flags, crc, aux_off, hash0, attr
NEWEST = 1  # flags: the newest entry of its path (the one the path buckets lead to)
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_CRC_AT = 16 + 8 + 8 + 4 + 4 + 8 + 2 + 2  # the crc field's offset in a record
_PATH_OFF = 16 + 8 + 8 + 4 + 4  # path_off, path_len's offset in a record
_PATH_AT = struct.Struct("<QH")


class Row(NamedTuple):
    """One entry as the table keeps it."""

    eid: bytes
    path: str
    attr: Attr
    block_size: int
    stored_at: float
    synced_ns: int              # the clean stop that vouches for its blocks; 0: read them
    hashes: list[int | None]    # one per block, None where the block is not held
    newest: bool = False        # read back: the newest entry of its path in the table


def block_bytes(row: Row) -> list[tuple[int, int]]:
    """(block index, bytes it takes on disk) of each block held, as the policy counts them."""
    out = []
    for i, h in enumerate(row.hashes):
        if h is not None:
            start = i * row.block_size
            out.append((i, allocated(max(0, min(row.block_size, row.attr.size - start)))))
    return out


def _buckets(count: int) -> int:
    n = 8
    while n < 2 * count:
        n <<= 1
    return n


def _put(table: array[int], key: int, value: int) -> None:
    mask = len(table) - 1
    i = key & mask
    while table[i]:
        i = (i + 1) & mask
    table[i] = value


def size_of(rows: list[Row | None]) -> int:
    """About the bytes write() makes of `rows` (a budget's check before writing them)."""
    heap = sum(len(row.path) + (9 * len(row.hashes) if len(row.hashes) > 1 else 0) for row in rows if row is not None)
    return HEADER.size + len(rows) * RECORD.size + 8 * _buckets(len(rows)) + heap


def _held(row: Row | None) -> TypeGuard[Row]:
    """Whether `row` is an entry with a block held (not a placeholder, nor one being written)."""
    return row is not None and any(h is not None for h in row.hashes)


def _numbered(rows: list[Row | None], numbered: int) -> tuple[list[Row | None], dict[bytes, int]]:
    """write's records: the first `numbered` rows where they are, then those with a block
    held; and each path's newest record (the restore order is by stored_at)."""
    rows = rows[:numbered] + [row for row in rows[numbered:] if _held(row)]
    newest = {row.path.encode(FS_ENCODING, FS_ERRORS): n for n, row in enumerate(rows) if _held(row)}
    return rows, newest


def write(path: str, rows: Iterable[Row | None], stop_ns: int, table_id: int, numbered: int = 0) -> int:
    """Write the table of `rows` (already in restore order) to `path`: a temporary file,
    fsync'd, renamed over. Returns its size. Rows with no block held (an entry being
    written) are left out, but among the first `numbered`, which keep their numbers (a
    checkpoint's next generation, see DiskTier.checkpoint): there such a row, or None,
    is a record of zeros, which no lookup finds and no read passes."""
    rows, newest = _numbered(list(rows), numbered)
    count = len(rows)
    buckets = _buckets(count)
    by_id = array("I", bytes(4 * buckets))  # (flat: a list of ints took ~36 bytes a bucket)
    by_path = array("I", bytes(4 * buckets))
    heap_at = HEADER.size + count * RECORD.size + 8 * buckets
    heap = bytearray()
    records = bytearray(count * RECORD.size)
    view = memoryview(records)
    used = blocks = 0
    for n, row in enumerate(rows):
        if not _held(row):
            continue  # (a record of zeros: its CRC fails, and no bucket leads to it)
        pb = row.path.encode(FS_ENCODING, FS_ERRORS)
        path_off = heap_at + len(heap)
        heap += pb
        held = block_bytes(row)
        used += sum(size for _, size in held)
        blocks += len(held)
        aux = b""
        hash0 = 0
        aux_off = 0
        if len(row.hashes) == 1:
            hash0 = row.hashes[0] or 0
        else:
            bitmap = bytearray(-(-len(row.hashes) // 8))
            for i, _ in held:
                bitmap[i >> 3] |= 1 << (i & 7)
            aux = b"".join(_U64.pack(h or 0) for h in row.hashes) + bytes(bitmap)
            aux_off = heap_at + len(heap)
            heap += aux
        if len(pb) > 0xFFFF:
            raise ValueError(f"a path of {len(pb)} bytes")
        at = n * RECORD.size
        RECORD.pack_into(records, at, row.eid, row.stored_at, row.synced_ns, row.block_size, len(row.hashes),
                         path_off, len(pb), NEWEST if newest[pb] == n else 0, 0, aux_off, hash0,
                         *row.attr[:STAT_FIELDS])
        crc = zlib.crc32(pb, zlib.crc32(view[at:at + RECORD.size]))
        _U32.pack_into(records, at + _CRC_AT, zlib.crc32(aux, crc) if aux else crc)
        _put(by_id, int.from_bytes(row.eid[:8], "little"), n + 1)
    for pb, n in newest.items():
        _put(by_path, xxhash.xxh3_64_intdigest(pb), n + 1)
    head = HEADER.pack(MAGIC, count, buckets, stop_ns, used, blocks, table_id, 0)
    head = head[:-8] + _U32.pack(zlib.crc32(head[:-8])) + bytes(4)
    if sys.byteorder != "little":
        by_id.byteswap()
        by_path.byteswap()
    parts = (head, records, by_id, by_path, heap)  # written in turn, not joined: no second copy
    replace_durably(path, parts)
    return sum(memoryview(part).nbytes for part in parts)


class Table:
    """A written table, read in place with pread (not mapped: a page fault on a mapping
    happens with Python's GIL held, so after the page cache was dropped each one would
    stall every thread of the daemon for a disk read; pread lets the others run). Raises
    ValueError (or OSError) if its header is damaged or it is not the table `table_id`
    names."""

    def __init__(self, path: str, table_id: int | None = None):
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self.size = os.fstat(self._fd).st_size
            head = os.pread(self._fd, HEADER.size, 0)
            if len(head) < HEADER.size:
                raise ValueError("too short")
            magic, count, buckets, stop_ns, used, blocks, tid, crc = HEADER.unpack(head)
            if magic != MAGIC or crc != zlib.crc32(head[:-8]):
                raise ValueError("damaged header")
            if table_id is not None and tid != table_id:
                raise ValueError("not the table the index names")
            if buckets & (buckets - 1) or HEADER.size + count * RECORD.size + 8 * buckets > self.size:
                raise ValueError("damaged header")
        except BaseException:
            os.close(self._fd)
            raise
        self.count, self.stop_ns, self.used, self.blocks, self.table_id = count, stop_ns, used, blocks, tid
        self._buckets = buckets
        self._by_id = HEADER.size + count * RECORD.size
        self._by_path = self._by_id + 4 * buckets

    def close(self) -> None:
        os.close(self._fd)

    def fileno(self) -> int:
        return self._fd

    def _read(self, at: int, length: int) -> bytes:
        return os.pread(self._fd, length, at)

    def row(self, n: int) -> Row | None:
        """Record `n`, or None if it fails its CRC (or cannot be read)."""
        return self._row(self._read(HEADER.size + n * RECORD.size, RECORD.size))

    def _row(self, rec: bytes, pb: bytes | None = None) -> Row | None:
        """The row of record `rec` (its path `pb` if read already), or None (see row)."""
        try:
            f = RECORD.unpack(rec)
            eid, stored_at, synced_ns, block_size, nblocks, path_off, path_len, flags, crc, aux_off, hash0 = f[:11]
            if not 0 < nblocks <= (1 << 32) or block_size <= 0 or path_off + path_len > self.size:
                return None
            if pb is None:
                pb = self._read(path_off, path_len)
            aux = b""
            if nblocks == 1:
                hashes: list[int | None] = [hash0]
            else:
                aux_len = 8 * nblocks + -(-nblocks // 8)
                if aux_off + aux_len > self.size:
                    return None
                aux = self._read(aux_off, aux_len)
                bitmap = aux[8 * nblocks:]
                hashes = [_U64.unpack_from(aux, 8 * i)[0] if bitmap[i >> 3] >> (i & 7) & 1 else None
                          for i in range(nblocks)]
            if zlib.crc32(aux, zlib.crc32(pb, zlib.crc32(rec[:_CRC_AT] + bytes(4) + rec[_CRC_AT + 4:]))) != crc:
                return None
            attr = Attr(*f[11:])  # type: ignore[arg-type]  # the 11 integer fields
            return Row(eid, pb.decode(FS_ENCODING, FS_ERRORS), attr, block_size, stored_at, synced_ns, hashes,
                       bool(flags & NEWEST))
        except (struct.error, ValueError, IndexError, OSError):
            return None

    def _probe(self, base: int, key: int) -> Iterator[int]:
        """Record numbers in the probe sequence of `key`, read 16 buckets at a time (one
        read covers a whole sequence at this load)."""
        mask = self._buckets - 1
        i = key & mask
        left = self._buckets
        while left > 0:
            chunk = self._read(base + 4 * i, 4 * min(16, self._buckets - i, left))
            if not chunk:
                return
            for (v,) in _U32.iter_unpack(chunk):
                if not v:
                    return
                if v <= self.count:
                    yield v - 1
            left -= len(chunk) // 4
            i = (i + len(chunk) // 4) & mask

    def find(self, eid: bytes) -> int | None:
        """The record number of entry `eid`, or None."""
        for n in self._probe(self._by_id, int.from_bytes(eid[:8], "little")):
            if self.eid_of(n) == eid:
                return n
        return None

    def find_path(self, path: str) -> int | None:
        """The record number of the newest entry of `path`, or None."""
        found = self._find_path(path)
        return None if found is None else found[0]

    def path_row(self, path: str) -> tuple[int, Row] | None:
        """(record number, row) of the newest entry of `path`, or None (none, or its record
        fails its CRC): the record read once (a lookup's answer after a restart)."""
        found = self._find_path(path)
        if found is None:
            return None
        row = self._row(found[1], found[2])
        return None if row is None else (found[0], row)

    def _find_path(self, path: str) -> tuple[int, bytes, bytes] | None:
        """(record number, record, path bytes) of the newest entry of `path`, or None."""
        pb = path.encode(FS_ENCODING, FS_ERRORS)
        for n in self._probe(self._by_path, xxhash.xxh3_64_intdigest(pb)):
            rec = self._read(HEADER.size + n * RECORD.size, RECORD.size)
            if len(rec) < _CRC_AT:
                continue
            _, _, _, _, _, path_off, path_len = struct.unpack_from("<16sdqIIQH", rec)
            if path_len == len(pb) and self._read(path_off, path_len) == pb:
                return n, rec, pb
        return None

    def eid_of(self, n: int) -> bytes:
        return self._read(HEADER.size + n * RECORD.size, 16)

    def eid_size(self, n: int) -> tuple[bytes, int] | None:
        """Record n's entry id and file size, at one read and without its path or CRC (to
        count an open the serving processes answered, which they did from a whole record)."""
        found = self.brief(n)
        return None if found is None else found[:2]

    def brief(self, n: int) -> tuple[bytes, int, int] | None:
        """eid_size, and the record's number of blocks."""
        if not 0 <= n < self.count:
            return None
        rec = self._read(HEADER.size + n * RECORD.size, RECORD.size)
        if len(rec) < RECORD.size:
            return None
        f = RECORD.unpack(rec)
        return f[0], f[15], f[4]


class Mapped:
    """A written table mapped read-only, for the serving processes (cachefs/fuse/serve.py):
    each answers the first lookup of a cached file after a restart from its record, without
    asking the daemon. A page fault here blocks only the one single-threaded serving
    process that takes it (the daemon reads with pread, see Table). Records are checked
    against their CRC at every read, as Table.row checks them."""

    def __init__(self, fd: int, data_fd: int = -1):
        self._data_fd = data_fd  # the tier's data directory (open_held)
        size = os.fstat(fd).st_size
        self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        head = self._map[:HEADER.size]
        magic, count, buckets, stop_ns, _, _, _, crc = HEADER.unpack(head)
        if magic != MAGIC or crc != zlib.crc32(head[:-8]) or buckets & (buckets - 1) \
                or HEADER.size + count * RECORD.size + 8 * buckets > size:
            self._map.close()
            raise ValueError("not an entry table")
        self.count, self.stop_ns, self.size = count, stop_ns, size
        self._mask = buckets - 1
        self._by_path = HEADER.size + count * RECORD.size + 4 * buckets

    def close(self) -> None:
        self._map.close()

    def find_path(self, pb: bytes) -> int | None:
        """The record number of the newest entry of the path `pb` (bytes), or None."""
        m, mask, base, count = self._map, self._mask, self._by_path, self.count
        i = xxhash.xxh3_64_intdigest(pb) & mask
        for _ in range(mask + 1):
            (v,) = _U32.unpack_from(m, base + 4 * i)
            if not v:
                return None
            if v <= count:
                at = HEADER.size + (v - 1) * RECORD.size
                path_off, path_len = _PATH_AT.unpack_from(m, at + _PATH_OFF)
                if path_len == len(pb) and path_off + path_len <= self.size and m[path_off:path_off + path_len] == pb:
                    return v - 1
            i = (i + 1) & mask
        return None

    def record(self, n: int) -> tuple | None:
        """Record n's fields as RECORD unpacks them (the 11 stat fields last), if it passes
        its CRC and is a whole entry of one block, the newest of its path; else None."""
        if not 0 <= n < self.count:
            return None
        m, at = self._map, HEADER.size + n * RECORD.size
        f = RECORD.unpack_from(m, at)
        if f[4] != 1 or not f[7] & NEWEST or f[5] + f[6] > self.size:  # one block, the newest
            return None
        rec = bytearray(m[at:at + RECORD.size])
        rec[_CRC_AT:_CRC_AT + 4] = bytes(4)
        if zlib.crc32(m[f[5]:f[5] + f[6]], zlib.crc32(rec)) != f[8]:
            return None
        return f

    def open_held(self, fields: tuple) -> int:
        """A read-only descriptor of the cached file of a record (fields as record gives
        them) if it is as the clean stop that vouched for it left it: its size, and its
        ctime from before that stop less the margin, or else its bytes' hash (the restart
        check's tests, tiers/checks.py); else -1."""
        name, synced, size = fields[0].hex(), fields[2], fields[15]
        if not synced:
            return -1
        try:
            fd = os.open(f"{name[:SUBDIR_CHARS]}/{name}", os.O_RDONLY | os.O_CLOEXEC, dir_fd=self._data_fd)
        except OSError:
            return -1
        try:
            st = os.fstat(fd)
            ok = st.st_size == size
            if ok and st.st_ctime_ns >= synced - CLEAN_MARGIN_NS:  # (written close to the stop, or since)
                data = os.pread(fd, size, 0)
                ok = len(data) == size and block_hash(data) == fields[10]
        except OSError:
            ok = False
        if not ok:
            os.close(fd)
            return -1
        return fd
