"""Serving processes (cachefs/fuse/serve.py) without a mount: the shared open table, and a
serving loop against a fake kernel (a SOCK_SEQPACKET socket pair delivers one message per
read, as /dev/fuse does). The real thing, several processes on one mount, is in
tests/fuse/test_serve_mount.py."""

from __future__ import annotations

import contextlib
import errno
import functools
import io
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import NamedTuple
from unittest import mock

import pytest

from cachefs.checkpointing import checkpoint_due
from cachefs.config import CHECKPOINT_GROWING, CHECKPOINT_MIN_FILES
from cachefs.fuse import protocol as p
from cachefs.fuse.serve import (
    MAIN_CHECK,
    MAX_FORWARDED,
    OWN_FH,
    REPORT,
    REPORT_EVERY,
    Server,
    decode_report,
)
from cachefs.fuse.servetable import ANSWERED, MAPPED, ServeTable
from cachefs.nodes import Backings, Nodes

O_RDONLY = os.O_RDONLY


@pytest.fixture
def table():
    t = ServeTable.create(capacity=1024, processes=2)
    yield t
    t.close()


def test_published_nodes_and_open_counts(table):
    assert table.publish(5, 7)
    assert not table.publish(1024, 7) and not table.publish(0, 7)  # beyond the table: the main process's
    other = ServeTable.attach(os.dup(table.fd))  # another process's view of the same memory
    try:
        assert other.slots[5] == 7 and other.capacity == 1024 and other.processes == 2
        other.counts(0)[5] += 2
        other.counts(1)[5] -= 1  # a release read by another process than its open
    finally:
        other.close()
    table.unpublish(5)
    assert table.slots[5] == 0
    assert table.quiesce([True, True])
    assert table.take_counts(5) == 1
    assert table.take_counts(5) == 0  # zeroed: the id may be given out again


def test_quiesce_waits_for_a_request_in_progress(table):
    step = 64 // 8
    table.busy[1 * step] = 3  # process 1 is answering a request
    assert not table.quiesce([True, True], timeout=0.05)
    assert table.quiesce([True, False], timeout=0.05)  # a dead process is not waited for
    threading.Timer(0.05, lambda: table.busy.__setitem__(step, 4)).start()
    assert table.quiesce([True, True], timeout=5)


class FakeKernel:
    """A serving process's view of /dev/fuse, and the main process's forward socket."""

    def __init__(self, table: ServeTable, **server: object):
        self.kernel, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.main, fwd = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.server = Server(0, theirs.fileno(), table, fwd, 1 << 16, **server)  # type: ignore[arg-type]
        self._keep = (theirs, fwd)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.result: list[int] = []
        self.unique = 0
        self.thread.start()

    def _run(self) -> None:
        self.result.append(self.server.run())

    def send(self, opcode: int, nodeid: int, payload: bytes = b"") -> int:
        self.unique += 1
        size = p.IN_HEADER.size + len(payload)
        self.kernel.send(p.IN_HEADER.pack(size, opcode, self.unique, nodeid, 0, 0, 4242, 0, 0) + payload)
        return self.unique

    def reply(self) -> tuple[int, int, bytes]:
        self.kernel.settimeout(5)
        data = self.kernel.recv(1 << 16)
        length, error, unique = p.OUT_HEADER.unpack_from(data)
        assert length == len(data)
        return unique, error, data[p.OUT_HEADER.size:]

    def forwarded(self) -> bytes:
        self.main.settimeout(5)
        return self.main.recv(1 << 16)

    def close(self) -> None:
        self.kernel.close()
        self.thread.join(5)
        for s in self._keep:
            s.close()


def open_in(flags: int) -> bytes:
    return p.OPEN_IN.pack(flags, 0)


def release_in(fh: int) -> bytes:
    return p.RELEASE_IN.pack(fh, 0, 0, 0)


def test_a_serving_process_answers_published_nodes_and_forwards_the_rest(table):
    table.publish(5, 9)
    k = FakeKernel(table)
    try:
        u = k.send(p.IOCTL, 5, b"\0" * 32)
        assert k.reply() == (u, -errno.ENOTTY, b"")
        u = k.send(p.OPEN, 5, open_in(O_RDONLY))
        unique, error, out = k.reply()
        assert (unique, error) == (u, 0)
        assert p.OPEN_OUT.unpack(out) == (OWN_FH | 5, p.FOPEN_PASSTHROUGH | p.FOPEN_NOFLUSH, 9)
        assert table.counts(0)[5] == 1
        u = k.send(p.OPEN, 5, open_in(os.O_WRONLY))
        assert k.reply() == (u, -errno.EROFS, b"")
        assert table.counts(0)[5] == 1
        u = k.send(p.MKDIR, 1, b"\0" * 8 + b"new\0")
        assert k.reply() == (u, -errno.EROFS, b"")
        # not published: the request goes to the main process as it was read
        k.send(p.OPEN, 6, open_in(O_RDONLY))
        message = k.forwarded()
        assert message[:4] == (0).to_bytes(4, "little")
        assert p.IN_HEADER.unpack_from(message, 4)[:4] == (p.IN_HEADER.size + 8, p.OPEN, k.unique, 6)
        # a release of a handle the main process gave out (no OWN_FH) is the main process's too
        k.send(p.RELEASE, 5, release_in(77))
        assert p.IN_HEADER.unpack_from(k.forwarded(), 4)[1] == p.RELEASE
        u = k.send(p.RELEASE, 5, release_in(OWN_FH | 5))
        assert k.reply() == (u, 0, b"")
        assert table.counts(0)[5] == 0
        k.send(p.LOOKUP, 1, b"name\0")
        assert p.IN_HEADER.unpack_from(k.forwarded(), 4)[1] == p.LOOKUP
        # idle now: what it answered is reported
        report = k.forwarded()
        assert report[:4] == REPORT.to_bytes(4, "little")
        counts, opened = decode_report(memoryview(report)[4:])
        answered = {kind: n for kind, (n, _) in counts.items() if n}
        assert answered == {"open": 2, "release": 1, "other": 2, "forwarded": 3}
        assert list(opened) == [5]
    finally:
        k.close()
    assert k.result == [0]


def entry_for(nodeid: int, size: int) -> bytes:
    return p.pack_entry_of(nodeid, 1000 + nodeid, 0o100444, 1, 0, 0, size, 0, 0, 0, 1, 0, (3600, 0))


def test_published_names_are_found_by_parent_and_name_until_their_deadline(table):
    far = time.monotonic_ns() + 10**12
    assert table.publish_name(5, 1, b"a.jpg", entry_for(5, 10), far)
    assert table.publish_name(6, 2, b"a.jpg", entry_for(6, 20), far)  # the same name in another directory
    assert not table.publish_name(7, 1, b"x" * 200, entry_for(7, 1), far)  # too long: the main process's
    assert not table.publish_name(1024, 1, b"b", entry_for(1024, 1), far)  # beyond the table
    now = time.monotonic_ns()
    assert table.entry(1, b"a.jpg", now) == (5, entry_for(5, 10))
    assert table.entry(2, b"a.jpg", now) == (6, entry_for(6, 20))
    assert table.entry(3, b"a.jpg", now) is None and table.entry(1, b"b.jpg", now) is None
    assert table.entry(1, b"a.jpg", far + 1) is None  # due for a check: the main process answers
    assert table.find(1, b"a.jpg") == 5 and table.find(3, b"a.jpg") is None  # whatever the deadline
    assert table.has_name(5) and not table.has_name(7)
    assert table.named(5) == entry_for(5, 10)
    table.unpublish_name(5)
    assert table.entry(1, b"a.jpg", now) is None and table.named(5) is None
    assert table.entry(2, b"a.jpg", now) == (6, entry_for(6, 20))
    # the name published again (another version: another node), reusing the tombstone
    assert table.publish_name(8, 1, b"a.jpg", entry_for(8, 11), far)
    assert table.entry(1, b"a.jpg", now) == (8, entry_for(8, 11))
    # a record being written is a miss, not a torn answer
    table.records[8 * 256] += 1
    assert table.entry(1, b"a.jpg", now) is None and table.named(8) is None
    table.records[8 * 256] += 1
    assert table.entry(1, b"a.jpg", now) == (8, entry_for(8, 11))


def test_names_survive_many_publishes_and_unpublishes_in_a_small_table():
    """Linear probing with backward-shift deletion: after any sequence of publishes and
    unpublishes (random, in a table of 32 buckets), every live name is found, no other
    is, and the buckets hold exactly the live names."""
    rng = random.Random(3)
    t = ServeTable.create(capacity=4096, processes=1, names=16)
    try:
        far = time.monotonic_ns() + 10**12
        live: dict[int, tuple[int, bytes]] = {}
        gone: dict[int, tuple[int, bytes]] = {}
        for step in range(3000):
            if len(live) < 14 and (not live or rng.random() < 0.55):
                nodeid = rng.randrange(2, 4096)
                if nodeid in live:
                    continue
                parent, name = rng.randrange(1, 4), f"f{rng.randrange(40)}".encode()
                if any(v == (parent, name) for v in live.values()):
                    continue
                assert t.publish_name(nodeid, parent, name, entry_for(nodeid, step), far)
                live[nodeid] = (parent, name)
                gone.pop(nodeid, None)
            else:
                nodeid = rng.choice(list(live))
                t.unpublish_name(nodeid)
                gone[nodeid] = live.pop(nodeid)
            now = time.monotonic_ns()
            for nodeid, (parent, name) in live.items():
                assert t.entry(parent, name, now)[0] == nodeid  # type: ignore[index]
            for nodeid, (parent, name) in gone.items():
                found = t.entry(parent, name, now)
                assert found is None or found[0] != nodeid
            assert sum(1 for i in range(t.buckets) if t.bucket[2 * i]) == len(live)
    finally:
        t.close()


def forget_in(n: int) -> bytes:
    return p.FORGET_IN.pack(n)


def test_a_serving_process_answers_lookups_getattrs_and_forgets_of_published_names(table):
    far = time.monotonic_ns() + 10**12
    table.publish_name(5, 1, b"a.jpg", entry_for(5, 10), far)
    k = FakeKernel(table)
    try:
        u = k.send(p.LOOKUP, 1, b"a.jpg\0")
        assert k.reply() == (u, 0, entry_for(5, 10))
        assert table.lookups(0)[5] == 1
        u = k.send(p.GETATTR, 5, p.GETATTR_IN.pack(0, 0, 0))
        unique, error, out = k.reply()
        assert (unique, error) == (u, 0)
        assert out == p.ATTR_OUT.pack(3600, 0, 0) + entry_for(5, 10)[p.ENTRY_OUT.size:]
        k.send(p.FORGET, 5, forget_in(3))
        # a forget has no reply: the next request's answer shows it was taken
        u = k.send(p.LOOKUP, 1, b"a.jpg\0")
        assert k.reply()[0] == u
        assert table.lookups(0)[5] == 1 - 3 + 1
        # a batch: the published node's forget taken here, the others forwarded as a batch
        items = [(5, 1), (9, 2), (11, 4)]
        k.send(p.BATCH_FORGET, 0, p.BATCH_FORGET_IN.pack(3, 0) + b"".join(p.FORGET_ONE.pack(*i) for i in items))
        message = k.forwarded()
        length, opcode = p.IN_HEADER.unpack_from(message, 4)[:2]
        assert (length, opcode) == (len(message) - 4, p.BATCH_FORGET)
        body = message[4 + p.IN_HEADER.size:]
        assert p.BATCH_FORGET_IN.unpack_from(body)[0] == 2
        assert [p.FORGET_ONE.unpack_from(body, 8 + 16 * i) for i in range(2)] == [(9, 2), (11, 4)]
        assert table.lookups(0)[5] == -2
        # not published, unknown, or unpublished: the main process's
        k.send(p.LOOKUP, 1, b"b.jpg\0")
        assert p.IN_HEADER.unpack_from(k.forwarded(), 4)[1] == p.LOOKUP
        table.unpublish_name(5)
        k.send(p.LOOKUP, 1, b"a.jpg\0")
        assert p.IN_HEADER.unpack_from(k.forwarded(), 4)[1] == p.LOOKUP
        k.send(p.FORGET, 5, forget_in(1))
        assert p.IN_HEADER.unpack_from(k.forwarded(), 4)[1] == p.FORGET
        k.send(p.GETATTR, 5, p.GETATTR_IN.pack(0, 0, 0))
        assert p.IN_HEADER.unpack_from(k.forwarded(), 4)[1] == p.GETATTR
        report = k.forwarded()
        counts, _ = decode_report(memoryview(report)[4:])
        assert {kind: n for kind, (n, _) in counts.items() if n} == {
            "lookup": 2, "getattr": 1, "forget": 1, "batch_forget": 1, "forwarded": 5}
    finally:
        k.close()
    assert table.take_lookups(5) == -2 and table.take_lookups(5) == 0


def test_an_unpublished_node_goes_to_the_main_process_even_for_its_own_handles(table):
    """A node taken back (forgotten, or its entry dropped): its opens and the releases of
    the handles the serving processes gave out are counted by the main process from then on."""
    table.publish(5, 9)
    k = FakeKernel(table)
    try:
        k.send(p.OPEN, 5, open_in(O_RDONLY))
        k.reply()
        table.unpublish(5)
        k.send(p.RELEASE, 5, release_in(OWN_FH | 5))
        assert p.IN_HEADER.unpack_from(k.forwarded(), 4)[1] == p.RELEASE
        k.send(p.OPEN, 5, open_in(O_RDONLY))
        assert p.IN_HEADER.unpack_from(k.forwarded(), 4)[1] == p.OPEN
        assert table.quiesce([True, True])
        assert table.take_counts(5) == 1  # the open it answered, folded into the main process's count
    finally:
        k.close()


def test_node_ids_are_reused_only_once_given_back():
    nodes = Nodes()
    a = nodes.add("/a")
    b = nodes.add("/b")
    assert nodes.forget(a, 0) is False  # a count of 0 takes nothing
    nodes.add("/a")  # a second lookup
    assert nodes.forget(a, 1) is False  # one reference left
    assert nodes.forget(a, 1) is True
    assert nodes.forget(a, 1) is False  # unknown now
    c = nodes.add("/c")
    assert c not in (a, b)  # not given back yet (the serving processes' table may hold it)
    nodes.recycle(a)
    nodes.recycle(b)  # still known: not reused
    d = nodes.add("/d")
    assert d == a and nodes.path(d) == "/d"
    assert nodes.add("/e") not in (a, b, c, d)


def test_nodes_give_their_tables_back_once_the_kernel_forgot_most_of_them():
    """A cold epoch's nodes forgotten (the kernel's forgets after a checkpoint took their
    names back): the tables are rebuilt for the nodes left, which keep their paths, ids,
    references and pins; forgotten ids are given out again."""
    from cachefs.identity import Attr
    from cachefs.nodes import NODES_REBUILD_MIN

    attr = Attr(0o100444, 1, 0, 0, 10, 1, 2, 3)
    nodes = Nodes()
    ids = [nodes.add(f"/d/f{i}", attr) for i in range(NODES_REBUILD_MIN + 10_000)]
    keep = ids[::100]
    assert all(nodes.pin(i) for i in keep[:5])
    full = sys.getsizeof(nodes._paths) + sys.getsizeof(nodes._ids) + sys.getsizeof(nodes._versions)
    for i in ids:
        if i not in keep:
            assert nodes.forget(i, 1)
            nodes.recycle(i)
    assert len(nodes) == len(keep) + 1  # (the root)
    assert (sys.getsizeof(nodes._paths) + sys.getsizeof(nodes._ids) + sys.getsizeof(nodes._versions)) * 8 < full
    assert all(nodes.path(i) == f"/d/f{ids.index(i)}" and nodes.id_of(nodes.path(i)) == i for i in keep)
    assert nodes.version(keep[1]) == attr and nodes.forget(keep[1], 1) is False  # pinned: stays
    assert nodes.unpin(keep[1]) is True and nodes.forget(keep[-1], 1) is True  # gone with its pin; not pinned
    assert nodes.add("/new") in set(ids) - set(keep)  # an id the kernel forgot


def test_table_node_ids_are_never_given_out_and_are_known_once_adopted():
    """Nodes.reserve: the daemon's own ids skip the table nodes' range and never recycle
    one; a table node is known once resolved (a request for it came to the daemon) or
    adopted, pinned once (its record's), and the path's own node, if any, stays the path's."""
    from cachefs.fuse.ops import FuseError
    from cachefs.identity import Attr

    attr = Attr(0o100444, 1, 0, 0, 10, 1, 2, 3)
    nodes = Nodes()
    nodes.reserve(4, 8)
    ids = [nodes.add(f"/f{i}") for i in range(5)]
    assert ids == [2, 3, 8, 9, 10]  # (1 is the root)
    resolved = []

    def resolve(nodeid: int) -> bool:
        resolved.append(nodeid)
        return nodeid == 5 and nodes.adopt(5, "/t/five", attr)

    nodes.resolve = resolve
    assert nodes.path(5) == "/t/five" and nodes.version(5) == attr and nodes.id_of("/t/five") == 5
    with pytest.raises(FuseError):
        nodes.path(6)  # a table node the daemon does not take: stale
    with pytest.raises(FuseError):
        nodes.path(11)  # not a table node: never resolved
    assert resolved == [5, 6]
    assert not nodes.adopt(5, "/t/five", attr)  # known: no second pin
    assert nodes.add("/t/five", attr) == 5  # the daemon's own lookup of it: the same node
    assert nodes.forget(5, 1) is False  # pinned by its record
    assert nodes.unpin(5, 0) is True  # taken, with its lookups folded: gone
    nodes.recycle(5)
    assert nodes.forget(ids[1], 1) is True
    nodes.recycle(ids[1])
    assert nodes.add("/g") == ids[1] and nodes.add("/h") == 11  # 5 is never given out
    assert nodes.add("/f0") == 2 and nodes.adopt(6, "/f0", attr) and nodes.id_of("/f0") == 2


def test_a_full_batch_is_reported_without_waiting_for_an_idle_moment(table, monkeypatch):
    monkeypatch.setattr("cachefs.fuse.serve.REPORT_AFTER", 3600.0)  # never idle long enough
    k = FakeKernel(table)
    try:
        for _ in range(REPORT_EVERY + 1):
            k.send(p.IOCTL, 5, b"")
            k.reply()
        counts, _ = decode_report(memoryview(k.forwarded())[4:])
        assert counts["other"][0] == REPORT_EVERY
    finally:
        k.close()


def test_while_the_main_process_asks_opens_are_reported_every_few_without_an_idle_moment(table, monkeypatch):
    """Order hints release a file's pin when the daemon hears of its open: while a session
    is open the main process asks for a report every few opens, not every 512 requests."""
    monkeypatch.setattr("cachefs.fuse.serve.REPORT_AFTER", 3600.0)  # never idle long enough
    table.publish(5, 9)
    k = FakeKernel(table)
    try:
        def open_release(times: int) -> None:
            for _ in range(times):
                k.send(p.OPEN, 5, open_in(O_RDONLY))
                assert k.reply()[1] == 0
                k.send(p.RELEASE, 5, release_in(OWN_FH | 5))
                assert k.reply()[1] == 0

        table.report_opens(4)
        open_release(4)
        counts, opened = decode_report(memoryview(k.forwarded())[4:])
        assert list(opened) == [5] * 4 and counts["open"][0] == 4 and counts["release"][0] == 3
        table.report_opens(0)  # the sessions ended: back to a report per REPORT_EVERY requests
        open_release(8)
        k.main.settimeout(0.3)
        with pytest.raises(TimeoutError):
            k.main.recv(1 << 16)
    finally:
        k.close()


def test_a_serving_process_stops_reading_while_its_forwarded_requests_wait(table):
    """A request handed to a file system cannot be killed until it is answered: while the
    main process does not answer (hung, or stopped) a serving process reads no more than
    MAX_FORWARDED, and the rest stay with the kernel."""
    k = FakeKernel(table)
    stopped = subprocess.Popen(["sleep", "60"])
    stopped.send_signal(signal.SIGSTOP)
    try:
        for _ in range(MAX_FORWARDED + 2):
            k.send(p.LOOKUP, 1, b"name\0")
        got = [k.forwarded() for _ in range(MAX_FORWARDED)]
        assert len(got) == MAX_FORWARDED
        k.main.settimeout(0.3)
        with pytest.raises(TimeoutError):
            k.main.recv(1 << 16)
        table.set_line(0, ANSWERED, 1)  # the main process answered one
        assert p.IN_HEADER.unpack_from(k.forwarded(), 4)[1] == p.LOOKUP
        k.main.settimeout(0.3)
        with pytest.raises(TimeoutError):
            k.main.recv(1 << 16)
        k.server.main_pid = stopped.pid  # stopped: nothing more is read, whatever the count
        time.sleep(2 * MAIN_CHECK)  # (the server looks again once its last look is this old)
        table.set_line(0, ANSWERED, MAX_FORWARDED + 2)
        with pytest.raises(TimeoutError):
            k.main.recv(1 << 16)
        stopped.send_signal(signal.SIGCONT)
        assert p.IN_HEADER.unpack_from(k.forwarded(), 4)[1] == p.LOOKUP
    finally:
        k.close()
        stopped.kill()
        stopped.wait()


def test_a_stop_is_seen_while_the_main_thread_still_runs(table):
    """A stop that reached another thread first counts: the main thread shows T only once
    it runs again (under load, or after a long disk wait), and a request read meanwhile
    would wait on the stopped process, unkillable."""
    k = FakeKernel(table)
    spin = ("import threading, time\n"
            "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
            "while True: pass\n")
    child = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.3)
        k.server.main_pid = child.pid
        assert not k.server.main_stopped()
        tids = os.listdir(f"/proc/{child.pid}/task")
        assert len(tids) == 2
        other = next(int(t) for t in tids if int(t) != child.pid)
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not k.server.main_stopped() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert k.server.main_stopped()
        real = k.server.main_stopped
        states = {child.pid: b"R", other: b"T"}  # the moment before the main thread stops

        def fake_open(path, mode="r", *a, **kw):
            tid = int(str(path).split("/")[-2])                     # /proc/<pid>/task/<tid>/stat
            return io.BytesIO(b"%d (python) %s 1 2 3" % (tid, states[tid]))

        k.server._stat_fd = os.open("/dev/null", os.O_RDONLY)  # the main thread's state: R (below)
        with mock.patch("os.pread", return_value=b"1 (python) R 1 2 3"), \
                mock.patch("builtins.open", fake_open):
            assert real()
            states[other] = b"S"
            assert not real()
        os.kill(child.pid, signal.SIGCONT)
    finally:
        k.close()
        child.kill()
        child.wait()


def test_a_sigstop_no_thread_has_taken_yet_counts_while_the_main_thread_sleeps(table):
    """The kernel hands a process's SIGSTOP to one of its threads; while that one is busy
    in the kernel, the main thread sleeps on (S) with the stop pending (ShdPnd). A serving
    process that trusted the sleeping main thread forwarded a request into the stop."""
    k = FakeKernel(table)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        k.server.main_pid = child.pid
        time.sleep(0.2)
        assert not k.server.main_stopped()  # asleep, nothing pending: real /proc
        status = open(f"/proc/{child.pid}/status", "rb").read()
        assert b"\nShdPnd:\t0000000000000000\n" in status
        pending = status.replace(b"ShdPnd:\t0000000000000000", b"ShdPnd:\t%016x" % (1 << (signal.SIGSTOP - 1)))
        other = status.replace(b"ShdPnd:\t0000000000000000", b"ShdPnd:\t%016x" % (1 << (signal.SIGUSR1 - 1)))
        k.server._stat_fd = os.open("/dev/null", os.O_RDONLY)
        for shown, stopped in ((pending, True), (other, False), (status, False)):
            with mock.patch("os.pread", return_value=b"%d (python) S 1 2 3" % child.pid), \
                    mock.patch("builtins.open", lambda path, mode="r", *a, shown=shown, **kw: io.BytesIO(shown)):
                assert k.server.main_stopped() is stopped
        os.close(k.server._stat_fd)
        k.server._stat_fd = -1
        os.kill(child.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not k.server.main_stopped() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert k.server.main_stopped()  # stopped: real /proc
        os.kill(child.pid, signal.SIGCONT)
    finally:
        k.close()
        child.kill()
        child.wait()


class FakeSession:
    """What the file system asks of a session for passthrough: backing ids, and whether
    its serving processes are alive."""

    def __init__(self):
        self.servers_alive = [True]
        self.next_id = 0
        self.closed: list[int] = []

    def blocking(self, refusable=True):
        return contextlib.nullcontext()

    def backing_open(self, fd):
        self.next_id += 1
        return self.next_id

    def backing_close(self, backing_id):
        self.closed.append(backing_id)


class FakeBacking(NamedTuple):
    """A cached copy, as tiers.multilevel.Backing (held and released in its tier)."""

    tier: object
    path: str
    eid: bytes
    in_ram = False

    def hold(self):
        pass

    def release(self):
        pass


class FakeRamBacking(NamedTuple):
    """A RAM copy, as tiers.multilevel.Backing with in_ram."""

    tier: object
    path: str
    eid: bytes
    in_ram = True

    def hold(self):
        pass

    def release(self):
        pass


def test_a_file_ram_took_has_its_nvme_registration_closed(tmp_path):
    """Backings.superseded: the NVMe copy's id closes at once when idle, or at its last
    close when open; the RAM copies are counted (opens.backing_files_ram)."""
    from cachefs.nodes import Backings

    (tmp_path / "copy").write_bytes(b"x")
    session = FakeSession()
    backings = Backings(session, 100)
    idle, held = b"I" * 16, b"H" * 16
    ids = {eid: backings.get(FakeBacking(None, str(tmp_path / "copy"), eid)) for eid in (idle, held)}  # type: ignore[arg-type]
    backings.put(idle)  # closed by its last open: kept, idle
    ram = backings.get(FakeRamBacking(None, str(tmp_path / "copy"), idle))  # type: ignore[arg-type]
    assert len(backings) == 3 and backings.ram_count == 1
    backings.superseded(idle)
    assert session.closed == [ids[idle]] and len(backings) == 2   # idle: closed now
    backings.superseded(held)
    assert session.closed == [ids[idle]] and backings.hold(held) == 0   # open: not given out again...
    backings.put(held)
    assert session.closed == [ids[idle], ids[held]] and len(backings) == 1   # ...and closed at its last close
    backings.put(Backings.ram_key(idle))
    backings.dropped(idle)  # RAM let go of it too
    assert session.closed[-1] == ram and len(backings) == 0 and backings.ram_count == 0


def test_a_checkpoint_closes_the_idle_registrations(tmp_path):
    """Backings.close_idle: after a checkpoint the files it recorded are table nodes that
    register their own (RAM's copies too); the daemon's idle registrations go, and each
    open one at its last close."""
    from cachefs.nodes import Backings

    (tmp_path / "copy").write_bytes(b"x")
    session = FakeSession()
    backings = Backings(session, 100)
    copy = str(tmp_path / "copy")
    idle = {bytes([n]) * 16: backings.get(FakeBacking(None, copy, bytes([n]) * 16)) for n in range(3)}  # type: ignore[arg-type]
    held = backings.get(FakeBacking(None, copy, b"H" * 16))  # type: ignore[arg-type]
    ram = backings.get(FakeRamBacking(None, copy, b"R" * 16))  # type: ignore[arg-type]
    for eid in idle:
        backings.put(eid)
    backings.put(Backings.ram_key(b"R" * 16))
    assert len(backings) == 5 and session.closed == []
    assert backings.close_idle() == 4
    assert sorted(session.closed) == sorted([*idle.values(), ram]) and len(backings) == 1
    assert backings.hold(b"H" * 16) == held and backings.hold(Backings.ram_key(b"R" * 16)) == 0
    assert backings.hold(b"\x00" * 16) == 0                          # registered again at its next open
    backings.put(b"H" * 16)
    backings.put(b"H" * 16)                                            # its last close: closed, not kept
    assert session.closed[-1] == held and len(backings) == 0 and backings.close_idle() == 0


def test_a_node_id_given_out_again_is_never_taken_back_for_its_previous_file(tmp_path):
    """A node forgotten while its entry is dropped: the forget's take-back frees the id, a
    lookup of another file gets it and publishes it, and only then is the drop handled. The
    drop must leave the new file's publication alone (it once cleared it, and the id was
    later served with the wrong file's backing id)."""
    from cachefs.config import Config
    from cachefs.fs import CachefsFS
    from cachefs.identity import Attr, FileId
    from cachefs.memsource import MemorySource
    from cachefs.nodes import Backings, NodeOpen
    from tests.helpers import make_core

    fs = CachefsFS(make_core(MemorySource()), Config(source="/src", mountpoint="/mnt", cache_dir=str(tmp_path)))
    session = FakeSession()
    fs.session = session  # type: ignore[assignment]
    fs._backings = Backings(session, 100)  # type: ignore[arg-type]
    fs._table = table = ServeTable.create(capacity=1024, processes=1)
    try:
        (tmp_path / "copy").write_bytes(b"x")

        def publish(path: str, eid: bytes) -> tuple[int, NodeOpen]:
            attr = Attr(0o100444, 1, 0, 0, 1, 0, 1, 1, 1)
            nodeid = fs.nodes.add(path, attr)
            state = NodeOpen(FileId.of(path, attr))
            state.refs, state.eid, state.published = 0, eid, True
            state.backing_id = fs._backings.get(FakeBacking(None, str(tmp_path / "copy"), eid))  # type: ignore[arg-type]
            fs._opens[nodeid] = state
            table.publish(nodeid, state.backing_id)
            fs._published[eid] = nodeid
            return nodeid, state

        first, old = publish("/a", b"E" * 16)
        fs.forget(first, 1)  # the kernel forgot it: queued for the reaper
        fs._dropped(b"E" * 16, False)  # and a tier dropped its copy: queued too
        queued = [fs._unpublished.get() for _ in range(2)]
        assert queued[0] == ("node", first, old, True) and queued[1] == ("copy", b"E" * 16)
        fs._take_back(table, first, old, True)  # the forget's take-back: the id is free
        assert session.closed == [old.backing_id]  # the dropped copy's id closed with its node
        again, new = publish("/b", b"F" * 16)
        assert again == first  # given out again
        assert fs._unpublish_copy(table, b"E" * 16) is None  # the drop: not this node's copy any more
        fs._take_back(table, again, old, False)  # a take-back queued with the old state: nothing
        assert table.slots[again] == new.backing_id and fs._opens[again] is new and new.published
    finally:
        fs._table = None
        table.close()


def test_the_reaper_keeps_no_batch_of_forgotten_nodes_while_it_waits_for_the_next(tmp_path):
    """A cold epoch's nodes forgotten at once (the page cache dropped): once taken back,
    nothing of them is left in memory while the reaper waits for the next forget (its last
    batch had stayed, 48,654 nodes' states at 200,000 files, until one came)."""
    import gc

    from cachefs.config import Config
    from cachefs.fs import CachefsFS
    from cachefs.identity import Attr, FileId
    from cachefs.memsource import MemorySource
    from cachefs.nodes import NodeOpen
    from tests.helpers import make_core

    fs = CachefsFS(make_core(MemorySource()), Config(source="/src", mountpoint="/mnt", cache_dir=str(tmp_path)))
    fs.session = FakeSession()  # type: ignore[assignment]
    fs._backings = Backings(fs.session, 1000)  # type: ignore[arg-type]
    fs._table = table = ServeTable.create(capacity=1024, processes=1)
    (tmp_path / "copy").write_bytes(b"x")
    reaper = threading.Thread(target=fs._reap_loop, daemon=True)
    reaper.start()
    try:
        ids, states = [], set()
        for i in range(300):
            attr = Attr(0o100444, 1, 0, 0, 1, 0, 1, 1, 1)
            nodeid = fs.nodes.add(f"/f{i}", attr)
            state = NodeOpen(FileId.of(f"/f{i}", attr))
            state.refs, state.eid, state.published = 0, i.to_bytes(16, "big"), True
            state.backing_id = fs._backings.get(FakeBacking(None, str(tmp_path / "copy"), state.eid))  # type: ignore[arg-type]
            fs._opens[nodeid] = state
            table.publish(nodeid, state.backing_id)
            fs._published[state.eid] = nodeid
            ids.append(nodeid)
            states.add(id(state))
        del state
        for nodeid in ids:
            fs.forget(nodeid, 1)  # queued for the reaper, with its state
        deadline = time.monotonic() + 10
        while fs._opens and time.monotonic() < deadline:  # (each taken back: its state gone from there)
            time.sleep(0.01)
        time.sleep(0.2)  # (its batch done: the reaper waits for the next)
        gc.collect()
        left = [o for o in gc.get_objects() if isinstance(o, NodeOpen) and id(o) in states]
        assert not fs._opens and not fs._published and left == []
    finally:
        fs._unpublished.put(("stop",))
        reaper.join(5)
        fs._table = None
        table.close()


def test_destroy_returns_once_the_invalidation_thread_is_done_with_the_table(tmp_path):
    """The daemon closes the serving processes' table after destroy: the thread that has
    the kernel drop changed names (and quiesces the table first) must be gone by then. It
    once was still in its quiesce, and died on the released table (seen in CI)."""
    import types

    from cachefs.config import Config
    from cachefs.fs import CachefsFS
    from cachefs.memsource import MemorySource
    from tests.helpers import make_core

    fs = CachefsFS(make_core(MemorySource()), Config(source="/src", mountpoint="/mnt", cache_dir=str(tmp_path)))
    session = FakeSession()
    fs._table = table = ServeTable.create(capacity=1024, processes=1)
    try:
        fs.init(types.SimpleNamespace(no_open=True), session)  # type: ignore[arg-type]
        fs.destroy()
        assert fs._invalidator is not None and not fs._invalidator.is_alive()
    finally:
        fs._table = None
        table.close()


def test_published_names_pin_their_nodes_and_are_taken_back_oldest_first(tmp_path):
    """The daemon's side of names: a lookup publishes the file's name (its node and its
    directory pinned: forgets counted by the serving processes do not reach the daemon),
    at most _name_limit of them, the oldest taken back first; a taken-back name's lookups
    counted in the table are folded into its node's references, and a node nobody holds
    any more is forgotten then. A file changed on the source has its name taken back."""
    from cachefs.config import Config
    from cachefs.fs import CachefsFS
    from cachefs.fuse.ops import Request
    from cachefs.memsource import MemorySource
    from tests.helpers import make_core

    source = MemorySource()
    source.add_dir("/d")
    for i in range(4):
        source.add_file(f"/d/f{i}", b"x" * (i + 1))
    fs = CachefsFS(make_core(source), Config(source="/src", mountpoint="/mnt", cache_dir=str(tmp_path)))
    session = FakeSession()
    fs.session = session  # type: ignore[assignment]
    fs._backings = Backings(session, 100)  # type: ignore[arg-type]
    fs._table = table = ServeTable.create(capacity=1024, processes=1, names=8)
    fs._name_limit = 3
    fs._ahead_seen.add("/d")  # nothing published ahead (see the test below)
    req = Request(1, 1, 0, 0, 1)
    try:
        d = p.ENTRY_OUT.unpack_from(fs.lookup(req, 1, b"d"))[0]
        ids = [p.ENTRY_OUT.unpack_from(fs.lookup(req, d, f"f{i}".encode()))[0] for i in range(3)]
        now = time.monotonic_ns()
        assert [table.entry(d, f"f{i}".encode(), now)[0] for i in range(3)] == ids  # type: ignore[index]
        table.lookups(0)[ids[0]] += 2  # a serving process answered two more lookups of f0...
        fs.forget(ids[0], 3)  # ...and the kernel forgot all three: one of them reached the daemon
        fs.forget(d, 1)  # the directory too
        assert fs.nodes.file_id(ids[0]) is not None and fs.nodes.path(d) == "/d"  # pinned
        # a fourth name: the oldest (f0) is taken back
        f3 = p.ENTRY_OUT.unpack_from(fs.lookup(req, d, b"f3"))[0]
        assert list(fs._named) == [ids[1], ids[2], f3]
        assert table.entry(d, b"f0", now) is None
        item = fs._unpublished.get_nowait()
        assert item == ("name", ids[0], d)
        fs._name_taken(table, ids[0], d)
        assert table.lookups(0)[ids[0]] == 0
        assert fs.nodes.file_id(ids[0]) is None  # 1 + 2 lookups, 3 forgets: gone, its id free
        assert fs.nodes.path(d) == "/d"  # still the directory of three names
        # the file changed on the source: its name goes to the daemon again at once
        fs._source_changed("/d/f1")
        assert table.entry(d, b"f1", now) is None and ids[1] not in fs._named
        assert fs._unpublished.get_nowait() == ("name", ids[1], d)
        fs._name_taken(table, ids[1], d)
        assert fs.nodes.file_id(ids[1]) is not None  # the kernel still holds it (one lookup)
        # a lookup of the new version: a new node, published under the name
        old_attr = fs.nodes.version(ids[1])
        source.add_file("/d/f1", b"changed")
        new = p.ENTRY_OUT.unpack_from(fs.lookup(req, d, b"f1"))[0]
        assert new != ids[1] and table.entry(d, b"f1", time.monotonic_ns())[0] == new  # type: ignore[index]
        # a lookup that found the old version and comes late publishes nothing over it
        assert old_attr is not None
        fs._publish_name(ids[1], d, b"f1", "/d/f1", old_attr, entry_for(ids[1], 1))
        assert table.entry(d, b"f1", time.monotonic_ns())[0] == new  # type: ignore[index]
        # a change found on the source takes the name back whichever node it is published with
        fs.nodes._ids["/d/f1"] = ids[1]  # as if the path pointed elsewhere meanwhile
        fs._source_changed("/d/f1")
        assert table.entry(d, b"f1", time.monotonic_ns()) is None and new not in fs._named
    finally:
        fs._table = None
        table.close()


def test_a_directory_s_cached_files_are_published_ahead_of_their_first_lookup(tmp_path):
    """_publish_dir: each cached file of a listed directory gets a node (no reference from
    the kernel, pinned by its name), a registered copy and its name published, so that a
    serving process answers its first lookup and open. Files not cached, empty ones,
    subdirectories and names published already are left alone; a node the kernel knows is
    published as it stands; a directory the kernel forgot is skipped (its id may be
    another's by now); and taking an ahead name back frees its node."""
    from cachefs.config import Config
    from cachefs.fs import CachefsFS
    from cachefs.fuse.ops import Request
    from cachefs.memsource import MemorySource
    from cachefs.nodes import Backings
    from tests.helpers import make_core

    source = MemorySource()
    source.add_dir("/d")
    source.add_dir("/d/sub")
    for i in range(5):
        source.add_file(f"/d/f{i}", b"x" * i)  # f0 is empty
    from cachefs.prefetch import Prefetcher

    core = make_core(source, prefetcher=Prefetcher(workers=0), readahead="dir")  # no fetch in the background
    fs = CachefsFS(core, Config(source="/src", mountpoint="/mnt", cache_dir=str(tmp_path)))
    session = FakeSession()
    fs.session = session  # type: ignore[assignment]
    fs._backings = Backings(session, 100)  # type: ignore[arg-type]
    fs._table = table = ServeTable.create(capacity=1024, processes=1, names=16)
    fs._ahead_seen.add("/d")  # published ahead by this test's calls, not in the background
    req = Request(1, 1, 0, 0, 1)
    try:
        for i in (0, 1, 2, 3):
            assert fs.core.read(f"/d/f{i}", 0, i) == b"x" * i  # cached (in RAM); f4 is not
        d = p.ENTRY_OUT.unpack_from(fs.lookup(req, 1, b"d"))[0]
        known = p.ENTRY_OUT.unpack_from(fs.lookup(req, d, b"f3"))[0]  # the kernel knows f3: named by its lookup
        assert list(fs._named) == [known]
        fs.core.readdir("/d")
        assert fs._publish_dir("/d") == 2  # f1 and f2
        now = time.monotonic_ns()
        ahead = {name: table.entry(d, name, now) for name in (b"f0", b"f1", b"f2", b"f3", b"f4", b"sub")}
        assert ahead[b"f0"] is None and ahead[b"f4"] is None and ahead[b"sub"] is None
        assert ahead[b"f3"][0] == known  # type: ignore[index]
        for name, size in ((b"f1", 1), (b"f2", 2)):
            nodeid = ahead[name][0]  # type: ignore[index]
            assert fs.nodes.path(nodeid) == "/d/" + name.decode() and fs.nodes.version(nodeid).size == size  # type: ignore[union-attr]
            assert table.slots[nodeid] and fs._opens[nodeid].published and fs._opens[nodeid].refs == 0
            assert fs.nodes.forget(nodeid, 0) is False  # pinned by its name, no kernel reference
        assert len(session.closed) == 0 and len(fs._backings) == 2  # f3's copy: registered at its first open
        assert fs.core.stats.snapshot()["serve"]["published_ahead"] == 2
        assert fs._publish_dir("/d") == 0  # done: nothing twice
        # directory read-ahead: a directory with a file not cached is its business still;
        # one whose every file is cached and published has nothing to fetch or check ahead
        assert fs.core.dir_readahead is not None
        fs.core.dir_readahead.touch_many(["/d/f1"])
        source.add_dir("/e")
        source.add_file("/e/g", b"yy")
        assert fs.core.prefetch_file("/e/g")[0] == "fetched"  # cached, no reader's touch
        fs.core.readdir("/e")
        fs._ahead_seen.add("/e")
        assert p.ENTRY_OUT.unpack_from(fs.lookup(req, 1, b"e"))[0] and fs._publish_dir("/e") == 1
        dirs = fs.core.stats.snapshot()["prefetch"]["dirs"]
        fs.core.dir_readahead.touch_many(["/e/g"])
        assert fs.core.stats.snapshot()["prefetch"]["dirs"] == dirs
        # taking an ahead name back (the kernel never looked it up) forgets its node
        f1 = ahead[b"f1"][0]  # type: ignore[index]
        with fs._names_lock:
            fs._take_name(f1)
        assert fs._unpublished.get_nowait() == ("name", f1, d)
        fs._name_taken(table, f1, d)
        assert fs.nodes.file_id(f1) is None
        state = fs._unpublished.get_nowait()
        assert state[:2] == ("node", f1) and state[3] is True  # its open state taken back, the id freed after
        # a directory not listed yet: nothing, and asked again at its next lookup
        source.add_dir("/u")
        source.add_file("/u/h", b"z")
        fs._ahead_seen.add("/u")
        assert fs._publish_dir("/u") == 0 and "/u" in fs._ahead_unlisted and "/u" not in fs._ahead_seen
        # a directory the kernel forgot is not published under its old id
        fs.forget(d, 1)
        assert fs.nodes.path(d) == "/d"  # pinned by f2's and f3's names
        assert fs._publish_dir("/nowhere") == 0
    finally:
        fs._table = None
        table.close()


def test_the_serving_loop_benchmark_gets_a_reply_to_every_request():
    """tools/servebench.py feeds the serving loop opens (and lookups) through a socket pair:
    every request gets the reply a serving process gives it (the published entry, the
    passthrough open, ENOTTY, the release; none forwarded), and the loop returns at the end
    of the stream."""
    from tools import servebench

    for lookups in (False, True):
        result = servebench.run(servebench.ROOT, 300, lookups)
        assert result["requests"] == 300 * (4 if lookups else 3) and result["bad"] == 0
        assert result["us_per_request"] > 0


def test_a_serving_process_answers_table_nodes_from_the_entry_table(tmp_path):
    """After a start from the NVMe tier's entry table: a file's first lookup in a directory
    whose path is published, its getattr, forgets and opens are answered from the table
    (the open registering the cached file once, under the node's lock), and reported; what
    the table cannot vouch for, and anything of a node the main process took, is forwarded."""
    from cachefs.config import CLEAN_MARGIN_NS
    from cachefs.fuse.serve import REGISTERED, REGISTERED_RAM
    from cachefs.fuse.servetable import RAM_REGISTERED, RAM_WANTED, ROW_CLOSING, ROW_FREE, ROW_TAKEN
    from cachefs.identity import Attr
    from cachefs.tiers import table as entry_table
    from cachefs.tiers.layout import block_hash
    from cachefs.tiers.table import Row

    data = tmp_path / "data"
    now = time.time()
    stop = time.time_ns() + 10 * CLEAN_MARGIN_NS  # the files below are older than this "stop"

    def attr(size: int) -> Attr:
        return Attr(0o100444, 1, 0, 0, size, 1, 2, 3, 8, 0, 500 + size)

    def row(n: int, path: str, size: int, stored_at: float = now, synced: int = stop, blocks: int = 1,
            hashed: bool = False) -> Row:
        eid = bytes([n]) * 16
        name = eid.hex()
        (data / name[:2]).mkdir(parents=True, exist_ok=True)
        (data / name[:2] / name).write_bytes(b"x" * size)
        hashes = [block_hash(b"x" * size)] if hashed else list(range(1, blocks + 1))
        return Row(eid, path, attr(size), 1 << 20, stored_at, synced, hashes)

    # (new.jpg and fresh.jpg: changed since the stop, by their ctime; fresh.jpg's bytes
    # still match its hash, as the restart check would read them)
    rows = [row(1, "/d/a.jpg", 10), row(2, "/d/old.jpg", 20, stored_at=now - 7200), row(3, "/d/big", 30, blocks=2),
            row(4, "/d/new.jpg", 40, synced=1), row(5, "/top.jpg", 50), row(6, "/d/gone.jpg", 60),
            row(7, "/d/fresh.jpg", 70, synced=1, hashed=True)]
    (data / "06" / ("06" * 16)).unlink()
    entry_table.write(str(tmp_path / "t"), rows, stop, 1)
    t = ServeTable.create(capacity=1024, processes=2, rows=len(rows))
    tfd = os.open(tmp_path / "t", os.O_RDONLY)
    dfd = os.open(data, os.O_PATH | os.O_DIRECTORY)
    ram = tmp_path / "ram"  # the RAM tier's data directory
    (ram / "05").mkdir(parents=True)
    rfd = os.open(ram, os.O_PATH | os.O_DIRECTORY)
    k = FakeKernel(t, rows=entry_table.Mapped(tfd, dfd), ttl=3600.0, ram_fd=rfd)
    registered: list[int] = []
    from_ram: list[bool] = []

    def backing_open(fd: int) -> int:
        registered.append(os.fstat(fd).st_size)
        from_ram.append(os.readlink(f"/proc/self/fd/{fd}").startswith(str(ram)))
        return 40 + len(registered)

    k.server.backing_open = backing_open  # type: ignore[method-assign]
    base = t.row_base
    try:
        assert base == 1024 and t.capacity == 1024 + len(rows) and t.row_of(base + 5) == 5 and t.row_of(5) == -1
        assert t.publish_dir(7, b"/d") and t.publish_dir(1, b"/")
        assert t.dir_path(7) == b"/d" and not t.has_name(7) and t.named(7) is None
        expected = p.pack_entry_of(base, 510, 0o100444, 1, 0, 0, 10, 1, 2, 3, 8, 0, (3600, 0))
        u = k.send(p.LOOKUP, 7, b"a.jpg\0")
        assert k.reply() == (u, 0, expected)
        assert t.lookups(0)[base] == 1 and t.has_name(base)
        u = k.send(p.LOOKUP, 1, b"top.jpg\0")
        assert k.reply()[1:] == (0, p.pack_entry_of(base + 4, 550, 0o100444, 1, 0, 0, 50, 1, 2, 3, 8, 0, (3600, 0)))
        u = k.send(p.GETATTR, base, p.GETATTR_IN.pack(0, 0, 0))
        assert k.reply() == (u, 0, p.ATTR_OUT.pack(3600, 0, 0) + expected[p.ENTRY_OUT.size:])
        for _ in range(2):  # registered at the first open only
            u = k.send(p.OPEN, base, open_in(O_RDONLY))
            unique, error, out = k.reply()
            assert (unique, error) == (u, 0)
            assert p.OPEN_OUT.unpack(out) == (OWN_FH | base, p.FOPEN_PASSTHROUGH | p.FOPEN_NOFLUSH, 41)
        assert registered == [10] and t.slots[base] == 41 and t.counts(0)[base] == 2
        k.send(p.FORGET, base, forget_in(1))
        # what the table cannot vouch for goes to the main process: attributes past the
        # TTL, more than one block, a file changed since the stop, a file gone, a name the
        # table does not have, a directory whose path is not published
        for name in (b"old.jpg", b"big", b"nope"):
            k.send(p.LOOKUP, 7, name + b"\0")
            assert p.IN_HEADER.unpack_from(k.forwarded(), 4)[1] == p.LOOKUP
        k.send(p.LOOKUP, 8, b"a.jpg\0")
        assert p.IN_HEADER.unpack_from(k.forwarded(), 4)[1] == p.LOOKUP
        # past the TTL until the main process finds the file unchanged on the source (a stat,
        # its directory's listing): then for a TTL from that check; an older check is none
        t.confirm_row(1, now - 3601)
        k.send(p.LOOKUP, 7, b"old.jpg\0")
        assert p.IN_HEADER.unpack_from(k.forwarded(), 4)[1] == p.LOOKUP
        t.confirm_row(1, time.time())
        t.confirm_row(1, now - 3601)  # (a later call with an older time keeps the newer)
        u = k.send(p.LOOKUP, 7, b"old.jpg\0")
        assert k.reply()[1:] == (0, p.pack_entry_of(base + 1, 520, 0o100444, 1, 0, 0, 20, 1, 2, 3, 8, 0, (3600, 0)))
        u = k.send(p.GETATTR, base + 1, p.GETATTR_IN.pack(0, 0, 0))
        assert k.reply()[:2] == (u, 0)
        for n in (3, 5):  # (its lookup is answered: the open finds what is wrong)
            u = k.send(p.LOOKUP, 7, rows[n].path.rsplit("/", 1)[1].encode() + b"\0")
            assert k.reply()[:2] == (u, 0)
            k.send(p.OPEN, base + n, open_in(O_RDONLY))
            assert p.IN_HEADER.unpack_from(k.forwarded(), 4)[1] == p.OPEN
        assert registered == [10] and t.slots[base + 3] == t.slots[base + 5] == 0
        u = k.send(p.LOOKUP, 7, b"fresh.jpg\0")
        assert k.reply()[:2] == (u, 0)
        u = k.send(p.OPEN, base + 6, open_in(O_RDONLY))
        assert k.reply()[:2] == (u, 0) and registered == [10, 70] and t.slots[base + 6] == 42
        # past the backing limit the main process closes a registration, the node staying
        # here: not while it is open (its opens use the id); once nothing is, and the next
        # open registers the file again
        assert t.close_row(6) == 42 and t.row_state[6] == ROW_CLOSING and t.slots[base + 6] == 0
        assert t.close_row(6) == 0 and t.row_theirs(6)
        k.send(p.OPEN, base + 6, open_in(O_RDONLY))  # no registration while closing: forwarded
        assert p.IN_HEADER.unpack_from(k.forwarded(), 4)[1] == p.OPEN
        assert not t.row_closed(6, 42) and t.row_state[6] == ROW_FREE and t.slots[base + 6] == 42
        assert t.close_row(6) == 42
        u = k.send(p.RELEASE, base + 6, release_in(OWN_FH | (base + 6)))  # answered here, without the slot
        assert k.reply() == (u, 0, b"") and t.counts(0)[base + 6] == 0
        assert t.row_closed(6, 42) and t.row_state[6] == ROW_FREE and t.slots[base + 6] == 0
        # a release of its own handle is answered here whatever the slot held when it was
        # read: one that read it empty just before a closing was undone (the id given back
        # because of this very open) is counted where its open was, or the node never closes
        t.counts(0)[base + 6] += 1  # (that open)
        u = k.send(p.RELEASE, base + 6, release_in(OWN_FH | (base + 6)))
        assert k.reply() == (u, 0, b"") and t.counts(0)[base + 6] == 0
        u = k.send(p.OPEN, base + 6, open_in(O_RDONLY))
        assert p.OPEN_OUT.unpack(k.reply()[2])[2] == 43 and registered == [10, 70, 70] and t.slots[base + 6] == 43
        assert t.close_row(0) == 41 and t.row_closed(0, 41) is False and t.slots[base] == 41  # (2 opens)
        # the main process takes a node: its id comes back, the rest is forwarded
        assert t.take_row(0) == 41 and t.row_state[0] == ROW_TAKEN and t.slots[base] == 0
        assert t.take_row(0) == -1 and t.row_state[4] == ROW_FREE
        k.send(p.LOOKUP, 7, b"a.jpg\0")
        assert p.IN_HEADER.unpack_from(k.forwarded(), 4)[1] == p.LOOKUP
        k.send(p.OPEN, base, open_in(O_RDONLY))
        assert p.IN_HEADER.unpack_from(k.forwarded(), 4)[1] == p.OPEN
        k.send(p.FORGET, base, forget_in(1))
        assert p.IN_HEADER.unpack_from(k.forwarded(), 4)[1] == p.FORGET
        # RAM takes a file: the node stays here, and its next registration is of RAM's copy
        # (the NVMe one while RAM's is not there whole); a registration of the other copy is
        # closed as past the limit, not while it is open
        assert t.close_row(4, True) == 0 and t.row_copy[4] == RAM_WANTED  # (nothing registered yet)
        (ram / "05" / ("05" * 16)).write_bytes(b"r" * 49)  # (being written)
        u = k.send(p.OPEN, base + 4, open_in(O_RDONLY))
        assert p.OPEN_OUT.unpack(k.reply()[2])[2] == 44 and registered[-1] == 50 and not from_ram[-1]
        assert t.row_copy[4] == RAM_WANTED and t.slots[base + 4] == 44
        (ram / "05" / ("05" * 16)).write_bytes(b"r" * 50)
        assert t.close_row(4, True) == 44 and t.row_state[4] == ROW_CLOSING and t.slots[base + 4] == 0
        assert not t.row_closed(4, 44) and t.slots[base + 4] == 44  # (open)
        u = k.send(p.RELEASE, base + 4, release_in(OWN_FH | (base + 4)))
        assert k.reply() == (u, 0, b"")
        assert t.close_row(4, True) == 44 and t.row_closed(4, 44) and t.slots[base + 4] == 0
        assert t.row_copy[4] == RAM_WANTED
        u = k.send(p.OPEN, base + 4, open_in(O_RDONLY))
        assert p.OPEN_OUT.unpack(k.reply()[2])[2] == 45 and registered[-1] == 50 and from_ram[-1]
        assert t.row_copy[4] == RAM_WANTED | RAM_REGISTERED and t.close_row(4, True) == 0
        u = k.send(p.RELEASE, base + 4, release_in(OWN_FH | (base + 4)))
        assert k.reply() == (u, 0, b"")
        # RAM lets it go: back to the NVMe copy
        assert t.close_row(4, False) == 45 and t.row_closed(4, 45) and t.row_copy[4] == 0
        (ram / "05" / ("05" * 16)).unlink()
        u = k.send(p.OPEN, base + 4, open_in(O_RDONLY))
        assert p.OPEN_OUT.unpack(k.reply()[2])[2] == 46 and not from_ram[-1] and t.row_copy[4] == 0
        # taken by the main process: its id (whichever copy's) comes back, the rest is forwarded
        assert t.take_row(4) == 46 and t.row_state[4] == ROW_TAKEN and t.slots[base + 4] == 0
        assert t.close_row(4, True) == 0 and t.row_state[4] == ROW_TAKEN  # (a taken node's copy: the daemon's)
        k.send(p.LOOKUP, 1, b"top.jpg\0")
        assert p.IN_HEADER.unpack_from(k.forwarded(), 4)[1] == p.LOOKUP
        report = k.forwarded()
        counts, opened = decode_report(memoryview(report)[4:])
        assert list(opened) == [base | REGISTERED, base, base, (base + 6) | REGISTERED, base + 6,
                                (base + 6) | REGISTERED, base + 6, (base + 4) | REGISTERED, base + 4,
                                (base + 4) | REGISTERED | REGISTERED_RAM, base + 4, (base + 4) | REGISTERED, base + 4]
        assert counts["lookup"][0] == 6 and counts["open"][0] == 7 and counts["forget"][0] == 1
        assert counts["release"][0] == 4
        assert t.lookups(0)[base] == 0
    finally:
        k.close()
        k.server.rows.close()
        os.close(tfd)
        os.close(dfd)
        os.close(rfd)
        t.close()


def test_a_serving_process_maps_a_checkpoints_table_once_the_main_process_publishes_it(tmp_path):
    """A mount that started without an entry table gives the serving table room for table
    nodes; once the main process publishes a checkpoint's (its table and data directory,
    by descriptor), a serving process maps them through /proc at its next look and
    answers their lookups and opens as a start's; until then they are forwarded."""
    from cachefs.config import CLEAN_MARGIN_NS
    from cachefs.identity import Attr
    from cachefs.serving import Mapped
    from cachefs.tiers import table as entry_table
    from cachefs.tiers.table import Row

    data = tmp_path / "data"
    eid = bytes([9]) * 16
    (data / eid.hex()[:2]).mkdir(parents=True)
    (data / eid.hex()[:2] / eid.hex()).write_bytes(b"y" * 30)
    synced = time.time_ns() + 10 * CLEAN_MARGIN_NS  # (the file is older than this checkpoint)
    attr = Attr(0o100444, 1, 0, 0, 30, 1, 2, 3, 8, 0, 77)
    entry_table.write(str(tmp_path / "t"), [Row(eid, "/d/a.jpg", attr, 1 << 20, time.time(), synced, [1])], synced, 5)
    main = ServeTable.create(capacity=1024, processes=1, room=64)
    mine = ServeTable.attach(os.dup(main.fd))  # the serving process's own view of the memfd
    assert (main.rows, main.room, main.row_base, mine.rows, mine.room) == (0, 64, 1024, 0, 64)
    k = FakeKernel(mine, ttl=3600.0, rows_from=Mapped)
    k.server.main_pid = os.getpid()
    k.server.backing_open = lambda fd: 77  # type: ignore[method-assign]
    tfd = os.open(tmp_path / "t", os.O_RDONLY)
    dfd = os.open(data, os.O_PATH | os.O_DIRECTORY)
    closing: list[int] = []
    try:
        k.send(p.LOOKUP, 7, b"a.jpg\0")
        assert k.forwarded()[4:] and mine.rows == 0                 # no table nodes yet
        main.publish_rows(1, tfd, dfd)
        assert main.publish_dir(7, b"/d") and main.rows == 1
        time.sleep(0.1)                                            # (a look every MAIN_CHECK)
        u = k.send(p.LOOKUP, 7, b"a.jpg\0")
        assert k.reply() == (u, 0, p.pack_entry_of(1024, 77, 0o100444, 1, 0, 0, 30, 1, 2, 3, 8, 0, (3600, 0)))
        assert mine.rows == 1 and mine.rows_published() is None     # mapped once
        u = k.send(p.OPEN, 1024, open_in(os.O_RDONLY))
        unique, error, out = k.reply()
        assert (unique, error) == (u, 0) and main.slots[1024] == 77  # registered by the serving process
        assert main.rows_everywhere([True]) and main.line(0, MAPPED) == 1
        # The next generation: the record before in its number, a new one after it
        eid2 = bytes([8]) * 16
        (data / eid2.hex()[:2]).mkdir()
        (data / eid2.hex()[:2] / eid2.hex()).write_bytes(b"z" * 40)
        attr2 = attr._replace(size=40, ino=78)
        entry_table.write(str(tmp_path / "t2"), [Row(eid, "/d/a.jpg", attr, 1 << 20, time.time(), synced, [1]),
                                                 Row(eid2, "/d/b.jpg", attr2, 1 << 20, time.time(), synced, [1])],
                          synced, 6, numbered=1)
        os.unlink(tmp_path / "t")  # (the main process unlinks the table before)
        tfd2 = os.open(tmp_path / "t2", os.O_RDONLY)
        closing.append(tfd2)
        k.send(p.LOOKUP, 7, b"b.jpg\0")
        assert k.forwarded()[4:]                                   # not before it is published
        main.publish_rows(2, tfd2, dfd)
        assert not main.rows_everywhere([True]) and main.rows_everywhere([False])  # (a dead process maps nothing)
        time.sleep(0.1)
        u = k.send(p.LOOKUP, 7, b"b.jpg\0")
        assert k.reply() == (u, 0, p.pack_entry_of(1025, 78, 0o100444, 1, 0, 0, 40, 1, 2, 3, 8, 0, (3600, 0)))
        u = k.send(p.LOOKUP, 7, b"a.jpg\0")                       # the node before keeps its id
        assert k.reply() == (u, 0, p.pack_entry_of(1024, 77, 0o100444, 1, 0, 0, 30, 1, 2, 3, 8, 0, (3600, 0)))
        assert mine.rows == 2 and main.rows_everywhere([True]) and main.line(0, MAPPED) == 2
        # A generation that cannot be mapped: the one before stays, and is not tried again
        main.publish_rows(2, 999, dfd)
        time.sleep(0.1)
        u = k.send(p.LOOKUP, 7, b"b.jpg\0")
        assert k.reply()[:2] == (u, 0) and mine.rows == 2 and not main.rows_everywhere([True])
        assert mine.rows_published() is None
    finally:
        k.close()
        if k.server.rows is not None:
            k.server.rows.close()
        for fd in [tfd, dfd, *closing, *k.server._rows_fds]:
            os.close(fd)
        mine.close()
        main.close()


def test_a_checkpoint_waits_for_an_epoch_that_reads_what_is_cached():
    """The NVMe tier is checkpointed once it holds more files than the limit, has stopped
    growing, and the job opens files: not while a cold epoch still fetches (below
    CHECKPOINT_MIN_FILES), nor while the job pauses (nothing opened), nor below the limit;
    and again once it cached many more."""
    held, limit = 60_000, 16_384
    due = functools.partial(checkpoint_due, growing_from=100_000)  # (a tier below the memory threshold)
    assert due(limit, held, grown=0, opened=500)
    assert due(limit, held, grown=held // 1000, opened=1)      # a trickle: read-ahead's last
    assert not due(limit, held, grown=held // 1000 + 1, opened=500)  # a cold epoch fetching
    assert not due(limit, held, grown=0, opened=0)             # a pause: nothing opened
    assert not due(limit, limit, grown=0, opened=500)          # all registered: nothing to hand over
    assert not due(limit, held, grown=held + 1, opened=500)    # the first look
    # the next generation, on the same terms, once the files stored since the last are
    # more than an eighth of its
    assert due(limit, held, grown=0, opened=500, tabled=80_000, since=10_001)
    assert not due(limit, held, grown=0, opened=500, tabled=80_000, since=10_000)
    assert not due(limit, held, grown=held // 100, opened=500, tabled=80_000, since=20_000)
    assert not due(limit, held, grown=0, opened=0, tabled=80_000, since=20_000)


def test_a_growing_tier_past_the_memory_threshold_is_checkpointed_at_each_eighth_more():
    """While a cold epoch still fetches, a tier past CHECKPOINT_MIN_FILES is checkpointed
    for the daemon's memory, then again each time the files stored since are more than a
    CHECKPOINT_GROWING-th of the table's: at the epoch's end the daemon holds at most the
    last ninth in memory."""
    first, limit = CHECKPOINT_MIN_FILES, 16_384
    assert CHECKPOINT_GROWING == 8
    assert not checkpoint_due(limit, first, grown=5_000, opened=500)            # not past it yet
    assert checkpoint_due(limit, first + 1, grown=5_000, opened=500)
    assert checkpoint_due(1 << 20, first + 1, grown=5_000, opened=500)          # below the backing limit too
    assert not checkpoint_due(limit, first + 1, grown=5_000, opened=0)          # read-ahead alone: no epoch
    assert not checkpoint_due(limit, 10 * first, grown=10 * first + 1, opened=500)  # the first look
    tabled = 100_000
    assert not checkpoint_due(limit, tabled + 12_500, grown=5_000, opened=500, tabled=tabled, since=12_500)
    assert checkpoint_due(limit, tabled + 12_501, grown=5_000, opened=500, tabled=tabled, since=12_501)
