import pytest

from cachefs.core import Core
from cachefs.memsource import MemorySource
from cachefs.stats import Stats
from cachefs.tiers.memory import MemoryTier
from cachefs.tiers.multilevel import MultiLevelCache


class FakeClock:
    """A clock the test advances by hand: TTLs are tested without sleeping."""

    def __init__(self, start: float = 1000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def source():
    return MemorySource()


def make_core(source, *, ram=64 << 20, disk=None, block_size=64 << 10, clock=None, **kw):
    stats = Stats()
    cache = MultiLevelCache(MemoryTier(ram, stats), disk, stats)
    extra = {"clock": clock} if clock is not None else {}
    return Core(source, cache, stats, namespace=b"test", block_size=block_size, **extra, **kw)
