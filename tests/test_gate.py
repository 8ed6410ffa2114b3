"""The source gate: demand never waits; background requests are bounded while demand is
active, by a limit that follows the demand latency (AIMD), and run freely once it is idle."""

from __future__ import annotations

import threading
import time

from cachefs.gate import SourceGate
from cachefs.stats import Stats
from tests.helpers import FakeClock


def _demand(gate, clock, took, op="read_range", size=128 << 10):
    with gate.demand(op, size):
        clock.advance(took)


def test_idle_means_the_whole_pool_and_demand_means_the_limit():
    clock = FakeClock()
    gate = SourceGate(maximum=16, start=4, idle=0.5, clock=clock)
    assert gate.allowed() == 16
    _demand(gate, clock, 0.002)
    assert gate.allowed() == 8             # a demand request at its floor: doubled (slow start)
    clock.advance(0.6)
    assert gate.allowed() == 16            # idle again


def test_slow_start_doubles_until_the_first_congestion():
    clock = FakeClock()
    gate = SourceGate(maximum=64, start=2, settle=0.0, grow=0.05, clock=clock)
    for expected in (4, 8, 16):
        clock.advance(0.05)
        _demand(gate, clock, 0.002)
        assert gate.limit == expected
    _demand(gate, clock, 0.020)            # congested: halved, and from now on one at a time
    assert gate.limit == 8
    clock.advance(0.05)
    _demand(gate, clock, 0.002)
    assert gate.limit == 9


def test_congested_demand_halves_the_limit_once_per_settle_and_grows_by_one_per_interval():
    clock = FakeClock()
    gate = SourceGate(maximum=16, start=8, settle=0.1, grow=0.1, clock=clock)
    gate._slow_start = False               # (doubling until the first congestion: below)
    _demand(gate, clock, 0.002)            # the floor: 2 ms
    assert gate.limit == 9
    _demand(gate, clock, 0.010)            # 5x the floor: congested
    assert gate.limit == 4
    _demand(gate, clock, 0.010)            # within the settle time: no second cut
    assert gate.limit == 4
    clock.advance(0.2)
    _demand(gate, clock, 0.012)
    assert gate.limit == 2
    for _ in range(3):                     # good, but within one grow interval of the cut
        _demand(gate, clock, 0.002)
    assert gate.limit == 2
    for _ in range(3):
        clock.advance(0.1)
        _demand(gate, clock, 0.002)
    assert gate.limit == 5


def test_floors_are_per_kind_and_size_class():
    clock = FakeClock()
    gate = SourceGate(maximum=64, start=4, grow=0.0, clock=clock)
    _demand(gate, clock, 0.002, size=128 << 10)
    _demand(gate, clock, 0.012, size=1 << 20)     # a first 1 MiB read: its own floor, not congestion
    _demand(gate, clock, 0.002, op="stat", size=0)
    assert gate.limit == 32                       # three doublings, no cut


def test_a_guess_a_reader_waits_for_goes_at_once():
    gate = SourceGate(maximum=4, start=0, idle=10.0)
    with gate.demand("read_range", 4096):
        pass
    gate.limit = 0
    wanted = threading.Event()
    ran = threading.Event()

    def guess():
        with gate.background("read_range", 1 << 20, urgent=wanted.is_set):
            ran.set()

    t = threading.Thread(target=guess)
    t.start()
    assert not ran.wait(0.1)
    wanted.set()
    gate.wake()
    assert ran.wait(1)
    t.join()


def test_the_limit_can_stop_background_which_resumes_when_demand_goes_idle():
    stats = Stats()
    gate = SourceGate(maximum=4, start=1, idle=0.2, settle=0.0, stats=stats)
    with gate.demand("read_range", 4096):
        time.sleep(0.002)
    gate.limit = 0                        # as after two congested demand requests
    gate._last_demand = time.monotonic()
    ran = threading.Event()

    def guess():
        with gate.background("read_range", 1 << 20):
            ran.set()

    t = threading.Thread(target=guess)
    t.start()
    assert not ran.wait(0.1)              # demand active: no room
    assert ran.wait(2)                    # idle for 0.2 s: the pool opens
    t.join()
    assert stats.get("source.background_waits") == 1


def test_background_in_flight_never_exceeds_the_limit_and_demand_never_waits():
    gate = SourceGate(maximum=8, start=2, idle=10.0)
    with gate.demand("read_range", 4096):
        pass                               # demand is active for the next 10 s
    peak = [0]
    now = [0]
    lock = threading.Lock()

    def guess():
        with gate.background("read_range", 1 << 20):
            with lock:
                now[0] += 1
                peak[0] = max(peak[0], now[0])
            time.sleep(0.02)
            with lock:
                now[0] -= 1

    threads = [threading.Thread(target=guess) for _ in range(12)]
    for t in threads:
        t.start()
    started = time.monotonic()
    with gate.demand("read_range", 4096):  # while twelve guesses queue
        assert time.monotonic() - started < 0.05
    for t in threads:
        t.join()
    assert peak[0] <= gate.maximum and peak[0] <= 4


def test_a_reader_of_a_block_a_guess_waits_to_fetch_promotes_it():
    """Through the core: read-ahead of a block is held at the gate (demand is active and
    the limit is 0); a reader that needs that very block waits for the guess, which then
    goes at once instead of after the reader's own misses end."""
    from cachefs.blocks import FileId
    from cachefs.memsource import MemorySource
    from cachefs.prefetch import READAHEAD, Prefetcher
    from tests.helpers import make_core

    source = MemorySource()
    data = bytes(range(256)) * 1024
    source.add_file("/big", data)
    prefetcher = Prefetcher(2)
    core = make_core(source, block_size=64 << 10, prefetcher=prefetcher)
    prefetcher.start()
    try:
        core.gate.limit = 0
        core.gate.idle = 60.0
        with core.gate.demand("read_range", 4096):
            pass                                   # demand is active for a minute
        a = source.stat("/big")
        fid = FileId("/big", a.size, a.mtime_ns, a.ctime_ns)
        prefetcher.submit("guess", lambda: core.prefetch_block(fid, 2), READAHEAD)
        deadline = time.monotonic() + 5
        while not core.flights.inflight:                 # the guess owns the block, held at the gate
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert source.calls["read_range"] == 0
        started = time.monotonic()
        assert core.read("/big", 2 * (64 << 10), 100) == data[2 * (64 << 10):2 * (64 << 10) + 100]
        assert time.monotonic() - started < 2     # not the minute until demand is idle
        assert source.calls["read_range"] == 1    # the guess's fetch, shared
    finally:
        core.close()


def test_a_batch_counts_as_its_files_and_readers_in_flight_take_their_places_first():
    clock = FakeClock()
    gate = SourceGate(maximum=16, start=16, idle=0.5, clock=clock)
    with gate.demand("stat"):
        assert gate.allowed() == 15           # one reader's request in flight: 15 left
        with gate.demand("stat"):
            assert gate.allowed() == 14
    clock.advance(0.1)
    assert gate.allowed() == 16               # the limit, demand recent but none in flight
    with gate.background("fill_many", weight=12):
        assert gate._background == 12
        ran = []

        def second():
            with gate.background("fill_many", weight=12):
                ran.append(1)

        t = threading.Thread(target=second)
        t.start()
        t.join(0.2)
        assert not ran                        # 12 + 12 > 16: waits
    t.join(2)
    assert ran == [1] and gate._background == 0
    with gate.background("fill_many", weight=40):   # alone, a batch larger than the limit goes
        assert gate._background == 40


def _queue_guesses(gate, weights, order, go=None):
    """Start a guess per weight, one at a time, each queued at the gate before the next
    starts; each appends its index to `order` when let in, then waits for `go` if given."""
    threads = []
    for i, weight in enumerate(weights):
        def guess(i=i, weight=weight):
            with gate.background("fill_many", weight=weight):
                order.append(i)
                if go is not None:
                    go.wait(10)
        t = threading.Thread(target=guess, daemon=True)
        t.start()
        threads.append(t)
        deadline = time.monotonic() + 5
        while len(gate._waiters) < i + 1:
            assert time.monotonic() < deadline and t.is_alive()
            time.sleep(0.001)
    return threads


def test_a_guess_s_end_lets_in_the_waiting_guesses_that_fit_in_the_order_they_came():
    """Each waiting guess is woken alone, once it fits: not every waiter at each end to
    look for itself (a herd of wake-ups per fetch), and in the order they came."""
    clock = FakeClock()
    gate = SourceGate(maximum=16, start=2, idle=60.0, clock=clock)
    with gate.demand("stat"):
        pass                                   # demand is recent: the limit holds
    gate.limit = 1
    order = []
    first = gate.background("fill", weight=1)
    first.__enter__()
    threads = _queue_guesses(gate, [1] * 10, order)
    assert order == [] and gate._background == 1
    first.__exit__(None, None, None)           # room for one: each ends and lets the next in
    for t in threads:
        t.join(5)
    assert order == list(range(10))
    assert gate._background == 0 and gate._waiters == []


def test_only_the_guesses_that_fit_are_woken_and_a_light_one_passes_a_heavy_one():
    clock = FakeClock()
    gate = SourceGate(maximum=16, start=4, idle=60.0, clock=clock)
    with gate.demand("stat"):
        pass                                   # demand is recent: the limit holds
    gate.limit = 4
    held = [gate.background("fill", weight=1) for _ in range(4)]
    for h in held:
        h.__enter__()
    order, go = [], threading.Event()
    threads = _queue_guesses(gate, [4, 1, 1, 1], order, go)
    held.pop().__exit__(None, None, None)      # room for one: the first light guess only
    deadline = time.monotonic() + 5
    while not order:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    time.sleep(0.05)
    assert order == [1] and gate._background == 4
    assert [w.weight for w in gate._waiters] == [4, 1, 1]
    assert all(w.lock.locked() for w in gate._waiters)  # none of them woken
    go.set()
    for h in held:
        h.__exit__(None, None, None)
    for t in threads:
        t.join(5)
    assert sorted(order) == [0, 1, 2, 3] and gate._background == 0 and gate._waiters == []
