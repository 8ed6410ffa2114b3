"""The control socket serves only the mounting user and root (issue 7, item 9): its name
is public (abstract namespace, published in user.cachefs.info), so the check is the peer's
credentials (SO_PEERCRED), not the socket's mode."""

import itertools
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from cachefs.control import ControlServer, request
from tests.helpers import ROOT

_names = itertools.count()


@pytest.fixture
def server():
    address = f"\0cachefs-test-control-{os.getpid()}-{next(_names)}"
    srv = ControlServer(address, {"ping": lambda req, send: {"pong": True}}, owner=os.getuid())
    srv.start()
    yield address
    srv.close()


def test_the_owner_is_served(server):
    replies = list(request(server, {"op": "ping"}, timeout=5))
    assert replies[-1] == {"pong": True, "final": True}


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to become another user")
def test_another_user_is_refused(server, fault_report):
    """50 requests in a row from another user, each answered "permission denied". The server
    once refused before reading the request; closing a socket with unread data resets it, and
    the client got BrokenPipeError or ConnectionResetError instead (4 failures in 14 runs)."""
    rounds = 50
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: become nobody, then ask
        os.close(r)
        out = []
        try:
            os.setgid(65534)
            os.setuid(65534)
            for _ in range(rounds):
                out.append(list(request(server, {"op": "ping", "pad": "x" * 65536}, timeout=5)))
        except BaseException as exc:  # report anything, never return into pytest
            out.append([{"exception": repr(exc)}])
        os.write(w, json.dumps(out).encode())
        os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        replies = json.loads(f.read())
    os.waitpid(pid, 0)
    refused = [{"error": "permission denied: this mount belongs to another user", "final": True}]
    assert replies == [refused] * rounds
    fault_report("another user (nobody) sends a control request", "permission denied", "-")


def test_bad_requests_get_an_error_not_a_dead_server(server):
    assert "unknown request" in list(request(server, {"op": "format-disk"}, timeout=5))[-1]["error"]
    assert list(request(server, {"op": "ping"}, timeout=5))[-1]["pong"] is True


def test_close_frees_the_name_at_once():
    """A remount in the same process binds the same name right after the old server closed:
    close() must not return while the accept thread still holds the socket (CI once failed
    with EADDRINUSE here; the loop reproduced it within a few hundred rounds)."""
    address = f"\0cachefs-test-control-{os.getpid()}-{next(_names)}"
    for _ in range(300):
        srv = ControlServer(address, {"ping": lambda req, send: {"pong": True}})
        srv.start()
        assert list(request(address, {"op": "ping"}, timeout=5))[-1]["pong"] is True
        srv.close()


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to become another user")
def test_another_users_idle_connections_cost_no_thread_and_no_descriptor_kept(server):
    """300 connections from another user that send nothing and stay open: once answered
    "permission denied" (or dropped past the refusal queue), none holds a thread or a
    descriptor of the daemon, and the owner is served meanwhile. They used to get a thread
    and a descriptor each, without a timeout: 3,000 of them, 3,018 threads."""
    threads, fds = threading.active_count(), _fds()
    r, w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.close(go_w)
        try:
            os.setgid(65534)
            os.setuid(65534)
            held = []
            for _ in range(300):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect(server)
                held.append(s)
            os.write(w, b"connected")
            os.read(go_r, 1)       # hold them until the parent has looked
        finally:
            os._exit(0)
    os.close(w)
    os.close(go_r)
    assert os.read(r, 100) == b"connected"
    time.sleep(1.0)                # the refusals time out (0.5 s each, one at a time; the rest dropped)
    assert list(request(server, {"op": "ping"}, timeout=5))[-1]["pong"] is True
    assert threading.active_count() <= threads + 1   # a ping's thread may still be ending
    assert _fds() <= fds + 70      # at most the refusal queue, waiting its turn
    os.write(go_w, b"x")
    os.waitpid(pid, 0)
    os.close(r)
    os.close(go_w)


def test_the_owners_connections_are_bounded_in_number_and_time():
    address = f"\0cachefs-test-control-{os.getpid()}-{next(_names)}"
    srv = ControlServer(address, {"ping": lambda req, send: {"pong": True}}, max_connections=4,
                        request_timeout=0.5)
    srv.start()
    try:
        idle = []
        for _ in range(4):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(address)
            idle.append(s)
        deadline = time.monotonic() + 5
        while srv.serving < 4:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        busy = list(request(address, {"op": "ping"}, timeout=5))[-1]
        assert busy["error"].startswith("busy:")
        time.sleep(0.8)            # the idle ones had 0.5 s to send a request
        assert list(request(address, {"op": "ping"}, timeout=5))[-1]["pong"] is True
        assert srv.serving <= 1
        for s in idle:
            s.close()
        # a request line without its end is refused past its bound, not buffered forever
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(address)
        s.settimeout(10)
        s.sendall(b"x" * ((1 << 20) + 10))
        reply = s.makefile("rb").readline()
        assert b"no complete line" in reply
        s.close()
    finally:
        srv.close()


def test_out_of_descriptors_the_channel_waits_and_comes_back(tmp_path):
    """accept() failing with EMFILE (the daemon's descriptors all taken) used to end the
    control thread for good: `cachefs warm` failed until a remount."""
    script = tmp_path / "server.py"
    script.write_text(textwrap.dedent(f"""
        import os, resource, sys, time
        sys.path.insert(0, {os.path.join(ROOT, "src")!r})
        from cachefs.control import ControlServer
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        srv = ControlServer("\\0" + sys.argv[1], {{"ping": lambda req, send: {{"pong": True}}}})
        srv.start()
        filler = []
        try:
            while True:
                filler.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        print("full", flush=True)
        sys.stdin.readline()            # the parent tried while no descriptor was free
        for fd in filler:
            os.close(fd)
        print("freed", flush=True)
        sys.stdin.readline()
    """))
    name = f"cachefs-test-control-{os.getpid()}-{next(_names)}"   # argv takes no NUL: the child adds it
    address = "\0" + name
    proc = subprocess.Popen([sys.executable, str(script), name], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=tmp_path)
    try:
        assert proc.stdout.readline().strip() == "full"
        # the descriptor accept() had reserved before the filling goes to a connection that
        # stays open; the next accept() then fails with EMFILE
        held = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        held.connect(address)
        with pytest.raises(OSError):   # queued by the kernel, never accepted: no answer
            list(request(address, {"op": "ping"}, timeout=1))
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "freed"
        deadline = time.monotonic() + 10
        while True:
            try:
                assert list(request(address, {"op": "ping"}, timeout=2))[-1]["pong"] is True
                break
            except OSError:
                assert time.monotonic() < deadline, "the control channel never came back"
                time.sleep(0.1)
        held.close()
    finally:
        proc.kill()
        proc.wait()
