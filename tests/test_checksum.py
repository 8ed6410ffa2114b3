import struct

import pytest
import xxhash

from cachefs.checksum import FORMAT_VERSION, HEADER_SIZE, MAGIC, decode_block, encode_block
from cachefs.errors import ChecksumError

KEY = b"ns\x00/a/b.jpg\x0011\x001700000000000000000\x004194304\x000"
DATA = b"hello world"

# The on-disk format, byte for byte. If this test fails you changed the format: bump
# FORMAT_VERSION (old blocks then read as misses) and update this constant deliberately.
GOLDEN = bytes.fromhex(
    "43465342"              # magic "CFSB"
    "0100"                  # version 1
    "0000"                  # flags
    "0b00000000000000"      # length 11
) + struct.pack("<Q", xxhash.xxh3_64_intdigest(DATA)) + struct.pack("<Q", xxhash.xxh3_64_intdigest(KEY)) + DATA

# And the two hashes themselves, pinned as literals so a change of hash function shows up too.
GOLDEN_HASHES = (xxhash.xxh3_64_intdigest(b"hello world"), 0xD447B1EA40E6988B)


def test_golden_bytes():
    assert encode_block(KEY, DATA) == GOLDEN
    assert HEADER_SIZE == 32 and MAGIC == b"CFSB" and FORMAT_VERSION == 1


def test_hash_function_is_xxh3_64():
    assert GOLDEN_HASHES[0] == GOLDEN_HASHES[1]


def test_roundtrip_including_empty():
    for data in (b"", b"x", bytes(range(256)) * 1000):
        assert decode_block(KEY, encode_block(KEY, data)) == data


@pytest.mark.parametrize("pos", [0, 5, 9, 17, 25, HEADER_SIZE, HEADER_SIZE + 10])
def test_any_flipped_byte_is_detected(pos):
    blob = bytearray(encode_block(KEY, DATA))
    blob[pos] ^= 0x40
    with pytest.raises(ChecksumError):
        decode_block(KEY, bytes(blob))


def test_truncated_and_extended_blobs_are_detected():
    blob = encode_block(KEY, DATA)
    for bad in (blob[:-1], blob + b"\0", blob[:10], b""):
        with pytest.raises(ChecksumError):
            decode_block(KEY, bad)


def test_blob_under_another_key_is_detected():
    with pytest.raises(ChecksumError, match="another key"):
        decode_block(KEY + b"1", encode_block(KEY, DATA))


def test_unknown_version_is_rejected():
    blob = bytearray(encode_block(KEY, DATA))
    blob[4] = 2
    with pytest.raises(ChecksumError, match="version"):
        decode_block(KEY, bytes(blob))
