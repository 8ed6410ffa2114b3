"""Serving processes on a real mount (passthrough mode): opens and releases of cached files
answered by processes beside the daemon, from the table it publishes. Bytes, counts, a
serving process killed, and entries dropped while the kernel still knows their nodes."""

from __future__ import annotations

import ctypes
import mmap
import os
import random
import signal
import time

import psutil
import pytest

from tests.helpers import stats

MiB = 1 << 20


def make_tree(src, dirs=3, files=40):
    data = {}
    rng = random.Random(7)
    for d in range(dirs):
        (src / f"c{d}").mkdir(parents=True)
        for i in range(files):
            rel = f"c{d}/{i:03d}.jpg"
            data[rel] = os.urandom(rng.choice([0, 1, 4095, 4096, 20_000, 70_000]))
            (src / rel).write_bytes(data[rel])
    return data


def epoch(mp, data, seed):
    names = sorted(data)
    random.Random(seed).shuffle(names)
    for rel in names:
        with open(mp / rel, "rb") as f:
            assert f.read() == data[rel], rel


def serving(mp):
    """The daemon's serving processes."""
    daemon = psutil.Process(stats(mp)["info"]["pid"])
    return [c for c in daemon.children() if "cachefs.serving" in " ".join(c.cmdline())]


def settled(mp):
    """Stats once the kernel's forgets have stopped coming (after the page cache is
    dropped, they come for a while)."""
    last = None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        s = stats(mp)
        now = (s["fuse"].get("forget", 0), s["fuse"].get("batch_forget", 0))
        if now == last:
            return s
        last = now
        time.sleep(0.3)
    return s


def passthrough_mount(mounts, src, *extra):
    mp = mounts.cachefs(str(src), extra=["--passthrough", "on", *extra])
    if stats(mp)["info"]["opens"] != "passthrough":
        pytest.skip("this kernel or user cannot use FUSE passthrough")
    return mp


def test_serving_processes_answer_the_opens_of_cached_files_and_count_them(tmp_path, mounts):
    src = tmp_path / "src"
    data = make_tree(src)
    mp = passthrough_mount(mounts, src, "--serve-processes", "2")
    assert len(serving(mp)) == 2
    epoch(mp, data, 1)
    first = stats(mp)
    assert first["serve"]["processes"] == 2
    epoch(mp, data, 2)
    epoch(mp, data, 3)
    third = stats(mp)  # counted by the time stats answer: the serving processes' reports settle first
    n = len(data)
    cached = sum(1 for blob in data.values() if blob)  # an empty file is the daemon's (nothing to pass through)
    assert third["serve"]["answered"] - first["serve"]["answered"] >= 2 * cached  # an open and a release each
    assert third["opens"]["passthrough"] - first["opens"]["passthrough"] == 2 * cached
    assert third["fuse"]["open"] - first["fuse"]["open"] == 2 * n
    assert third["fuse"]["release"] - first["fuse"]["release"] == 2 * n
    hits = (third["ram"]["hits"] + third["disk"]["hits"]) - (first["ram"]["hits"] + first["disk"]["hits"])
    assert hits == 2 * cached  # every file is one block
    assert third["fuse"]["read"] == first["fuse"]["read"]  # the kernel read the cached files itself
    assert third["fuse"].get("errors", 0) == 0
    assert "Warning" not in (tmp_path / "cache" / "cachefs.log").read_text()  # the serving processes' starts


def test_a_killed_serving_process_leaves_the_mount_serving(tmp_path, mounts):
    src = tmp_path / "src"
    data = make_tree(src, dirs=2, files=30)
    mp = passthrough_mount(mounts, src, "--serve-processes", "2")
    epoch(mp, data, 1)
    servers = serving(mp)
    servers[0].send_signal(signal.SIGKILL)
    servers[0].wait(10)
    epoch(mp, data, 2)
    assert stats(mp)["serve"]["processes"] == 1
    servers[1].send_signal(signal.SIGKILL)
    servers[1].wait(10)
    epoch(mp, data, 3)  # the daemon reads /dev/fuse itself again
    s = stats(mp)
    assert s["serve"]["processes"] == 0 and s["fuse"].get("errors", 0) == 0
    log = (tmp_path / "cache" / "cachefs.log").read_text()
    assert "serving process 0 ended" in log and "serving process 1 ended" in log


def test_entries_dropped_under_published_nodes_are_served_right_and_their_ids_closed(tmp_path, mounts):
    """A tier evicts entries the kernel still knows nodes of (their opens were answered by
    the serving processes): the node is taken back, the next open is the daemon's (and
    fetches again), an open handle keeps its bytes, and no backing id outlives its entry."""
    src = tmp_path / "src"
    src.mkdir()
    data = {}
    for i in range(48):
        data[f"f{i:03d}"] = os.urandom(128 << 10)
        (src / f"f{i:03d}").write_bytes(data[f"f{i:03d}"])
    mp = passthrough_mount(mounts, src, "--ram-size", "1MiB", "--disk-size", "2MiB", "--min-free", "0",
                           "--policy", "lru", "--readahead", "off", "--serve-processes", "1")
    held = open(mp / "f000", "rb")
    try:
        for seed in range(3):
            epoch(mp, data, seed)
        assert held.read() == data["f000"]
    finally:
        held.close()
    deadline = time.monotonic() + 5
    while True:
        s = stats(mp)
        if s["opens"]["backing_files"] <= s["ram"]["files"] + s["disk"]["files"] or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert s["disk"]["evictions"] > 0 and s["serve"]["answered"] > 0
    assert s["opens"]["backing_files"] <= s["ram"]["files"] + s["disk"]["files"], s["opens"]
    assert s["fuse"].get("errors", 0) == 0



def resident_pages(root) -> int:
    """Pages of the files under `root` in the page cache (mmap and mincore; nothing read)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    total = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            size = os.path.getsize(path)
            if not size:
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
                vec = ctypes.create_string_buffer(-(-size // mmap.PAGESIZE))
                try:
                    assert libc.mincore(addr, size, vec) == 0, ctypes.get_errno()
                finally:
                    libc.munmap(addr, size)
                total += sum(b & 1 for b in vec.raw)
            finally:
                os.close(fd)
    return total


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping the page cache needs root")
def test_a_file_promoted_to_ram_is_read_from_ram_by_the_kernel(tmp_path, mounts):
    """RAM takes a file from NVMe at its second open; its node is then published again with
    the RAM copy, and opens pass the RAM copy through, not the NVMe one registered before
    (the NVMe files' pages stay out of the page cache)."""
    src = tmp_path / "src"
    src.mkdir()
    data = {f"f{i:02d}": os.urandom(20_000 + i) for i in range(40)}
    for name, blob in data.items():
        (src / name).write_bytes(blob)
    # fetched at open by the daemon itself, into NVMe only (a fetch process would write
    # RAM's copy too, while RAM has room: then no promotion is left to see)
    mp = passthrough_mount(mounts, src, "--ram-size", "64MiB", "--readahead", "off", "--serve-processes", "1",
                           "--fetch-processes", "0")
    epoch(mp, data, 1)  # fetched whole at open, into NVMe
    epoch(mp, data, 2)  # RAM takes each
    assert stats(mp)["ram"]["promotions"] == len(data)
    # each node is taken back from the serving processes and published again with its RAM
    # copy; the NVMe copy's registration is closed
    deadline = time.monotonic() + 10
    while stats(mp)["opens"]["backing_files_ram"] < len(data) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stats(mp)["opens"]["backing_files_ram"] == stats(mp)["opens"]["backing_files"] == len(data)
    assert stats(mp)["serve"]["published"] == len(data)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
    epoch(mp, data, 3)
    assert resident_pages(tmp_path / "cache" / "store" / "data") == 0
    s = stats(mp)
    assert s["ram"]["hits"] >= len(data) and s["fuse"].get("errors", 0) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping the page cache needs root")
def test_a_file_opened_cold_is_in_ram_from_its_fill_and_read_from_there(tmp_path, mounts):
    """A cold open has a fetch process fetch the file into NVMe and, while RAM has room,
    into RAM too: the first epoch registers RAM's copies (none promoted, none registered
    twice), and the next epoch is read from RAM by the kernel, nothing fetched again."""
    src = tmp_path / "src"
    src.mkdir()
    data = {f"f{i:02d}": os.urandom(20_000 + i) for i in range(40)}
    for name, blob in data.items():
        (src / name).write_bytes(blob)
    mp = passthrough_mount(mounts, src, "--ram-size", "64MiB", "--readahead", "off", "--serve-processes", "1")
    epoch(mp, data, 1)
    s = stats(mp)
    assert (s["opens"]["filled"], s["source"]["read_range"], s["prefetch"]["blocks"]) == (40, 40, 0)
    assert s["ram"]["promotions"] == 0
    assert s["opens"]["backing_files_ram"] == s["opens"]["backing_files"] == len(data)
    os.sync()  # the NVMe copies were written just now: dirty pages are not dropped
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
    assert resident_pages(tmp_path / "cache" / "store" / "data") == 0
    epoch(mp, data, 2)
    assert resident_pages(tmp_path / "cache" / "store" / "data") == 0
    s = stats(mp)
    assert s["ram"]["hits"] >= len(data) and s["source"]["read_range"] == len(data)
    assert s["ram"]["promotions"] == 0 and s["fuse"].get("errors", 0) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping the page cache needs root")
def test_serving_processes_answer_lookups_after_the_kernel_forgot_the_names(tmp_path, mounts):
    """Once looked up by the daemon, a file's name is published: after the kernel dropped
    its dentries and inodes, the next epoch's lookups, opens, releases and forgets are the
    serving processes' (the daemon sees the directories' lookups), with the same node ids,
    and a file changed on the source is seen once its attributes are due for a check."""
    src = tmp_path / "src"
    data = make_tree(src, dirs=2, files=30)
    mp = passthrough_mount(mounts, src, "--serve-processes", "1", "--metadata-ttl", "3")
    epoch(mp, data, 1)  # into NVMe
    epoch(mp, data, 2)  # into RAM (counted at the serving process's report, which stats wait for)
    n, cached = len(data), sum(1 for blob in data.values() if blob)
    deadline = time.monotonic() + 10
    while stats(mp)["opens"]["backing_files_ram"] < cached and time.monotonic() < deadline:
        time.sleep(0.05)  # each node taken back and published again with its RAM copy
    epoch(mp, data, 3)
    inodes = {rel: os.stat(mp / rel).st_ino for rel in data}
    before = stats(mp)
    assert before["serve"]["names"] == n and before["serve"]["published"] == cached
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
    epoch(mp, data, 4)
    after = stats(mp)
    assert after["fuse"]["lookup"] - before["fuse"]["lookup"] >= n
    answered = after["serve"]["answered"] - before["serve"]["answered"]
    assert answered >= n + 2 * cached  # a lookup each, an open and a release each cached file
    # the daemon's: the directories' lookups, and the opens and releases of empty files
    assert after["serve"]["forwarded"] - before["serve"]["forwarded"] <= 2 * (n - cached) + 10
    assert {rel: os.stat(mp / rel).st_ino for rel in data} == inodes  # the source's inode numbers
    assert after["fuse"].get("errors", 0) == 0
    # changed on the source: within the TTL the old version, then the new one
    rel = next(r for r, blob in data.items() if blob)
    (src / rel).write_bytes(b"new version")
    time.sleep(3.5)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
    assert (mp / rel).read_bytes() == b"new version"
    data[rel] = b"new version"
    epoch(mp, data, 5)


def test_after_a_remount_cached_files_are_the_serving_processes_from_their_first_lookup(tmp_path, mounts):
    """After a clean stop the NVMe tier starts from its entry table, and each file it holds
    is a table node: a remounted job's first lookup of it, its opens (the cached file
    registered by the serving process), releases and forgets never reach the daemon, which
    answers the directories, the files not cached and the empty ones. The bytes are the
    source's, every open is counted as a hit, and the next epoch is the same."""
    src = tmp_path / "src"
    data = make_tree(src, dirs=2, files=30)
    args = ("--serve-processes", "1", "--readahead", "file", "--ram-size", "0")  # only what the job reads is cached
    mp = passthrough_mount(mounts, src, *args)
    read = {rel: blob for rel, blob in data.items() if rel.startswith("c0/") or rel < "c1/015"}
    epoch(mp, read, 1)  # into NVMe: c0, and half of c1
    time.sleep(2.1)  # older than the clean stop by its margin: each file trusted at one stat after it
    mounts.unmount(mp)
    mp = passthrough_mount(mounts, src, *args)
    for d in ("c0", "c1"):
        assert sorted(os.listdir(mp / d)) == sorted(r.split("/")[1] for r in data if r.startswith(d + "/"))
    before = stats(mp)
    epoch(mp, data, 2)
    after = stats(mp)
    n = len(data)
    cached = sum(1 for blob in read.values() if blob)  # an empty file is the daemon's
    cold = sum(1 for rel, blob in data.items() if blob and rel not in read)
    assert after["serve"]["table_registrations"] - before["serve"].get("table_registrations", 0) == cached
    assert after["serve"].get("table_nodes_taken", 0) == 0
    assert after["serve"]["answered"] - before["serve"]["answered"] >= 3 * cached  # a lookup, an open, a release
    # the daemon's: the files not cached (a lookup, an open, a release, reads) and the empty ones
    assert after["serve"]["forwarded"] - before["serve"]["forwarded"] <= 3 * (n - cached) + 2 * cold + 10
    assert after["disk"]["hits"] - before["disk"]["hits"] == cached
    assert after["fuse"]["read"] - before["fuse"]["read"] <= 2 * cold  # the kernel read the cached files itself
    assert after["fuse"].get("errors", 0) == 0
    deadline = time.monotonic() + 15  # each cached file trusted once: by its registration or the check
    while stats(mp)["disk"].get("trusted_files", 0) < cached and time.monotonic() < deadline:
        time.sleep(0.05)
    checked = stats(mp)["disk"]
    assert checked["trusted_files"] == cached and checked.get("vouched_files", 0) <= cached
    with open("/proc/sys/vm/drop_caches", "w") as f:  # every file looked up and opened again
        f.write("2\n")
    epoch(mp, data, 3)
    again = stats(mp)
    assert again["serve"]["table_registrations"] == after["serve"]["table_registrations"]  # one each, kept
    assert again["disk"]["hits"] - after["disk"]["hits"] >= cached and again["fuse"].get("errors", 0) == 0
    # the daemon made an object of the files it cached in this mount only: the opens it
    # counted left the others in the entry table
    assert again["disk"]["files_in_memory"] == cold and again["disk"]["files"] == cached + cold


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping the page cache needs root")
def test_a_table_node_ram_takes_stays_the_serving_processes_and_is_read_from_ram(tmp_path, mounts):
    """After a remount, RAM takes each file at its first open (the RAM tier starts empty):
    the table node stays the serving processes', the NVMe copy's registration is closed
    once nothing has it open, and the next open registers RAM's copy, in the serving
    process: the kernel reads no NVMe page, and the daemon answers nothing of those files
    and keeps no node of them. The bytes are the source's throughout."""
    src = tmp_path / "src"
    src.mkdir()
    data = {f"f{i:02d}": os.urandom(20_000 + i) for i in range(40)}
    for name, blob in data.items():
        (src / name).write_bytes(blob)
    args = ("--ram-size", "64MiB", "--readahead", "off", "--serve-processes", "1")
    mp = passthrough_mount(mounts, src, *args)
    epoch(mp, data, 1)  # into NVMe (and RAM, gone with the daemon)
    mounts.unmount(mp)
    mp = passthrough_mount(mounts, src, *args)
    held = open(mp / "f00", "rb")  # (open through the switch: it is tried again until closed)
    epoch(mp, data, 2)  # table nodes: registered by the serving process; RAM takes each
    s = stats(mp)
    assert s["serve"]["table_registrations"] == len(data) and s["ram"]["promotions"] == len(data)
    deadline = time.monotonic() + 10
    while stats(mp)["serve"].get("table_switches", 0) < len(data) - 1 and time.monotonic() < deadline:
        time.sleep(0.05)  # the NVMe copies' registrations closed (nothing has them open)
    time.sleep(0.5)
    assert stats(mp)["serve"]["table_switches"] == len(data) - 1  # (not f00's: open)
    assert held.read() == data["f00"]
    held.close()
    while stats(mp)["serve"].get("table_switches", 0) < len(data) and time.monotonic() < deadline:
        time.sleep(0.05)
    s = stats(mp)
    assert s["serve"]["table_switches"] == len(data) and s["serve"].get("table_nodes_taken", 0) == 0
    assert s["opens"]["backing_files"] == 0 and s["serve"]["published"] == 0  # (the daemon holds none)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")
    before = stats(mp)
    epoch(mp, data, 3)
    assert resident_pages(tmp_path / "cache" / "store" / "data") == 0
    s = stats(mp)
    assert s["ram"]["hits"] - before["ram"]["hits"] == len(data) and s["fuse"].get("errors", 0) == 0
    assert s["serve"]["table_registrations_ram"] == len(data) and s["serve"]["table_registrations"] == 2 * len(data)
    assert s["serve"].get("table_nodes_taken", 0) == 0 and s["fuse"]["nodes"] <= 1  # (the root)
    daemons = {k: n for k, v in s["fuse"].items() if not k.endswith("_us") and (n := v - before["fuse"].get(k, 0))}
    stats_queries = daemons.get("getxattr", 0)  # (stats() is read from an xattr)
    # lookups, opens, releases, forgets: theirs (the daemon answering them would be 3 a file)
    assert s["serve"]["forwarded"] - before["serve"]["forwarded"] - stats_queries == 0, daemons


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping the page cache needs root")
def test_table_nodes_ram_lets_go_are_registered_with_the_nvme_copy_again(tmp_path, mounts):
    """After a remount RAM takes the files it has room for, each table node's registration
    switching to RAM's copy; a big file read through the daemon then has RAM let them go
    (its blocks evict them), and each node's registration switches back to the NVMe copy
    (RAM's unlinked copy is not kept registered), the nodes staying the serving
    processes'. Every byte is the source's."""
    src = tmp_path / "src"
    src.mkdir()
    data = {f"f{i:02d}": os.urandom(20_000 + i) for i in range(40)}
    for name, blob in data.items():
        (src / name).write_bytes(blob)
    args = ("--ram-size", "256KiB", "--block-size", "64KiB", "--policy", "ram=lru", "--readahead", "off",
            "--serve-processes", "1")
    mp = passthrough_mount(mounts, src, *args)
    epoch(mp, data, 1)
    mounts.unmount(mp)
    mp = passthrough_mount(mounts, src, *args)
    epoch(mp, data, 2)  # RAM takes what it has room for
    held = stats(mp)["ram"]["files"]
    deadline = time.monotonic() + 10
    while stats(mp)["serve"].get("table_switches", 0) < held and time.monotonic() < deadline:
        time.sleep(0.05)  # (their NVMe copies' registrations closed)
    epoch(mp, data, 3)  # registered with RAM's copies
    s = stats(mp)
    assert 0 < held < len(data) and s["serve"]["table_registrations_ram"] > 0
    big = os.urandom(17 << 20)  # (more than a file fetched whole: its blocks go through RAM)
    (src / "big").write_bytes(big)
    with open(mp / "big", "rb") as f:
        assert f.read() == big
    deadline = time.monotonic() + 10
    while stats(mp)["serve"].get("table_switches_back", 0) == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    epoch(mp, data, 4)  # (checks every byte)
    s = stats(mp)
    assert s["ram"]["evictions"] > 0 and s["serve"]["table_switches_back"] > 0
    assert s["serve"].get("table_nodes_taken", 0) == 0 and s["fuse"].get("errors", 0) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping the page cache needs root")
def test_past_the_backing_limit_table_nodes_lose_their_registrations_not_their_serving(tmp_path, mounts):
    """More cached files than --backing-files after a remount: the oldest registrations the
    serving process made are closed once nothing has them open, and the nodes stay the
    serving processes' (none taken by the daemon): the next epoch's lookups and opens are
    still theirs, registering the closed files again. The bytes are the source's."""
    src = tmp_path / "src"
    src.mkdir()
    data = {f"f{i:02d}": os.urandom(20_000 + i) for i in range(60)}
    for name, blob in data.items():
        (src / name).write_bytes(blob)
    limit = 16
    args = ("--ram-size", "0", "--readahead", "off", "--serve-processes", "1", "--backing-files", str(limit))
    mp = passthrough_mount(mounts, src, *args)
    epoch(mp, data, 1)  # into NVMe
    mounts.unmount(mp)
    mp = passthrough_mount(mounts, src, *args)

    def closed_after(before: int) -> int:
        deadline = time.monotonic() + 10  # (the serving process reports its registrations when idle)
        while stats(mp)["serve"].get("table_backings_closed", 0) - before < len(data) - limit:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
        return stats(mp)["serve"].get("table_backings_closed", 0) - before

    epoch(mp, data, 2)
    assert closed_after(0) == len(data) - limit
    s = stats(mp)
    assert s["serve"]["table_registrations"] == len(data) and s["serve"].get("table_nodes_taken", 0) == 0
    with open("/proc/sys/vm/drop_caches", "w") as f:  # every file looked up and opened again
        f.write("3\n")
    epoch(mp, data, 3)
    assert closed_after(s["serve"]["table_backings_closed"]) == len(data) - limit
    after = stats(mp)
    assert after["serve"]["table_registrations"] - s["serve"]["table_registrations"] == len(data) - limit
    assert after["serve"].get("table_nodes_taken", 0) == 0 and after["fuse"].get("errors", 0) == 0
    stats_queries = after["fuse"]["getxattr"] - s["fuse"]["getxattr"]  # (stats() is read from an xattr)
    assert after["serve"]["forwarded"] - s["serve"]["forwarded"] - stats_queries <= 5  # lookups, opens, releases
    assert after["disk"]["hits"] - s["disk"]["hits"] == len(data)


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping the page cache needs root")
def test_a_file_changed_on_the_source_after_a_remount_is_seen_once_its_table_node_expires(tmp_path, mounts):
    """A table node's lookups are answered from the attributes a clean stop kept, for
    --metadata-ttl after they were stored (as the daemon answers from its index): then the
    lookup is the daemon's, which finds the new version; the node the kernel held keeps
    the old one for whoever has it open."""
    src = tmp_path / "src"
    data = make_tree(src, dirs=1, files=20)
    args = ("--ram-size", "0", "--serve-processes", "1", "--metadata-ttl", "3")
    mp = passthrough_mount(mounts, src, *args)
    epoch(mp, data, 1)
    mounts.unmount(mp)
    mp = passthrough_mount(mounts, src, *args)
    epoch(mp, data, 2)
    assert stats(mp)["serve"]["table_registrations"] == sum(1 for blob in data.values() if blob)
    rel = next(r for r, blob in data.items() if blob)
    held = open(mp / rel, "rb")  # (held across the change)
    try:
        (src / rel).write_bytes(b"new version")
        time.sleep(3.5)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("2\n")
        assert (mp / rel).read_bytes() == b"new version"
        assert held.read() == data[rel]
    finally:
        held.close()
    data[rel] = b"new version"
    epoch(mp, data, 3)
    assert stats(mp)["fuse"].get("errors", 0) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping the page cache needs root")
def test_past_the_metadata_ttl_table_nodes_are_the_serving_processes_again_once_checked(tmp_path, mounts):
    """A table node's attributes are good for --metadata-ttl after the file was fetched or
    last found unchanged on the source. Past it, the epoch's lookups go to the daemon,
    which checks each file (a stat, or its directory's listing) and renews the node: the
    next epoch's lookups are the serving processes' again, though there are more files
    than the names the daemon may publish. The bytes are the source's."""
    src = tmp_path / "src"
    data = {}
    for d in range(2):
        (src / f"c{d}").mkdir(parents=True)
        for i in range(30):
            data[f"c{d}/{i:02d}.jpg"] = os.urandom(20_000 + i)
            (src / f"c{d}/{i:02d}.jpg").write_bytes(data[f"c{d}/{i:02d}.jpg"])
    ttl = 15
    args = ("--ram-size", "0", "--readahead", "off", "--serve-processes", "1", "--backing-files", "16",
            "--metadata-ttl", str(ttl))  # (the names' limit: 16, of 60 files)
    mp = passthrough_mount(mounts, src, *args)
    epoch(mp, data, 1)  # into NVMe
    mounts.unmount(mp)
    mp = passthrough_mount(mounts, src, *args)
    epoch(mp, data, 2)  # table nodes
    time.sleep(ttl + 1)  # past the TTL of the fetch and of the directories' checks at the remount

    def forwarded(seed):
        with open("/proc/sys/vm/drop_caches", "w") as f:  # every file looked up again
            f.write("3\n")
        before = settled(mp)
        epoch(mp, data, seed)
        after = stats(mp)
        assert after["fuse"].get("errors", 0) == 0
        assert after["disk"]["hits"] - before["disk"]["hits"] == len(data)
        stats_queries = after["fuse"]["getxattr"] - before["fuse"]["getxattr"]  # (stats() is read from an xattr)
        return after["serve"]["forwarded"] - before["serve"]["forwarded"] - stats_queries

    # past the TTL: lookups go to the daemon until their directory's check (which the
    # first sets off) renews its files, in this epoch already; without the renewal, every
    # lookup of this epoch and the next
    assert forwarded(3) >= 1
    assert forwarded(4) <= 5  # the directories' lookups
    assert stats(mp)["serve"].get("table_nodes_taken", 0) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping the page cache needs root")
def test_the_first_mount_past_the_backing_limit_hands_its_files_to_the_serving_processes(tmp_path, mounts):
    """In a mount that started without an entry table, once the NVMe tier holds more files
    than --backing-files and stops growing, its entries are written as a table (a
    checkpoint) whose files the serving processes answer as after a remount: with the page
    cache dropped, the next epochs' lookups and opens are theirs, registering again the
    files past the limit, instead of each coming to the daemon. The files leave the
    daemon's memory for their records, and stay out of it through the epochs; the names it
    had published are taken back, and its nodes for them go as the kernel forgets them.
    The bytes are the source's."""
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    data = {f"d/f{i:02d}.jpg": os.urandom(20_000 + i) for i in range(60)}
    for name, blob in data.items():
        (src / name).write_bytes(blob)
    limit = 16
    mp = passthrough_mount(mounts, src, "--ram-size", "0", "--readahead", "off", "--serve-processes", "1",
                           "--backing-files", str(limit), "--metadata-ttl", "3600")
    epoch(mp, data, 1)  # into NVMe
    time.sleep(12)  # (two looks of the checkpoint thread: the tier stopped growing)
    assert stats(mp)["serve"].get("checkpoints", 0) == 0  # nothing opened meanwhile: no epoch reads the cache yet
    deadline = time.monotonic() + 30
    while stats(mp)["serve"].get("checkpoints", 0) < 1:  # an epoch reading what is cached
        assert time.monotonic() < deadline, "no checkpoint"
        assert (mp / "d" / "f00.jpg").read_bytes() == data["d/f00.jpg"]
        time.sleep(0.2)
    s = stats(mp)
    assert s["disk"]["cooled_files"] == len(data) and s["disk"]["files"] == len(data)
    assert s["disk"]["files_in_memory"] < len(data) // 4, s["disk"]  # (f00, if the daemon opened it since)
    assert s["serve"]["names_tabled"] >= limit // 2 and s["serve"]["names"] == 0, s["serve"]
    # and the kernel is told to drop its names of them: it forgets the daemon's nodes for
    # them without a page-cache drop (before, they stayed until memory pressure or a drop)
    deadline = time.monotonic() + 10
    while (s := stats(mp))["fuse"]["nodes"] > 3:  # the root, the directory (and f00, if open)
        assert time.monotonic() < deadline, s["fuse"]
        time.sleep(0.2)
    assert s["serve"]["names_dropped"] >= len(data) - 1, s["serve"]
    for seed in (2, 3):
        with open("/proc/sys/vm/drop_caches", "w") as f:  # every file looked up and opened again
            f.write("3\n")
        before = settled(mp)  # (the kernel's forgets of the daemon's nodes are forwarded to it)
        epoch(mp, data, seed)
        after = stats(mp)
        stats_queries = after["fuse"]["getxattr"] - before["fuse"]["getxattr"]  # (stats() is read from an xattr)
        forwarded = after["serve"]["forwarded"] - before["serve"]["forwarded"] - stats_queries
        # the directory's lookup (without: each file's, and most opens); in the first also
        # the kernel's forgets of the daemon's nodes of the epochs before, a message each
        # under load (68 seen; a batch when they queue up), where without table nodes each
        # file's lookup and open come too (the next epoch has none of them)
        assert forwarded <= (3 * len(data) // 2 if seed == 2 else 5), (seed, forwarded)
        assert after["serve"]["table_registrations"] > before["serve"].get("table_registrations", 0)
        assert after["disk"]["hits"] - before["disk"]["hits"] == len(data)
        assert after["opens"]["passthrough"] - before["opens"]["passthrough"] == len(data)  # once each
        assert after["fuse"].get("errors", 0) == 0
        assert after["disk"]["files_in_memory"] < len(data) // 4, after["disk"]  # (a forwarded open's)
        # the daemon keeps no registration of an NVMe copy (each closed at its last close:
        # table nodes register their own), nor a node published with one (the kernel
        # forgot them all; a release it sends after the close may still be on its way)
        deadline = time.monotonic() + 10
        while (now := stats(mp))["opens"]["backing_files"] or now["serve"]["published"]:
            assert time.monotonic() < deadline, (now["opens"], now["serve"])
            time.sleep(0.2)
    assert after["serve"]["table_registrations"] >= len(data) - limit


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping the page cache needs root")
def test_a_checkpoint_hands_over_the_files_ram_holds_with_rams_copies(tmp_path, mounts):
    """A first mount whose RAM holds every file (a fetch process writes RAM's copy at the
    fill): the checkpoint records them too, and their table nodes register RAM's copies,
    in the serving process: with the page cache dropped the kernel reads RAM, not one
    NVMe page, and the daemon keeps neither a node nor a registration of them (it kept
    both for each file RAM held, as its own node). The bytes are the source's."""
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    data = {f"d/f{i:02d}.jpg": os.urandom(20_000 + i) for i in range(60)}
    for name, blob in data.items():
        (src / name).write_bytes(blob)
    mp = passthrough_mount(mounts, src, "--ram-size", "64MiB", "--readahead", "off", "--serve-processes", "1",
                           "--backing-files", "16", "--metadata-ttl", "3600")
    epoch(mp, data, 1)  # into NVMe and RAM
    assert stats(mp)["ram"]["files"] == len(data)
    _checkpoints(mp, data, 1)
    s = stats(mp)
    assert s["disk"]["cooled_files"] == len(data), s["disk"]  # (RAM's files' NVMe entries too)
    for seed in (2, 3):
        os.sync()  # (the fill's pages are dirty still: a drop keeps those)
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        before = settled(mp)
        epoch(mp, data, seed)
        after = stats(mp)
        assert after["ram"]["hits"] - before["ram"]["hits"] == len(data) and after["fuse"].get("errors", 0) == 0
        assert after["serve"]["table_registrations"] > before["serve"].get("table_registrations", 0)
    assert resident_pages(tmp_path / "cache" / "store" / "data") == 0
    assert after["serve"]["table_registrations_ram"] == after["serve"]["table_registrations"]
    # (an open that comes while a registration past the limit is being closed is forwarded,
    # and the daemon takes that node: a few under load, each registering RAM's copy itself)
    taken = after["serve"].get("table_nodes_taken", 0)
    assert taken <= len(data) // 4, after["serve"]
    deadline = time.monotonic() + 10
    while (now := stats(mp))["opens"]["backing_files"] > taken or now["fuse"]["nodes"] > 3 + taken:
        assert time.monotonic() < deadline, (now["opens"], now["fuse"])  # (the root, the directory, f00)
        time.sleep(0.2)
    assert now["opens"]["backing_files"] == now["opens"]["backing_files_ram"]


def _checkpoints(mp, data, n):
    """Read cached files until the mount has written `n` checkpoints."""
    deadline = time.monotonic() + 40
    rel = sorted(data)[0]
    while stats(mp)["serve"].get("checkpoints", 0) < n:
        assert time.monotonic() < deadline, f"no checkpoint {n}"
        assert (mp / rel).read_bytes() == data[rel]
        time.sleep(0.2)


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping the page cache needs root")
def test_files_cached_after_the_checkpoint_are_handed_over_by_the_next_one(tmp_path, mounts):
    """A mount that caches many more files after its checkpoint (a second dataset, the rest
    of a cold epoch that paused) writes the next generation of the table: the files before
    keep their records (and node ids), the new ones follow, and with the page cache dropped
    an epoch over both is the serving processes' (without it, each new file's lookup and
    open came to the daemon). The table before leaves the disk, and its bytes the tier's
    budget once the serving process maps the new one."""
    src = tmp_path / "src"
    data: dict[str, dict[str, bytes]] = {"a": {}, "b": {}}
    for d in data:
        (src / d).mkdir(parents=True)
        for i in range(60):
            data[d][f"{d}/f{i:02d}.jpg"] = blob = os.urandom(20_000 + i)
            (src / d / f"f{i:02d}.jpg").write_bytes(blob)
    mp = passthrough_mount(mounts, src, "--ram-size", "0", "--readahead", "off", "--serve-processes", "1",
                           "--backing-files", "16", "--metadata-ttl", "3600")
    cache = mounts.tmp / "cache"
    epoch(mp, data["a"], 1)
    _checkpoints(mp, data["a"], 1)
    epoch(mp, data["b"], 1)  # cached after the checkpoint: the daemon's nodes
    _checkpoints(mp, data["b"], 2)
    assert len(list(cache.rglob("entries-*"))) == 1  # the table before is unlinked
    both = {**data["a"], **data["b"]}
    s = stats(mp)  # each generation's files left the daemon's memory
    assert s["disk"]["cooled_files"] >= len(both) - 1 and s["disk"]["files_in_memory"] < len(both) // 4, s["disk"]
    for seed in (2, 3):
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        before = settled(mp)
        epoch(mp, both, seed)
        after = stats(mp)
        stats_queries = after["fuse"]["getxattr"] - before["fuse"]["getxattr"]
        forwarded = after["serve"]["forwarded"] - before["serve"]["forwarded"] - stats_queries
        # the directories' lookups (without: the new files' too); in the first also the
        # kernel's forgets of the daemon's nodes of the epochs before, a message each under
        # load (130 seen; a batch when they queue up; the next epoch has none of them)
        assert forwarded <= (3 * len(both) // 2 if seed == 2 else 6), (seed, forwarded)
        assert after["disk"]["hits"] - before["disk"]["hits"] == len(both)
        assert after["opens"]["passthrough"] - before["opens"]["passthrough"] == len(both)
        assert after["fuse"].get("errors", 0) == 0
    table, = cache.rglob("entries-*")
    deadline = time.monotonic() + 15  # (the daemon looks every few seconds)
    while (counted := stats(mp)["disk"]["checkpoint_bytes"]) != table.stat().st_size:
        assert counted > table.stat().st_size  # (the one before, till then)
        assert time.monotonic() < deadline, "the table before is still counted"
        time.sleep(0.5)
