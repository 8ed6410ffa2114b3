"""The daemon checks every control request itself (any program can send one, not only the
CLI): a malformed one is a "bad request" answer, never a crash or a job stuck "running"."""

from __future__ import annotations

import pytest

from cachefs.cli import _progress_line
from cachefs.daemon import control_handlers
from cachefs.memsource import MemorySource
from cachefs.prefetch import Prefetcher
from cachefs.warm import WarmJob
from tests.helpers import make_core


@pytest.fixture
def core():
    src = MemorySource()
    for i in range(5):
        src.add_file(f"/d/{i}", b"x" * 100)
    c = make_core(src, prefetcher=Prefetcher(0))
    yield c
    c.close()


@pytest.mark.parametrize("request_", [
    {"op": "warm", "paths": ["/"], "shard": [1, 0]},          # divided by zero in the feeder
    {"op": "warm", "paths": ["/"], "shard": [2, 2]},
    {"op": "warm", "paths": ["/"], "shard": [-1, 2]},
    {"op": "warm", "paths": ["/"], "shard": ["0", "2"]},
    {"op": "warm", "paths": ["/"], "shard": [0]},
    {"op": "warm", "paths": "/"},
    {"op": "warm", "paths": []},
    {"op": "warm", "paths": ["relative"]},
    {"op": "warm", "paths": ["/"], "interval": 0},
    {"op": "warm", "paths": ["/"], "interval": "fast"},
    {"op": "coverage", "path": 5},
    {"op": "coverage", "path": "/", "interval": 1e9},
])
def test_malformed_requests_are_refused_before_anything_starts(core, request_):
    handler = control_handlers(core)[request_["op"]]
    with pytest.raises(ValueError):
        handler(request_, lambda reply: None)
    assert not core.prefetcher._feeders   # no job was left behind


def test_a_shard_is_checked_by_the_job_too(core):
    with pytest.raises(ValueError):
        WarmJob(core, ["/"], shard=(1, 0))


def test_a_job_whose_walk_fails_ends_as_failed_not_running(core, monkeypatch):
    job = WarmJob(core, ["/d"])

    def broken(path):
        raise ZeroDivisionError("integer division or modulo by zero")

    monkeypatch.setattr(job, "_visit", broken)
    assert job() is None
    assert job.done and job.progress()["state"] == "failed" and "division" in job.progress()["error"]


def test_warm_progress_gives_no_share_or_eta_until_the_total_is_known():
    counting = {"files_done": 1007, "files_total": 1007, "bytes_loaded": 1 << 20, "elapsed_s": 2.0,
                "total_known": False}
    line = _progress_line(counting)
    assert "%" not in line and "ETA" not in line and "at least 1007" in line
    assert "(50%)" in _progress_line(dict(counting, files_total=2014, total_known=True))
