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
    _unpublished: queue.SimpleQueue[tuple[int, bool]]  # (node, forgotten) to take back
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
        with contextlib.nullcontext() if new else self._node_lock(nodeid):
            with self._opens_lock:
                taken = nodeid in self._opens
                if not taken:
                    self._opens[nodeid] = state
            if taken:
                self._backings.put(eid)
                return
            self._table.publish(nodeid, backing_id)
            self._published[eid] = nodeid

    def _dropped(self, eid: bytes) -> None:
        """A tier dropped an entry: a node published with its file is taken back from the
        serving processes first, then its backing id is closed (now, or at its last close)."""
        for key in (eid, eid + b"r"):  # see Backings.key
            nodeid = self._published.get(key)
            if nodeid is not None and self._table is not None:
                self._table.unpublish(nodeid)
                self._unpublished.put((nodeid, False))
        if self._backings is not None:
            self._backings.dropped(eid)

    def _reap_loop(self) -> None:
        """Nodes unpublished (forgotten, or their entry dropped): once no serving process can
        still be answering from their old slot (quiesce), their opens counted in the table are
        folded into the main process's count. A forgotten node is then gone and its id free;
        a dropped one lives until its last release, which the serving processes forward."""
        table = self._table
        assert table is not None and self.session is not None
        while True:
            batch = [self._unpublished.get()]
            time.sleep(0.005)  # a batch forget comes as many: one wait for all of them
            while not self._unpublished.empty():
                batch.append(self._unpublished.get())
            if any(nodeid == 0 for nodeid, _ in batch):
                return
            if not table.quiesce(self.session.servers_alive):
                log.warning("a serving process did not finish a request within 5 s")
            for nodeid, forgotten in batch:
                self._take_back(table, nodeid, forgotten)

    def _take_back(self, table: OpenTable, nodeid: int, forgotten: bool) -> None:
        with self._node_lock(nodeid, refusable=False):
            state = self._opens.get(nodeid)
            if state is not None and state.published:
                state.refs += table.take_counts(nodeid)
                state.published = False
                if self._published.get(state.eid) == nodeid:
                    del self._published[state.eid]
            if state is not None and (forgotten or state.refs <= 0):
                with self._opens_lock:
                    del self._opens[nodeid]
            else:
                state = None
        if state is not None:
            self._closed(state)
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
