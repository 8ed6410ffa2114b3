"""Source faults through the core, without a mount: errors keep their errno, a hung source
times out instead of blocking its reader, and a source that stopped answering leaves what
is cached readable (issue 7, items 1-3)."""

import errno
import logging
import threading
import time

import pytest

from cachefs import guard as guard_mod
from tests.helpers import make_core

BS = 64 << 10


@pytest.fixture
def quick_retry(monkeypatch):
    monkeypatch.setattr(guard_mod, "SOURCE_RETRY", 0.2)


def files(source, n=6, size=3000):
    for i in range(n):
        source.add_file(f"/d/f{i}", bytes([i]) * size)


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOENT, errno.ESTALE, errno.EACCES])
def test_a_source_error_reaches_the_reader_as_that_errno_and_the_rest_is_served(source, code, fault_report):
    files(source)
    core = make_core(source, block_size=BS, source_timeout=5)
    core.getattr("/d/f0")
    source.faults[("read_range", "/d/f0")] = code
    with pytest.raises(OSError) as info:
        core.read("/d/f0", 0, 100)
    assert info.value.errno == code
    assert core.read("/d/f1", 0, 100) == bytes([1]) * 100            # the rest still served
    assert core.stats.snapshot()["source"]["down"] == 0
    counted = core.stats.get("source.errors")
    assert counted == (0 if code == errno.ENOENT else 1)             # "no such file" is an answer
    fault_report(f"source read fails with {errno.errorcode[code]}", f"{errno.errorcode[code]}; other files served",
                 f"source.errors={counted}, source.down=0")
    core.close()


def test_a_hung_request_fails_with_etimedout_and_starves_no_other_reader(source):
    files(source)
    core = make_core(source, block_size=BS, source_timeout=0.3)
    for i in range(6):
        core.getattr(f"/d/f{i}")                                        # metadata cached
    source.hang("/d/f0")
    result = {}

    def hung_reader():
        start = time.monotonic()
        try:
            core.read("/d/f0", 0, 100)
        except OSError as exc:
            result["errno"], result["took"] = exc.errno, time.monotonic() - start

    t = threading.Thread(target=hung_reader)
    t.start()
    time.sleep(0.05)
    for i in range(1, 6):                                               # while it hangs
        assert core.read(f"/d/f{i}", 0, 100) == bytes([i]) * 100
    t.join(5)
    assert result["errno"] == errno.ETIMEDOUT and 0.25 < result["took"] < 2
    snap = core.stats.snapshot()
    assert snap["source"]["timeouts"] == 1 and snap["source"]["down"] == 0   # one file, not the source
    source.release()
    assert core.read("/d/f0", 0, 100) == bytes([0]) * 100
    core.close()


def test_a_source_that_stops_answering_serves_what_is_cached_and_fails_the_rest_fast(
        source, clock, quick_retry, caplog):
    caplog.set_level(logging.WARNING)
    files(source)
    core = make_core(source, block_size=BS, source_timeout=0.2, clock=clock, metadata_ttl=10)
    for i in range(3):
        assert core.read(f"/d/f{i}", 0, 3000) == bytes([i]) * 3000      # f0-f2 cached in full
    for i in range(3, 6):
        core.getattr(f"/d/f{i}")
    core.readdir("/d")
    source.hang()                                                       # the server is gone
    failures = []
    for i in range(3, 6):                                               # three timeouts in a row
        with pytest.raises(OSError) as info:
            core.read(f"/d/f{i}", 0, 100)
        failures.append(info.value.errno)
    assert failures == [errno.ETIMEDOUT] * 3
    assert core.stats.snapshot()["source"]["down"] == 1
    assert "source not answering" in caplog.text
    clock.advance(60)                                                   # metadata expired too
    start = time.monotonic()
    for i in range(3):
        assert core.read(f"/d/f{i}", 0, 3000) == bytes([i]) * 3000      # cached: still served
    assert [e.name for e in core.readdir("/d")] == [f"f{i}" for i in range(6)]
    with pytest.raises(OSError) as info:
        core.read("/d/f4", 0, 100)                                      # not cached: fails at once
    assert info.value.errno == errno.ETIMEDOUT and time.monotonic() - start < 0.15
    snap = core.stats.snapshot()
    assert snap["metadata"]["stale_served"] >= 4 and snap["source"]["fast_failures"] >= 1
    source.release()                                                    # it comes back
    time.sleep(0.25)                                                    # the next probe is due
    assert core.read("/d/f4", 0, 100) == bytes([4]) * 100
    assert core.stats.snapshot()["source"]["down"] == 0
    assert "source answering again" in caplog.text
    core.close()


def test_without_a_timeout_requests_run_in_the_callers_thread(source):
    files(source, n=1)
    core = make_core(source, block_size=BS)
    seen = []
    real = source.read_range
    source.read_range = lambda *a: (seen.append(threading.current_thread()), real(*a))[1]
    core.read("/d/f0", 0, 10)
    assert seen == [threading.current_thread()]


# -- item 10: a model of open/read/seek/close through the core ---------------------------------

from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule  # noqa: E402

from cachefs.errors import SourceChanged  # noqa: E402
from cachefs.memsource import MemorySource  # noqa: E402

SMALL_BS = 4096
NAMES = ("/a", "/b", "/dir/c", "/dir/d")


class OpenReadSeekClose(RuleBasedStateMachine):
    """Handles pin the identity the file had at open (as the FUSE layer's per-handle mode
    does); a handle reads exactly that version's bytes, or fails with ESTALE once the
    source has another version: never a byte of the wrong version, never a mix."""

    handles = Bundle("handles")

    def __init__(self) -> None:
        super().__init__()
        self.source = MemorySource()
        self.versions: dict[str, bytes] = {}
        self.serial = 0
        for name in NAMES:
            self._write(name, 3 * SMALL_BS + 123)
        # a RAM tier of 3 blocks: evictions and refetches all the time
        self.core = make_core(self.source, block_size=SMALL_BS, ram=3 * SMALL_BS, metadata_ttl=0)

    def _write(self, name: str, size: int) -> None:
        self.serial += 1
        data = bytes((self.serial * 7 + i) % 251 for i in range(size))
        self.source.add_file(name, data)
        self.versions[name] = data

    @rule(target=handles, name=st.sampled_from(NAMES))
    def open(self, name):
        fid = self.core.file_id(name)
        return {"name": name, "fid": fid, "data": self.versions[name], "pos": 0}

    @rule(h=handles, pos=st.integers(0, 4 * SMALL_BS))
    def seek(self, h, pos):
        h["pos"] = pos

    @rule(h=handles, size=st.integers(0, 2 * SMALL_BS + 7))
    def read(self, h, size):
        try:
            got = self.core.read(h["name"], h["pos"], size, fid=h["fid"])
        except SourceChanged:
            assert self.versions[h["name"]] != h["data"], "ESTALE for a file that did not change"
            return
        assert got == h["data"][h["pos"]:h["pos"] + size]
        h["pos"] += len(got)

    @rule(h=consumes(handles))
    def close(self, h):
        pass  # a handle holds nothing in the core but its identity

    @rule(name=st.sampled_from(NAMES), size=st.integers(0, 4 * SMALL_BS))
    def rewrite(self, name, size):
        self._write(name, size)

    @invariant()
    def tier_within_budget(self):
        self.core.cache.ram.check()


OpenReadSeekClose.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
test_open_read_seek_close_model = OpenReadSeekClose.TestCase
