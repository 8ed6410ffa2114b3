"""Demand first at the source: a reader's miss never queues behind read-ahead.

Every request to the source is either *demand* (a reader is waiting for it: a miss, a
lookup, a listing) or *background* (read-ahead, warming, hinted fetches, whole-block fills
of randomly read blocks, attributes fetched ahead). The store serves them all on one
link, in the order they arrive: sixteen read-ahead fetches in flight put a reader's miss
behind sixteen transfers (measured: source reads at p50 37 ms against a 2.4 ms round trip
at a job's start). The gate bounds the background requests in flight:

- while no demand request has been seen for `idle` seconds, up to `maximum` (the prefetch
  pool's size): an idle job's read-ahead and `cachefs warm` run at full speed;
- while demand is active, up to the pool's size less the readers' requests in flight, and
  at most `limit`, which adapts as TCP's congestion window does
  (additive increase, multiplicative decrease) to the demand latency: while demand
  requests take no longer than CONGESTED x the lowest latency seen lately for requests of
  their kind and size (plus SLACK), the limit doubles every `grow` seconds until the first
  congestion, and grows by one every `grow` seconds after that; a demand request that took
  longer halves the limit, at most once per `settle` seconds. It starts at `start`; it
  may fall to 0, which stops background requests while demand suffers, until demand
  latency is back at its floor. The thresholds are loose (3x, 3 ms) because on a busy
  machine the CPU, not the store, adds the first milliseconds: measured on 2 cores,
  2x and 1 ms cut a cold epoch's throughput by 20%, 3x and 3 ms by 13%.
- a fetch process's batch counts as each of its files (16 files fetched at once weigh as
  16 requests: counted as one, eight batches were 128 files of work for the daemon while
  the job's first misses waited);
- the weakest guesses (`idle_only`: the whole-block fill of a block a random reader
  missed twice) wait for demand to be idle;
- a guess a reader has come to wait for (the block it fetches is the one the reader
  needs: a database paging through a block read ahead) goes at once: the reader's
  priority is inherited (`urgent`).

The floors are kept per (operation, size class), from every request, background ones
included: the lowest latency seen, creeping up 5% a second, so that a store that became
slower for good sets a new floor. Background requests wait for room; demand requests
never wait here. Counters: `source.background_waits` (background requests that waited for
room) and the gauge `source.background_limit`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator

from cachefs.config import CONGESTED, FLOOR_CREEP, SLACK
from cachefs.stats import Stats


class SourceGate:
    def __init__(self, maximum: int = 16, start: int = 8, idle: float = 0.5, settle: float = 0.1,
                 grow: float = 0.05, stats: Stats | None = None, clock: Callable[[], float] = time.monotonic):
        self.maximum = max(1, maximum)
        self.limit = min(start, self.maximum)
        self.idle = idle
        self.settle = settle
        self.grow = grow
        self._clock = clock
        self._stats = stats
        self._lock = threading.Lock()
        self._waiters: list[_Waiter] = []  # guesses waiting for room, in the order they came
        self._background = 0
        self._demand = 0
        self._last_demand = -1e18
        self._last_cut = -1e18
        self._last_grow = -1e18
        self._slow_start = True
        self._floors: dict[tuple[str, int], tuple[float, float]] = {}  # kind -> (floor, when)
        if stats is not None:
            stats.gauge("source.background_limit", self.allowed)

    # -- the two kinds of request ----------------------------------------------------------

    @contextlib.contextmanager
    def demand(self, op: str, size: int = 0) -> Iterator[None]:
        """Around a request a reader waits for: never waits, and its latency steers the limit."""
        with self._lock:
            self._demand += 1
        with self._timed(op, size, demand=True):
            yield

    @contextlib.contextmanager
    def background(self, op: str, size: int = 0, urgent: Callable[[], bool] | None = None,
                   idle_only: bool = False, weight: int = 1) -> Iterator[None]:
        """Around a guess: waits until the limit has room for it, or until `urgent()` says
        a reader now waits for it (then it goes at once: see wake()). `idle_only`: the
        weakest guesses, which wait for demand to be idle whatever the limit. `weight`:
        the files one request fetches (a fetch process's batch counts as each of its
        files); one request goes whatever its weight when none is in flight."""
        waiter = None
        with self._lock:
            if _fits(self._background, weight, self._allowed(idle_only)) or (urgent and urgent()):
                self._background += weight
            else:
                if self._stats is not None:
                    self._stats.incr("source.background_waits")
                waiter = _Waiter(weight, idle_only, urgent)
                self._waiters.append(waiter)
                wait = self._wait_time()
        if waiter is not None:
            # Let in by _let_in (which counted it in flight), or a timeout: demand going
            # idle is seen by the timeout (at most `idle` late), so that the end of each
            # reader's request does not look at every waiting guess.
            while not waiter.lock.acquire(timeout=wait):
                with self._lock:
                    self._let_in(urgent=True)
                    if not waiter.waiting:
                        break
                    wait = self._wait_time()
        with self._timed(op, size, demand=False, weight=weight):
            yield

    @contextlib.contextmanager
    def _timed(self, op: str, size: int, demand: bool, weight: int = 1) -> Iterator[None]:
        """Around one request already counted in flight: its latency feeds its kind's floor
        (and, for demand, the limit) unless it failed; then it leaves the count."""
        start = self._clock()
        ok = False
        try:
            yield
            ok = True
        finally:
            took = self._clock() - start
            with self._lock:
                floor = self._floor((op, _size_class(size)), took) if ok else 0.0
                if not demand:
                    self._background -= weight
                else:
                    self._demand -= 1
                    self._last_demand = self._clock()
                    if ok:
                        self._steer(floor, took)
                self._let_in()  # room grew (a guess less, a reader's place, the limit)

    def wake(self) -> None:
        """Something a waiting guess's urgent() reads has changed."""
        with self._lock:
            self._let_in(urgent=True)

    def _wait_time(self) -> float:
        left = self.idle - (self._clock() - self._last_demand)
        return left if self._demand == 0 and left > 0 else self.idle

    def _let_in(self, urgent: bool = False) -> None:
        """Let in, in the order they came, the waiting guesses that fit now (lock held):
        each is counted in flight here and woken alone. A guess's end used to wake every
        waiting guess to look for itself (`notify_all`), and at a million files, with
        sixteen read-ahead workers mostly waiting while the job's misses were demand,
        those wake-ups were 13-15% of the daemon's interpreter time. `urgent`: ask each waiter's urgent()
        too (after wake(), or a timeout; a guess turned urgent is let in by the wake()
        that says so)."""
        if not self._waiters:
            return
        allowed = self._allowed()
        if not urgent and self._background >= allowed:
            return  # the common case: no room (idle_only guesses are allowed no more)
        allowed_idle = self._allowed(True)
        left = []
        for waiter in self._waiters:
            if (_fits(self._background, waiter.weight, allowed_idle if waiter.idle_only else allowed)
                    or (urgent and waiter.urgent is not None and waiter.urgent())):
                self._background += waiter.weight
                waiter.waiting = False
                waiter.lock.release()
            else:
                left.append(waiter)
        self._waiters = left

    # -- the limit -------------------------------------------------------------------------

    def allowed(self) -> int:
        """Background requests allowed in flight now."""
        with self._lock:
            return self._allowed()

    def _allowed(self, idle_only: bool = False) -> int:
        if self._demand == 0 and self._clock() - self._last_demand >= self.idle:
            return self.maximum
        if idle_only:
            return 0
        # the readers' requests in flight take their places first
        return min(self.limit, max(1, self.maximum - self._demand))

    def _floor(self, kind: tuple[str, int], took: float) -> float:
        """The floor of `kind` after this sample (lock held)."""
        now = self._clock()
        floor, when = self._floors.get(kind, (took, now))
        floor = min(took, floor * (1 + FLOOR_CREEP * max(0.0, now - when)))
        self._floors[kind] = (floor, now)
        return floor

    def _steer(self, floor: float, took: float) -> None:
        now = self._clock()
        if took > CONGESTED * floor + SLACK:
            if now - self._last_cut >= self.settle:
                self._last_cut = self._last_grow = now
                self._slow_start = False
                self.limit //= 2
        elif self.limit < self.maximum and now - self._last_grow >= self.grow:
            self._last_grow = now
            # slow start (doubling) until the first sign of congestion, then one at a time
            self.limit = min(self.maximum, self.limit * 2 if self._slow_start else self.limit + 1)


class _Waiter:
    """A guess at the gate: what it needs, and a lock held until it is let in."""

    __slots__ = ("weight", "idle_only", "urgent", "lock", "waiting")

    def __init__(self, weight: int, idle_only: bool, urgent: Callable[[], bool] | None):
        self.weight, self.idle_only, self.urgent = weight, idle_only, urgent
        self.lock = threading.Lock()
        self.lock.acquire()
        self.waiting = True


def _fits(background: int, weight: int, allowed: int) -> bool:
    """Whether a guess of `weight` fits beside `background` in flight: one goes whatever its
    weight when none is in flight."""
    return background + weight <= allowed or (background == 0 and allowed > 0)


def _size_class(size: int) -> int:
    """Sizes within a factor of two share a class (4 KiB and below are one)."""
    return max(0, size.bit_length() - 12)
