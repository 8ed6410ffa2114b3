"""Cache identity: which blocks a read touches, and the key each block is stored under."""

from __future__ import annotations

import functools

import xxhash

from cachefs.identity import FileId


def block_count(size: int, block_size: int) -> int:
    """Number of blocks of a file; an empty file has none, a small file exactly one."""
    return (size + block_size - 1) // block_size


def block_range(offset: int, length: int, size: int, block_size: int) -> range:
    """Indices of the blocks that hold bytes [offset, offset+length) of a file of `size` bytes."""
    end = min(offset + length, size)
    if offset >= end:
        return range(0)
    return range(offset // block_size, (end - 1) // block_size + 1)


def block_extent(index: int, size: int, block_size: int) -> tuple[int, int]:
    """(offset, length) of block `index` in a file of `size` bytes."""
    start = index * block_size
    return start, max(0, min(block_size, size - start))


# The last 4,096 ids: a file's open, its report and its release ask for its id within
# moments of each other (the memo answered 92% of what 65,536 did, which held ~24 MB of
# paths and identities at any size of tree; a miss costs about 0.6 us more than a hit).
@functools.lru_cache(maxsize=1 << 12)
def entry_id(namespace: bytes, fid: FileId, block_size: int) -> bytes:
    """The 16-byte id of one cached file version: the xxh3_128 of its key.

    The key carries the source namespace (one per source directory, so two sources can
    share a cache dir), the file's identity, and the block size (a remount with another
    block size must not read blocks of the old geometry). Paths are bytes-safe: undecodable
    names were decoded with surrogateescape and are encoded back the same way. The id
    names the entry's file in a tier, so it is also the on-disk name.
    """
    path = fid.path.encode("utf-8", "surrogateescape")
    key = b"%s\0%s\0%d\0%d\0%d\0%d" % (namespace, path, fid.size, fid.mtime_ns, fid.ctime_ns, block_size)
    if fid.version:  # a store's own version name (ETag); POSIX keys are as they always were
        key += b"\0" + fid.version.encode("utf-8", "surrogateescape")
    return xxhash.xxh3_128_digest(key)


ENTRY_ID_SIZE = 16  # bytes of an entry id (xxh3-128)


def block_key(namespace: bytes, fid: FileId, index: int, block_size: int) -> tuple[bytes, int]:
    """The cache key of one block: (entry id, block index)."""
    return entry_id(namespace, fid, block_size), index
