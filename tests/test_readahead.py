"""The read-ahead policy as a pure object: offsets in, blocks out. Invariants checked:
nothing is returned twice while a stream holds, the window never exceeds its maximum,
nothing past the end of the file, and nothing at all for random access."""

import random

from cachefs.readahead import DirectoryCursor, SequentialReadahead, StreamTable

BS = 1 << 20


def test_sequential_reads_grow_the_window_and_never_repeat():
    ra = SequentialReadahead(BS, initial=2, maximum=16)
    size = 100 * BS
    issued, windows = [], []
    for off in range(0, 40 * BS, BS):
        got = ra.on_read(off, BS, size)
        assert not set(got) & set(issued)                 # never twice
        assert all(b > off // BS for b in got)            # only ahead of the reader
        issued += got
        windows.append(ra.window)
    assert windows[:6] == [0, 2, 4, 8, 16, 16]            # confirm, then doubling to the cap
    assert max(issued) <= 39 + 16
    assert sorted(issued) == list(range(2, max(issued) + 1))  # a contiguous run ahead


def test_window_is_clipped_at_end_of_file():
    ra = SequentialReadahead(BS, initial=8, maximum=8)
    size = 5 * BS + 100
    got = ra.on_read(0, BS, size) + ra.on_read(BS, BS, size) + ra.on_read(2 * BS, BS, size)
    assert max(got) == 5 and len(got) == len(set(got))


def test_random_access_fetches_nothing_and_resets():
    ra = SequentialReadahead(BS)
    rng = random.Random(3)
    size = 1000 * BS
    for _ in range(200):
        assert ra.on_read(rng.randrange(10, 990) * BS, 128 << 10, size) == []
    assert ra.window == 0


def test_kernel_reordering_within_slack_is_still_sequential():
    ra = SequentialReadahead(BS, slack_blocks=2)
    size = 50 * BS
    got = []
    for off in (0, BS, 3 * BS, 2 * BS, 4 * BS, 5 * BS):   # two requests swapped in flight
        got += ra.on_read(off, BS, size)
    assert ra.window > 0 and got


def test_a_jump_stops_then_a_new_run_restarts():
    ra = SequentialReadahead(BS, initial=2, maximum=4)
    size = 200 * BS
    for off in range(0, 6 * BS, BS):
        ra.on_read(off, BS, size)
    assert ra.window == 4
    assert ra.on_read(100 * BS, BS, size) == []           # a seek
    assert ra.window == 0
    assert ra.on_read(101 * BS, BS, size) == []           # one step is not yet a pattern
    assert ra.on_read(102 * BS, BS, size) == [103, 104]   # confirmed again: a fresh window


def test_small_reads_of_a_big_file_move_block_by_block():
    ra = SequentialReadahead(BS, initial=2, maximum=8)
    size = 20 * BS
    got = []
    for off in range(0, 4 * BS, 128 << 10):               # `cat`: 128 KiB at a time
        got += ra.on_read(off, 128 << 10, size)
    assert len(got) == len(set(got)) and max(got) <= 3 + 8


def test_stream_table_is_bounded():
    t = StreamTable(lambda: SequentialReadahead(BS), max_streams=3)
    for k in range(10):
        t.get(k)
    assert len(t) == 3


def test_directory_cursor_sorted_and_skips_files_already_read():
    c = DirectoryCursor("/d", ["c.jpg", "a.jpg", "b.jpg", "d.jpg"])
    c.skip("b.jpg")
    assert [c.next(), c.next(), c.next(), c.next()] == ["a.jpg", "c.jpg", "d.jpg", None]
