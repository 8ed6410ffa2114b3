"""Real mounts: cachefs through its CLI (daemonized, as users run it) and tools/slowfs."""

import os
import shutil

import pytest

from tests.helpers import Mounts


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/fuse/" in str(item.fspath):
            item.add_marker(pytest.mark.fuse)


@pytest.fixture(autouse=True)
def _need_fuse():
    if not (os.path.exists("/dev/fuse") and shutil.which("fusermount3")):
        pytest.skip("needs /dev/fuse and fusermount3 (apt-get install fuse3)")


@pytest.fixture
def mounts(tmp_path):
    m = Mounts(tmp_path)
    yield m
    m.cleanup()
