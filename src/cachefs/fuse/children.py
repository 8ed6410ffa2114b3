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
