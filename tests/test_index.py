"""The NVMe tier's index format, pinned byte for byte: change it only with a new file name
(cachefs/tiers/index.py)."""

import stat

from cachefs.source import Attr
from cachefs.tiers import index

ATTR = Attr(stat.S_IFREG | 0o644, 1, 1000, 1000, 110_000, 1, 2_000_000_000, 3, 216, 0, 42)
ENTRY = "0123456789abcdef0123456789abcdef"


def test_lines_are_pinned():
    assert index.NAME == "index.v1"
    assert index.entry_line(ENTRY, 1 << 20, 1700000000.5, ATTR, "/a/b.jpg") == (
        b"E\t0123456789abcdef0123456789abcdef\t1048576\t1700000000.500\t33188\t1\t1000\t1000\t110000\t1\t"
        b"2000000000\t3\t216\t0\t42\t2f612f622e6a7067\t936a2c20\n")
    assert index.block_line(ENTRY, 3, 0xDEADBEEF) == \
        b"B\t0123456789abcdef0123456789abcdef\t3\t00000000deadbeef\ta41d2141\n"
    assert index.drop_line(ENTRY) == b"D\t0123456789abcdef0123456789abcdef\t-1\t1bfb1a42\n"
    assert index.clean_line(1700000000.0) == b"C\t1700000000.000\tf9087402\n"


def test_every_line_parses_back():
    for line, record in [
        (index.entry_line(ENTRY, 4096, 5.25, ATTR, "/caf\udce9 \t\n"),
         index.EntryRecord(ENTRY, 4096, 5.25, ATTR, "/caf\udce9 \t\n")),   # any bytes in a name
        (index.block_line(ENTRY, 0, 2**64 - 1), index.BlockRecord(ENTRY, 0, 2**64 - 1)),
        (index.drop_line(ENTRY, 7), index.DropRecord(ENTRY, 7)),
        (index.clean_line(9.0), index.CleanRecord(9.0)),
    ]:
        assert index.parse(line) == record


def test_a_damaged_line_is_none():
    good = index.block_line(ENTRY, 1, 5)
    assert index.parse(good.replace(b"\t1\t", b"\t2\t")) is None          # CRC mismatch
    assert index.parse(good[:-5] + b"\n") is None                          # torn
    assert index.parse(b"\xff\xfe\n") is None and index.parse(b"\n") is None
    assert index.parse(b"X\tsomething\t00000000\n") is None
