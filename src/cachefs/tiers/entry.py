"""An entry of a file store (cachefs/tiers/store.py): one cached file version in memory,
which of its blocks are present, their hashes, who has it open."""

from __future__ import annotations

from cachefs.identity import Attr


def allocated(size: int) -> int:
    """Bytes `size` bytes of a file take on a filesystem with 4 KiB blocks."""
    return -(-size // 4096) * 4096


class Entry:
    """One cached file version: which blocks are present, their hashes, who has it open."""

    __slots__ = ("attr", "block_size", "eid", "hashes", "path", "present", "punched", "stored_at", "unverified",
                 "users")

    def __init__(self, eid: bytes, path: str, attr: Attr, block_size: int, stored_at: float):
        self.eid = eid                  # (the tier's dict key, the same object: no bytes of its own)
        self.path = path
        self.attr = attr
        self.block_size = block_size
        self.stored_at = stored_at      # wall clock, when its attributes were last known good
        self.hashes: list[int | None] = [None] * max(1, -(-attr.size // block_size))
        self.present = 0
        self.unverified: set[int] | None = None  # blocks to check before they are served
        self.users = 0                  # opens the kernel holds for passthrough
        self.punched = 0                # blocks punched out so far (a read across one is not served)

    @property
    def name(self) -> str:
        """The entry id in hex: its file's name (made when asked: 81 bytes less per entry)."""
        return self.eid.hex()

    @property
    def size(self) -> int:
        return self.attr.size

    @property
    def held(self) -> bool:
        """Whether a block of it has its hash (a table records it; see table._held)."""
        return any(h is not None for h in self.hashes)

    @property
    def complete(self) -> bool:
        return self.present == len(self.hashes)

    def extent(self, index: int) -> tuple[int, int]:
        start = index * self.block_size
        return start, max(0, min(self.block_size, self.attr.size - start))
