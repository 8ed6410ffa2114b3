"""The source guard: every request to the source goes through `SourceGuard.call`.

It counts and times the request (source.<op>), orders it at the gate (a reader's request
first, guesses wait for room: cachefs/gate.py), bounds it with --source-timeout (the
request runs on a thread of its own, so a hung store holds that thread, not the reader's),
and tells a source that stopped answering from one that answered with an error (the errno
table in cachefs/errors.py). While the source is down, requests fail at once with
ETIMEDOUT, one probe per SOURCE_RETRY seconds going through.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from cachefs.config import SOURCE_DOWN_AFTER, SOURCE_RETRY, SOURCE_THREADS
from cachefs.errors import NotSent, source_failure
from cachefs.flight import Flights
from cachefs.gate import SourceGate
from cachefs.hooks import KernelHooks
from cachefs.prefetch import THREAD_PREFIX as PREFETCH_THREAD
from cachefs.stats import Stats

log = logging.getLogger(__name__)


def _subject(args: tuple[Any, ...]) -> str:
    """The path a source request is about, for messages."""
    return str(getattr(args[0], "path", args[0])) if args else ""


def _size_of(kind: str, args: tuple[Any, ...]) -> int:
    """The bytes a source request asks for, where its arguments say (see SourceGate)."""
    if kind == "read_range":
        return int(args[2])
    if kind in ("fill", "fill_for_reader") and args[2] is not None:
        return int(args[2].size)
    return 0


def in_prefetch_thread() -> bool:
    """Whether this thread is one of the prefetch pool's (its requests are guesses)."""
    return threading.current_thread().name.startswith(PREFETCH_THREAD)


class SourceGuard:
    def __init__(self, stats: Stats, gate: SourceGate, flights: Flights, hooks: KernelHooks,
                 timeout: float = 0.0):
        self._stats = stats
        self.gate = gate
        self._flights = flights
        self._hooks = hooks
        self.timeout = timeout
        self._pool = (ThreadPoolExecutor(SOURCE_THREADS, thread_name_prefix="cachefs-source")
                      if timeout > 0 else None)
        self._down_since: float | None = None  # when the source stopped answering (monotonic)
        self._next_probe = 0.0
        self._unanswered = 0  # requests in a row that got no answer
        self._lock = threading.Lock()
        stats.gauge("source.down", lambda: int(self._down_since is not None))

    @property
    def down(self) -> bool:
        """The source stopped answering (SOURCE_DOWN_AFTER requests in a row timed out)."""
        return self._down_since is not None

    def call(self, op: str, fn: Callable[..., Any], *args: Any, bounded: bool = False) -> Any:
        """fn(*args): a request to the source, counted as source.<op> (not if fn raises
        NotSent: its caller asks another way). `bounded`: fn keeps --source-timeout itself
        (a fetch process's request, under its socket's timeout), so it runs on the caller's
        thread."""
        self._stats.incr(f"source.{op}")
        if self._down_since is not None and not self._probe_due():
            self._stats.incr("source.fast_failures")
            raise OSError(errno.ETIMEDOUT, "source not answering (cachefs serves what it has cached)",
                          _subject(args))
        start = time.monotonic()
        kind = fn.__name__
        flights = self._flights
        gate = (self.gate.background(kind, _size_of(kind, args), flights.urgent(), idle_only=flights.idle_only,
                                     weight=len(args[0]) if kind == "fill_many" else 1)
                if in_prefetch_thread() else self.gate.demand(kind, _size_of(kind, args)))
        sent = True
        try:
            with gate:
                result = self._bounded(op, fn, args, bounded)
        except NotSent:
            sent = False
            self._stats.incr(f"source.{op}", -1)
            raise
        except OSError as exc:
            if bounded and exc.errno == errno.ETIMEDOUT:  # its own timeout (see Fetchers.fill)
                self._stats.incr("source.timeouts")
            down, counted = source_failure(exc)
            if down:
                self._no_answer(op, args, exc)
            else:
                self._answered()  # an error about one file is still an answer
            if counted:
                self._stats.incr("source.errors")
            raise
        finally:
            if sent:
                self._stats.observe(f"source.{op}", time.monotonic() - start)
        self._answered()
        return result

    def _bounded(self, op: str, fn: Callable[..., Any], args: tuple[Any, ...], bounded: bool = False) -> Any:
        """fn(*args), given at most --source-timeout: it runs on a thread of its own, so a
        request that hangs holds that thread, not the reader's. The prefetch pool's own
        threads call it directly: nobody waits on them but a reader of the same block, and
        that wait is bounded too (BlockPath.wait); so does a request that is `bounded`
        itself. The hand-off costs a cold epoch about 10%."""
        with self._hooks.blocking():
            if self._pool is None or bounded or in_prefetch_thread():
                return fn(*args)
            future = self._pool.submit(fn, *args)
            try:
                return future.result(self.timeout)
            except FutureTimeout:
                future.cancel()  # still queued (every source thread hung): never run it
                self._stats.incr("source.timeouts")
                raise OSError(errno.ETIMEDOUT, f"source did not answer {op} within {self.timeout:g}s",
                              _subject(args)) from None

    def _probe_due(self) -> bool:
        """While the source is down, one request per SOURCE_RETRY seconds goes through."""
        with self._lock:
            now = time.monotonic()
            if now < self._next_probe:
                return False
            self._next_probe = now + SOURCE_RETRY
            return True

    def _no_answer(self, op: str, args: tuple[Any, ...], exc: OSError) -> None:
        """A request got no answer. SOURCE_DOWN_AFTER of them in a row, with no answer in
        between, and the source counts as down (one hung file does not make it so)."""
        with self._lock:
            self._unanswered += 1
            self._next_probe = time.monotonic() + SOURCE_RETRY
            if self._down_since is not None or self._unanswered < SOURCE_DOWN_AFTER:
                return
            self._down_since = time.monotonic()
        self._stats.incr("source.down_events")
        log.warning("source not answering (%s %s: %s): serving what is cached, failing the rest with "
                    "ETIMEDOUT at once; trying it again every %gs", op, _subject(args), exc.strerror, SOURCE_RETRY)

    def _answered(self) -> None:
        if self._down_since is None and not self._unanswered:
            return
        with self._lock:
            since, self._down_since = self._down_since, None
            self._unanswered = 0
        if since is not None:
            log.warning("source answering again after %.0fs", time.monotonic() - since)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)  # a hung request stays hung
