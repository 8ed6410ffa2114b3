"""Memory the daemon freed, given back to the system.

CPython returns a 1 MiB arena of small objects once it is empty, but bigger blocks (a
dict's table, a list's array) come from the C library's heap, which keeps the pages of the
blocks freed inside it. After the daemon lets go of a cold epoch's objects at once (a
checkpoint cooling its files, the kernel forgetting its nodes) it asks glibc to give those
pages back (`malloc_trim`); elsewhere (musl, another libc) nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


def _trim() -> Callable[[int], int] | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_malloc_trim = _trim()


def give_back() -> bool:
    """Give the heap's free pages back to the system; whether the C library could (it
    walks the heap: 32 ms to give back 390 MB of 500 MB here, so only after big releases)."""
    if _malloc_trim is None:
        return False
    try:
        return bool(_malloc_trim(0))
    except OSError as exc:
        log.debug("malloc_trim: %s", exc)
        return False
