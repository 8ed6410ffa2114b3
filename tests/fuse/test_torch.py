"""A real PyTorch pipeline through the mount: a DataLoader with worker processes over an
ImageFolder tree yields the same samples (bytes and class indices) as over the source."""

import json
import os
import random

import pytest

torch = pytest.importorskip("torch", reason="the torch extra (torch and Pillow) is not installed")

from cachefs.torch import ImageFolder  # noqa: E402


def make_tree(root, classes=4, per_class=25):
    rng = random.Random(7)
    for c in range(classes):
        d = root / f"n{c:08d}"
        d.mkdir(parents=True)
        for i in range(per_class):
            (d / f"img_{i:04d}.JPEG").write_bytes(rng.randbytes(rng.randrange(2_000, 150_000)))
        (d / "notes.txt").write_text("not an image")        # skipped, as torchvision skips it
    (root / "stray.jpg").write_bytes(b"no class")           # files at the top are not samples


def epoch(dataset, seed):
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, shuffle=True, num_workers=3,
                                         generator=torch.Generator().manual_seed(seed),
                                         collate_fn=lambda batch: batch, persistent_workers=False)
    return [item for batch in loader for item in batch]


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_dataloader_with_workers_reads_the_same_samples_through_the_mount(tmp_path, mounts):
    src = tmp_path / "src"
    make_tree(src)
    mp = mounts.cachefs(str(src))
    direct, mounted = ImageFolder(str(src)), ImageFolder(str(mp))
    assert mounted.classes == direct.classes and len(mounted) == len(direct) == 100
    assert [os.path.relpath(p, mp) for p, _ in mounted.samples] == [os.path.relpath(p, src) for p, _ in direct.samples]
    for seed in (1, 2):                                      # a cold epoch, then a warm one
        assert epoch(mounted, seed) == epoch(direct, seed)
    counts = {}
    for _, target in mounted.samples:
        counts[target] = counts.get(target, 0) + 1
    assert counts == {0: 25, 1: 25, 2: 25, 3: 25}


# -- order hints ------------------------------------------------------------------------------

from cachefs.torch import HintedSampler  # noqa: E402
from tests.helpers import stats  # noqa: E402


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:  # every read of the epoch reaches cachefs
        f.write("3")


def ram_counts(mp):
    s = stats(mp)
    return s["ram"].get("hits", 0), s["ram"].get("misses", 0), s.get("hint", {})


def block_counts(mp):
    """Blocks the job's reads looked up, and of them found in RAM and on NVMe."""
    s = stats(mp)
    hits, misses = s["ram"].get("hits", 0), s["ram"].get("misses", 0)
    return hits + misses, hits, s.get("disk", {}).get("hits", 0)


def shares(before, after):
    """Of an epoch's block lookups: the share RAM served, the share the source did (at the
    job's read: neither RAM nor NVMe had it)."""
    looked, ram, disk = (a - b for a, b in zip(after, before, strict=True))
    return ram / looked, (looked - ram - disk) / looked


def settled(mp, timeout=10.0):
    """The hint stats once every session has ended (the daemon sees a closed connection
    a moment after the job closes it)."""
    import time

    deadline = time.monotonic() + timeout
    while (hint := ram_counts(mp)[2])["sessions"] and time.monotonic() < deadline:
        time.sleep(0.05)
    return hint


def hinted_epoch(dataset, seed, hinted=True, stop_after=None):
    sampler = torch.utils.data.RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))
    if hinted:
        sampler = HintedSampler(sampler, dataset, lookahead=256)
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, sampler=sampler, num_workers=2,
                                         collate_fn=lambda batch: batch)
    out = []
    for i, batch in enumerate(loader):
        out.extend(batch)
        if stop_after is not None and i + 1 >= stop_after:
            break
    return out


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_hinted_sampler_over_a_dataset_larger_than_the_cache_reads_from_ram(tmp_path, mounts):
    src = tmp_path / "src"
    make_tree(src, classes=4, per_class=60)                  # 240 files, about 18 MB
    size = sum(f.stat().st_size for f in src.rglob("*.JPEG"))
    slow = mounts.slowfs(src, latency="1ms")
    mp = mounts.cachefs(str(slow), extra=("--ram-size", str(size // 4), "--disk-size", "4MiB",
                                          "--min-free", "0"))
    direct, mounted = ImageFolder(str(src)), ImageFolder(str(mp))
    assert hinted_epoch(mounted, 1, hinted=False) == hinted_epoch(direct, 1, hinted=False)
    drop_caches()
    c0 = block_counts(mp)
    assert hinted_epoch(mounted, 2, hinted=False) == hinted_epoch(direct, 2, hinted=False)
    c1 = block_counts(mp)
    drop_caches()
    assert hinted_epoch(mounted, 3) == hinted_epoch(direct, 3, hinted=False)
    c2 = block_counts(mp)
    hint = settled(mp)
    plain, hinted = shares(c0, c1), shares(c1, c2)
    # measured: RAM 0.19-0.25 of the blocks and the source 0.73-0.81 without hints; with
    # them RAM 0.86-0.94 and the source 0.01-0.03 (the first files are read before the
    # pool, fetching from a 1 ms store, gets ahead of the job; blocks on a fast NVMe tier
    # are left there: the job's read of them costs less than a fetch ahead). The source's
    # share was 0.07-0.19 while the serving processes reported opens every 512 requests,
    # the pins of read files held until then (a CI run: RAM 0.59).
    assert plain[0] < 0.4 and plain[1] > 0.5, (plain, hinted, hint)
    assert hinted[0] > 0.6 and hinted[1] < 0.08, (plain, hinted, hint)
    assert hint["used"] > 120 and hint["from_source"] > 100
    assert hint["sessions"] == 0 and hint["pinned_bytes"] == 0   # the epoch's session ended


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_an_epoch_ended_early_and_a_killed_job_release_their_pins(tmp_path, mounts):
    import signal
    import subprocess
    import sys
    import time

    src = tmp_path / "src"
    make_tree(src, classes=4, per_class=60)
    mp = mounts.cachefs(str(src), extra=("--ram-size", "8MiB"))
    mounted = ImageFolder(str(mp))
    assert len(hinted_epoch(mounted, 1, stop_after=3)) == 24          # break after 3 batches
    hint = settled(mp)
    assert hint["sessions"] == 0 and hint["pinned_bytes"] == 0
    assert hint["paths"] >= 24 and hint["sessions_opened"] == 1
    # a job killed while its session is open (hinted, nothing read)
    job = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
sys.path.insert(0, {os.getcwd()!r})
import torch
from cachefs.torch import HintedSampler, ImageFolder
ds = ImageFolder({str(mp)!r})
it = iter(HintedSampler(torch.utils.data.SequentialSampler(ds), ds, lookahead=200))
next(it)
print("hinting", flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert job.stdout.readline().strip() == "hinting"
        deadline = time.monotonic() + 10
        while ram_counts(mp)[2]["pinned_bytes"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ram_counts(mp)[2]["pinned_bytes"] > 0 and ram_counts(mp)[2]["sessions"] == 1
    finally:
        job.send_signal(signal.SIGKILL)
        job.wait()
    hint = settled(mp)
    assert hint["sessions"] == 0 and hint["pinned_bytes"] == 0
    # and a new job hints as before, with the same samples as unhinted
    assert hinted_epoch(mounted, 4) == hinted_epoch(ImageFolder(str(src)), 4, hinted=False)


def test_hinted_sampler_off_cachefs_is_the_plain_sampler(tmp_path, caplog):
    src = tmp_path / "src"
    make_tree(src, classes=2, per_class=5)
    ds = ImageFolder(str(src))
    order = list(torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(3)))
    hinted = HintedSampler(torch.utils.data.RandomSampler(ds, generator=torch.Generator().manual_seed(3)), ds)
    assert list(hinted) == order and len(hinted) == 10
    assert "order hints off" in caplog.text and "not on a cachefs mount" in caplog.text
    batches = HintedSampler(torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(ds), 4, False), ds)
    assert list(batches) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_diagnose_on_a_mount_reports_the_cache_over_the_run(tmp_path, mounts, capsys):
    from cachefs.cli import main
    from tools.mkdataset import build

    src = tmp_path / "src"
    build(str(src), classes=2, per_class=20, seed=2, mean_kb=20, progress=False)
    mp = mounts.cachefs(str(src))
    assert main(["diagnose", str(mp), "--seconds", "1", "--workers", "2", "--batch-size", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr()[0])
    cache = report["cache"]
    assert cache["mountpoint"] == str(mp)
    assert cache["source_bytes"] > 0 and cache["ram_hits"] + cache["misses"] > 0   # a cold mount
    assert 0 <= cache["block_hit_rate"] <= 1
    assert main(["diagnose", str(mp), "--seconds", "1", "--workers", "2", "--batch-size", "4"]) == 0
    assert "cachefs        " + str(mp) in capsys.readouterr()[0]


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_workers_restarting_each_epoch_and_two_jobs_at_once(tmp_path, mounts):
    import threading

    src = tmp_path / "src"
    make_tree(src, classes=4, per_class=40)
    mp = mounts.cachefs(str(src), extra=("--ram-size", "4MiB"))
    mounted, direct = ImageFolder(str(mp)), ImageFolder(str(src))
    # one sampler and one DataLoader for two epochs: its workers are new processes each epoch
    sampler = HintedSampler(torch.utils.data.RandomSampler(mounted, generator=torch.Generator().manual_seed(5)),
                            mounted, lookahead=64)
    loader = torch.utils.data.DataLoader(mounted, batch_size=8, sampler=sampler, num_workers=2,
                                         collate_fn=lambda batch: batch, persistent_workers=False)
    reference = torch.utils.data.RandomSampler(direct, generator=torch.Generator().manual_seed(5))
    for _ in range(2):
        got = [item for batch in loader for item in batch]
        assert got == [direct[i] for i in reference]
    hint = ram_counts(mp)[2]
    assert hint["sessions_opened"] == 2 and hint["used"] > 0
    # two jobs hinting the same mount at once, each getting its own samples
    results = {}

    def job(seed):
        results[seed] = hinted_epoch(mounted, seed)

    threads = [threading.Thread(target=job, args=(seed,)) for seed in (11, 12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results[11] == hinted_epoch(direct, 11, hinted=False)
    assert results[12] == hinted_epoch(direct, 12, hinted=False)
    hint = settled(mp)
    assert hint["sessions_opened"] == 4 and hint["sessions"] == 0 and hint["pinned_bytes"] == 0
