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
    under a debugger. A stop on its way counts too:

    - a SIGSTOP no thread has taken yet (/proc/<pid>/status, ShdPnd). The kernel hands it
      to one thread, and while that one is busy in the kernel (a disk wait, at a start)
      the others, the main thread among them, sleep on: a serving process that trusted an
      asleep main thread forwarded a request into the stop, where its caller could no
      longer be killed (a mounted test hung so in CI, 0.4 s after the daemon started);
    - a stop that reached another thread first: the main thread shows T only once it
      runs again, which under load or after a long disk wait takes long enough for a
      serving process to read a request and forward it into the stop.

    Once a thread has taken the SIGSTOP it wakes every other one: an asleep main thread
    with no SIGSTOP pending is not on its way to a stop."""
    state = _state(stat)
    if state in (b"T", b"t"):
        return True
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            if stop_pending(f.read()):
                return True
    except OSError:
        return False
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


def stop_pending(status: bytes) -> bool:
    """Whether a /proc/<pid>/status names a SIGSTOP sent to the process and not yet taken
    by any of its threads (the shared pending set, ShdPnd)."""
    start = status.find(b"\nShdPnd:")
    if start < 0:
        return False
    try:
        return bool(int(status[start + 8:status.index(b"\n", start + 1)], 16) & (1 << (signal.SIGSTOP - 1)))
    except ValueError:
        return False
