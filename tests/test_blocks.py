import xxhash
from hypothesis import given
from hypothesis import strategies as st

from cachefs.blocks import FileId, block_count, block_extent, block_key, block_range, entry_id


def test_block_count():
    assert block_count(0, 4) == 0
    assert block_count(1, 4) == 1
    assert block_count(4, 4) == 1
    assert block_count(5, 4) == 2


def test_block_range_edges():
    assert list(block_range(0, 10, 0, 4)) == []          # empty file
    assert list(block_range(0, 4, 10, 4)) == [0]
    assert list(block_range(3, 2, 10, 4)) == [0, 1]
    assert list(block_range(8, 100, 10, 4)) == [2]       # clipped at EOF
    assert list(block_range(10, 5, 10, 4)) == []         # at EOF
    assert list(block_range(4, 0, 10, 4)) == []          # zero length


@given(st.integers(0, 10_000), st.integers(0, 3000), st.integers(0, 3000), st.integers(1, 700))
def test_block_range_covers_exactly_the_bytes(size, offset, length, bs):
    blocks = list(block_range(offset, length, size, bs))
    wanted = set(range(offset, min(offset + length, size)))
    covered = set()
    for i in blocks:
        start, n = block_extent(i, size, bs)
        assert n > 0
        covered |= set(range(start, start + n))
    assert wanted <= covered
    # no block that holds none of the wanted bytes
    for i in blocks:
        start, n = block_extent(i, size, bs)
        assert wanted & set(range(start, start + n))


def test_block_key_carries_identity_and_geometry():
    fid = FileId("/a/b", 10, 123)
    k = block_key(b"ns", fid, 0, 4096)
    assert k != block_key(b"ns", FileId("/a/b", 11, 123), 0, 4096)   # size change
    assert k != block_key(b"ns", FileId("/a/b", 10, 124), 0, 4096)   # mtime change
    assert k != block_key(b"ns", FileId("/a/b", 10, 123, 9), 0, 4096)  # ctime change
    assert k != block_key(b"ns", fid, 1, 4096)                       # other block
    assert k != block_key(b"ns", fid, 0, 8192)                       # other block size
    assert k != block_key(b"other", fid, 0, 4096)                    # other source
    assert k == block_key(b"ns", FileId("/a/b", 10, 123), 0, 4096)


def test_block_key_of_undecodable_name_is_the_original_bytes():
    name = b"/caf\xe9".decode("utf-8", "surrogateescape")
    eid, index = block_key(b"ns", FileId(name, 1, 1), 0, 4096)
    assert index == 0 and eid == xxhash.xxh3_128_digest(b"ns\0/caf\xe9\0001\0001\0000\0004096")


def test_an_entry_id_changes_with_every_part_of_the_identity():
    base = (b"ns", FileId("/a", 10, 20, 30), 4096)
    ids = {entry_id(*base),
           entry_id(b"other", *base[1:]),                         # another source
           entry_id(b"ns", FileId("/b", 10, 20, 30), 4096),        # another path
           entry_id(b"ns", FileId("/a", 11, 20, 30), 4096),        # size
           entry_id(b"ns", FileId("/a", 10, 21, 30), 4096),        # mtime
           entry_id(b"ns", FileId("/a", 10, 20, 31), 4096),        # ctime (cp -p, re-extracted tar)
           entry_id(b"ns", FileId("/a", 10, 20, 30), 8192)}        # block geometry
    assert len(ids) == 7 and all(len(i) == 16 for i in ids)
    assert block_key(*base[:2], 5, 4096) == (entry_id(*base), 5)
