"""The NVMe tier's entry table (cachefs/tiers/table.py) and a start from it
(cachefs/tiers/restored.py): the format, pinned; a clean stop's table mapped at the next
start with nothing read into memory; entries brought in one at a time as they are touched;
and every way back to a full replay (a crash after such a start, a damaged record, a table
the index does not name)."""

import os
import stat
import threading
import time
import zlib

import pytest

from cachefs.identity import Attr, EntryInfo
from cachefs.stats import Stats
from cachefs.tiers import index, table
from cachefs.tiers.coldset import COLD, TRUSTED
from cachefs.tiers.table import Row, Table

from .test_tiers import check, eid, info, kill, no_margin, put  # noqa: F401  (no_margin: a fixture)

ATTR = Attr(stat.S_IFREG | 0o644, 1, 1000, 1000, 110_000, 1, 2_000_000_000, 3, 216, 0, 42)
BS = 64 << 10


def row(n: int, path: str, size: int = 110_000, hashes=None, stored_at: float = 0.0, synced: int = 7) -> Row:
    attr = ATTR._replace(size=size)
    nblocks = max(1, -(-size // BS))
    return Row(eid(n), path, attr, BS, stored_at or float(n), synced,
               hashes if hashes is not None else [n * 1000 + i for i in range(nblocks)])


def test_the_layout_is_pinned(tmp_path):
    assert table.HEADER.size == 64 and table.RECORD.size == 160 and table.MAGIC == b"cachefT1"
    assert index.table_name(0xABC) == "entries-0000000000000abc.v1"
    assert index.table_line(0xABC) == b"T\t0000000000000abc\t307a9472\n"
    assert index.parse(index.table_line(5)) == index.TableRecord(5)
    path = str(tmp_path / "t")
    table.write(path, [row(1, "/a/b.jpg", 5000), row(2, "/big", 3 * BS, [11, None, 13])], 123, 0xABC)
    data = open(path, "rb").read()
    assert len(data) == 64 + 2 * 160 + 8 * 8 + len(b"/a/b.jpg/big") + 3 * 8 + 1
    assert zlib.crc32(data) == 0x71DE6509


def test_rows_round_trip_and_are_found_by_id_and_by_path(tmp_path):
    rows = [row(1, "/d/f\n1", 5000), row(2, "/caf\udce9", 0), row(3, "/" + "x" * 254),
            row(4, "/big", 5 * BS + 7, [1, None, 0, None, 2**64 - 1, 9]), row(5, "/d/f\n1", 6000, stored_at=99.0)]
    path = str(tmp_path / "t")
    table.write(path, rows, 123, 77)
    t = Table(path, 77)
    assert (t.count, t.stop_ns, t.table_id) == (5, 123, 77)
    assert t.blocks == 1 + 1 + 2 + 4 + 1                          # a hash of 0 is a block held
    assert t.used == 8192 + 0 + 110_592 + 3 * BS + 4096 + 8192     # the policy's 4 KiB blocks
    for n, r in enumerate(rows):
        assert t.row(n) == r._replace(newest=n != 0) and t.find(r.eid) == n   # (row 4 is /d/f\n1's newest)
        assert t.eid_size(n) == (r.eid, r.attr.size)
    assert t.eid_size(5) is None
    assert t.find_path("/d/f\n1") == 4                             # the newest version of a path
    assert t.find_path("/caf\udce9") == 1 and t.find(eid(9)) is None and t.find_path("/nope") is None
    assert t.path_row("/d/f\n1") == (4, rows[4]._replace(newest=True)) and t.path_row("/nope") is None
    assert t.path_row("/big") == (3, rows[3]._replace(newest=True))
    assert t.path_brief("/d/f\n1") == (4, 99.0, 1) and t.path_brief("/big") == (3, rows[3].stored_at, 6)
    assert t.path_brief("/nope") is None


def test_a_damaged_record_is_not_there_and_a_damaged_header_is_no_table(tmp_path):
    path = str(tmp_path / "t")
    table.write(path, [row(1, "/a"), row(2, "/b")], 1, 5)
    with open(path, "r+b") as f:
        f.seek(64 + 160 + 100)                                     # record 1's attributes
        f.write(b"\xff")
    t = Table(path, 5)
    assert t.row(0) == row(1, "/a")._replace(newest=True) and t.row(1) is None and t.find(eid(2)) == 1
    assert t.path_row("/a") == (0, t.row(0)) and t.path_row("/b") is None and t.find_path("/b") == 1
    with pytest.raises(ValueError):
        Table(path, 6)                                             # not the table the index names
    with open(path, "r+b") as f:
        f.seek(10)
        f.write(b"\xff")
    with pytest.raises(ValueError):
        Table(path, 5)


def tables(t) -> list[str]:
    return sorted(n for n in os.listdir(t.directory) if n.startswith("entries-"))


def test_a_start_after_a_clean_stop_reads_nothing_into_memory(disk):
    t = disk()
    data = {n: os.urandom(20_000 + n) for n in range(30)}
    for n, d in data.items():
        put(t, n, d)
    used, held = t.used_bytes, len(t)
    t.close()
    assert open(os.path.join(t.directory, index.NAME), "rb").read().startswith(b"T\t") and len(tables(t)) == 1
    t2 = disk()
    assert t2._entries == {} and t2.used_bytes == used and len(t2) == held
    assert t2.attr_of("/f3")[0].size == 20_003 and t2._entries == {}   # a lookup leaves it in the table
    assert t2.get((eid(3), 0)) == data[3] and list(t2._entries) == [eid(3)]  # a read brings one in
    assert t2.backing_file(eid(4)) is not None and len(t2._entries) == 2
    check(t2)
    assert all(t2.get((eid(n), 0)) == d for n, d in data.items())
    check(t2)


def test_victims_are_taken_from_the_table_oldest_first(disk):
    t = disk(capacity=4 << 20)
    for n in range(40):
        put(t, n, os.urandom(50_000))
    t.close()
    t2 = disk(capacity=2 << 20)                                        # a smaller budget: trimmed at start
    assert t2._entries == {}                                           # none stayed in memory
    kept = [n for n in range(40) if (eid(n), 0) in t2]
    assert kept and kept == list(range(40 - len(kept), 40))            # the oldest went
    assert not os.path.exists(t2.file_of(eid(0).hex()))
    check(t2)
    assert t2._volume() <= 2 << 20


def test_opens_counted_on_whole_one_block_records_leave_them_in_the_table(disk):
    """The opens a serving process reports count as the policy's hits without making an
    entry of each record (about 1 KB a file in memory); a record of several blocks is
    brought in, and one brought in later keeps the access its hit gave it."""
    t = disk()
    for n in range(30):
        put(t, n, bytes([n]) * 20_000)
    put(t, 30, b"a" * BS, 0, size=BS + 100)
    put(t, 30, b"b" * 100, 1, size=BS + 100)  # two blocks
    t.close()
    t2 = disk()
    assert t2.hit_whole([eid(n) for n in range(30)]) == [True] * 30
    assert t2._entries == {} and (eid(3), 0) in t2 and t2._entries == {}  # held, still cold
    r = t2._restored
    ticks = {n: r.ticks[t2._restored.table.find(eid(n))] for n in range(30)}
    assert sorted(ticks.values()) == list(ticks.values()) and 0 not in ticks.values()  # each hit a tick, in order
    assert r.read == 30 and r.files == 31
    assert t2.hit_whole([eid(30)]) == [True] and list(t2._entries) == [eid(30)]  # two blocks: brought in
    assert t2.entry(eid(5)) is not None  # brought in: as last accessed by its hit, not the oldest
    assert t2.policy._entries[(eid(5), 0)][1] == ticks[5] and next(iter(t2.policy._entries)) == (eid(30), 0)
    assert t2.get((eid(5), 0)) == bytes([5]) * 20_000
    check(t2)


def test_a_record_confirmed_or_outdated_stays_in_the_table_with_its_new_time(disk):
    """A check that finds a restored file unchanged (or changed) on the source gives its
    record a new time (or 0) in a column, without bringing it into memory; the next clean
    stop writes that time, and an entry brought in meanwhile carries it."""
    t = disk()
    for n in range(5):
        put(t, n, bytes([n]) * 3000)
    t.close()
    t2 = disk()
    before = {n: t2.attr_of(f"/f{n}")[1] for n in range(5)}
    assert t2.confirm("/f3", lambda attr: False) is None  # not the version the source has: not confirmed
    assert t2.confirm("/f1") == (eid(1), t2.table_find(path="/f1")) and t2.outdated("/f2") is None
    assert t2._entries == {}
    now = t2.attr_of("/f1")[1]
    assert now > before[1] and t2.attr_of("/f2")[1] == 0.0 and t2.attr_of("/f3")[1] == before[3]
    assert t2.entry(eid(1)).stored_at == now and t2.entry(eid(2)).stored_at == 0.0  # brought in: the same
    t2.confirm("/f4")
    t2.close()
    t3 = disk()
    assert t3.attr_of("/f4")[1] > before[4] and t3.attr_of("/f1")[1] == now and t3.attr_of("/f2")[1] == 0.0
    check(t3)


def test_a_record_read_while_cold_outlasts_those_not_read_and_goes_by_its_last_read(disk):
    t = disk(capacity=4 << 20, policy="lru")
    for n in range(40):
        put(t, n, bytes([n]) * 50_000)
    t.close()
    t2 = disk(capacity=2_400_000, policy="lru")  # room for the 40 and a few more
    assert all((eid(n), 0) in t2 for n in range(40))
    read = list(range(9, -1, -1))  # the ten oldest records, read newest first
    assert t2.hit_whole([eid(n) for n in read]) == [True] * 10
    for n in range(40, 60):  # no room: the records not read since the start go first
        assert put(t2, n, bytes([n]) * 50_000)
    held = {n for n in range(60) if (eid(n), 0) in t2}
    assert set(range(10)) <= held and set(range(40, 60)) <= held
    assert not set(range(10, 40)) <= held and t2._entries.keys().isdisjoint(eid(n) for n in range(10))
    for n in range(60, 100):  # then the records read while cold, by their last read (9 before 0)
        put(t2, n, bytes([n]) * 50_000)
    cold_left = [n for n in read if (eid(n), 0) in t2]
    assert cold_left == read[len(read) - len(cold_left):] and len(cold_left) < 10
    check(t2)


def test_a_record_being_brought_in_is_held_to_a_reader_asking_meanwhile(disk):
    """A read asks whether a block is held without the tier's lock: a record another
    thread is bringing in (its state taken, its keys not yet the policy's) is waited for,
    not answered "not held" (the reader fetched the block from the source again)."""
    import threading

    t = disk()
    for n in range(4):
        put(t, n, bytes([n]) * 3000)
    t.close()
    t2 = disk()
    r = t2._restored
    bring = r._bring

    def slow_bring(*args):
        time.sleep(0.3)
        bring(*args)

    r._bring = slow_bring
    other = threading.Thread(target=t2.entry, args=(eid(2),))
    other.start()
    time.sleep(0.1)  # the other thread is inside the bring-in
    assert (eid(2), 0) in t2 and eid(2) in t2._entries
    other.join()
    check(t2)


def test_a_hard_cut_takes_the_records_not_read_first_then_those_read_by_their_last_read(disk):
    t = disk()
    for n in range(10):
        put(t, n, bytes([n]) * 3000)  # 4 KiB each on disk
    t.close()
    t2 = disk()
    assert t2.hit_whole([eid(n) for n in (3, 1, 2)]) == [True] * 3
    with t2._lock:
        victims = t2.policy.shrink(9 * 4096)
    assert [key[0] for key in victims] == [eid(n) for n in (0, 4, 5, 6, 7, 8, 9, 3, 1)]
    assert t2.policy.keys() == [(eid(2), 0)]


@pytest.mark.usefixtures("no_margin")
def test_records_a_serving_process_vouched_for_are_trusted_and_the_check_waits_while_they_come(disk):
    """A serving process tests a file when it registers a backing id for it (as the restart
    check does, at an fstat): its records are trusted without the check's stat, and the
    check waits while such registrations come, for the files the job is opening."""
    t = disk()
    for n in range(6):
        put(t, n, bytes([n]) * 3000)
    time.sleep(0.05)
    t.close()
    stats = Stats()
    t2 = disk(stats=stats, scrub=True)
    r = t2._restored
    number = {n: r.table.find(eid(n)) for n in range(6)}
    t2.vouch_rows([number[1], number[2], number[1]])
    assert [r.state[number[n]] for n in range(6)] == [COLD, TRUSTED, TRUSTED, COLD, COLD, COLD]
    assert stats.get("disk.trusted_files") == 2 and t2._entries == {}
    assert not t2.needs_check(eid(2)) and stats.get("disk.trusted_files") == 2
    # registrations keep coming for 2.5 s: the check (a second after the start) waits
    until = time.monotonic() + 2.5
    while time.monotonic() < until:
        t2.vouch_rows([number[2]])
        time.sleep(0.05)
    assert r.state[number[0]] == COLD and stats.get("disk.trusted_files") == 2
    deadline = time.monotonic() + 10                          # then quiet: it checks the rest
    while stats.get("disk.trusted_files") < 6 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert stats.get("disk.trusted_files") == 6 and all(r.state[number[n]] == TRUSTED for n in range(6))
    assert t2.get((eid(0), 0)) == bytes([0]) * 3000 and t2.get((eid(1), 0)) == bytes([1]) * 3000
    check(t2)


def test_the_orphan_sweep_waits_while_the_job_opens_cached_files(disk, monkeypatch):
    from cachefs.tiers import checks as checks_mod
    from cachefs.tiers import restored as restored_mod

    monkeypatch.setattr(restored_mod, "SWEEP_RATE", 20)   # a pause, and a look at the job, at each file
    monkeypatch.setattr(checks_mod, "VOUCH_QUIET", 0.3)
    t = disk()
    for n in range(3):
        put(t, n, bytes([n]) * 3000)
    t.close()
    orphans = [t.file_of(eid(n).hex()) for n in (70, 71)]
    for path in orphans:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        open(path, "wb").write(b"no record")
        os.utime(path, (time.time() - 60, time.time() - 60))
    t2 = disk()
    done: list[int] = []
    sweep = threading.Thread(target=lambda: done.append(t2._sweep_orphans()))
    sweep.start()
    until = time.monotonic() + 2.0
    while time.monotonic() < until:                           # the job opens a cached file every 50 ms
        assert t2.hit_whole([eid(1)]) == [True]
        time.sleep(0.05)
    assert sweep.is_alive() and not done                      # 5 files at 20 a second: it waited
    sweep.join(10)
    assert done == [2] and not any(os.path.exists(p) for p in orphans)
    assert t2.get((eid(2), 0)) == bytes([2]) * 3000


def test_the_restart_check_reads_records_in_bulk(disk):
    t = disk()
    for n in range(9):
        put(t, n, bytes([n]) * (100 + n))
    t.close()
    found = Table(t._table_path(t._table_id))
    assert [(n, e, s, size) for n, e, s, size in found.synced()] == [
        (n, row.eid, row.synced_ns, row.attr.size) for n in range(found.count) if (row := found.row(n)) is not None]
    assert found.count == 9 and {size for *_, size in found.synced()} == {100 + n for n in range(9)}
    assert all(s > 0 for _, _, s, _ in found.synced())       # written back at the clean stop
    found.close()


@pytest.mark.usefixtures("no_margin")
def test_a_record_the_restart_check_trusted_needs_no_check_and_stays_cold(disk):
    t = disk()
    for n in range(20):
        put(t, n, bytes([n]) * 3000)
    time.sleep(0.05)  # older than the stop by the margin
    t.close()
    stats = Stats()
    t2 = disk(stats=stats, scrub=True)
    # before the restart check's pass (a second after the start): checked here, at one stat
    assert not t2.needs_check(eid(5)) and t2._entries == {} and stats.get("disk.trusted_files") == 1
    deadline = time.monotonic() + 10
    while stats.get("disk.trusted_files") < 20 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert stats.get("disk.trusted_files") == 20  # each once
    assert not t2.needs_check(eid(3)) and t2._entries == {}
    assert t2.get((eid(3), 0)) == bytes([3]) * 3000 and not t2.needs_check(eid(3))
    check(t2)


@pytest.mark.usefixtures("no_margin")
def test_a_lookup_s_record_answers_the_fill_and_open_after_it_with_no_other_read(disk):
    """After a remount, directory read-ahead and an open ask of a cold file: its attributes
    (a lookup, by path), whether a tier holds it, whether it needs a check. The lookup's
    read of the record answers the other two (at 200,000 files each was a probe of the
    table by entry id, read from disk after the page cache was dropped)."""
    t = disk()
    for n in range(20):
        put(t, n, bytes([n]) * 3000)
    t.put((eid(30), 0), b"x" * BS, info("/f30", 2 * BS, BS))   # a file of two blocks, one held
    time.sleep(0.05)  # older than the stop by the margin
    t.close()
    t2 = disk(scrub=True)
    reads = []
    real = t2._restored.table._read
    t2._restored.table._read = lambda at, length: (reads.append(at), real(at, length))[1]
    for n in (4, 7, 30):
        attr, _ = t2.attr_of(f"/f{n}")                             # the lookup: its record read
        assert attr.size == (3000 if n != 30 else 2 * BS) and reads
        reads.clear()
        assert t2.probably_has((eid(n), 0)) and not t2.probably_has((eid(n), 1))
        t2.needs_check(eid(n))
        if n != 30:
            assert reads == []                                     # nor was anything else read
    assert t2._entries == {} and not t2.probably_has((eid(99), 0))  # a file it never held
    # a table node's open, counted by its entry id and size: that one read tells the count
    # (a hit on a whole file of one block, the record left cold) the record's shape too
    for n in (11, 12):
        number = t2._restored.table.find(eid(n))
        reads.clear()
        assert t2.table_eid_size(number) == (eid(n), 3000) and len(reads) == 1
        assert t2.hit_whole([eid(n)]) == [True] and len(reads) == 1
    assert t2._entries == {}
    check(t2)


def test_a_crash_after_a_start_from_the_table_keeps_what_happened_since(disk):
    t = disk()
    for n in range(10):
        put(t, n, bytes([n]) * 5000)
    t.close()
    t2 = disk()
    put(t2, 20, b"new" * 1000)
    t2.discard((eid(3), 0))                                            # a restored entry dropped
    kill(t2)
    t3 = disk()                                                        # the table, then the log's lines
    assert t3.get((eid(3), 0)) is None and t3.get((eid(20), 0)) == b"new" * 1000
    assert all(t3.get((eid(n), 0)) == bytes([n]) * 5000 for n in range(10) if n != 3)
    assert tables(t3) == []                                            # compacted: the index is whole again
    check(t3)
    t3.close()
    t4 = disk()
    assert t4.get((eid(20), 0)) == b"new" * 1000 and t4.get((eid(3), 0)) is None


def test_a_compaction_during_a_run_keeps_the_entries_still_in_the_table(disk):
    t = disk()
    for n in range(10):
        put(t, n, bytes([n]) * 5000)
    t.close()
    t2 = disk()
    assert t2.get((eid(1), 0)) == b"\x01" * 5000
    t2._compact()                                                      # as when the log outgrows its live part
    assert tables(t2) == [] and len(t2._entries) == 1
    assert t2.get((eid(2), 0)) == b"\x02" * 5000                       # still read from the mapping
    kill(t2)
    t3 = disk()
    assert all(t3.get((eid(n), 0)) == bytes([n]) * 5000 for n in range(10))
    check(t3)


def test_a_damaged_record_costs_its_file_only(disk):
    t = disk()
    for n in range(5):
        put(t, n, bytes([n]) * 5000)
    t.close()
    found = Table(os.path.join(t.directory, tables(t)[0]))
    n = found.find(eid(2))
    with open(os.path.join(t.directory, tables(t)[0]), "r+b") as f:
        f.seek(64 + 160 * n + 120)
        f.write(b"\x55\x55")
    t2 = disk()
    assert t2.get((eid(2), 0)) is None and not os.path.exists(t2.file_of(eid(2).hex()))
    assert all(t2.get((eid(k), 0)) == bytes([k]) * 5000 for k in (0, 1, 3, 4))
    assert put(t2, 2, b"\x02" * 5000) and t2.get((eid(2), 0)) == b"\x02" * 5000


def test_a_newer_version_of_a_path_hides_the_tables(disk):
    t = disk()
    put(t, 1, b"old" * 1000)
    t.close()
    t2 = disk()
    newer = EntryInfo("/f1", ATTR._replace(size=4000, mtime_ns=5), BS)
    assert t2.put((eid(99), 0), b"n" * 4000, newer)
    assert t2.attr_of("/f1")[0].size == 4000
    t2.discard((eid(99), 0))
    assert t2.attr_of("/f1") is None                                   # not the older version's attributes
    check(t2)


def test_a_table_the_index_does_not_name_is_deleted(disk):
    t = disk()
    put(t, 1, b"x" * 5000)
    kill(t)                                                            # a log, no table
    stray = os.path.join(t.directory, index.table_name(12345))
    table.write(stray, [row(7, "/ghost")], 1, 12345)                   # a stop that died before the index's rename
    t2 = disk()
    assert tables(t2) == [] and t2.get((eid(1), 0)) == b"x" * 5000 and t2.entry(eid(7)) is None


def test_an_unreadable_table_costs_its_files_not_the_mount(disk, caplog):
    t = disk()
    put(t, 1, b"x" * 5000)
    t.close()
    with open(os.path.join(t.directory, tables(t)[0]), "r+b") as f:
        f.write(b"garbage!")
    t2 = disk()
    assert "entry table could not be read" in caplog.text
    assert t2.get((eid(1), 0)) is None and not os.path.exists(t2.file_of(eid(1).hex()))
    assert put(t2, 2, b"y" * 5000) and t2.get((eid(2), 0)) == b"y" * 5000


def test_a_stop_with_nothing_changed_since_the_start_keeps_the_table(disk, monkeypatch):
    t = disk()
    for n in range(5):
        put(t, n, bytes([n]) * 5000)
    t.close()
    first = tables(t)
    t2 = disk()
    assert all(t2.get((eid(n), 0)) == bytes([n]) * 5000 for n in range(5))   # an epoch reads; nothing changes
    t2.close()
    assert tables(t2) == first                                         # the same table stands for this stop
    t3 = disk()
    assert t3._entries == {} and t3.get((eid(2), 0)) == b"\x02" * 5000
    t3.confirm("/f1")                                                  # an entry's time changed: written anew
    t3.close()
    assert tables(t3) != first and len(tables(t3)) == 1
    t4 = disk()
    assert t4.attr_of("/f1")[1] > t4.attr_of("/f0")[1]
    put(t4, 9, b"new" * 100)                                           # an entry added: written anew
    t4.close()
    t5 = disk()
    assert t5.get((eid(9), 0)) == b"new" * 100 and len(t5) == 6
    check(t5)


@pytest.mark.usefixtures("no_margin")
def test_the_restart_check_trusts_unchanged_files_and_leaves_them_in_the_table(disk):
    """After a clean stop each record's file is checked at one stat, off the serving path,
    and left in the table; a file changed since is brought in unverified, and its bytes
    are compared before they are served."""
    t = disk()
    for n in range(200):
        put(t, n, bytes([n % 256]) * 3000)
    time.sleep(0.05)  # older than the stop by the margin
    t.close()
    touched = t.file_of(eid(7).hex())
    os.chmod(touched, 0o644)  # its ctime moves past the clean stop; its bytes are the same
    stats = Stats()
    t2 = disk(stats=stats, scrub=True)
    deadline = time.monotonic() + 10
    while stats.get("disk.trusted_files") < 199 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stats.get("disk.trusted_files") == 199 and list(t2._entries) == [eid(7)]
    assert t2.get((eid(7), 0)) == bytes([7]) * 3000 and not t2._entries[eid(7)].unverified
    assert all(t2.get((eid(n), 0)) == bytes([n % 256]) * 3000 for n in range(200))
    check(t2)


def test_a_mapped_table_finds_paths_and_gives_whole_one_block_records_only(tmp_path):
    """table.Mapped, the serving processes' read-only view: a path's newest record, and its
    fields only if it passes its CRC, is of one block, and is its path's newest."""
    rows = [row(1, "/d/a.jpg", 5000), row(2, "/d/a.jpg", 6000, stored_at=99.0), row(3, "/big", 3 * BS),
            row(4, "/caf\udce9", 100)]
    path = str(tmp_path / "t")
    table.write(path, rows, 123, 77)
    fd = os.open(path, os.O_RDWR)
    try:
        m = table.Mapped(fd)
        assert (m.count, m.stop_ns) == (4, 123)
        assert m.find_path(b"/d/a.jpg") == 1 and m.find_path(b"/big") == 2
        assert m.find_path("/caf\udce9".encode("utf-8", "surrogateescape")) == 3
        assert m.find_path(b"/d/b.jpg") is None and m.find_path(b"/d") is None
        f = m.record(1)
        assert f is not None and f[0] == eid(2) and f[1] == 99.0 and f[2] == 7
        assert Attr(*f[11:]) == ATTR._replace(size=6000)
        assert m.record(0) is None      # not its path's newest
        assert m.record(2) is None      # three blocks
        assert m.record(4) is None and m.record(-1) is None
        # a damaged record is not there (the mapping sees the file as it is now)
        at = table.HEADER.size + 3 * table.RECORD.size + 100
        os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 1]), at)
        assert m.record(3) is None and m.record(1) is not None
        m.close()
        os.pwrite(fd, b"X", 0)
        with pytest.raises(ValueError):
            table.Mapped(fd)
    finally:
        os.close(fd)


def test_a_checkpoint_is_a_table_of_what_a_mount_without_one_holds(disk):
    """A mount that started without a table (its first) writes the entries it holds as a
    table of their own, for the serving processes' table nodes: found by path and by id,
    each vouched for by the checkpoint, counted in the budget; a newer version of a path
    retires its record; none without a file new since the last, nor after a start from
    a table; the index does not name it, and the next start (or a clean stop) removes it."""
    t = disk()
    data = {n: os.urandom(3000 + n) for n in range(20)}
    for n, d in data.items():
        put(t, n, d)
    retired = []
    t.on_unpathed.append(retired.append)
    volume, room = t._volume(), t.policy.capacity
    got = t.checkpoint()
    assert got is not None
    fd, count, ram = got
    os.close(fd)
    assert not ram
    size = os.path.getsize(os.path.join(t.directory, tables(t)[0]))
    assert count == 20 and len(tables(t)) == 1
    assert t._volume() == volume + size and t.policy.capacity <= room - size  # in the budget
    n = t.table_find(path="/f3")
    assert n is not None and t.table_find(eid=eid(3)) == n
    r = t.table_row(n)
    assert r is not None and r.path == "/f3" and r.attr.size == 3003 and r.synced_ns > 0
    assert t.table_eid_size(n) == (eid(3), 3003)
    m = table.Mapped(os.open(os.path.join(t.directory, tables(t)[0]), os.O_RDONLY))
    assert m.record(n) is not None
    m.close()
    assert t.checkpoint()[:2] == (-1, 20)                              # nothing new since
    assert t.put((eid(99), 0), b"n" * 4000, EntryInfo("/f3", ATTR._replace(size=4000, mtime_ns=5), BS))
    assert retired == [n]                                              # not the path's newest any more
    check(t)
    kill(t)                                                            # a crash: the index names no table
    t2 = disk()
    assert tables(t2) == [] and t2.get((eid(5), 0)) == data[5]         # the checkpoint is removed
    got = t2.checkpoint(ram={eid(6)})                                  # (RAM's files are in it, and said)
    assert got is not None and got[1] == 21 and list(got[2]) == [t2.table_find(path="/f6")]
    os.close(got[0])
    t2.close()
    assert len(tables(t2)) == 1 and t2._table_id and tables(t2) == [index.table_name(t2._table_id)]
    t3 = disk()
    assert t3.checkpoint() is None and t3.get((eid(4), 0)) == data[4]  # a start from a table has one
    t3.close()


def test_a_path_stored_while_a_checkpoint_is_written_retires_its_record(disk, monkeypatch):
    """The entries are copied under the tier's lock and written outside it: a newer version
    of a path stored meanwhile is the path's newest, not the table's record of it."""
    t = disk()
    for n in range(5):
        put(t, n, b"o" * 3000)
    retired = []
    t.on_unpathed.append(retired.append)
    finish = table.Writer.finish

    def finish_then_store(writer):
        size = finish(writer)
        assert t.put((eid(99), 0), b"n" * 4000, EntryInfo("/f2", ATTR._replace(size=4000, mtime_ns=5), BS))
        return size

    monkeypatch.setattr(table.Writer, "finish", finish_then_store)
    got = t.checkpoint()
    assert got is not None and got[1] == 5
    os.close(got[0])
    n = t.table_find(path="/f2")
    assert n is not None and t.table_eid_size(n) == (eid(2), 3000)
    assert retired == [n] and t._stored_since_copy is None
    assert t.put((eid(98), 0), b"m" * 4000, EntryInfo("/f4", ATTR._replace(size=4000, mtime_ns=6), BS))
    assert retired == [n, t.table_find(path="/f4")]                   # (after it, as before)
    check(t)
    t.close()


def test_a_next_checkpoint_keeps_the_records_before_in_their_numbers(disk):
    """A mount that cached more files after its checkpoint writes the next generation: every
    record of the one before in its number (the kernel may hold its node id), a dropped
    entry's as that table had it, then the files stored since (RAM's too); a newer
    version of a path is the new table's record of it. The table before is unlinked, and
    counted in the budget until no serving process maps it (checkpoint_released)."""
    t = disk()
    for n in range(10):
        put(t, n, os.urandom(3000 + n))
    fd, count, _ = t.checkpoint()
    os.close(fd)
    first = tables(t)
    one = {n: (t.table_eid_size(n), t.table_row(n)) for n in range(count)}
    assert count == 10 and t.stored_since_checkpoint == 0
    for n in range(10, 16):
        put(t, n, os.urandom(3000 + n))
    assert t.put((eid(99), 0), b"n" * 4000, EntryInfo("/f2", ATTR._replace(size=4000, mtime_ns=5), BS))
    dropped = t.table_find(eid=eid(7))
    t.discard((eid(7), 0))
    assert t.stored_since_checkpoint == 7
    size_before = t._checkpoint_bytes
    fd, count, ram_rows = t.checkpoint(ram={eid(15)})                   # (RAM holds f15)
    os.close(fd)
    assert list(ram_rows) == [t.table_find(eid=eid(15))] and ram_rows[0] >= 10  # (a new record)
    assert count == 10 + 7 and tables(t) != first and len(tables(t)) == 1  # the one before unlinked
    for n, (eid_size, r) in one.items():
        assert t.table_eid_size(n) == eid_size, n                       # the same record, the same number
        if n != dropped:
            assert t.table_row(n)._replace(synced_ns=0) == r._replace(newest=r.path != "/f2", synced_ns=0)
    assert t.table_row(dropped) == one[dropped][1]                       # as the table before had it
    assert {t.table_eid_size(n)[0] for n in range(10, 17)} == {eid(n) for n in range(10, 16)} | {eid(99)}
    assert t.table_find(path="/f2") >= 10 and t.table_find(path="/f15") >= 10
    size = os.path.getsize(os.path.join(t.directory, tables(t)[0]))
    assert t._checkpoint_bytes == size + size_before                    # the one before: still mapped
    t.checkpoint_released()
    assert t._checkpoint_bytes == size and t._volume() >= t.policy.used + size
    assert t.checkpoint(room=17)[:2] == (-1, 17) and t.stored_since_checkpoint == 0  # nothing new
    put(t, 21, os.urandom(3000))
    assert t.checkpoint(room=17) is None and t.stored_since_checkpoint == 1  # no room: not written
    check(t)
    t.close()
    assert tables(t) and first[0] not in tables(t)


def test_a_checkpoint_without_room_in_the_budget_is_not_written(disk):
    t = disk(capacity=1 << 20)
    n = 0
    while put(t, n, b"x" * 3000, evict=False):
        n += 1
    assert t.checkpoint() is None and tables(t) == []
    check(t)


def test_a_table_written_a_record_at_a_time_is_the_table_of_the_whole_list(tmp_path, monkeypatch):
    """A Writer sends records and paths to the file as they come (here each at once): a
    later record of a path takes the newest flag from one already on the disk, whose CRC is
    made again; the file is byte for byte the one written from the whole list at once."""
    rows = [row(1, "/a", 5000), None, row(3, "/big", 5 * BS + 7, [1, None, 0, None, 2**64 - 1, 9]),
            row(4, "/a", 6000), row(5, "/e", 100, [None]), row(6, "/big", 3 * BS, [4, 5, 6]), row(7, "/a", 7000)]
    whole = str(tmp_path / "whole")
    table.write(whole, rows, 123, 77, numbered=len(rows))
    monkeypatch.setattr(table.Writer, "FLUSH", 1)
    each = str(tmp_path / "each")
    w = table.Writer(each, len(rows), 123, 77)
    for r in rows:
        w.add(r)
    assert w.finish() == os.path.getsize(each)
    assert open(each, "rb").read() == open(whole, "rb").read()
    assert w.hidden == {0, 1, 2, 3, 4}          # superseded by a later record of the path, or of zeros
    t = Table(each, 77)
    assert t.find_path("/a") == 6 and t.find_path("/big") == 5 and t.find_path("/e") is None
    for n in (0, 2, 3):                         # unmarked on the disk, their CRCs made again
        assert t.row(n) == rows[n]._replace(newest=False) and t.find(rows[n].eid) == n
    assert t.row(6) == rows[6]._replace(newest=True) and t.row(1) is None and t.row(4) is None
    t.close()
    assert sorted(os.listdir(tmp_path)) == ["each", "whole"]


def test_a_writer_given_other_than_its_count_writes_nothing(tmp_path):
    w = table.Writer(str(tmp_path / "t"), 2, 1, 1)
    w.add(row(1, "/x", 10))
    with pytest.raises(ValueError, match="1 rows added to a table sized for 2"):
        w.finish()
    w.add(row(2, "/y", 10))
    with pytest.raises(ValueError, match="more than the 2 rows"):
        w.add(row(3, "/z", 10))
    w.abort()
    assert os.listdir(tmp_path) == []


def test_a_checkpoint_holds_no_row_per_record_while_it_writes(disk):
    """What a checkpoint's next generation allocates while it writes (Python's, traced) is
    a few tens of bytes per record beside 1 MiB buffers: made as Rows before the write, the
    records of the one before (cold: read from it) had been ~700 bytes each at once."""
    import tracemalloc

    stats = Stats()
    t = disk(capacity=256 << 20, stats=stats)
    files = 12_000
    for n in range(files):
        assert t.put((eid(n), 0), b"x" * 100, info(f"/d{n % 10}/file-{n:05d}.jpg", 100))
    got = t.checkpoint()                        # the first generation: the files leave memory
    assert got is not None and got[1] == files and stats.get("disk.cooled_files") == files
    os.close(got[0])
    for n in range(files, files + 1000):
        assert t.put((eid(n), 0), b"y" * 100, info(f"/e/file-{n:05d}.jpg", 100))
    tracemalloc.start()
    try:
        got = t.checkpoint()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert got is not None and got[1] == files + 1000
    os.close(got[0])
    assert t.table_row(t.table_find(path="/d3/file-00003.jpg")).attr.size == 100
    # measured: 159 bytes a record (most of it the 1 MiB buffers, at 13,000 records) against
    # 1,010 when the rows were made first
    assert peak < 250 * (files + 1000), peak / (files + 1000)
    t.close()


def test_a_clean_stop_writes_its_table_in_restore_order_without_a_row_per_record_at_once(disk):
    """A clean stop sorts the entries in memory and the cold records by `stored at` (a
    record's checked time where the restart check or a lookup confirmed it since) and makes
    each row only as it is written: made first, a row of each cold record read back from
    the table had been ~1 KB of objects at once."""
    import tracemalloc

    t = disk(capacity=256 << 20)
    files = 12_000
    for n in range(files):
        assert t.put((eid(n), 0), bytes([n % 251]) * 100, info(f"/d{n % 10}/file-{n:05d}.jpg", 100))
    t.close()
    t2 = disk(capacity=256 << 20)
    assert t2._entries == {} and len(t2) == files                  # all cold
    for n in range(files, files + 500):                             # newer, in memory
        assert t2.put((eid(n), 0), b"y" * 100, info(f"/e/file-{n:05d}.jpg", 100))
    for n in range(0, files, 1000):                                 # brought in (warm)
        assert t2.get((eid(n), 0)) == bytes([n % 251]) * 100
    confirmed = t2.table_find(path="/d5/file-00005.jpg")           # a cold record checked since:
    assert confirmed is not None and t2._restored.cold(confirmed)
    t2._restored.stamp(confirmed, time.time() + 100)              # restored by its checked time
    tracemalloc.start()
    try:
        t2.close()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # measured: 173 bytes a record (the 1 MiB buffers most of it, at 12,500 records),
    # against 813 with every row made first
    assert peak < 300 * (files + 500), peak / (files + 500)
    (name,) = tables(t2)
    written = Table(os.path.join(t2.directory, name))
    when = written.stored_ats()
    assert written.count == files + 500 and list(when) == sorted(when)
    assert written.find_path("/d5/file-00005.jpg") == written.count - 1   # the newest: last
    written.close()
    t3 = disk(capacity=256 << 20)
    assert all(t3.get((eid(n), 0)) == bytes([n % 251]) * 100 for n in range(0, files, 7))
    assert all(t3.get((eid(n), 0)) == b"y" * 100 for n in range(files, files + 500, 7))
    check(t3)
