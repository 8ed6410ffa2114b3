"""The RAM tier: entry files on a tmpfs, within --ram-size, kept or evicted by a Policy.

RAM-backed files rather than bytes in the daemon: the kernel can pass reads of a hot file
through to its tmpfs copy without entering the daemon at all (FUSE passthrough), and the
daemon path reads them with one pread. The directory is private to the daemon
(`cachefs-<uid>-<pid>-*` under /dev/shm, or $XDG_RUNTIME_DIR) and removed when it stops;
one a killed daemon left behind is removed by the next daemon that starts.

Invariants (checked by tests/test_tiers.py after every operation):
  - used_bytes == the blocks held, in 4 KiB pages, <= capacity at every moment;
  - a block larger than the whole tier is never admitted (and evicts nothing);
  - the blocks held are exactly the policy's keys.

Hinted blocks (cachefs/hints.py) are pinned: no policy evicts them until they are read.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import weakref

from cachefs.identity import BlockKey, EntryInfo
from cachefs.policy import DEFAULT_POLICY, Policy
from cachefs.stats import Stats
from cachefs.tiers.entry import allocated
from cachefs.tiers.store import FileStore

log = logging.getLogger(__name__)

TMPFS_MAGIC = 0x01021994
PREFIX = "cachefs-"


def _is_tmpfs(path: str) -> bool:
    try:
        import ctypes

        class _StatFs(ctypes.Structure):
            _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 112)]

        buf = _StatFs()
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.statfs(os.fsencode(path), ctypes.byref(buf)) != 0:
            return False
        return (buf.f_type & 0xFFFFFFFF) == TMPFS_MAGIC
    except (OSError, AttributeError):
        return False


def ram_base() -> str:
    """Where RAM tiers put their directories: the first tmpfs we may write to."""
    for base in ("/dev/shm", os.environ.get("XDG_RUNTIME_DIR") or ""):
        if base and os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK) and _is_tmpfs(base):
            return base
    return tempfile.gettempdir()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def sweep_stale(base: str) -> int:
    """Remove RAM tier directories of this user whose daemon is gone; how many."""
    removed = 0
    mine = f"{PREFIX}{os.getuid()}-"
    try:
        names = os.listdir(base)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(mine):
            continue
        try:
            pid = int(name[len(mine):].split("-", 1)[0])
        except ValueError:
            continue
        if not _pid_alive(pid):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
            removed += 1
    return removed


class MemoryTier(FileStore):
    name = "ram"

    def __init__(self, capacity: int, stats: Stats | None = None, policy: str | Policy = DEFAULT_POLICY,
                 max_idle: float | None = None, base: str | None = None):
        base = base or ram_base()
        if sweep_stale(base):
            log.info("removed RAM tier files a stopped cachefs left in %s", base)
        directory = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getuid()}-{os.getpid()}-", dir=base)
        super().__init__(directory, capacity, stats, policy, max_idle, direct=False)
        self._cleanup = weakref.finalize(self, shutil.rmtree, directory, True)
        if not _is_tmpfs(base):
            log.warning("no tmpfs to hold the RAM tier (looked at /dev/shm and $XDG_RUNTIME_DIR): its files "
                        "live on %s's filesystem", base)
        else:
            free = shutil.disk_usage(base).free
            if free < self._capacity:
                log.warning("%s has %d MiB free, less than the RAM tier's %d MiB: the tier will hold what fits "
                            "(in a container, raise --shm-size)", base, free >> 20, self._capacity >> 20)
        s = self._stats
        s.gauge("ram.used_bytes", lambda: self.policy.used)
        s.gauge("ram.capacity_bytes", lambda: self._capacity)
        s.gauge("ram.entries", lambda: len(self.policy))
        s.gauge("ram.files", lambda: len(self._entries))

    def put_pinned(self, key: BlockKey, data: bytes, info: EntryInfo, pin_limit: int) -> bool:
        """Store a hinted block, pinned until unpin(): it replaces unpinned blocks, oldest
        access first, whatever the policy (see Policy.admit_pinned). False if refused."""
        return self._put(key, data, info, lambda size: self.policy.admit_pinned(key, size, pin_limit), "refused")

    def pin(self, key: BlockKey) -> bool:
        """Hold a cached block until unpin(); False if it is not cached."""
        with self._lock:
            return self.policy.pin(key)

    def unpin(self, key: BlockKey) -> None:
        with self._lock:
            self.policy.unpin(key)

    @property
    def pinned_bytes(self) -> int:
        return self.policy.pinned_bytes

    def _write_failed(self, exc: OSError) -> None:
        log.warning("writing to the RAM tier failed (%s); the block is served from where it came", exc)

    def close(self) -> None:
        super().close()
        with self._lock:
            for key in list(self.policy.keys()):
                self.policy.remove(key)
            self._entries.clear()
        self._cleanup()


__all__ = ["MemoryTier", "allocated"]
