import pytest

from cachefs.config import GiB, KiB, MiB, format_size, parse_duration, parse_size
from cachefs.errors import CachefsError


@pytest.mark.parametrize("text,expected", [
    ("0", 0), ("4096", 4096), ("1B", 1), ("1KiB", KiB), ("1k", KiB), ("1KB", 1000),
    ("16GiB", 16 * GiB), ("16G", 16 * GiB), ("16GB", 16 * 10**9), ("512MiB", 512 * MiB),
    ("1.5GiB", int(1.5 * GiB)), (" 2 MiB ", 2 * MiB), ("1TiB", 1024 * GiB), (".5M", MiB // 2),
])
def test_parse_size_accepts(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["12XB", "", "GiB", "-5G", "1e9", "1,5G", "10 G B", "nan", "0x10", "9" * 400 + "GiB"])
def test_parse_size_rejects_with_clear_message(text):
    with pytest.raises(CachefsError, match="invalid --ram-size"):
        parse_size(text, "--ram-size")


def test_negative_size_says_so():
    with pytest.raises(CachefsError, match="negative"):
        parse_size("-1GiB")


@pytest.mark.parametrize("text,expected", [("30", 30.0), ("1.5s", 1.5), ("500ms", 0.5), ("10m", 600.0), ("1h", 3600.0)])
def test_parse_duration(text, expected):
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["-1", "1d", "soon", ""])
def test_parse_duration_rejects(text):
    with pytest.raises(CachefsError):
        parse_duration(text)


def test_format_size():
    assert format_size(512) == "512 B"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(16 * GiB) == "16.0 GiB"


def test_backing_files_kept_grow_with_the_machine_within_a_share_of_its_memory():
    from cachefs.config import BACKING_BYTES, BACKING_CACHE_MIN, BACKING_RAM_SHARE, backing_limit

    assert backing_limit(1 << 30) == BACKING_CACHE_MIN                   # a small machine: the floor
    big = 512 << 30                                                      # a training node
    assert backing_limit(big) * BACKING_BYTES <= big // BACKING_RAM_SHARE
    assert backing_limit(big) > 1_281_167 * 4                            # ImageNet-1k, all kept
    assert backing_limit() >= BACKING_CACHE_MIN                          # this machine's


def test_serving_processes_only_where_stores_reach_other_cores_in_order():
    from cachefs.config import stores_ordered

    assert stores_ordered("x86_64") and stores_ordered("AMD64")
    assert not stores_ordered("aarch64") and not stores_ordered("ppc64le")
