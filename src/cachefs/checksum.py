"""The on-disk block format: a 32-byte versioned header, then the block's data.

    offset  size  field
    0       4     magic  b"CFSB"
    4       2     format version (1), little-endian
    6       2     flags (0; reserved)
    8       8     data length in bytes, little-endian
    16      8     xxh3_64 of the data, little-endian
    24      8     xxh3_64 of the cache key the block was stored under, little-endian

The key hash makes a blob that ended up under the wrong key (a torn rename, a copied
cache dir) fail verification exactly like flipped bits do. tests/test_checksum.py pins
these bytes: change the layout only with a new version number.
"""

from __future__ import annotations

import struct

import xxhash

from cachefs.errors import ChecksumError

MAGIC = b"CFSB"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHHQQQ")
HEADER_SIZE = _HEADER.size  # 32


def _hash(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


def encode_block(key: bytes, data: bytes) -> bytes:
    """Return header + data for storing `data` under `key`."""
    return _HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(data), _hash(data), _hash(key)) + data


def decode_block(key: bytes, blob: bytes) -> bytes:
    """Verify a stored blob against `key` and return its data; raise ChecksumError if bad."""
    if len(blob) < HEADER_SIZE:
        raise ChecksumError(f"blob of {len(blob)} bytes is shorter than the header")
    magic, version, _flags, length, data_hash, key_hash = _HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise ChecksumError(f"bad magic {magic!r}")
    if version != FORMAT_VERSION:
        raise ChecksumError(f"unknown block format version {version}")
    if length != len(blob) - HEADER_SIZE:
        raise ChecksumError(f"length {length} in header, {len(blob) - HEADER_SIZE} stored")
    data = blob[HEADER_SIZE:]
    if key_hash != _hash(key):
        raise ChecksumError("block stored under another key")
    if data_hash != _hash(data):
        raise ChecksumError("data checksum mismatch")
    return data
