"""The prefetch executor, driven by step() in the test's thread: no threads, no clock."""

import sys

from cachefs.blockpath import Guesses
from cachefs.prefetch import DIR, READAHEAD, WARM, Prefetcher
from cachefs.stats import Stats
from tests.helpers import run_until_idle


def test_best_priority_first_then_feeders_in_priority_order():
    p = Prefetcher(workers=0)
    ran = []
    warm_items = iter(["w1", "w2"])
    dir_items = iter(["d1"])
    p.add_feeder(WARM, lambda: (lambda x: (x, lambda: ran.append(x)) if x else None)(next(warm_items, None)))
    p.add_feeder(DIR, lambda: (lambda x: (x, lambda: ran.append(x)) if x else None)(next(dir_items, None)))
    p.submit("r1", lambda: ran.append("r1"), READAHEAD)
    p.submit("r2", lambda: ran.append("r2"), READAHEAD)
    assert run_until_idle(p) == 5
    assert ran == ["r1", "r2", "d1", "w1", "w2"]


def test_a_queued_key_runs_once_and_a_better_priority_wins():
    p = Prefetcher(workers=0)
    ran = []
    assert p.submit("k", lambda: ran.append("warm"), WARM)
    assert not p.submit("k", lambda: ran.append("again"), WARM)       # de-duplicated
    assert p.submit("k", lambda: ran.append("readahead"), READAHEAD)  # upgraded
    p.submit("other", lambda: ran.append("other"), DIR)
    run_until_idle(p)
    assert ran == ["readahead", "other"]


def test_full_queue_drops_guesses_and_counts_them():
    p = Prefetcher(workers=0, max_queued=2)
    assert p.submit(1, lambda: None, READAHEAD) and p.submit(2, lambda: None, READAHEAD)
    assert not p.submit(3, lambda: None, READAHEAD)
    assert p._stats.get("prefetch.dropped") == 1


def test_a_failing_task_is_counted_and_the_executor_goes_on():
    p = Prefetcher(workers=0)
    ran = []
    p.submit("bad", lambda: 1 / 0, READAHEAD)
    p.submit("good", lambda: ran.append(1), READAHEAD)
    assert run_until_idle(p) == 2 and ran == [1]
    assert p._stats.get("prefetch.errors") == 1


def test_a_broken_feeder_is_removed():
    p = Prefetcher(workers=0)

    def broken():
        raise RuntimeError("boom")

    p.add_feeder(DIR, broken)
    assert run_until_idle(p) == 0
    assert p._feeders == []


def test_threads_run_submitted_work_and_stop():
    import threading

    p = Prefetcher(workers=3)
    p.start()
    done = threading.Event()
    p.submit("x", done.set, READAHEAD)
    assert done.wait(5)
    p.stop()
    assert all(not t.is_alive() for t in p._threads)


def test_guesses_count_uses_and_give_their_table_back_as_they_drain():
    """Blocks fetched ahead count a use once (or a waste); once nearly all were read, the
    set's table is rebuilt (a set keeps its size as keys go: a cold epoch's read-ahead had
    left 4 MB of it for the rest of the mount)."""
    stats = Stats()
    g = Guesses(stats)
    keys = [(i.to_bytes(16, "big"), 0) for i in range(20_000)]
    for k in keys:
        g.add(k)
    full = sys.getsizeof(g._keys)
    for k in keys[:-10]:
        g.used(k)
    g.used(keys[0])                                                    # counted once
    g.lost(keys[-1])
    assert stats.get("prefetch.used") == 19_990 and stats.get("prefetch.wasted") == 1
    assert len(g._keys) == 9 and keys[-2] in g and keys[-1] not in g and g
    assert sys.getsizeof(g._keys) * 50 < full
