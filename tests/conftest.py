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


# The fault table of issue 7: each fault test reports what it injected, what the reader
# saw, what the stats counted and what data was lost, from its own run; the table is
# printed at the end of the session. Identical rows (one per case of a parametrized
# test) are printed once, with their count.
FAULT_TABLE: dict[tuple[str, str, str, str], int] = {}


@pytest.fixture
def fault_report():
    def report(fault: str, reader_saw: str, counted: str, lost: str = "none") -> None:
        row = (fault, reader_saw, counted, lost)
        FAULT_TABLE[row] = FAULT_TABLE.get(row, 0) + 1
    return report


def pytest_terminal_summary(terminalreporter):
    if not FAULT_TABLE:
        return
    terminalreporter.section("faults injected (issue 7)")
    terminalreporter.write_line("| fault injected | what the reader saw | what the stats counted | data lost |")
    terminalreporter.write_line("|---|---|---|---|")
    for (fault, *rest), count in FAULT_TABLE.items():
        if count > 1:
            fault = f"{fault} ({count} cases)"
        terminalreporter.write_line("| " + " | ".join((fault, *rest)) + " |")
