"""Coverage: how much of a subtree is cached, per tier, in files and bytes.

The answer to "is my dataset warm yet". It walks the subtree depth first in sorted order
through the core's metadata cache (so a tree listed once costs the source nothing again)
and looks every block of every regular file up in each tier's index: no block is read,
nothing is fetched, and no access is counted by a policy.

A file counts as cached in a tier when all its blocks are there; "cached" (any tier)
when each block is in RAM or on NVMe. The kernel's page cache is a further tier that
cachefs cannot see: a file served from it may show as uncached here only if cachefs
itself no longer holds it.
"""

from __future__ import annotations

import stat as stat_mod
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cachefs.blocks import block_extent, block_key

if TYPE_CHECKING:
    from cachefs.core import Core

TIERS = ("ram", "disk", "cached")


def empty_report(path: str) -> dict[str, Any]:
    report: dict[str, Any] = {"path": path, "files": 0, "bytes": 0, "errors": 0, "elapsed_s": 0.0}
    for tier in TIERS:
        report[tier] = {"files": 0, "bytes": 0}
    return report


def coverage(core: Core, path: str, progress: Callable[[dict[str, Any]], None] | None = None,
             every: float = 0.5, clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """The coverage report of `path` (a file or a directory of the mount, "/"-rooted).

    `progress`, if given, is called with the report so far at most every `every` seconds.
    Raises OSError (ENOENT, ...) if `path` itself cannot be looked up; errors further down
    are counted in "errors" and the walk goes on.
    """
    report = empty_report(path)
    start = last = clock()
    root = core.getattr(path)  # a missing root is the caller's error, not a count
    todo: list[tuple[str, bool]] = [(path, root.is_dir)]
    while todo:
        current, is_dir = todo.pop()
        try:
            if is_dir:
                entries = sorted(core.readdir(current), key=lambda e: e.name, reverse=True)
                base = current.rstrip("/")
                for e in entries:  # pushed in reverse: popped in sorted order
                    if stat_mod.S_ISDIR(e.type_mode):
                        todo.append((f"{base}/{e.name}", True))
                    elif stat_mod.S_ISREG(e.type_mode):
                        todo.append((f"{base}/{e.name}", False))
            else:
                _count_file(core, current, report)
        except OSError:
            report["errors"] += 1
        now = clock()
        if progress is not None and now - last >= every:
            last = now
            report["elapsed_s"] = round(now - start, 3)
            progress(dict(report, **{t: dict(report[t]) for t in TIERS}))
    report["elapsed_s"] = round(clock() - start, 3)
    return report


def _count_file(core: Core, path: str, report: dict[str, Any]) -> None:
    fid = core.file_id(path)
    bs = core.block_size
    blocks = -(-fid.size // bs)
    ram, disk = core.cache.ram, core.cache.disk
    held = {"ram": 0, "disk": 0, "cached": 0}
    whole = {"ram": True, "disk": True, "cached": True}
    for index in range(blocks):
        key = block_key(core.namespace, fid, index, bs)
        length = block_extent(index, fid.size, bs)[1]
        in_ram = key in ram
        on_disk = disk is not None and disk.probably_has(key)
        for tier, there in (("ram", in_ram), ("disk", on_disk), ("cached", in_ram or on_disk)):
            if there:
                held[tier] += length
            else:
                whole[tier] = False
    report["files"] += 1
    report["bytes"] += fid.size
    for tier in TIERS:
        report[tier]["bytes"] += held[tier]
        report[tier]["files"] += whole[tier]
