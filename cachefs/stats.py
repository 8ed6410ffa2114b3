"""One stats object: counters and gauges, read as a snapshot of plain data.

Every component increments named counters ("ram.hits", "source.bytes") and registers
gauges (a callable read at snapshot time, for occupancy and capacity). The CLI, the tests
and later a Prometheus endpoint all read `snapshot()`; nothing else is exported.
"""

from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

# Version of the snapshot's layout, shown as "schema" in `cachefs stats --json`.
SCHEMA_VERSION = 1


class Stats:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._lock = threading.Lock()
        self._counters: dict[str, int] = defaultdict(int)
        self._gauges: dict[str, Callable[[], Any]] = {}
        self._info: dict[str, Any] = {}
        self._clock = clock
        self._started = clock()

    def incr(self, name: str, n: int = 1) -> None:
        # A lock, not a bare +=: the daemon is multithreaded and a lost increment would
        # make the exact-count tests (and users' dashboards) lie.
        with self._lock:
            self._counters[name] += n

    def add_many(self, pairs: dict[str, int]) -> None:
        with self._lock:
            for name, n in pairs.items():
                self._counters[name] += n

    def get(self, name: str) -> int:
        with self._lock:
            return self._counters.get(name, 0)

    def gauge(self, name: str, fn: Callable[[], Any]) -> None:
        self._gauges[name] = fn

    def set_info(self, **info: Any) -> None:
        self._info.update(info)

    def snapshot(self) -> dict[str, Any]:
        """Plain nested data: {"schema", "info", "uptime_s", <section>: {<name>: value}}."""
        with self._lock:
            flat: dict[str, Any] = dict(self._counters)
        for name, fn in self._gauges.items():
            try:
                flat[name] = fn()
            except Exception:  # a gauge must never break stats
                flat[name] = None
        out: dict[str, Any] = {
            "schema": SCHEMA_VERSION,
            "info": dict(self._info, pid=os.getpid()),
            "uptime_s": round(self._clock() - self._started, 3),
        }
        for name, value in sorted(flat.items()):
            section, _, key = name.partition(".")
            out.setdefault(section, {})[key] = value
        return out
