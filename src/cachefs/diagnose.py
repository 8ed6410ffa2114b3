"""`cachefs diagnose PATH`: is this training input pipeline storage-bound, CPU-bound, or fine?

Two measurements on the ImageFolder-style dataset at PATH, on disjoint shuffled halves of
its files (so the second is not served from what the first just cached):

  1. raw reads: N processes read whole files, nothing else: the storage's ceiling for N
     readers, in files/s, with per-file latency;
  2. the DataLoader: N workers, batches of B, decode + the usual transforms, no model. Each
     sample's wall time waiting for its bytes and its CPU time decoding are summed in the
     workers; per-core CPU use, the process tree's read bytes and the system's disk and
     network reads are sampled with psutil meanwhile.

The verdict (`judge`, a pure function of those figures):
  - fine           the loader delivers at least --target images/s;
  - storage-bound  below it, and the workers spend >= STORAGE_SHARE of their time
                   waiting for bytes: faster storage (cachefs) makes the loader faster;
  - cpu-bound      below it, and they spend it decoding/transforming: storage is not the
                   problem; more workers, GPU decoding or lighter transforms are.
On a cachefs mount the cache's hit rates over the run are shown too.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time
from typing import Any

import psutil

from cachefs.config import format_size
from cachefs.errors import CachefsError

# A worker waiting for bytes this share of its time or more is held up by storage.
STORAGE_SHARE = 0.35
# The rate the training step consumes, when --target does not say (images/s): a ResNet-50
# in mixed precision on one current GPU takes 1000-3000; a loader below this starves it.
DEFAULT_TARGET = 1000.0
# CPU busy (share of all cores) from which the CPU counts as saturated.
CPU_SATURATED = 0.85
LATENCY_SAMPLES = 5000  # per raw reader, for p50/p99


class Progress:
    """One phase at a time on stderr: a bar redrawn in place on a terminal, else a line
    when the phase starts."""

    def __init__(self, enabled: bool | None = None, stream: Any = None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if enabled is None else enabled
        self._phase = ""

    def start(self, phase: str, total_s: float) -> None:
        self._phase, self._total = phase, total_s
        if not self.tty:
            print(f"cachefs diagnose: {phase} ({total_s:.0f}s)...", file=self.stream, flush=True)

    def update(self, elapsed_s: float, note: str = "") -> None:
        if not self.tty:
            return
        done = min(1.0, elapsed_s / self._total) if self._total else 1.0
        bar = "#" * int(done * 24)
        line = f"{self._phase:<22} [{bar:<24}] {elapsed_s:4.0f}/{self._total:.0f}s  {note}"
        print("\r" + line[:100].ljust(100), end="", file=self.stream, flush=True)

    def done(self) -> None:
        if self.tty:
            print("\r" + " " * 100 + "\r", end="", file=self.stream, flush=True)


# -- measurement 1: raw reads ---------------------------------------------------------------

def _raw_reader(paths: list[str], deadline: float, out: Any) -> None:
    files = nbytes = 0
    latencies: list[float] = []
    buf = bytearray(1 << 20)
    for path in paths:
        if time.monotonic() >= deadline:
            break
        t0 = time.perf_counter()
        try:
            with open(path, "rb", buffering=0) as f:
                while n := f.readinto(buf):
                    nbytes += n
        except OSError:
            continue
        if len(latencies) < LATENCY_SAMPLES:
            latencies.append(time.perf_counter() - t0)
        files += 1
    out.put((files, nbytes, latencies))


def raw_reads(paths: list[str], workers: int, seconds: float, progress: Progress) -> dict[str, Any]:
    """N processes read whole files (interleaved slices of `paths`) for `seconds`."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    start = time.monotonic()
    deadline = start + seconds
    procs = [ctx.Process(target=_raw_reader, args=(paths[i::workers], deadline, out), daemon=True)
             for i in range(workers)]
    for p in procs:
        p.start()
    progress.start("1/2 raw reads", seconds)
    results: list[tuple[int, int, list[float]]] = []
    while len(results) < workers:
        try:
            results.append(out.get(timeout=0.5))
        except Exception:  # queue.Empty: still running
            if not any(p.is_alive() for p in procs) and out.empty():
                break
        progress.update(time.monotonic() - start)
    elapsed = time.monotonic() - start
    for p in procs:
        p.join(5)
    progress.done()
    files = sum(r[0] for r in results)
    nbytes = sum(r[1] for r in results)
    lat = sorted(x for r in results for x in r[2])
    return {"workers": workers, "seconds": round(elapsed, 2), "files": files, "bytes": nbytes,
            "files_per_s": files / elapsed if elapsed else 0.0, "bytes_per_s": nbytes / elapsed if elapsed else 0.0,
            "latency_p50_ms": 1000 * lat[len(lat) // 2] if lat else None,
            "latency_p99_ms": 1000 * lat[min(len(lat) - 1, int(len(lat) * 0.99))] if lat else None,
            "exhausted": files >= len(paths)}


# -- measurement 2: the DataLoader --------------------------------------------------------

class SystemSampler:
    """psutil over a window: per-core CPU busy (from the kernel's CPU times, exact), the
    process tree's reads (workers included), and the system's block-device and network reads."""

    def __init__(self) -> None:
        self._me = psutil.Process()

    def _tree_read(self) -> tuple[int, int]:
        chars = nbytes = 0
        for proc in [self._me, *self._me.children(recursive=True)]:
            try:
                io = proc.io_counters()
            except (psutil.Error, AttributeError):
                continue
            chars += getattr(io, "read_chars", io.read_bytes)
            nbytes += io.read_bytes
        return chars, nbytes

    @staticmethod
    def _system_read() -> tuple[int, int]:
        disk = psutil.disk_io_counters()
        net = psutil.net_io_counters()
        return (disk.read_bytes if disk else 0), (net.bytes_recv if net else 0)

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._cpu0 = psutil.cpu_times(percpu=True)
        self._tree0, self._sys0 = self._tree_read(), self._system_read()

    def stop(self) -> dict[str, Any]:
        elapsed = max(time.monotonic() - self._t0, 1e-9)
        tree, system = self._tree_read(), self._system_read()
        per_core = []
        for t0, t1 in zip(self._cpu0, psutil.cpu_times(percpu=True), strict=False):
            total = sum(t1) - sum(t0)
            idle = (t1.idle - t0.idle) + (getattr(t1, "iowait", 0.0) - getattr(t0, "iowait", 0.0))
            per_core.append(max(0.0, min(1.0, 1 - idle / total)) if total > 0 else 0.0)
        return {
            "cpu_busy": statistics.fmean(per_core) if per_core else None,
            "cpu_per_core": [round(c, 3) for c in per_core],
            "cores": psutil.cpu_count() or 1,
            "tree_read_per_s": (tree[0] - self._tree0[0]) / elapsed,
            "tree_storage_read_per_s": (tree[1] - self._tree0[1]) / elapsed,
            "disk_read_per_s": (system[0] - self._sys0[0]) / elapsed,
            "net_recv_per_s": (system[1] - self._sys0[1]) / elapsed,
        }


class _Cycle:
    """The loader's sample order, repeated: a small dataset still fills the window."""

    def __init__(self, indices: list[int], length: int):
        self.indices, self.length = indices, length

    def __iter__(self):  # type: ignore[no-untyped-def]
        for i in range(self.length):
            yield self.indices[i % len(self.indices)]

    def __len__(self) -> int:
        return self.length


def run_loader(root: str, indices: list[int], workers: int, batch_size: int, seconds: float,
               transform: tuple[Any, bool, str], progress: Progress) -> dict[str, Any]:
    import torch.utils.data

    from cachefs import pipeline

    fn, decode, described = transform
    timings = pipeline.Timings()
    dataset = pipeline.make_dataset(root, pipeline.TimedLoader(timings, fn, decode))
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, sampler=_Cycle(indices, 1 << 40),
                                         num_workers=workers,
                                         collate_fn=pipeline.collate, persistent_workers=False)
    progress.start("2/2 DataLoader", seconds)
    sampler = SystemSampler()
    started = time.monotonic()
    first_batch_s = None
    images = 0
    t_start = started
    before: dict[str, float] = {}
    it = iter(loader)
    try:
        for batch in it:
            n = len(batch[1])
            now = time.monotonic()
            if first_batch_s is None:
                # the measured window starts once the workers are up and the first batch is in
                first_batch_s = now - started
                t_start, before = now, timings.read()
                sampler.start()
                continue
            images += n
            progress.update(now - t_start, f"{images / max(now - t_start, 1e-9):.0f} img/s")
            if now - t_start >= seconds:
                break
    finally:
        del it  # shuts the workers down
    elapsed = time.monotonic() - t_start
    progress.done()
    if first_batch_s is None:
        raise CachefsError("the DataLoader produced no batch (is the dataset empty?)")
    system = sampler.stop()
    after = timings.read()
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    samples = max(d["samples"], 1)
    busy = d["read_s"] + d["decode_wall_s"]
    return {"workers": workers, "batch_size": batch_size, "transform": described, "seconds": round(elapsed, 2),
            "first_batch_s": round(first_batch_s, 2), "images": images,
            "images_per_s": images / elapsed if elapsed > 0 else 0.0,
            "read_ms_per_image": 1000 * d["read_s"] / samples,
            "cpu_ms_per_image": 1000 * d["cpu_s"] / samples,
            "decode_ms_per_image": 1000 * d["decode_wall_s"] / samples,
            "read_share": d["read_s"] / busy if busy > 0 else 0.0,
            "mean_file_bytes": d["bytes"] / samples,
            "system": system, "samples": len(dataset)}


# -- the verdict ------------------------------------------------------------------------------

def judge(raw: dict[str, Any], load: dict[str, Any], target: float, cache: dict[str, Any] | None,
          cores: int, path: str) -> dict[str, Any]:
    """Verdict, the reasons (figures) behind it and advice, from the two measurements."""
    rate, share = load["images_per_s"], load["read_share"]
    cpu_busy = load["system"].get("cpu_busy")
    workers = load["workers"]
    cpu_ms = load["cpu_ms_per_image"]
    cpu_ceiling = min(workers, cores) * 1000 / cpu_ms if cpu_ms > 0 else float("inf")
    reasons = [
        f"the DataLoader delivered {rate:.0f} images/s with {workers} workers (target {target:.0f})",
        f"its workers spent {share:.0%} of their time waiting for file bytes "
        f"({load['read_ms_per_image']:.1f} ms per image) and the rest decoding and transforming "
        f"({cpu_ms:.1f} ms of CPU per image)",
        f"raw reads with {raw['workers']} processes: {raw['files_per_s']:.0f} files/s, "
        f"{format_size(raw['bytes_per_s'])}/s, p50 {_ms(raw['latency_p50_ms'])}, p99 {_ms(raw['latency_p99_ms'])}",
    ]
    if cpu_busy is not None:
        reasons.append(f"CPU busy {cpu_busy:.0%} of {cores} cores during the DataLoader run; "
                       f"decoding alone could reach about {cpu_ceiling:.0f} images/s on {min(workers, cores)} cores")
    advice: list[str] = []
    if rate >= target:
        verdict = "fine"
        advice.append("the input pipeline keeps up with the target: if training is slow, look at the model step")
        advice.append("keep pin_memory=True and persistent_workers=True in the DataLoader")
    elif share >= STORAGE_SHARE:
        verdict = "storage-bound"
        speedup = min(1 / max(1 - share, 1e-3), cpu_ceiling / rate if rate else float("inf"))
        reasons.append(f"with instant storage the loader would run up to {speedup:.1f}x faster")
        if cache is None:
            advice.append(f"serve the data through cachefs: cachefs mount {path} /mnt/data "
                          "--ram-size <most of your free RAM> --cache-dir <local NVMe dir>, then "
                          "`cachefs warm /mnt/data` before training (or let the first epoch fill it)")
        else:
            advice.extend(_cache_advice(cache))
        advice.append(f"more DataLoader workers: a worker waiting on storage uses no CPU, so "
                      f"num_workers above the core count ({cores}) overlaps more reads")
    else:
        verdict = "cpu-bound"
        if cpu_busy is not None and cpu_busy < CPU_SATURATED and workers < cores:
            advice.append(f"the CPU is only {cpu_busy:.0%} busy: raise num_workers to {cores}")
        advice.append("decode on the GPU (NVIDIA DALI, or torchvision.io.decode_jpeg(device='cuda')) "
                      "and run the augmentation there")
        advice.append("make the transforms cheaper (decode at reduced size with PIL's draft(), "
                      "Pillow-SIMD, fewer augmentations), or use more CPU cores")
        advice.append("pin_memory=True so the copy to the GPU overlaps; faster storage or cachefs "
                      "will not make this loader faster")
    return {"verdict": verdict, "reasons": reasons, "advice": advice}


def _cache_advice(cache: dict[str, Any]) -> list[str]:
    hit = cache.get("block_hit_rate")
    if hit is None or hit >= 0.9:
        return ["the cache is serving what it holds; the source behind it sets the pace of misses"]
    return [f"the cache served only {hit:.0%} of blocks over the run: warm it first "
            "(`cachefs warm MOUNTPOINT`), or give it room for the dataset (--ram-size, --disk-size)",
            "if the dataset is larger than the cache, wrap your sampler in "
            "cachefs.torch.HintedSampler: the daemon then fetches the coming batches ahead"]


def _ms(v: float | None) -> str:
    return "-" if v is None else (f"{v:.2f} ms" if v < 10 else f"{v:.0f} ms")


# -- the whole run --------------------------------------------------------------------------

def _cache_snapshot(path: str) -> tuple[str, dict[str, Any]] | None:
    from cachefs.mounttable import mount_of, read_control

    try:
        mp, _ = mount_of(path)
        return mp, read_control(mp, "user.cachefs.stats")
    except (CachefsError, OSError, ValueError):
        return None


def _cache_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    from cachefs.stats import block_hit_rate

    def d(section: str, key: str) -> int:
        return int(after.get(section, {}).get(key, 0) or 0) - int(before.get(section, {}).get(key, 0) or 0)

    ram_hits, ram_misses, disk_hits = d("ram", "hits"), d("ram", "misses"), d("disk", "hits")
    lookups = ram_hits + ram_misses
    return {"block_hit_rate": block_hit_rate(ram_hits, ram_misses, disk_hits),
            "ram_hit_rate": ram_hits / lookups if lookups else None,
            "ram_hits": ram_hits, "disk_hits": disk_hits, "misses": max(0, ram_misses - disk_hits),
            "source_bytes": d("source", "bytes"), "ram_bytes": d("ram", "served_bytes"),
            "disk_bytes": d("disk", "served_bytes")}


def list_samples(path: str) -> list[str]:
    from cachefs.torch import IMG_EXTENSIONS, find_classes, make_samples

    if not os.path.isdir(path):
        raise CachefsError(f"{path} is not a directory")
    try:
        _, class_to_idx = find_classes(path)
    except FileNotFoundError:
        raise CachefsError(f"{path} has no class folders: diagnose expects an ImageFolder tree "
                           "(PATH/<class>/<image>)") from None
    samples = [p for p, _ in make_samples(path, class_to_idx)]
    if not samples:
        raise CachefsError(f"no images ({', '.join(IMG_EXTENSIONS)}) under {path}")
    return samples


def diagnose(path: str, workers: int, batch_size: int, seconds: float, transform: str = "standard",
             target: float = DEFAULT_TARGET, progress: Progress | None = None,
             seed: int | None = None) -> dict[str, Any]:
    from cachefs.pipeline import make_transform

    progress = progress or Progress()
    path = os.path.abspath(path)
    samples = list_samples(path)
    loaded = make_transform(transform)  # a transform that does not load fails before any work
    order = list(range(len(samples)))
    random.Random(seed).shuffle(order)
    half = max(1, len(order) // 2)
    raw_paths = [samples[i] for i in order[:half]]
    loader_indices = order[half:] or order
    cache_before = _cache_snapshot(path)
    raw = raw_reads(raw_paths, workers, seconds, progress)
    load = run_loader(path, loader_indices, workers, batch_size, seconds, loaded, progress)
    cache = None
    if cache_before is not None:
        after = _cache_snapshot(path)
        if after is not None:
            cache = dict(_cache_delta(cache_before[1], after[1]), mountpoint=cache_before[0])
    cores = load["system"]["cores"]
    report: dict[str, Any] = {"path": path, "files": len(samples), "raw": raw, "loader": load, "cache": cache,
              "target_images_per_s": target, "torchvision": _has_torchvision()}
    report.update(judge(raw, load, target, cache, cores, path))
    if raw["exhausted"] or load["images"] + batch_size >= len(loader_indices):
        report["reasons"].append(f"note: the dataset ({len(samples)} files) ran out before {seconds:.0f}s: "
                                 "repeat reads may have come from the page cache")
    return report


def _has_torchvision() -> bool:
    from cachefs.pipeline import has_torchvision

    return has_torchvision()


def format_report(r: dict[str, Any]) -> str:
    raw, load, cache = r["raw"], r["loader"], r["cache"]
    sysd = load["system"]
    lines = [f"cachefs diagnose {r['path']}: {r['files']} images"
             f"{' (torchvision)' if r['torchvision'] else ''}", ""]
    lines.append(f"  raw reads      {raw['workers']} processes   {raw['files_per_s']:8.0f} files/s  "
                 f"{format_size(raw['bytes_per_s'])}/s  p50 {_ms(raw['latency_p50_ms'])}  "
                 f"p99 {_ms(raw['latency_p99_ms'])}")
    lines.append(f"  DataLoader     {load['workers']} workers x {load['batch_size']}  "
                 f"{load['images_per_s']:8.0f} images/s  first batch {load['first_batch_s']:.1f}s  "
                 f"transform {load['transform']}")
    lines.append(f"  per image      read {load['read_ms_per_image']:.2f} ms   decode+transform "
                 f"{load['decode_ms_per_image']:.2f} ms ({load['cpu_ms_per_image']:.2f} ms CPU)   "
                 f"waiting for storage {load['read_share']:.0%}")
    if sysd.get("cpu_busy") is not None:
        cores = " ".join(f"{c:.0%}" for c in sysd["cpu_per_core"][:16])
        lines.append(f"  CPU            {sysd['cpu_busy']:.0%} busy of {sysd['cores']} cores  [{cores}]")
    lines.append(f"  reads          process tree {format_size(sysd['tree_read_per_s'])}/s, "
                 f"block devices {format_size(sysd['disk_read_per_s'])}/s, "
                 f"network in {format_size(sysd['net_recv_per_s'])}/s")
    if cache is not None:
        hit = cache["block_hit_rate"]
        lines.append(f"  cachefs        {cache['mountpoint']}: block hit rate {'-' if hit is None else f'{hit:.0%}'}, "
                     f"RAM {format_size(cache['ram_bytes'])}, NVMe {format_size(cache['disk_bytes'])}, "
                     f"source {format_size(cache['source_bytes'])} over the run")
    lines += ["", f"verdict: {r['verdict'].upper()}"]
    lines += [f"  - {reason}" for reason in r["reasons"]]
    lines += ["", "advice:"] + [f"  - {a}" for a in r["advice"]]
    return "\n".join(lines)


def check_torch() -> None:
    """Raise a CachefsError telling how to get PyTorch and Pillow if they do not import."""
    try:
        import PIL  # noqa: F401
        import torch  # noqa: F401
    except ImportError as exc:
        raise CachefsError(f"cachefs diagnose needs PyTorch and Pillow ({exc.name} is missing): "
                           "pip install torch pillow (into the environment that runs cachefs)") from None
