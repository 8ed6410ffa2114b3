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

import contextlib
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
from cachefs.tiers.layout import SUBDIR_CHARS, block_hash, write_all

NAME = "entries.v1"
MAGIC = b"cachefT1"
HEADER = struct.Struct("<8sQQqQQQI4x")  # magic, count, buckets, stop ns, used bytes, blocks, id, crc
_FIXED = "<16sdqIIQHHIQQ"  # a record's fields before its stat fields
RECORD = struct.Struct(_FIXED + "q" * STAT_FIELDS)
# eid, stored_at, synced_ns, block_size, nblocks, path_off, path_len, flags, crc, aux_off, hash0, attr
NEWEST = 1  # flags: the newest entry of its path (the one the path buckets lead to)
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_CRC_AT = 16 + 8 + 8 + 4 + 4 + 8 + 2 + 2  # the crc field's offset in a record
_PATH_OFF = 16 + 8 + 8 + 4 + 4  # path_off, path_len's offset in a record
_PATH_AT = struct.Struct("<QH")
_HEAD = struct.Struct("<16sdqIIQH")  # RECORD's first fields: eid, stored_at, synced_ns, block_size, nblocks, path
assert RECORD.format.startswith(_HEAD.format)
_STORED_AT = struct.Struct(f"<16xd{RECORD.size - 24}x")  # a record's `stored at`
_SIZE_AT = struct.calcsize(_FIXED + "q" * Attr._fields.index("size"))  # its file size's offset
# a record's entry id, `synced` and file size (the restart check's, Table.synced)
_SYNCED = struct.Struct(f"<16s8xq{_SIZE_AT - 32}xq{RECORD.size - _SIZE_AT - 8}x")  # (32: eid, stored at, synced)


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


def size_for(count: int, heap: int) -> int:
    """The bytes of a table of `count` records whose paths and hashes take `heap` bytes."""
    return HEADER.size + count * RECORD.size + 8 * _buckets(count) + heap


def heap_of(path: str, nblocks: int) -> int:
    """About the heap bytes of a record's path and (more than one block) hashes."""
    return len(path) + (9 * nblocks if nblocks > 1 else 0)


def _held(row: Row | None) -> TypeGuard[Row]:
    """Whether `row` is an entry with a block held (not a placeholder, nor one being written)."""
    return row is not None and any(h is not None for h in row.hashes)


def write(path: str, rows: Iterable[Row | None], stop_ns: int, table_id: int, numbered: int = 0) -> int:
    """Write the table of `rows` (already in restore order) to `path`: a temporary file,
    fsync'd, renamed over. Returns its size. Rows with no block held (an entry being
    written) are left out, but among the first `numbered`, which keep their numbers (a
    checkpoint's next generation, see DiskTier.checkpoint): there such a row, or None,
    is a record of zeros, which no lookup finds and no read passes."""
    rows = list(rows)
    rows = rows[:numbered] + [row for row in rows[numbered:] if _held(row)]
    writer = Writer(path, len(rows), stop_ns, table_id)
    try:
        for row in rows:
            writer.add(row)
        return writer.finish()
    except BaseException:
        writer.abort()
        raise


class Writer:
    """A table written a record at a time (write() is the whole-list form): records and
    their paths go to a temporary file beside `path` as they come, 1 MiB at a time, the
    buckets and the header at the end (finish), then fsync and rename. What it holds
    while it writes is the two bucket arrays and each record's path hash (~30 bytes a
    record), not the rows: a checkpoint of 1.28 million files had held a Row object per
    record (~700 bytes each with its hashes' list, and its path and attributes where read
    from the table before). Exactly `count` rows are added; a row with no block held (or
    None) is a record of zeros. The newest record of a path is the last added: an earlier
    one loses its NEWEST flag (and its CRC is made again) when a later one comes."""

    FLUSH = 1 << 20

    def __init__(self, path: str, count: int, stop_ns: int, table_id: int):
        self.path, self.count, self.stop_ns, self.table_id = path, count, stop_ns, table_id
        self.buckets = _buckets(count)
        self.heap_at = HEADER.size + count * RECORD.size + 8 * self.buckets
        self.by_id = array("I", bytes(4 * self.buckets))  # (flat: a list of ints took ~36 bytes a bucket)
        self.by_path = array("I", bytes(4 * self.buckets))
        self.path_hashes = array("Q", bytes(8 * count))
        self.hidden: set[int] = set()  # records no path bucket leads to: of zeros, or a later one's path
        self.added = self.used = self.blocks = 0
        self._records = bytearray()  # records not written yet, from number _records_from
        self._records_from = 0
        self._heap = bytearray()  # heap bytes not written yet, from heap offset _heap_from
        self._heap_from = 0
        self._tmp = path + ".new"
        self._fd = os.open(self._tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)

    def add(self, row: Row | None) -> None:
        n = self.added
        if n >= self.count:
            raise ValueError(f"more than the {self.count} rows the table was sized for")
        self.added += 1
        records = self._records
        at = len(records)
        records += bytes(RECORD.size)
        if not _held(row):
            self.hidden.add(n)
            self._flush_if_full()
            return  # (a record of zeros: its CRC fails, and no bucket leads to it)
        pb = row.path.encode(FS_ENCODING, FS_ERRORS)
        if len(pb) > 0xFFFF:
            raise ValueError(f"a path of {len(pb)} bytes")
        heap = self._heap
        path_off = self.heap_at + self._heap_from + len(heap)
        heap += pb
        held = block_bytes(row)
        self.used += sum(size for _, size in held)
        self.blocks += len(held)
        aux = b""
        hash0 = aux_off = 0
        if len(row.hashes) == 1:
            hash0 = row.hashes[0] or 0
        else:
            bitmap = bytearray(-(-len(row.hashes) // 8))
            for i, _ in held:
                bitmap[i >> 3] |= 1 << (i & 7)
            aux = b"".join(_U64.pack(h or 0) for h in row.hashes) + bytes(bitmap)
            aux_off = self.heap_at + self._heap_from + len(heap)
            heap += aux
        RECORD.pack_into(records, at, row.eid, row.stored_at, row.synced_ns, row.block_size, len(row.hashes),
                         path_off, len(pb), NEWEST, 0, aux_off, hash0, *row.attr[:STAT_FIELDS])
        _seal(records, at, pb, aux)
        _put(self.by_id, int.from_bytes(row.eid[:8], "little"), n + 1)
        self._newest(n, pb)
        self._flush_if_full()

    def _newest(self, n: int, pb: bytes) -> None:
        """Record `n` leads the path buckets to `pb`: it takes an earlier record's slot."""
        key = xxhash.xxh3_64_intdigest(pb)
        self.path_hashes[n] = key
        by_path, hashes = self.by_path, self.path_hashes
        mask = len(by_path) - 1
        i = key & mask
        while (v := by_path[i]) and not (hashes[v - 1] == key and self._path_of(v - 1) == pb):
            i = (i + 1) & mask
        if v:
            self._unmark(v - 1)
        by_path[i] = n + 1

    def _record(self, m: int) -> bytes:
        if m >= self._records_from:
            at = (m - self._records_from) * RECORD.size
            return bytes(self._records[at:at + RECORD.size])
        return os.pread(self._fd, RECORD.size, HEADER.size + m * RECORD.size)

    def _heap_bytes(self, off: int, length: int) -> bytes:
        rel = off - self.heap_at
        if rel >= self._heap_from:
            return bytes(self._heap[rel - self._heap_from:rel - self._heap_from + length])
        return os.pread(self._fd, length, off)

    def _path_of(self, m: int) -> bytes:
        path_off, path_len = _PATH_AT.unpack_from(self._record(m), _PATH_OFF)
        return self._heap_bytes(path_off, path_len)

    def _unmark(self, m: int) -> None:
        """Record `m` is no longer its path's newest: its flag cleared, its CRC made again."""
        rec = bytearray(self._record(m))
        fields = list(RECORD.unpack(rec))  # (see RECORD: nblocks, path_off, path_len, flags, crc, aux_off)
        nblocks, path_off, path_len, aux_off = fields[4], fields[5], fields[6], fields[9]
        fields[7] = fields[8] = 0
        RECORD.pack_into(rec, 0, *fields)
        aux = self._heap_bytes(aux_off, 8 * nblocks + -(-nblocks // 8)) if nblocks > 1 else b""
        _seal(rec, 0, self._heap_bytes(path_off, path_len), aux)
        if m >= self._records_from:
            at = (m - self._records_from) * RECORD.size
            self._records[at:at + RECORD.size] = rec
        else:
            write_all(self._fd, memoryview(rec), HEADER.size + m * RECORD.size)
        self.hidden.add(m)

    def _flush_if_full(self, force: bool = False) -> None:
        if len(self._records) >= self.FLUSH or force:
            write_all(self._fd, memoryview(self._records), HEADER.size + self._records_from * RECORD.size)
            self._records_from += len(self._records) // RECORD.size
            self._records = bytearray()
        if len(self._heap) >= self.FLUSH or force:
            write_all(self._fd, memoryview(self._heap), self.heap_at + self._heap_from)
            self._heap_from += len(self._heap)
            self._heap = bytearray()

    def finish(self) -> int:
        """The buckets and the header written, fsync'd, renamed over `path`: its size."""
        if self.added != self.count:
            raise ValueError(f"{self.added} rows added to a table sized for {self.count}")
        self._flush_if_full(force=True)
        head = HEADER.pack(MAGIC, self.count, self.buckets, self.stop_ns, self.used, self.blocks, self.table_id, 0)
        head = head[:-8] + _U32.pack(zlib.crc32(head[:-8])) + bytes(4)
        by_id, by_path = self.by_id, self.by_path
        if sys.byteorder != "little":
            by_id.byteswap()
            by_path.byteswap()
        write_all(self._fd, memoryview(head), 0)
        write_all(self._fd, memoryview(by_id).cast("B"), HEADER.size + self.count * RECORD.size)
        write_all(self._fd, memoryview(by_path).cast("B"), HEADER.size + self.count * RECORD.size + 4 * self.buckets)
        os.fsync(self._fd)
        os.close(self._fd)
        self._fd = -1
        os.replace(self._tmp, self.path)
        return self.heap_at + self._heap_from

    def abort(self) -> None:
        """Nothing written after all: the temporary file goes."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        with contextlib.suppress(OSError):
            os.unlink(self._tmp)


def _seal(buf: bytearray, at: int, pb: bytes, aux: bytes) -> None:
    """The CRC of the record at `at` (its CRC field zero), with its path and heap part."""
    crc = zlib.crc32(pb, zlib.crc32(memoryview(buf)[at:at + RECORD.size]))
    _U32.pack_into(buf, at + _CRC_AT, zlib.crc32(aux, crc) if aux else crc)


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
        self.heap_bytes = self.size - self._by_path - 4 * buckets  # (paths and hashes)

    def close(self) -> None:
        os.close(self._fd)

    def fileno(self) -> int:
        return self._fd

    def _read(self, at: int, length: int) -> bytes:
        return os.pread(self._fd, length, at)

    def _chunks(self, step: int = 4096) -> Iterator[tuple[int, bytes]]:
        """(first record number, its records' bytes), `step` records at a time (one pread
        each, not CRC-checked)."""
        for first in range(0, self.count, step):
            chunk = self._read(HEADER.size + first * RECORD.size, min(step, self.count - first) * RECORD.size)
            yield first, chunk[:len(chunk) - len(chunk) % RECORD.size]

    def stored_ats(self) -> array[float]:
        """Every record's `stored at`, in bulk (not CRC-checked: for an order, a record's own
        read checks it)."""
        out = array("d")
        for _, chunk in self._chunks():
            out.extend(at for (at,) in _STORED_AT.iter_unpack(chunk))
        return out

    def synced(self) -> Iterator[tuple[int, bytes, int, int]]:
        """(record number, entry id, `synced` ns, file size) of every record, in bulk and not
        CRC-checked: the restart check's, which needs no more to stat a file (about 3 us a
        record here, against 8-12 for a whole row and a stat by path). What it trusts is the
        file; the record's own CRC is checked whenever it is read (row)."""
        for first, chunk in self._chunks():
            for i, (eid, synced_ns, size) in enumerate(_SYNCED.iter_unpack(chunk)):
                yield first + i, eid, synced_ns, size

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

    def path_brief(self, path: str) -> tuple[int, float, int] | None:
        """(record number, `stored at`, number of blocks) of the newest entry of `path`, or
        None: its path compared, not its CRC (for a guess; a record's own read checks it)."""
        found = self._find_path(path)
        if found is None:
            return None
        _, stored_at, _, _, nblocks, _, _ = _HEAD.unpack_from(found[1])
        return found[0], stored_at, nblocks

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
            _, _, _, _, _, path_off, path_len = _HEAD.unpack_from(rec)
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

    def open_copy(self, fields: tuple, dir_fd: int) -> int:
        """A read-only descriptor of the record's file as another tier holds it, under that
        tier's data directory `dir_fd` (RAM's, written in this mount and only ever unlinked
        whole: its size is the test, a copy being written is shorter), or -1."""
        name = fields[0].hex()
        try:
            fd = os.open(f"{name[:SUBDIR_CHARS]}/{name}", os.O_RDONLY | os.O_CLOEXEC, dir_fd=dir_fd)
        except OSError:
            return -1
        try:
            if os.fstat(fd).st_size == fields[15]:
                return fd
        except OSError:
            pass
        os.close(fd)
        return -1
