"""Child processes of the daemon (the serving processes, the fetch processes): how they
are started so that they import this package as the daemon does, and die with it."""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def child_env() -> dict[str, str]:
    """The environment of a child process that imports this package as its parent does,
    wherever it is installed (a serving process; the fetch processes)."""
    env = dict(os.environ)
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = here + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def die_with_parent() -> None:
    """In a child process: ignore the terminal's Ctrl-C (it is for the daemon), and die
    with the parent (PR_SET_PDEATHSIG). The caller then checks that the parent is still
    the one it was started by."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _state(stat: bytes) -> bytes:
    """The state letter of a /proc/<pid>/stat line."""
    end = stat.rfind(b")")
    return stat[end + 2:end + 3]


def parent_stopped(pid: int, stat: bytes) -> bool:
    """Whether process `pid` (`stat`: its /proc/<pid>/stat, just read) is stopped: T, or t
    under a debugger. A stop that reached another thread first counts: the main thread
    shows T only once it runs again, which under load or after a long disk wait takes long
    enough for a serving process to read a request and forward it into the stop, where its
    caller could no longer be killed. An asleep main thread is not on its way to a stop (a
    stop wakes it first)."""
    state = _state(stat)
    if state in (b"T", b"t"):
        return True
    if state == b"S":
        return False
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as f:
                if _state(f.read(1024)) in (b"T", b"t"):
                    return True
        except OSError:
            continue
    return False
