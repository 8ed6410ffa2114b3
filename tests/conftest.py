import pytest

from cachefs.memsource import MemorySource
from cachefs.stats import Stats
from cachefs.tiers.disk import DiskTier
from tests.helpers import FakeClock


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def source():
    return MemorySource()


@pytest.fixture
def disk(tmp_path):
    """An NVMe tier under tmp_path (each made by the test closed after it), as many times
    as the test makes one: a remount is a second."""
    tiers = []

    def make(capacity=8 << 20, stats=None, scrub=False, **kw):
        t = DiskTier(str(tmp_path / "store"), capacity, stats or Stats(), scrub=scrub, **kw)
        tiers.append(t)
        return t

    yield make
    for t in tiers:
        t.close()


# The fault table: each fault test reports what it injected, what the reader
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
    terminalreporter.section("faults injected")
    terminalreporter.write_line("| fault injected | what the reader saw | what the stats counted | data lost |")
    terminalreporter.write_line("|---|---|---|---|")
    for (fault, *rest), count in FAULT_TABLE.items():
        if count > 1:
            fault = f"{fault} ({count} cases)"
        terminalreporter.write_line("| " + " | ".join((fault, *rest)) + " |")
