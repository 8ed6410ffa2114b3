"""The restart check's queue (cachefs/dircheck.py): each directory is checked once it is
due, less the margin, and once however often it is queued; one that needs no check is
passed by."""

import threading
import time

from cachefs.dircheck import AHEAD_MAX, CheckQueue


class _Dirs:
    def __init__(self, due: dict[str, float | None]):
        self.due = due
        self.checked: list[tuple[str, float]] = []
        self.asked: list[str] = []

    def due_of(self, directory: str) -> float | None:
        self.asked.append(directory)
        if any(d == directory for d, _ in self.checked):
            return None  # checked: as Metadata._check_due says
        return self.due[directory]

    def check(self, directory: str) -> None:
        self.checked.append((directory, time.time()))
        if directory == "/fails":
            raise OSError(5, "the source said no")


def test_a_directory_is_checked_when_due_less_the_margin_and_once():
    start = time.time()
    dirs = _Dirs({"/now": 0.0, "/later": start + 2.0, "/fails": 0.0, "/never": None})
    queue = CheckQueue(dirs.due_of, dirs.check, ttl=5.0)  # margin: a fifth of the TTL
    assert queue.ahead == 1.0 and CheckQueue(dirs.due_of, dirs.check, ttl=3600).ahead == AHEAD_MAX
    for directory in ("/fails", "/later", "/now", "/never", "/later", "/now", "/later"):
        queue.submit(directory)
    deadline = time.monotonic() + 10
    while len(dirs.checked) < 2:
        assert time.monotonic() < deadline, dirs.checked
        time.sleep(0.01)
    if time.time() < start + 0.9:  # (not yet due: waiting, unless this thread was held up that long)
        assert queue.waiting == {"/later"}
    while len(dirs.checked) < 3:
        assert time.monotonic() < deadline, dirs.checked
        time.sleep(0.01)
    queue.stop(wait=10)
    assert sorted(d for d, _ in dirs.checked) == ["/fails", "/later", "/now"]  # (an error stops nothing)
    assert dict(dirs.checked)["/later"] >= start + 1.0  # due at 2 s, looked at again 1 s before
    assert dirs.asked.count("/later") == 2  # queued three times: waiting once, then due
    assert dirs.asked.count("/never") == 1 and queue.waiting == set()


def test_stop_ends_the_thread_while_a_directory_waits():
    dirs = _Dirs({"/later": time.time() + 3600})
    queue = CheckQueue(dirs.due_of, dirs.check, ttl=3600)
    queue.submit("/later")
    deadline = time.monotonic() + 10
    while not dirs.asked:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    queue.stop(wait=10)
    assert queue._thread is not None and not queue._thread.is_alive()
    assert dirs.checked == []


def test_a_directory_being_checked_is_not_handed_out_again():
    """Until its check has listed it, a directory is not checked (Metadata._check_due says
    "now" still): queued again meanwhile, it is not listed twice."""
    release, started, done = threading.Event(), threading.Event(), []

    def check(directory):
        started.set()
        assert release.wait(10)
        done.append(directory)

    queue = CheckQueue(lambda d: None if done else 0.0, check, ttl=60)
    queue.submit("/slow")
    assert started.wait(10)
    for _ in range(3):
        queue.submit("/slow")
    queue.submit("")  # (stop: the thread has looked at every one before it)
    queue._thread.join(10)
    release.set()
    deadline = time.monotonic() + 10
    while not done:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.1)
    assert done == ["/slow"]
