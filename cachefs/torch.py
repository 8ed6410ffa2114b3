"""PyTorch helpers (the optional `torch` extra). The daemon and the core never import this.

`ImageFolder` lists a tree exactly as torchvision's `datasets.ImageFolder` does (classes
are the sorted subdirectory names, samples sorted by path, the same image extensions), so
`cachefs diagnose` and the tests can run the usual pipeline where torchvision is not
installed. It reads through the ordinary file API: pointed at a cachefs mount, it is what
any training job's dataset does.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch.utils.data

# torchvision.datasets.folder.IMG_EXTENSIONS
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def find_classes(root: str) -> tuple[list[str], dict[str, int]]:
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    if not classes:
        raise FileNotFoundError(f"no class folders in {root}")
    return classes, {name: i for i, name in enumerate(classes)}


def make_samples(root: str, class_to_idx: dict[str, int],
                 extensions: tuple[str, ...] = IMG_EXTENSIONS) -> list[tuple[str, int]]:
    samples = []
    for name in sorted(class_to_idx):
        base = os.path.join(root, name)
        for dirpath, _, files in sorted(os.walk(base, followlinks=True)):
            for fname in sorted(files):
                if fname.lower().endswith(extensions):
                    samples.append((os.path.join(dirpath, fname), class_to_idx[name]))
    return samples


class ImageFolder(torch.utils.data.Dataset):
    """(loader(path), class index) per sample; `loader` defaults to the raw bytes, and
    `transform` (e.g. decode + resize + to tensor) is applied to what it returns."""

    def __init__(self, root: str, loader: Callable[[str], Any] = read_bytes,
                 transform: Callable[[Any], Any] | None = None):
        self.root = root
        self.classes, self.class_to_idx = find_classes(root)
        self.samples = make_samples(root, self.class_to_idx)
        self.targets = [idx for _, idx in self.samples]
        self.loader = loader
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        path, target = self.samples[index]
        sample = self.loader(path)
        if self.transform is not None:
            sample = self.transform(sample)
        return sample, target
