"""The file system's side of the serving processes (cachefs/fuse/serve.py): which nodes are
published in their table, taking nodes back (forgotten by the kernel, or their entry
dropped by a tier), and their reports counted as the tiers' hits. A mixin of CachefsFS
(cachefs/fs.py), which owns the state it works on."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from cachefs.fuse.serve import OpenTable, decode_report
from cachefs.identity import FileId
from cachefs.nodes import Backings, NodeOpen, Nodes

if TYPE_CHECKING:
    from cachefs.core import Core
    from cachefs.fuse.session import Session

log = logging.getLogger(__name__)


class Published:
    """Nodes published to the serving processes (see design.md, "Serving processes")."""

    core: Core
    nodes: Nodes
    session: Session | None
    _opens: dict[int, NodeOpen]
    _opens_lock: threading.Lock
    _backings: Backings | None
    _table: OpenTable | None
    _published: dict[bytes, int]  # Backings key -> the node published with it
    # (node, its state, forgotten) to take back, or (0, None, False, key) for a dropped copy
    _unpublished: queue.SimpleQueue[tuple[int, NodeOpen | None, bool, bytes]]
    _node_lock: Callable[..., contextlib.AbstractContextManager[None]]
    _closed: Callable[[NodeOpen], None]

    def _publish_known(self, nodeid: int, fid: FileId, new: bool) -> None:
        """A file looked up whose cached copy has a backing id already (opened in an earlier
        epoch) is published before the kernel hears of the node: its opens and releases
        then never reach this process (the serving processes count them)."""
        assert self._backings is not None and self._table is not None
        eid = self.core.entry_id(fid)
        backing_id = self._backings.hold(eid + b"r")
        if backing_id:
            eid += b"r"
        elif self.core.cache.in_ram(eid):
            return  # promoted since: the open registers the RAM copy
        else:
            backing_id = self._backings.hold(eid)
            if not backing_id:
                return
        if not 0 < nodeid < self._table.capacity:
            self._backings.put(eid)
            return
        state = NodeOpen(fid)
        state.refs, state.backing_id, state.eid, state.published = 0, backing_id, eid, True
        # A new node id needs no node lock: no open can name it before this lookup is
        # answered (another lookup of the same name may: the first state in wins).
        with contextlib.nullcontext() if new else self._node_lock(nodeid, refusable=False):
            with self._opens_lock:
                taken = nodeid in self._opens
                if not taken:
                    self._opens[nodeid] = state
            if taken:
                self._backings.put(eid)
                return
            self._table.publish(nodeid, backing_id)
            self._published[eid] = nodeid
        self._check_doomed(eid)

    def _check_doomed(self, key: bytes) -> None:
        """After a publish: a tier that dropped the copy meanwhile (its _dropped found no
        node yet) gets the node taken back all the same."""
        assert self._backings is not None
        if self._backings.doomed(key):
            self._unpublished.put((0, None, False, key))

    def _dropped(self, eid: bytes) -> None:
        """A tier dropped an entry: the node published with its file is taken back from the
        serving processes (by the reaper: a tier's lock may be held here, and the node's
        lock is taken before the tiers' everywhere else), and its backing id closed at its
        last close. Until then the kernel reads the dropped copy, the same bytes."""
        for key in (eid, eid + b"r"):  # see Backings.key
            if key in self._published:
                self._unpublished.put((0, None, False, key))
        if self._backings is not None:
            self._backings.dropped(eid)

    def _reap_loop(self) -> None:
        """Nodes to take back from the serving processes: forgotten by the kernel (forget
        cleared their slots), or published with a copy a tier dropped (their slots are
        cleared here, if the node still stands for that copy). Once no serving process can
        still be answering from an old slot (quiesce), the opens counted in the table are
        folded into the main process's count. A forgotten node is then gone and its id
        free; a dropped one lives until its last release, which the serving processes
        forward."""
        table = self._table
        assert table is not None and self.session is not None
        while True:
            batch = [self._unpublished.get()]
            time.sleep(0.005)  # a batch forget comes as many: one wait for all of them
            while not self._unpublished.empty():
                batch.append(self._unpublished.get())
            if any(nodeid == 0 and not key for nodeid, _, _, key in batch):
                return
            taken = [(nodeid, state, forgotten) for nodeid, state, forgotten, key in batch
                     if not key and state is not None]
            taken += [found for _, _, _, key in batch if key and (found := self._unpublish_dropped(table, key))]
            if not taken:
                continue
            waited = 0
            while not table.quiesce(self.session.servers_alive):
                waited += 5  # a serving process stopped mid-request: nothing is safe to fold yet
                log.warning("a serving process has not finished a request for %d s", waited)
            for nodeid, state, forgotten in taken:
                try:
                    self._take_back(table, nodeid, state, forgotten)
                except Exception:
                    log.exception("taking node %d back from the serving processes failed", nodeid)

    def _unpublish_dropped(self, table: OpenTable, key: bytes) -> tuple[int, NodeOpen, bool] | None:
        nodeid = self._published.get(key)
        if nodeid is None:
            return None
        with self._node_lock(nodeid, refusable=False):
            state = self._opens.get(nodeid)
            if state is None or not state.published or state.eid != key:
                return None  # forgotten (and maybe given out again) meanwhile
            table.unpublish(nodeid)
            return nodeid, state, False

    def _take_back(self, table: OpenTable, nodeid: int, state: NodeOpen, forgotten: bool) -> None:
        closing = None
        with self._node_lock(nodeid, refusable=False):
            if self._opens.get(nodeid) is state:  # not torn down, nor another node's since
                if state.published:
                    state.refs += table.take_counts(nodeid)
                    state.published = False
                    if self._published.get(state.eid) == nodeid:
                        del self._published[state.eid]
                if forgotten or state.refs <= 0:
                    with self._opens_lock:
                        del self._opens[nodeid]
                    closing = state
            if forgotten:
                table.unpublish(nodeid)
        if closing is not None:
            self._closed(closing)
        if forgotten:
            self.nodes.recycle(nodeid)

    def served(self, report: memoryview) -> None:
        """A serving process's report: its requests counted, and the files it opened counted
        as the tiers' hits (as an open this process answers counts them)."""
        counts, opened = decode_report(report)
        add = {"opens.passthrough": len(opened), "serve.forwarded": counts.pop("forwarded")[0]}
        for kind, (n, micros) in counts.items():
            add[f"fuse.{kind}"] = n
            add[f"fuse.{kind}_us"] = micros
        add["serve.answered"] = sum(n for n, _ in counts.values())
        self.core.stats.add_many(add)
        for nodeid in opened:
            state = self._opens.get(nodeid)
            if state is None:
                continue
            try:
                again, _ = self.core.open_file(state.fid, fill=False)
            except Exception as exc:  # counting only: it never fails a reader
                log.debug("counting an open of %s failed: %s", state.fid.path, exc)
                continue
            if again is not None:
                again.release()
