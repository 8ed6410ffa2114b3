"""Coverage: how much of a subtree is cached, per tier, in files and bytes.

The answer to "is my dataset warm yet". It walks the subtree depth first in sorted order
through the core's metadata cache (so a tree listed once costs the source nothing again,
and one never listed a request per directory) and looks every block of every regular file
up in each tier's index: no block is read, nothing is fetched, and no access is counted by
a policy. A file's identity (size, mtime) comes from what the daemon knows: its last
lookup, or the NVMe tier's index (listings bring names only). A file known to neither
was never cached (or only in RAM, longer ago than --metadata-ttl): it counts as uncached,
and its bytes are unknown ("unknown_size") unless `exact` has such files stat'ed on the
source, in parallel.

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
from cachefs.identity import FileId

if TYPE_CHECKING:
    from cachefs.core import Core
    from cachefs.identity import Attr

TIERS = ("ram", "disk", "cached")


def empty_report(path: str) -> dict[str, Any]:
    report: dict[str, Any] = {"path": path, "files": 0, "bytes": 0, "errors": 0, "elapsed_s": 0.0,
                              "directories": 0, "unknown_size": 0}
    for tier in TIERS:
        report[tier] = {"files": 0, "bytes": 0}
    return report


def coverage(core: Core, path: str, progress: Callable[[dict[str, Any]], None] | None = None,
             every: float = 0.5, clock: Callable[[], float] = time.monotonic,
             exact: bool = False) -> dict[str, Any]:
    """The coverage report of `path` (a file or a directory of the mount, "/"-rooted).

    `progress`, if given, is called with the report so far at most every `every` seconds.
    `exact`: files the daemon knows nothing of are stat'ed on the source (see above).
    Raises OSError (ENOENT, ...) if `path` itself cannot be looked up; errors further down
    are counted in "errors" and the walk goes on.
    """
    report = empty_report(path)
    start = last = clock()
    root = core.getattr(path)  # a missing root is the caller's error, not a count
    if not root.is_dir:
        if root.is_file:
            _count_file(core, path, root, report)
        report["elapsed_s"] = round(clock() - start, 3)
        return report
    def tick() -> None:
        nonlocal last
        now = clock()
        if progress is not None and now - last >= every:
            last = now
            report["elapsed_s"] = round(now - start, 3)
            progress(dict(report, **{t: dict(report[t]) for t in TIERS}))

    todo = [path]
    while todo:
        current = todo.pop()
        try:
            entries = sorted(core.readdir(current), key=lambda e: e.name)
        except OSError:
            report["errors"] += 1
            continue
        report["directories"] += 1
        base = current.rstrip("/")
        files = [f"{base}/{e.name}" for e in entries if stat_mod.S_ISREG(e.type_mode)]
        todo.extend(f"{base}/{e.name}" for e in reversed(entries) if stat_mod.S_ISDIR(e.type_mode))
        tick()
        attrs = core.attrs_of(files, fetch=exact)
        for file in files:
            _count_file(core, file, attrs.get(file), report)
            tick()
    report["elapsed_s"] = round(clock() - start, 3)
    return report


def _count_file(core: Core, path: str, attr: Attr | None, report: dict[str, Any]) -> None:
    report["files"] += 1
    if attr is None:  # never looked up, not in the index: nothing of it is cached
        report["unknown_size"] += 1
        return
    if not attr.is_file:  # changed into something else since it was listed
        report["errors"] += 1
        report["files"] -= 1
        return
    fid = FileId.of(path, attr)
    bs = core.block_size
    blocks = -(-fid.size // bs)
    held = {"ram": 0, "disk": 0, "cached": 0}
    whole = {"ram": True, "disk": True, "cached": True}
    for index in range(blocks):
        key = block_key(core.namespace, fid, index, bs)
        length = block_extent(index, fid.size, bs)[1]
        in_ram, on_disk = core.cache.held(key)
        for tier, there in (("ram", in_ram), ("disk", on_disk), ("cached", in_ram or on_disk)):
            if there:
                held[tier] += length
            else:
                whole[tier] = False
    report["bytes"] += fid.size
    for tier in TIERS:
        report[tier]["bytes"] += held[tier]
        report[tier]["files"] += whole[tier]
