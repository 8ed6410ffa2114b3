"""Cache tiers, and the protocol every one of them speaks.

A tier holds blocks of file versions: `get` returns a block's bytes or None, `put` offers
one and returns whether the tier kept it. A miss, a checksum failure and a tier I/O error
all come back as None (counted in the tier's stats), and a tier that cannot go on raises
TierError (cachefs.errors), which the composite cache turns into a miss too: a failing
tier degrades to a slower read, never to a failed one.

The tiers: `memory.MemoryTier` (RAM, files on tmpfs) and `disk.DiskTier` (NVMe, files and
an index), both `store.FileStore`s, keyed by (entry id, index); `shared.SharedTier`
(memcached), which names a block by path and version instead, alike on every node, from
the EntryInfo passed along. `multilevel.MultiLevelCache` chains them and is the one door
the rest of cachefs goes through.
"""

from __future__ import annotations

from typing import Protocol

from cachefs.identity import BlockKey, EntryInfo


class Tier(Protocol):
    name: str

    def get(self, key: BlockKey, lo: int = 0, hi: int | None = None, info: EntryInfo | None = None) -> bytes | None:
        """Bytes [lo:hi] of the block, or None (a miss). `info`: the file version the
        block belongs to (a tier that names blocks by path and version needs it)."""
        ...

    def put(self, key: BlockKey, data: bytes, info: EntryInfo, evict: bool = True) -> bool:
        """Offer a block; whether the tier keeps it. With evict=False only free room is
        used (a guess never pushes out cached data)."""
        ...

    def close(self) -> None: ...
