"""Cache tiers. Each speaks one block protocol: get(key) -> bytes | None, put(key, data).

A miss, a checksum failure and a tier I/O error all return None to the caller (and are
counted in stats), so a failing tier degrades to a slower read, never to a failed one.
"""

from typing import Protocol


class Tier(Protocol):
    name: str

    def get(self, key: bytes) -> bytes | None: ...

    def put(self, key: bytes, data: bytes) -> bool: ...

    def discard(self, key: bytes) -> None: ...

    @property
    def used_bytes(self) -> int: ...

    @property
    def capacity(self) -> int: ...

    def close(self) -> None: ...
