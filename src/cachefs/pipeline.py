"""The usual image-training input pipeline, for `cachefs diagnose` (the `torch` extra).

torchvision's transforms when torchvision is installed; otherwise the same operations with
PIL and torch (RandomResizedCrop's sampling, bilinear resize, flip, ToTensor, Normalize),
so the CPU cost measured is the cost a training job pays. Every sample is timed in the
worker process: wall time waiting for the file's bytes, and CPU time decoding and
transforming them, summed into shared counters the parent reads.
"""

from __future__ import annotations

import importlib
import io
import math
import multiprocessing
import random
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from PIL import Image

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet's, as every recipe uses
TRANSFORMS = ("standard", "eval", "none")


def has_torchvision() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # not installed, or built for another torch (an ImportError or worse)
        return False
    return True


def _to_tensor_normalized(img: Image.Image) -> torch.Tensor:
    w, h = img.size
    t = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(h, w, 3).permute(2, 0, 1)
    t = t.float().div_(255)
    mean = torch.tensor(MEAN).view(3, 1, 1)
    std = torch.tensor(STD).view(3, 1, 1)
    return t.sub_(mean).div_(std)


class RandomResizedCropFlip:
    """torchvision's RandomResizedCrop(224, scale=(0.08, 1), ratio=(3/4, 4/3)) +
    RandomHorizontalFlip + ToTensor + Normalize: ImageNet training's augmentation."""

    def __init__(self, size: int = 224, scale: tuple[float, float] = (0.08, 1.0),
                 ratio: tuple[float, float] = (3 / 4, 4 / 3)):
        self.size, self.scale, self.ratio = size, scale, ratio

    def crop_box(self, width: int, height: int, rng: random.Random) -> tuple[int, int, int, int]:
        area = width * height
        log_ratio = (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            target = area * rng.uniform(*self.scale)
            aspect = math.exp(rng.uniform(*log_ratio))
            w = int(round(math.sqrt(target * aspect)))
            h = int(round(math.sqrt(target / aspect)))
            if 0 < w <= width and 0 < h <= height:
                x, y = rng.randint(0, width - w), rng.randint(0, height - h)
                return x, y, x + w, y + h
        # fallback: the central crop at the closest allowed aspect ratio
        in_ratio = width / height
        if in_ratio < self.ratio[0]:
            w, h = width, int(round(width / self.ratio[0]))
        elif in_ratio > self.ratio[1]:
            w, h = int(round(height * self.ratio[1])), height
        else:
            w, h = width, height
        x, y = (width - w) // 2, (height - h) // 2
        return x, y, x + w, y + h

    def __call__(self, img: Image.Image) -> torch.Tensor:
        rng = random.Random()
        img = img.resize((self.size, self.size), Image.Resampling.BILINEAR, box=self.crop_box(*img.size, rng))
        if rng.random() < 0.5:
            img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
        return _to_tensor_normalized(img)


class ResizeCenterCrop:
    """Resize(256) + CenterCrop(224) + ToTensor + Normalize: ImageNet evaluation."""

    def __init__(self, resize: int = 256, size: int = 224):
        self.resize, self.size = resize, size

    def __call__(self, img: Image.Image) -> torch.Tensor:
        w, h = img.size
        scale = self.resize / min(w, h)
        w, h = max(self.size, round(w * scale)), max(self.size, round(h * scale))
        img = img.resize((w, h), Image.Resampling.BILINEAR)
        x, y = (w - self.size) // 2, (h - self.size) // 2
        return _to_tensor_normalized(img.crop((x, y, x + self.size, y + self.size)))


def torchvision_transform(name: str) -> Callable[[Any], Any]:
    from torchvision import transforms as T

    normalize = [T.ToTensor(), T.Normalize(MEAN, STD)]
    if name == "standard":
        return T.Compose([T.RandomResizedCrop(224), T.RandomHorizontalFlip(), *normalize])
    return T.Compose([T.Resize(256), T.CenterCrop(224), *normalize])


def make_transform(spec: str) -> tuple[Callable[[Any], Any] | None, bool, str]:
    """(transform of a decoded PIL image or None, whether samples are decoded, description).

    `spec` is "standard" (training augmentation), "eval", "none" (bytes only: no decode),
    or MODULE:NAME of your own callable (given a PIL image), e.g. mypkg.data:train_tf.
    Raises ValueError for a spec that does not name one."""
    if spec == "none":
        return None, False, "none (raw bytes, no decode)"
    if spec in ("standard", "eval"):
        what = ("RandomResizedCrop(224) + flip + ToTensor + Normalize" if spec == "standard"
                else "Resize(256) + CenterCrop(224) + ToTensor + Normalize")
        if has_torchvision():
            return torchvision_transform(spec), True, f"{spec}: torchvision {what}"
        return (RandomResizedCropFlip() if spec == "standard" else ResizeCenterCrop()), True, f"{spec}: {what}"
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"unknown transform {spec!r}: use one of {', '.join(TRANSFORMS)} or MODULE:NAME")
    if "" not in sys.path:
        sys.path.insert(0, "")  # your own module, from the current directory
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load transform {spec!r}: {exc}") from None
    if not callable(fn):
        raise ValueError(f"transform {spec!r} is not callable")
    return fn, True, f"{spec} (yours)"


class Timings:
    """Counters shared with the DataLoader's worker processes (forked after this exists)."""

    FIELDS = ("samples", "bytes", "read_s", "cpu_s", "decode_wall_s")

    def __init__(self) -> None:
        self._values = multiprocessing.get_context("fork").Array("d", len(self.FIELDS))

    def add(self, nbytes: int, read_s: float, cpu_s: float, wall_s: float) -> None:
        with self._values.get_lock():
            v = self._values
            v[0] += 1
            v[1] += nbytes
            v[2] += read_s
            v[3] += cpu_s
            v[4] += wall_s

    def read(self) -> dict[str, float]:
        with self._values.get_lock():
            return dict(zip(self.FIELDS, self._values[:], strict=True))


class TimedLoader:
    """loader(path): read the file's bytes (timed, wall clock: waiting for storage), then
    decode and transform them (timed, CPU time). The result is what the training loop gets."""

    def __init__(self, timings: Timings, transform: Callable[[Any], Any] | None, decode: bool):
        self.timings, self.transform, self.decode = timings, transform, decode

    def __call__(self, path: str) -> Any:
        t0 = time.perf_counter()
        with open(path, "rb") as f:
            data = f.read()
        t1 = time.perf_counter()
        c1 = time.process_time()
        sample: Any = data
        if self.decode:
            sample = Image.open(io.BytesIO(data)).convert("RGB")
            if self.transform is not None:
                sample = self.transform(sample)
        self.timings.add(len(data), t1 - t0, time.process_time() - c1, time.perf_counter() - t1)
        return sample


def make_dataset(root: str, loader: Callable[[str], Any]) -> Any:
    """torchvision's ImageFolder if installed, else cachefs.torch.ImageFolder (same listing)."""
    if has_torchvision():
        from torchvision.datasets import ImageFolder as TVImageFolder

        return TVImageFolder(root, loader=loader)
    from cachefs.torch import ImageFolder

    return ImageFolder(root, loader=loader)


def collate(batch: list[tuple[Any, int]]) -> Any:
    """default_collate, except raw bytes stay a list (transform "none")."""
    if batch and isinstance(batch[0][0], bytes):
        return [s for s, _ in batch], torch.tensor([t for _, t in batch])
    return torch.utils.data.default_collate(batch)
