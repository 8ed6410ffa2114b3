"""tierstart: what a start of the NVMe tier costs, by the number of files it holds.

Builds an NVMe tier of N one-block files through the tier's own API (no source, no mount:
what is measured is the tier alone), stops it cleanly, then in fresh processes, each with
the page cache dropped first where the machine allows:

  start     opening the tier after the clean stop (the median of --repeats), and the
            process's RSS after it;
  touch     bringing every entry into memory (as an epoch's opens would), per entry;
  stop      the clean stop after that (nothing changed since the start), and the first
            clean stop after the build (every entry in memory, all written);
  first     in the build (a first mount, each file read once after it was stored): the RSS
            with every entry in memory, and after a checkpoint of them (which cools them
            out of memory where the version does), with the checkpoint's time.

    python tools/tierstart.py --files 200000 --baseline ../old-checkout

With --baseline, the same tier is built and measured by the checkout in DIR too (its own
cache dir, the same entries), side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tools.common import add_workspace_options, drop_caches, median, workspace, write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs inside the checkout under test (PYTHONPATH=<checkout>/src): one step, a JSON line out.
CHILD = r"""
import json, os, sys, time
import psutil, xxhash
from cachefs.identity import Attr, EntryInfo
from cachefs.tiers.disk import DiskTier

step, directory, files = sys.argv[1], sys.argv[2], int(sys.argv[3])
out = {}
def eid(i):
    return xxhash.xxh3_128_digest(b"tierstart %d" % i)
if step == "build":
    t = DiskTier(directory, 1 << 44, scrub=False)
    data = b"x" * 2048
    h = xxhash.xxh3_64_intdigest(data)
    for i in range(files):
        e = eid(i)
        path = t.file_of(e.hex())
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        name = f"n{i // 1281:08d}/n{i // 1281:08d}_{i}.JPEG"
        attr = Attr(0o100644, 1, 0, 0, len(data), i, i, i, 8, 0, 1000 + i)
        t.adopt((e, 0), len(data), h, EntryInfo(name, attr, 1 << 20))
    for i in range(0, files, 4096):  # each read once (a serving process's report of an epoch's opens)
        t.hit_whole([eid(j) for j in range(i, min(i + 4096, files))])
    out["built_rss"] = psutil.Process().memory_info().rss
    start = time.perf_counter()
    got = t.checkpoint()
    out["checkpoint_s"] = time.perf_counter() - start
    if got is not None and got[0] >= 0:
        os.close(got[0])
    out["checkpointed_rss"] = psutil.Process().memory_info().rss
    start = time.perf_counter()
    t.close()
    out["stop_s"] = time.perf_counter() - start
else:
    start = time.perf_counter()
    t = DiskTier(directory, 1 << 44, scrub=False)
    out["start_s"] = time.perf_counter() - start
    out["start_rss"] = psutil.Process().memory_info().rss
    if step == "touch":
        start = time.perf_counter()
        for i in range(files):
            assert t.entry(eid(i)) is not None
        out["touch_us"] = (time.perf_counter() - start) / files * 1e6
        out["touched_rss"] = psutil.Process().memory_info().rss
    start = time.perf_counter()
    t.close()
    out["stop_s"] = time.perf_counter() - start
print(json.dumps(out))
"""


def run(checkout: str, step: str, directory: str, files: int) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.join(checkout, "src"))
    proc = subprocess.run([sys.executable, "-c", CHILD, step, directory, str(files)], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"tierstart: {step} in {checkout} failed:\n{proc.stderr.strip()}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(checkout: str, directory: str, files: int, repeats: int) -> dict:
    first_stop = None
    built: dict = {}
    if not os.path.isdir(os.path.join(directory, "data")):
        print(f"tierstart: building {files:,} entries in {directory}", file=sys.stderr)
        built = run(checkout, "build", directory, files)
        first_stop = built["stop_s"]
    starts = []
    for _ in range(repeats):
        drop_caches()
        starts.append(run(checkout, "start", directory, files))
    drop_caches()
    touch = run(checkout, "touch", directory, files)
    return {"start_s": median(s["start_s"] for s in starts),
            "start_rss_per_file": median(s["start_rss"] for s in starts) / files,
            "touch_us": touch["touch_us"], "touched_rss_per_file": touch["touched_rss"] / files,
            "stop_s": touch["stop_s"], "first_stop_s": first_stop,
            **({"built_rss_per_file": built["built_rss"] / files, "checkpoint_s": built["checkpoint_s"],
                "checkpointed_rss_per_file": built["checkpointed_rss"] / files} if built else {})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workspace_options(p, repeats=3)
    p.add_argument("--files", type=int, default=200_000)
    p.add_argument("--baseline", metavar="DIR", help="also measure the cachefs checkout in DIR")
    args = p.parse_args()
    with workspace(args, "tierstart") as work:
        systems = [("this", ROOT)] + ([("baseline", os.path.abspath(args.baseline))] if args.baseline else [])
        results = {}
        for name, checkout in systems:
            results[name] = measure(checkout, os.path.join(work, f"{name}-{args.files}"), args.files, args.repeats)
        print(f"| {args.files:,} files | start s | RSS after start B/file | touch us/entry | RSS touched B/file "
              f"| stop after touch s | first stop s |")
        print("|---|---|---|---|---|---|---|")
        for name, r in results.items():
            first = "-" if r["first_stop_s"] is None else f"{r['first_stop_s']:.2f}"
            print(f"| {name} | {r['start_s']:.2f} | {r['start_rss_per_file']:.0f} | {r['touch_us']:.1f} "
                  f"| {r['touched_rss_per_file']:.0f} | {r['stop_s']:.2f} | {first} |")
        if all("checkpoint_s" in r for r in results.values()):
            print(f"\n| {args.files:,} files, the build (a first mount) | RSS B/file, every entry in memory "
                  f"| checkpoint s | RSS B/file after it |")
            print("|---|---|---|---|")
            for name, r in results.items():
                print(f"| {name} | {r['built_rss_per_file']:.0f} | {r['checkpoint_s']:.2f} "
                      f"| {r['checkpointed_rss_per_file']:.0f} |")
        write_json(args.json, {"files": args.files, "results": results})


if __name__ == "__main__":
    main()
