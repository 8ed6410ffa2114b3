"""The mount table and the control client: which cachefs mounts exist, whether one is
stale, and how to ask a mount's daemon for its stats and control socket. Used by the CLI
and by the job-side helpers (cachefs.torch, diagnose): it imports nothing of the daemon.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from cachefs.errors import CachefsError

log = logging.getLogger(__name__)

T = TypeVar("T")


def _inside(child: str, parent: str) -> bool:
    return child == parent or child.startswith(parent.rstrip("/") + "/")


FSTYPE = "fuse.cachefs"


@dataclass
class MountEntry:
    mountpoint: str
    fstype: str
    source: str


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal
    out, i = bytearray(), 0
    raw = field.encode("utf-8", "surrogateescape")
    while i < len(raw):
        if raw[i:i + 1] == b"\\" and i + 3 < len(raw) + 1 and raw[i + 1:i + 4].isdigit():
            out.append(int(raw[i + 1:i + 4], 8))
            i += 4
        else:
            out.append(raw[i])
            i += 1
    return out.decode("utf-8", "surrogateescape")


def list_mounts() -> list[MountEntry]:
    entries = []
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rfields = left.split(), right.split()
                if len(fields) >= 5 and len(rfields) >= 2:
                    entries.append(MountEntry(_unescape(fields[4]), rfields[0], _unescape(rfields[1])))
    except OSError:
        pass
    return entries


def find_mount(path: str) -> MountEntry | None:
    """The mount whose mount point is exactly `path` (the last one if stacked)."""
    path = os.path.realpath(os.path.abspath(path))  # mountinfo records resolved paths
    found = None
    for entry in list_mounts():
        if entry.mountpoint == path:
            found = entry
    return found


def cachefs_mounts() -> list[MountEntry]:
    return [m for m in list_mounts() if m.fstype == FSTYPE]


def fusermount_available() -> bool:
    return shutil.which("fusermount3") is not None


def kernel_unmount(mountpoint: str, lazy: bool = False) -> str | None:
    """Unmount (umount2 as root, fusermount3 -u otherwise); None, or the one-line reason it failed."""
    from cachefs.fuse.kernel import MountError, unmount

    try:
        unmount(mountpoint, lazy=lazy)
        return None
    except MountError as exc:
        return str(exc.strerror or exc)


# Seconds the CLI waits for a daemon before it says the daemon does not answer (a daemon
# stopped with SIGSTOP, or stuck): every control request and every probe of a mount point.
CONTROL_TIMEOUT = float(os.environ.get("CACHEFS_CONTROL_TIMEOUT", "10"))


class NotAnswering(CachefsError):
    """The daemon of a mount did not answer in time."""


def bounded(fn: Callable[[], T], timeout: float, what: str) -> T:
    """fn() in a thread, waited for at most `timeout` seconds: anything that touches a FUSE
    mount point (a stat, a getxattr, even resolving its path) blocks for as long as its
    daemon does not answer. Raises NotAnswering then; the thread is left behind."""
    result: list[tuple[bool, object]] = []

    def run() -> None:
        try:
            result.append((True, fn()))
        except BaseException as exc:
            result.append((False, exc))

    t = threading.Thread(target=run, daemon=True, name="cachefs-probe")
    t.start()
    t.join(timeout)
    if not result:
        raise NotAnswering(f"{what}: its daemon does not answer within {timeout:g} s (stopped or hung)")
    ok, value = result[0]
    if not ok:
        raise value  # type: ignore[misc]
    return value  # type: ignore[return-value]


def probe(mountpoint: str, timeout: float = CONTROL_TIMEOUT) -> tuple[str, str]:
    """(state, resolved path) of a mount point: "none" (nothing mounted there), "live",
    "dead" (the kernel says its daemon is gone: ENOTCONN), or "hung" (no answer within
    `timeout`: stopped, or stuck, but alive). Only "dead" is stale.

    statfs, because the kernel never caches it: stat() of a dead mount's root can still
    succeed from the attribute cache."""
    path = os.path.abspath(mountpoint)

    def look() -> tuple[str, str]:
        real = os.path.realpath(path)  # resolving the mount point itself asks its daemon
        if find_mount(real) is None:
            return "none", real
        try:
            os.statvfs(real)
        except OSError as exc:
            return ("dead" if exc.errno == errno.ENOTCONN else "live"), real
        return "live", real

    try:
        return bounded(look, timeout, path)
    except NotAnswering:
        return "hung", path


def read_control(mountpoint: str, name: str, timeout: float = CONTROL_TIMEOUT) -> dict:
    """Read one user.cachefs.* attribute of a live cachefs mount as JSON; a one-line
    CachefsError naming the mount if it is not one, is stale, or does not answer."""
    mp = os.path.abspath(mountpoint)

    def read() -> bytes:
        entry = find_mount(mp)
        if entry is None or entry.fstype != FSTYPE:
            raise CachefsError(f"{mountpoint} is not a cachefs mount point")
        try:
            return os.getxattr(mp, name)
        except OSError as exc:
            if exc.errno == errno.ENOTCONN:
                raise CachefsError(f"{mp} is a stale cachefs mount (its daemon died); "
                                   f"run: cachefs umount {mp}") from None
            raise CachefsError(f"cannot read stats of {mp}: {exc.strerror}") from None

    return json.loads(bounded(read, timeout, mp))


def control_address(mountpoint: str) -> str:
    info = read_control(mountpoint, "user.cachefs.info")
    address = info.get("control")
    if not address:
        raise CachefsError(f"the daemon of {mountpoint} has no control socket (an older cachefs?)")
    return "\0" + address[1:] if address.startswith("@") else address


def mount_of(path: str) -> tuple[str, str]:
    """(mount point, path inside the mount as '/a/b') of a path on a cachefs mount."""
    real = os.path.realpath(os.path.abspath(path))
    best = None
    for entry in cachefs_mounts():
        if _inside(real, entry.mountpoint) and (best is None or len(entry.mountpoint) > len(best)):
            best = entry.mountpoint
    if best is None:
        raise CachefsError(f"{path} is not on a cachefs mount")
    rel = "/" + os.path.relpath(real, best) if real != best else "/"
    return best, "/" if rel == "/." else rel

