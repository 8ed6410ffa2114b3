"""A checkpoint's idle entries leave memory for its records (cachefs/tiers/checkpoint.py,
"Cooling"): a first mount's files kept as a start from a clean stop keeps its own, 22 bytes
of columns each instead of an entry in memory (about 1 KB), with the same answers, the
same place in the policy's order, and nothing lost at a clean stop, a crash or the next
generation of the checkpoint."""

from __future__ import annotations

import os
import sys
import threading

from cachefs.identity import EntryInfo
from cachefs.stats import Stats
from cachefs.tiers.coldset import TRUSTED, WARM

from .test_table import ATTR, BS, tables
from .test_tiers import check, eid, info, kill, put


def checkpoint(t, **kw) -> int:
    got = t.checkpoint(**kw)
    assert got is not None and got[0] >= 0
    os.close(got[0])
    return got[1]


def test_a_checkpoint_takes_its_idle_entries_out_of_memory(disk):
    """Whole files of one block, checked: out of memory, still held, read, hit and looked up
    as before (an open one too: its release does not bring it back; one RAM holds too); a
    file of two blocks stays."""
    stats = Stats()
    t = disk(stats=stats)
    data = {n: os.urandom(3000 + n) for n in range(20)}
    for n, d in data.items():
        put(t, n, d)
    put(t, 30, b"a" * BS, 0, size=BS + 100)
    put(t, 30, b"b" * 100, 1, size=BS + 100)                          # two blocks
    assert t.acquire(eid(3))                                           # the kernel has it open
    assert t.confirm("/f4") == (eid(4), -1)  # (in memory: no record)
    when = t.attr_of("/f4")[1]
    used, held, keys, volume = t.policy.used, len(t), len(t.policy), t._volume()
    got = t.checkpoint(ram={eid(5)})                                   # (RAM holds f5: in it, and said)
    assert got is not None and got[1] == 21 and list(got[2]) == [t.table_find(eid=eid(5))]
    os.close(got[0])
    assert set(t._entries) == {eid(30)}
    assert stats.get("disk.cooled_files") == 20 and t._restored.files == 20
    assert (t.policy.used, len(t), len(t.policy)) == (used, held, keys) and t.files_held() == 21
    assert t._volume() > volume                                        # (the checkpoint is counted too)
    assert t.attr_of("/f4") == (info("/f4", 3004, BS).attr, when) and set(t._entries) == {eid(30)}
    t.release(eid(3))
    assert eid(3) not in t._entries
    assert t.hit_whole([eid(n) for n in (6, 7, 8)]) == [True] * 3 and eid(6) not in t._entries  # hits stay cold
    assert not t.needs_check(eid(9)) and eid(9) not in t._entries      # checked in this mount
    copy = t.cold_copy(eid(10))                                        # RAM copies from the record
    assert copy is not None and open(copy[0], "rb").read() == data[10] and eid(10) not in t._entries
    assert all(t.get((eid(n), 0)) == d for n, d in data.items())      # the daemon's reads bring them in
    assert t._restored.files == 0 and len(t._entries) == 21
    check(t)


def test_cooled_files_keep_their_place_in_the_policy_s_order(disk):
    """A cooled file goes as it would have in memory: the ones read longest ago first."""
    t = disk(capacity=2_400_000, policy="lru")                         # room for the 40 and a few more
    for n in range(40):
        put(t, n, bytes([n]) * 50_000)
    assert t.hit_whole([eid(n) for n in range(10)]) == [True] * 10    # the first ten read again: newest
    checkpoint(t)
    assert t._entries == {}
    for n in range(40, 60):                                            # no room: the oldest read go
        assert put(t, n, bytes([n]) * 50_000)
    held = {n for n in range(60) if (eid(n), 0) in t}
    gone = sorted(set(range(40)) - held)
    assert gone and gone == list(range(10, 10 + len(gone)))            # 10, 11, ... in their order
    assert set(range(10)) <= held and set(range(40, 60)) <= held
    assert all(t.get((eid(n), 0)) == bytes([n]) * 50_000 for n in held)
    check(t)


def test_files_fetched_ahead_leave_memory_too_and_their_first_read_is_no_reuse(disk):
    """Read-ahead's files not read yet are cooled as well (directory read-ahead can outrun a
    shuffled epoch: half its files were waiting at the checkpoint, and stayed in memory).
    Each one's first read counts no reuse, whether it stays cold or is brought in, as in
    memory; a file read before counts its reuse as ever."""
    t = disk()
    for n in range(10):
        put(t, n, os.urandom(3000 + n), evict=False)                    # fetched ahead
    put(t, 10, os.urandom(3000))                                       # read (stored by a read)
    assert len(t.policy._unread) == 10
    checkpoint(t)
    assert t._entries == {} and not t.policy._unread and sum(t._restored.fresh) == 10
    for _ in range(200):                                               # accesses between: far apart
        t.policy.miss()
    seen = t.policy._hits_seen
    assert t.hit_whole([eid(n) for n in range(5)]) == [True] * 5       # first reads, left cold
    assert t.policy._hits_seen == seen and t._entries == {} and sum(t._restored.fresh) == 5
    assert t.policy._held((eid(7), 0)) and (eid(7), 0) in t.policy._unread  # brought in: unread still
    t.policy.hit((eid(7), 0))
    assert t.policy._hits_seen == seen and (eid(7), 0) not in t.policy._unread
    assert t.hit_whole([eid(10)]) == [True] and t.policy._hits_seen == seen + 1  # a reuse
    check(t)


def test_cooled_files_outlast_a_clean_stop_a_crash_and_a_compaction(disk):
    """A clean stop writes the cooled records into its table (with a confirmed file's new
    time); a crash leaves the index's lines, which a compaction during the run rewrote from
    the records."""
    t = disk()
    data = {n: os.urandom(5000 + n) for n in range(12)}
    for n, d in data.items():
        put(t, n, d)
    checkpoint(t)
    assert t._entries == {}
    assert t.confirm("/f2")[0] == eid(2)  # type: ignore[index]
    when = t.attr_of("/f2")[1]
    t.close()
    t2 = disk()
    assert len(t2) == 12 and t2.attr_of("/f2")[1] == when
    assert all(t2.get((eid(n), 0)) == d for n, d in data.items())
    t2.close()
    for name in os.listdir(t2.directory):                             # a fresh tier: a first mount
        if name.startswith(("entries-", "index")):
            os.unlink(os.path.join(t2.directory, name))
    t3 = disk()
    assert len(t3) == 0
    for n, d in data.items():
        put(t3, n, d)
    checkpoint(t3)
    put(t3, 40, b"new" * 1000)
    t3._compact()                                                      # the index from the records
    kill(t3)
    t4 = disk()
    assert len(t4) == 13 and tables(t4) == []                          # (the checkpoint: removed)
    assert all(t4.get((eid(n), 0)) == d for n, d in data.items()) and t4.get((eid(40), 0)) == b"new" * 1000
    check(t4)


def test_a_next_checkpoint_keeps_the_cooled_records_cold_and_cools_the_new_files(disk):
    """The next generation has the cooled records in their numbers: the cold set is its
    own, the files stored since join it, and the table before is closed only once no
    serving process maps it (a reader of the cold set may hold it till then)."""
    stats = Stats()
    t = disk(stats=stats)
    data = {n: os.urandom(4000 + n) for n in range(16)}
    for n in range(10):
        put(t, n, data[n])
    checkpoint(t)
    r = t._restored
    numbers = {n: t.table_find(eid=eid(n)) for n in range(10)}
    for n in range(10, 16):
        put(t, n, data[n])
    assert t.put((eid(99), 0), b"v2" * 2000, EntryInfo("/f2", ATTR._replace(size=4000, mtime_ns=5), BS))
    assert t.attr_of("/f2")[0].size == 4000                            # the newest version, not the record's
    assert checkpoint(t) == 17
    assert t._restored is r and r.table is t._checkpoint and stats.get("disk.cooled_files") == 10 + 7
    assert t._entries == {} and r.files == 17
    assert {n: t.table_find(eid=eid(n)) for n in range(10)} == numbers
    assert t.attr_of("/f2")[0].size == 4000 and t.get((eid(99), 0)) == b"v2" * 2000
    old, = t._retired_tables
    assert old.row(0) is not None                                      # still open
    t.checkpoint_released()
    assert t._retired_tables == []
    assert all(t.get((eid(n), 0)) == d for n, d in data.items())
    check(t)


def test_a_file_being_cooled_is_held_to_a_reader_asking_meanwhile(disk):
    """Whether a block is held is asked without the tier's lock: a file taken out of the
    policy's entries and not yet a cold record (cooling, in a batch under the lock) is
    waited for, not missed."""
    t = disk()
    put(t, 1, b"x" * 3000)
    checkpoint(t)
    r, n = t._restored, t.table_find(eid=eid(1))
    assert r.cold(n) and eid(1) not in t._entries
    answers = []
    with t._lock:  # as _cool has it: out of the policy's entries, the record not cold yet
        r.state[n] = WARM
        asking = threading.Thread(target=lambda: answers.append((eid(1), 0) in t.policy))
        asking.start()
        asking.join(0.3)
        assert asking.is_alive()                                       # waits for the lock
        r.state[n] = TRUSTED                                           # cooled
    asking.join(5)
    assert answers == [True]


def test_cooling_gives_back_the_tables_of_the_entries_it_emptied(disk):
    """A dict keeps its table's size as its keys go: the tier's entries, its paths and the
    policy's order are rebuilt after cooling (at 200,000 files, ~35 MB given back)."""
    t = disk(capacity=64 << 20)
    for n in range(3000):
        put(t, n, b"x" * 100)

    def tables_size() -> int:
        return sys.getsizeof(t._entries) + sys.getsizeof(t._paths) + sys.getsizeof(t.policy._entries)

    before = tables_size()
    checkpoint(t)
    assert t._entries == {} and t._paths == {} and len(t.policy) == 3000
    assert tables_size() < before / 20
    assert t.get((eid(2999), 0)) == b"x" * 100
    check(t)
