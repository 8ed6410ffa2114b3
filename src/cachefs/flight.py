"""Single flight: one fetch per missing block, whoever asks for it.

Concurrent readers of one missing block (the kernel's parallel read-ahead, several
DataLoader workers, a guess and a reader) share one NVMe lookup or source fetch: the first
claims the block and runs the fetch, the others wait for its result. A reader that comes
to wait for a block a guess is fetching makes the guess's source request urgent at the
gate (priority inheritance, see cachefs/gate.py).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

from cachefs.gate import SourceGate
from cachefs.identity import BlockKey

Result = Any  # what a fetch hands its waiters: (bytes, tier name) for blocks


class Flights:
    def __init__(self, gate: SourceGate):
        self._gate = gate
        self.inflight: dict[BlockKey, Future[Result]] = {}
        self._lock = threading.Lock()
        # Blocks a reader waits for while a guess fetches them: that guess's source request
        # goes ahead of the gate (see promote), as the reader's own would.
        self._promoted: set[BlockKey] = set()
        self._owned = threading.local()  # .keys: the blocks this thread fetches; .idle_only

    def __contains__(self, key: BlockKey) -> bool:
        return key in self.inflight

    def claim(self, key: BlockKey) -> tuple[Future[Result], bool]:
        """The in-flight fetch of `key`, and whether the caller now owns (must run) it."""
        with self._lock:
            pending = self.inflight.get(key)
            if pending is not None:
                return pending, False
            pending = self.inflight[key] = Future()
            return pending, True

    def run(self, key: BlockKey, pending: Future[Result], fetch: Callable[[], Result]) -> Result:
        """Run the fetch this thread owns and hand its result (or error) to every waiter."""
        try:
            with self.owning(key):
                result = fetch()
            pending.set_result(result)
            return result
        except BaseException as exc:
            pending.set_exception(exc)
            raise
        finally:
            self.end(key)

    def end(self, key: BlockKey, pending: Future[Result] | None = None, result: Result = None) -> None:
        """The owner's fetch of `key` is over (and, with `pending`, its waiters get `result`)."""
        with self._lock:
            del self.inflight[key]
            self._promoted.discard(key)
        if pending is not None:
            pending.set_result(result)

    @contextlib.contextmanager
    def owning(self, *keys: BlockKey) -> Iterator[None]:
        """Around the fetch of blocks this thread owns: a reader that comes to wait for one
        of them makes the fetch's source request urgent (see promote)."""
        before = getattr(self._owned, "keys", ())
        self._owned.keys = keys
        try:
            yield
        finally:
            self._owned.keys = before
            if self._promoted:
                with self._lock:
                    self._promoted.difference_update(keys)

    def promote(self, key: BlockKey) -> None:
        """A reader waits for a block another thread fetches: if that is a guess waiting at
        the gate, it goes now (priority inheritance)."""
        with self._lock:
            if key in self._promoted or key not in self.inflight:
                return
            self._promoted.add(key)
        self._gate.wake()

    def urgent(self) -> Callable[[], bool] | None:
        """For the gate: whether a reader now waits for what this thread fetches."""
        keys = getattr(self._owned, "keys", ())
        if not keys:
            return None
        promoted = self._promoted
        return lambda: any(k in promoted for k in keys)

    @contextlib.contextmanager
    def when_idle(self) -> Iterator[None]:
        """This thread's source requests wait for an idle store (see SourceGate)."""
        self._owned.idle_only = True
        try:
            yield
        finally:
            self._owned.idle_only = False

    @property
    def idle_only(self) -> bool:
        return getattr(self._owned, "idle_only", False)
