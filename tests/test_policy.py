"""Cache policies, alone: admission, victims, ageing, and their invariants.

Invariants (Policy.check, after every operation): used == sum of entry sizes <= capacity;
every stale key is an entry. The epoch tests replay the access patterns of issue #4
through the policy itself (one block per file), as tools/simulate.py does through the
whole core.
"""

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cachefs.policy import KeepPolicy, LRUPolicy, make_policy, parse_policy_spec


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def access(policy, key, size=1):
    """One read through a tier using `policy`: True on a hit; a miss offers the block."""
    if key in policy:
        policy.hit(key)
        return True
    policy.miss()
    policy.admit(key, size)
    policy.check()
    return False


def epochs(policy, files, n_epochs, order="random", seed=0):
    """Hit rate of each epoch."""
    rng = random.Random(seed)
    rates = []
    for _ in range(n_epochs):
        keys = list(files)
        if order == "random":
            rng.shuffle(keys)
        rates.append(sum(access(policy, k) for k in keys) / len(keys))
    return rates


def test_keep_admits_until_full_then_keeps():
    p = KeepPolicy(3)
    for k in "abc":
        assert p.admit(k, 1) == []
    assert p.admit("d", 1) is None  # full, nothing stale or idle: refused
    assert sorted(p.keys()) == ["a", "b", "c"]
    p.check()


def test_lru_evicts_the_least_recently_used():
    p = LRUPolicy(3)
    for k in "abc":
        p.admit(k, 1)
    p.hit("a")
    assert p.admit("d", 1) == ["b"]
    assert sorted(p.keys()) == ["a", "c", "d"]
    p.check()


@pytest.mark.parametrize("cls", [KeepPolicy, LRUPolicy])
def test_stale_entries_go_first(cls):
    p = cls(3)
    for k in "abc":
        p.admit(k, 1)
    p.hit("a")
    p.mark_stale("c")  # its source file changed
    assert p.admit("d", 1) == ["c"]
    p.check()


@pytest.mark.parametrize("cls", [KeepPolicy, LRUPolicy])
def test_a_guess_never_evicts(cls):
    p = cls(2)
    p.admit("a", 1)
    p.admit("b", 1)
    p.mark_stale("a")
    assert p.admit("c", 1, evict=False) is None
    assert sorted(p.keys()) == ["a", "b"]


def test_keep_replaces_entries_idle_longer_than_max_idle():
    clock = FakeClock()
    p = KeepPolicy(2, max_idle=60, clock=clock)
    p.admit("a", 1)
    clock.now = 30
    p.admit("b", 1)
    assert p.admit("c", 1) is None
    clock.now = 61  # a has been unread for 61 s, b for 31 s
    assert p.admit("c", 1) == ["a"]
    p.check()


def test_oversized_block_is_refused_without_evicting():
    p = LRUPolicy(10)
    p.admit("a", 6)
    assert p.admit("big", 11) is None
    assert p.keys() == ["a"]


def test_shrink_frees_bytes_whatever_the_policy():
    p = KeepPolicy(10)
    for k in "abcde":
        p.admit(k, 2)
    p.mark_stale("d")
    victims = p.shrink(3)
    assert victims[0] == "d" and len(victims) == 2 and p.used == 6
    p.check()


@pytest.mark.parametrize("ratio", [0.1, 0.35, 0.5, 0.9])
def test_keep_reaches_the_optimum_under_random_epochs(ratio):
    files = range(2000)
    keep = epochs(KeepPolicy(int(ratio * 2000)), files, 5)
    lru = epochs(LRUPolicy(int(ratio * 2000)), files, 5)
    assert keep[0] == 0
    assert all(abs(r - ratio) < 1e-9 for r in keep[1:]), keep  # exactly cache/dataset
    assert sum(lru[1:]) / 4 < 0.8 * ratio                     # LRU thrashes
    if ratio == 0.35:
        assert sum(keep[1:]) >= 1.5 * sum(lru[1:])


def test_keep_does_not_collapse_under_sequential_epochs():
    files = range(1000)
    assert epochs(KeepPolicy(400), files, 5, order="sorted")[1:] == [0.4] * 4
    assert epochs(LRUPolicy(400), files, 5, order="sorted")[1:] == [0.0] * 4


def test_keep_follows_a_change_of_working_set():
    p = KeepPolicy(1000)
    a = [("a", i) for i in range(2000)]
    b = [("b", i) for i in range(2000)]
    before = epochs(p, a, 5, seed=1)
    after = epochs(p, b, 4, seed=2)
    assert before[-1] == 0.5
    assert after[0] == 0
    assert after[1] >= 0.85 * 0.5, after  # most of B is in after one epoch
    assert after[2] == 0.5, after          # all of it, and the optimum, by the third


def test_policy_spec_parsing():
    assert parse_policy_spec("lru") == {"ram": "lru", "disk": "lru"}
    assert parse_policy_spec("ram=lru") == {"ram": "lru", "disk": "keep"}
    assert parse_policy_spec("ram=lru,disk=keep") == {"ram": "lru", "disk": "keep"}
    for bad in ("fifo", "ram=fifo", "gpu=lru", ""):
        with pytest.raises(ValueError):
            parse_policy_spec(bad)


ops = st.lists(st.tuples(st.sampled_from(["admit", "guess", "hit", "miss", "remove", "stale", "shrink", "tick"]),
                         st.integers(0, 15), st.integers(0, 40)), max_size=200)


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from(["keep", "lru"]), capacity=st.integers(0, 100), sequence=ops,
       max_idle=st.sampled_from([None, 5.0]))
def test_invariants_hold_under_any_sequence(name, capacity, sequence, max_idle):
    clock = FakeClock()
    p = make_policy(name, capacity, max_idle=max_idle, clock=clock)
    model: dict[int, int] = {}  # key -> size, what the tier would hold
    for op, key, size in sequence:
        if op in ("admit", "guess"):
            before = dict(model)
            victims = p.admit(key, size, evict=(op == "admit"))
            if victims is None:
                model.pop(key, None)  # a refused re-put drops the old copy
                assert key not in p
            else:
                assert op == "admit" or victims == []  # a guess never evicts
                assert all(v in before and v != key for v in victims)
                for v in victims:
                    model.pop(v)
                model[key] = size
        elif op == "hit":
            if key in model:
                p.hit(key)
            else:
                p.miss()
        elif op == "miss":
            p.miss()
        elif op == "remove":
            assert p.remove(key) == (key in model)
            model.pop(key, None)
        elif op == "stale":
            p.mark_stale(key)
        elif op == "shrink":
            for v in p.shrink(size):
                model.pop(v)
        else:
            clock.now += size
        p.check()
        assert sorted(p.keys()) == sorted(model)
        assert p.used == sum(model.values()) <= capacity


def test_simulate_tool_replays_through_the_core(tmp_path):
    """tools/simulate.py drives the real core and tiers; its figures match the policy's."""
    from tools import simulate

    for tier in ("ram", "disk"):
        keep = simulate.run(tier, "keep", "random", 0.5, files=200, epochs=4, block=1 << 20,
                            seed=0, ranks=4, workdir=str(tmp_path))
        lru = simulate.run(tier, "lru", "sequential", 0.5, files=200, epochs=4, block=1 << 20,
                           seed=0, ranks=4, workdir=str(tmp_path))
        # the optimum less each file's rounding to 4 KiB pages (and, on NVMe, the index)
        assert keep[0] == 0 and min(keep[2:]) >= (0.97 if tier == "ram" else 0.9) * 0.5, (tier, keep)
        assert lru[1:] == [0.0] * 3, (tier, lru)  # LRU's collapse under sequential epochs
    results = [{"tier": "ram", "policy": p, "pattern": "random", "ratio": r, "steady": r * 0.9}
               for p in ("keep", "lru") for r in (0.2, 0.5)]
    simulate.plot(results, str(tmp_path / "plot.png"))
    assert (tmp_path / "plot.png").stat().st_size > 10_000


def test_keep_never_evicts_in_a_first_pass_with_rereads_and_read_ahead():
    """A first epoch over more data than fits: blocks read in several pieces, and blocks
    fetched ahead then read, are not epoch-scale reuses; they must not make the tier take
    everything older for idle (that would turn keep into LRU)."""
    p = KeepPolicy(100)
    for i in range(1000):
        if i % 2:
            p.admit(("ahead", i), 1, evict=False)  # read-ahead: only into free room
            p.hit(("ahead", i))
        else:
            if ("f", i) not in p:
                p.miss()
                p.admit(("f", i), 1)
            p.hit(("f", i))  # the same block, a second read request
            p.hit(("f", i))
        p.check()
    assert len(p) == 100
    kept = p.keys()
    assert all(index < 200 for _, index in kept)  # the first blocks admitted, kept


@pytest.mark.parametrize("cls", [KeepPolicy, LRUPolicy])
def test_hits_in_a_batch_keep_the_books_of_hits_one_by_one(cls):
    """A serving process's report counts its opens' blocks in one call (hit_many): the
    tier's books, its victims and its idle thresholds come out as if each block had been
    hit on its own, through epochs that end windows, reuse entries, hit blocks fetched
    ahead and keys the tier does not hold."""
    rng = random.Random(3)
    one, batched = cls(60, clock=FakeClock()), cls(60, clock=FakeClock())
    pending: list = []
    for _ in range(6):
        order = list(range(100))
        rng.shuffle(order)
        for i in order:
            key = ("f", i)
            if rng.random() < 0.1:
                key = ("absent", i)  # a report of a file this tier let go meanwhile
            elif key not in one:
                assert key not in batched
                batched.hit_many(pending)  # (the report came before this miss)
                pending = []
                ahead = rng.random() < 0.2
                for p in (one, batched):
                    p.miss()
                    victims = p.admit(key, 1, evict=not ahead)
                    if p is one:
                        expected = victims
                    else:
                        assert victims == expected
                if key not in one:
                    continue
            one.hit(key)
            pending.append(key)
            if len(pending) == 7 or rng.random() < 0.05:
                batched.hit_many(pending)
                pending = []
        batched.hit_many(pending)
        pending = []
        for p in (one, batched):
            p.check()
        assert list(one._entries.items()) == list(batched._entries.items())
        assert (one.mean_reuse, one._max_reuse, one.long_run_hit_rate, one.collapsed, one._tick) == \
            (batched.mean_reuse, batched._max_reuse, batched.long_run_hit_rate, batched.collapsed, batched._tick)
    assert one.mean_reuse > 0  # the epochs' reuses were counted
