"""The source's extended attributes as the daemon keeps them (cachefs/metadata.py): each
path's names from one listxattr, and a value once asked for, for --metadata-ttl. `ls -l`
asks for two attributes of every file, and most files have none: those share one empty
map."""

from __future__ import annotations

import errno
from collections.abc import Callable

from cachefs.guard import SourceGuard
from cachefs.source import Source
from cachefs.stats import Stats
from cachefs.ttlcache import TTLCache

_NO_XATTRS: dict[str, bytes | None] = {}  # never written to: no name is in it


class XattrCache:
    def __init__(self, source: Source, guard: SourceGuard, stats: Stats, ttl: float, max_entries: int,
                 clock: Callable[[], float]):
        self._source = source
        self._guard = guard
        self._stats = stats
        self._ttl = ttl
        self._cache = TTLCache(max_entries, clock)

    def _names(self, path: str) -> dict[str, bytes | None]:
        """`path`'s extended attributes: name -> value (None until asked for)."""
        known = self._cache.get(path)
        if isinstance(known, dict):
            self._stats.incr("metadata.hits")
            return known
        try:
            names = self._guard.call("listxattr", self._source.listxattr, path)
        except OSError as exc:
            if exc.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP):
                raise
            names = []
        fresh: dict[str, bytes | None] = dict.fromkeys(names) if names else _NO_XATTRS
        self._cache.put(path, fresh, self._ttl)
        return fresh

    def get(self, path: str, name: str) -> bytes:
        known = self._names(path)
        if name not in known:
            raise OSError(errno.ENODATA, "no such attribute", path)
        value = known[name]
        if value is None:
            value = known[name] = self._guard.call("getxattr", self._source.getxattr, path, name)
        return value

    def list(self, path: str) -> list[str]:
        return list(self._names(path))

    def pop(self, path: str) -> None:
        self._cache.pop(path)
