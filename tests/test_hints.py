"""Order hints without a mount: pins in the policy, the daemon's HintBoard driven through the
core with the prefetch executor stepped by hand, and the control protocol over a socket."""

import os
import random
import threading
import time

import pytest

from cachefs.blocks import block_key
from cachefs.control import ControlServer
from cachefs.daemon import control_streams
from cachefs.hintclient import HintClient
from cachefs.hints import attach
from cachefs.policy import make_policy
from cachefs.prefetch import Prefetcher
from cachefs.tiers.disk import DiskTier
from tests.helpers import make_core, run_until_idle

BS = 64 << 10
FILE = 49_152  # one block per file, like an ImageNet JPEG; whole pages, as the tiers count them


# -- pins in the policy --------------------------------------------------------------------

@pytest.mark.parametrize("name", ["keep", "lru"])
def test_pinned_blocks_replace_unpinned_oldest_first_and_are_never_victims(name):
    p = make_policy(name, capacity=10)
    for k in "abcde":
        assert p.admit(k, 2) == []
    p.hit("a")                                   # access order now b c d e a
    assert p.admit_pinned("x", 2, pin_limit=6) == ["b"]
    assert p.admit_pinned("y", 4, pin_limit=6) == ["c", "d"]
    assert p.pinned_bytes == 6 and p.is_pinned("x") and p.is_pinned("y")
    p.check()
    assert p.admit_pinned("z", 2, pin_limit=6) is None       # over the pin limit
    victims = p.admit("n", 2)
    assert (victims is None) == (name == "keep")              # keep: nothing idle to replace
    assert victims is None or not {"x", "y"} & set(victims)
    assert [k for k in "abcdexyzn" if p.is_pinned(k)] == ["x", "y"]
    p.check()
    # an ordinary admission never takes a pinned block, even under LRU
    q = make_policy(name, capacity=4)
    q.admit_pinned("p", 2, pin_limit=4)
    q.admit("o", 2)
    if name == "lru":
        assert q.admit("n", 2) == ["o"]
        assert q.admit("m", 4) is None          # only the pinned block could make room
    assert "p" in q and q.is_pinned("p")
    q.check()


def test_pins_are_counted_and_a_hard_shrink_takes_them_last():
    p = make_policy("keep", capacity=10)
    p.admit_pinned("a", 4, pin_limit=10)
    p.pin("a")                                   # a second job hinted it too
    p.admit("b", 4)
    p.unpin("a")
    assert p.is_pinned("a")
    assert p.shrink(4) == ["b"]                  # the unpinned block first
    assert p.shrink(4) == ["a"]                  # a hard budget beats a pin
    assert p.pinned_bytes == 0 and p.used == 0
    p.check()
    assert not p.pin("gone")


def test_a_pinned_block_first_read_is_not_a_reuse():
    p = make_policy("keep", capacity=1000)
    p.admit_pinned("a", 1, pin_limit=1000)
    for _ in range(200):
        p.miss()
    p.hit("a")
    assert p.mean_reuse == 0                     # no reuse distance learned from it


# -- the board, through the core -----------------------------------------------------------

def make_dataset(source, n, seed=0):
    rng = random.Random(seed)
    files = {}
    for i in range(n):
        path = f"/train/c{i % 10}/img_{i:05d}.jpg"
        files[path] = rng.randbytes(FILE)
        source.add_file(path, files[path])
    return files


def hinted_core(source, ram, disk=None):
    p = Prefetcher(workers=0)
    core = make_core(source, prefetcher=p, ram=ram, block_size=BS, disk=disk, hints=attach)
    return core, p


def run_epoch(core, p, board, order, files, session=None, feed_every=16):
    """Read `order` the way a job does, the hint window sent `feed_every` samples at a time
    ahead of the reads and the pool stepped between reads (it is faster than the job)."""
    sent = 0
    for i, path in enumerate(order):
        if session is not None and sent < min(len(order), i + 4 * feed_every):
            board.add(session, order[sent:sent + feed_every], yielded=i)
            sent += feed_every
        run_until_idle(p)
        assert core.read(path, 0, FILE) == files[path]


def ram_hit_rate(core, before=(0, 0)):
    hits = core.stats.get("ram.hits") - before[0]
    misses = core.stats.get("ram.misses") - before[1]
    return hits / (hits + misses)


def test_a_hinted_epoch_over_a_dataset_4x_ram_reads_from_ram(source):
    files = make_dataset(source, 200)                          # 200 x 48 KiB = 9.4 MiB
    ram = 2_600_000                                           # a quarter of it
    core, p = hinted_core(source, ram)
    board = core.hints
    order = list(files)
    random.Random(1).shuffle(order)
    run_epoch(core, p, board, order, files)                   # cold, no hints
    random.Random(2).shuffle(order)
    before = (core.stats.get("ram.hits"), core.stats.get("ram.misses"))
    run_epoch(core, p, board, order, files)                   # no hints: keep's quarter
    plain = ram_hit_rate(core, before)
    assert 0.1 < plain < 0.4
    random.Random(3).shuffle(order)
    session = board.open("job")
    before = (core.stats.get("ram.hits"), core.stats.get("ram.misses"))
    run_epoch(core, p, board, order, files, session=session)
    hinted = ram_hit_rate(core, before)
    assert hinted > 0.95, (plain, hinted)
    assert core.stats.get("hint.used") >= 190
    assert core.cache.ram.used_bytes <= ram
    assert session.pinned <= board.budget()
    core.cache.ram.check()
    board.close(session)
    assert core.cache.ram.pinned_bytes == 0 and not board.holding


def test_hints_fetch_from_nvme_first_and_offer_source_fetches_to_nvme(source, tmp_path):
    files = make_dataset(source, 40)
    disk = DiskTier(str(tmp_path / "blocks"), 64 << 20)
    core, p = hinted_core(source, ram=1_000_000, disk=disk)
    order = list(files)
    session = core.hints.open("job", lookahead=8)
    core.hints.add(session, order[:8], yielded=0)
    run_until_idle(p)
    assert core.stats.get("hint.from_source") == 8
    disk.flush()
    assert all(disk.probably_has(k) for k in core.cache.ram.policy.keys())  # noqa: SIM118
    core.hints.close(session)
    core.cache.ram.clear()                                   # RAM lost; NVMe kept
    disk.read_latency = 0.0002                               # a fast NVMe: the reader reads it
    session = core.hints.open("job", lookahead=8)
    core.hints.add(session, order[:8], yielded=0)
    run_until_idle(p)
    assert core.stats.get("hint.left_on_disk") == 8 and core.cache.ram.pinned_bytes == 0
    core.hints.close(session)
    disk.read_latency = 0.005                                # a slow one: fetched ahead
    session = core.hints.open("job", lookahead=8)
    core.hints.add(session, order[:8], yielded=0)
    run_until_idle(p)
    assert core.stats.get("hint.from_disk") == 8
    reads = source.calls["read_range"]
    for path in order[:8]:
        assert core.read(path, 0, FILE) == files[path]
    assert source.calls["read_range"] == reads               # all from RAM
    disk.close()


def test_window_stays_within_budget_and_advances_as_the_job_reads(source):
    files = make_dataset(source, 100)
    core, p = hinted_core(source, ram=1_000_000)             # budget: 500 KB = 10 files
    board = core.hints
    order = list(files)
    session = board.open("job")
    board.add(session, order, yielded=0)
    run_until_idle(p)
    assert core.stats.get("hint.from_source") == 10
    assert session.pinned == 10 * FILE <= board.budget()
    for path in order[:5]:
        core.read(path, 0, FILE)
    assert session.pinned == 5 * FILE
    run_until_idle(p)                                       # the window moved on by 5
    assert core.stats.get("hint.from_source") == 15
    core.cache.ram.check()


def test_an_epoch_cut_short_or_a_job_that_skips_leaves_nothing_pinned(source):
    files = make_dataset(source, 60)
    core, p = hinted_core(source, ram=2_000_000)
    board = core.hints
    order = list(files)
    session = board.open("job", lookahead=10)
    board.add(session, order[:20], yielded=0)
    run_until_idle(p)
    assert session.pinned > 0
    board.add(session, [], yielded=40)                       # the sampler ran 40 ahead: pins
    assert session.pinned == 0                               # 30 behind it are skipped ones
    assert core.stats.get("hint.expired") > 0
    board.add(session, order[20:30], yielded=40)             # already passed: skipped in queue
    run_until_idle(p)
    assert session.pinned == 0 and core.stats.get("hint.skipped") == 10
    second = board.open("job 2")
    board.add(second, order[30:40], yielded=0)
    run_until_idle(p)
    assert core.cache.ram.pinned_bytes > 0
    board.close(second)                                      # the epoch ended early
    assert core.cache.ram.pinned_bytes == 0 and board.holding  # (the first session is open)
    board.close(session)
    assert not board.holding
    core.cache.ram.check()


def test_files_the_job_read_before_their_fetch_are_not_pinned_and_watchers_hear_sessions(source):
    files = make_dataset(source, 40)
    core, p = hinted_core(source, ram=4_000_000)
    board = core.hints
    heard: list[bool] = []
    board.watch(heard.append)
    order = list(files)
    session = board.open("job")
    second = board.open("job 2")
    assert heard == [True]                                   # the first session only
    board.add(session, order[:20], yielded=0)
    for path in order[:10]:                                  # the job got ahead of the pool
        assert core.read(path, 0, FILE) == files[path]
    run_until_idle(p)
    assert core.stats.get("hint.passed") == 10               # read already: not pinned
    assert core.stats.get("hint.from_ram") == 0
    assert set(session.holds) == {block_key(core.namespace, core.file_id(path), 0, BS) for path in order[10:20]}
    for path in order[10:20]:
        assert core.read(path, 0, FILE) == files[path]
    assert session.pinned == 0 and core.stats.get("hint.used") == 10
    board.close(session)
    assert heard == [True]
    board.close(second)                                      # the last one
    assert heard == [True, False] and not board.holding
    late: list[bool] = []
    third = board.open("job 3")
    board.watch(late.append)                                 # a watcher added while a session is open
    board.close(third)
    assert late == [True, False] and heard == [True, False, True, False]


def test_two_jobs_share_the_budget_and_each_reads_from_ram(source):
    files = make_dataset(source, 120)
    core, p = hinted_core(source, ram=2_000_000)
    board = core.hints
    a_order, b_order = list(files), list(files)
    random.Random(5).shuffle(a_order)
    random.Random(6).shuffle(b_order)
    a, b = board.open("a"), board.open("b")
    board.add(a, a_order[:40], 0)
    board.add(b, b_order[:40], 0)
    run_until_idle(p)
    assert a.pinned <= board.budget() and b.pinned <= board.budget()
    assert a.pinned > 0 and b.pinned > 0
    assert core.cache.ram.pinned_bytes <= board.limit
    before = (core.stats.get("ram.hits"), core.stats.get("ram.misses"))
    for i in range(40):
        for path in (a_order[i], b_order[i]):
            assert core.read(path, 0, FILE) == files[path]
        run_until_idle(p)
    assert ram_hit_rate(core, before) > 0.9
    board.close(a)
    board.close(b)
    assert core.cache.ram.pinned_bytes == 0
    core.cache.ram.check()


def test_a_hinted_file_that_fails_is_counted_and_the_rest_go_on(source):
    files = make_dataset(source, 10)
    core, p = hinted_core(source, ram=2_000_000)
    session = core.hints.open("job")
    core.hints.add(session, ["/train/missing.jpg", *list(files)[:3]], 0)
    run_until_idle(p)
    assert core.stats.get("hint.errors") == 1 and core.stats.get("hint.from_source") == 3


def test_without_hints_nothing_changes(source):
    files = make_dataset(source, 20)
    core, p = hinted_core(source, ram=2_000_000)
    for path in files:
        core.read(path, 0, FILE)
    run_until_idle(p)
    assert core.hints is not None and not core.hints.holding
    assert core.stats.get("hint.from_source") == 0 and core.cache.ram.pinned_bytes == 0


# -- the control protocol ------------------------------------------------------------------

@pytest.fixture
def served(source):
    files = make_dataset(source, 30)
    p = Prefetcher(workers=2)
    core = make_core(source, prefetcher=p, ram=4_000_000, block_size=BS, hints=attach)
    p.start()
    address = f"\0cachefs-test-hints-{os.getpid()}-{threading.get_ident()}"
    server = ControlServer(address, {}, streams=control_streams(core))
    server.start()
    yield core, address, files
    server.close()
    core.close()


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_client_session_over_the_socket_and_release_when_the_client_goes(served):
    core, address, files = served
    client = HintClient(address, lookahead=64, label="test")
    assert client.active and client.session == 1 and client.budget == core.hints.budget()
    assert client.send(list(files)[:10], yielded=0)
    assert wait_for(lambda: core.stats.get("hint.from_source") == 10)
    assert wait_for(lambda: core.cache.ram.pinned_bytes == 10 * FILE)
    client.close()                                          # what kill -9 of the job does too
    assert wait_for(lambda: core.cache.ram.pinned_bytes == 0 and core.stats.snapshot()["hint"]["sessions"] == 0)


def test_client_without_a_daemon_turns_hints_off_with_a_warning(caplog):
    client = HintClient("\0cachefs-test-nobody-listens")
    assert not client.active and not client.send(["/a"], 0)
    assert "order hints off" in caplog.text
