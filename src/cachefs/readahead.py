"""Read-ahead decisions as pure objects: offsets in, blocks to fetch out. No threads, no I/O.

`SequentialReadahead` follows one file. A read that continues where the last one ended
(give or take the kernel's own out-of-order read-ahead requests) is sequential: the window
of blocks fetched ahead doubles, from `initial` up to `maximum` blocks, and only blocks
not asked for before are returned. A read elsewhere is random: the window collapses and
nothing is fetched until the pattern holds again for `confirm` reads.

`DirectoryCursor` walks a directory's files in sorted order (the order a freshly copied
dataset lies on a disk and the order NFS lists it), for read-ahead across files.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class SequentialReadahead:
    def __init__(self, block_size: int, initial: int = 2, maximum: int = 32, confirm: int = 2,
                 slack_blocks: int = 2):
        self.block_size = block_size
        self.initial = initial
        self.maximum = maximum
        self.confirm = confirm
        self.slack = slack_blocks * block_size
        self.window = 0          # blocks ahead currently wanted (0: not sequential)
        self.streak = 0          # consecutive sequential reads seen
        self.next_end = -1       # where the last read ended
        self.issued_upto = -1    # highest block index already returned for fetching
        self.scattered = 0       # consecutive reads that were not sequential

    @property
    def random(self) -> bool:
        """The reader jumps around: at least two reads in a row were not sequential."""
        return self.scattered >= 2

    def on_read(self, offset: int, size: int, file_size: int) -> list[int]:
        """Record a read; return the block indices to fetch ahead (maybe none)."""
        end = min(offset + size, file_size)
        sequential = self.next_end >= 0 and abs(offset - self.next_end) <= self.slack
        if offset == 0 and self.next_end < 0:
            sequential = True  # a read from the start is how a sequential scan begins
        self.next_end = max(end, self.next_end) if sequential else end
        self.scattered = 0 if sequential else self.scattered + 1
        if not sequential:
            self.streak = 0
            self.window = 0
            self.issued_upto = -1
            return []
        self.streak += 1
        if self.streak < self.confirm:
            return []
        self.window = self.initial if self.window == 0 else min(self.maximum, self.window * 2)
        last_block = (file_size - 1) // self.block_size if file_size else -1
        current = (max(end, 1) - 1) // self.block_size
        start = max(current + 1, self.issued_upto + 1)
        stop = min(last_block, current + self.window)
        if start > stop:
            return []
        self.issued_upto = stop
        return list(range(start, stop + 1))


class StreamTable:
    """Per-file read-ahead state, bounded (LRU): cachefs has no per-open handles."""

    def __init__(self, factory, max_streams: int = 1024):  # type: ignore[no-untyped-def]
        self._factory = factory
        self._max = max_streams
        self._streams: OrderedDict[object, SequentialReadahead] = OrderedDict()

    def get(self, key: object) -> SequentialReadahead:
        st = self._streams.get(key)
        if st is None:
            st = self._streams[key] = self._factory()
            if len(self._streams) > self._max:
                self._streams.popitem(last=False)
        else:
            self._streams.move_to_end(key)
        return st

    def __len__(self) -> int:
        return len(self._streams)


class DirectoryCursor:
    """The files of one directory still to fetch ahead, in sorted order."""

    def __init__(self, directory: str, names: Iterable[str]):
        self.directory = directory
        self._names = sorted(names)
        self._pos = 0
        self._skip: set[str] = set()

    def skip(self, name: str) -> None:
        """A file already being read by the job: fetching it ahead would be no help."""
        self._skip.add(name)

    def next(self) -> str | None:
        while self._pos < len(self._names):
            name = self._names[self._pos]
            self._pos += 1
            if name not in self._skip:
                return name
        return None
