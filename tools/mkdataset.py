#!/usr/bin/env python3
"""mkdataset: a synthetic ImageFolder dataset of real JPEGs, deterministic from a seed.

    python tools/mkdataset.py OUT --classes 10 --per-class 100 [--seed 0] [--mean-kb 110]

Writes OUT/class_000/img_00000.jpg ... Images are decodable JPEGs of ImageNet-like sizes
(short side 300-500 px; about 110 KB mean file size by default, with ImageNet's spread),
made from a random low-resolution pattern plus fine noise whose strength sets the size.
The same seed and arguments give the same bytes.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import random
import sys
import time

from PIL import Image

# Measured: KB of a 500x375 JPEG at quality 95 against the noise blend factor.
_SIZE_CURVE = [(0.0, 25), (0.02, 35), (0.05, 58), (0.1, 87), (0.15, 107), (0.2, 121),
               (0.3, 143), (0.4, 160), (0.6, 186), (1.0, 225)]
_SIGMA = 0.45  # spread of file sizes (lognormal), close to ImageNet's


def _alpha_for(kb_at_ref: float) -> float:
    for (a0, k0), (a1, k1) in zip(_SIZE_CURVE, _SIZE_CURVE[1:], strict=False):
        if kb_at_ref <= k1:
            return a0 + (a1 - a0) * max(0.0, kb_at_ref - k0) / (k1 - k0)
    return 1.0


def make_jpeg(rng: random.Random, mean_kb: float) -> bytes:
    w = rng.randint(300, 500)
    h = int(w * rng.choice((0.75, 1.0, 1.333, 0.667)))
    # a smooth random picture: a tiny random image upscaled
    base = Image.frombytes("RGB", (8, 6), rng.randbytes(8 * 6 * 3)).resize((w, h), Image.Resampling.BICUBIC)
    # fine detail: noise whose strength sets the file size
    noise = Image.frombytes("RGB", (w, h), rng.randbytes(w * h * 3))
    # 1.1: the curve flattens at the top, which pulls the mean down by about a tenth
    target_kb = rng.lognormvariate(0, _SIGMA) / math.exp(_SIGMA**2 / 2) * mean_kb * 1.1
    img = Image.blend(base, noise, _alpha_for(target_kb * (500 * 375) / (w * h)))
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def build(out: str, classes: int, per_class: int, seed: int, mean_kb: float, progress: bool = True) -> int:
    total_bytes = 0
    n = classes * per_class
    start = time.monotonic()
    for c in range(classes):
        d = os.path.join(out, f"class_{c:03d}")
        os.makedirs(d, exist_ok=True)
        for i in range(per_class):
            rng = random.Random(f"{seed}/{c}/{i}")
            data = make_jpeg(rng, mean_kb)
            path = os.path.join(d, f"img_{i:05d}.jpg")
            with open(path, "wb") as f:
                f.write(data)
            total_bytes += len(data)
            done = c * per_class + i + 1
            if progress and (done % 50 == 0 or done == n):
                rate = done / max(1e-9, time.monotonic() - start)
                print(f"\rmkdataset: {done}/{n} images, {total_bytes / 1e6:.1f} MB, {rate:.0f} img/s",
                      end="", file=sys.stderr, flush=True)
    if progress:
        print(file=sys.stderr)
    return total_bytes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--per-class", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mean-kb", type=float, default=110.0, help="target mean file size in KB (default: 110)")
    p.add_argument("-q", "--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.classes < 1 or args.per_class < 1:
        print("mkdataset: error: --classes and --per-class must be at least 1", file=sys.stderr)
        return 2
    total = build(args.out, args.classes, args.per_class, args.seed, args.mean_kb, not args.quiet)
    n = args.classes * args.per_class
    if not args.quiet:
        print(f"mkdataset: {n} JPEGs in {args.out}, {total / 1e6:.1f} MB, mean {total / n / 1e3:.1f} KB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
