"""PyTorch helpers (the optional `torch` extra). The daemon and the core never import this.

`ImageFolder` lists a tree exactly as torchvision's `datasets.ImageFolder` does (classes
are the sorted subdirectory names, samples sorted by path, the same image extensions), so
`cachefs diagnose` and the tests can run the usual pipeline where torchvision is not
installed. It reads through the ordinary file API: pointed at a cachefs mount, it is what
any training job's dataset does.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import torch.utils.data

# torchvision.datasets.folder.IMG_EXTENSIONS
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def read_bytes(path: str) -> bytes:
    """The file's bytes, opened unbuffered: a buffered open() before Python 3.14 asks
    `isatty()`, on a FUSE mount one more request per file (docs/pytorch.md)."""
    with open(path, "rb", buffering=0) as f:
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


def _sample_paths(dataset: Any) -> Callable[[int], str]:
    """index -> file path for torchvision-style datasets (samples / imgs), Subset and
    ConcatDataset of them; TypeError for anything else (pass paths= instead)."""
    if isinstance(dataset, torch.utils.data.Subset):
        inner, indices = _sample_paths(dataset.dataset), dataset.indices
        return lambda i: inner(indices[i])
    if isinstance(dataset, torch.utils.data.ConcatDataset):
        import bisect

        parts, ends = [_sample_paths(d) for d in dataset.datasets], dataset.cumulative_sizes

        def concat(i: int) -> str:
            k = bisect.bisect_right(ends, i)
            return parts[k](i - (ends[k - 1] if k else 0))
        return concat
    samples = getattr(dataset, "samples", None) or getattr(dataset, "imgs", None)
    if samples is None:
        raise TypeError(f"cannot tell the file of a sample of {type(dataset).__name__}: pass paths=")
    return lambda i: samples[i][0]


class HintedSampler(torch.utils.data.Sampler[int]):
    """Wrap a sampler and tell the cachefs mount, ahead of the reads, which files the
    coming samples are: the daemon fetches that window into RAM (cachefs/hints.py).

        sampler = HintedSampler(RandomSampler(dataset), dataset)
        loader = DataLoader(dataset, sampler=sampler, batch_size=256, num_workers=8)

    `dataset` maps indices to files (ImageFolder, DatasetFolder, Subset/ConcatDataset of
    them), or give `paths` (a sequence or a callable index -> path). `mount` is found from
    the files when not given. The wrapped sampler may yield indices or lists of them (a
    batch sampler). Iteration is exactly the wrapped sampler's: off a cachefs mount, with an
    old daemon, or if the mount goes away, hints turn off with one warning and the epoch
    goes on. Each epoch is one session; ending an epoch early, a crash or kill -9 ends it
    and releases what it held. Safe to pickle (no connection lives outside an epoch).
    """

    def __init__(self, sampler: Any, dataset: Any = None, mount: str | None = None, *,
                 paths: Any = None, lookahead: int | None = None, label: str = ""):
        from cachefs.hintclient import DEFAULT_LOOKAHEAD

        self.sampler = sampler
        if paths is None and dataset is None:
            raise TypeError("HintedSampler needs the dataset (or paths=) to name the files")
        self._path_of = paths if callable(paths) else (paths.__getitem__ if paths is not None
                                                        else _sample_paths(dataset))
        self.mount = mount
        self.lookahead = lookahead or DEFAULT_LOOKAHEAD
        self.label = label

    def __len__(self) -> int:
        return len(self.sampler)

    def set_epoch(self, epoch: int) -> None:
        """Passed on (DistributedSampler reshuffles with it)."""
        if hasattr(self.sampler, "set_epoch"):
            self.sampler.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        from collections import deque

        from cachefs.hintclient import CHUNK

        source = iter(self.sampler)
        ahead: deque = deque()
        unsent: list[str] = []
        yielded = 0
        exhausted = False
        channel, to_mount = self._connect()
        try:
            while True:
                while not exhausted and len(ahead) < self.lookahead:
                    try:
                        item = next(source)
                    except StopIteration:
                        exhausted = True
                        break
                    ahead.append(item)
                    if channel is not None and to_mount is not None:
                        for index in (item if isinstance(item, (list, tuple)) else (item,)):
                            path = to_mount(self._path_of(int(index)))
                            if path is not None:
                                unsent.append(path)
                if channel is not None and unsent and (len(unsent) >= CHUNK or exhausted or yielded == 0):
                    if not channel.send(unsent, yielded):
                        channel = None
                    unsent = []
                if not ahead:
                    return
                item = ahead.popleft()
                yielded += len(item) if isinstance(item, (list, tuple)) else 1
                yield item
        finally:
            if channel is not None:
                channel.close()

    def _connect(self) -> tuple[Any, Callable[[str], str | None] | None]:
        """(HintClient or None, path -> path inside the mount or None)."""
        import logging

        from cachefs.errors import CachefsError
        from cachefs.hintclient import HintClient
        from cachefs.mounttable import control_address, mount_of

        log = logging.getLogger("cachefs.torch")
        try:
            first = self._path_of(0) if self.mount is None else self.mount
            mountpoint, _ = mount_of(first)
            client = HintClient(control_address(mountpoint), self.lookahead,
                                self.label or f"pid {os.getpid()}")
        except (CachefsError, OSError, IndexError, KeyError) as exc:
            log.warning("cachefs: order hints off: %s", exc)
            return None, None
        if not client.active:
            return None, None
        dirs: dict[str, str | None] = {}

        def to_mount(path: str) -> str | None:
            directory, _, name = path.rpartition("/")
            inside = dirs.get(directory, "")
            if inside == "":
                real = os.path.realpath(directory or "/")
                inside = dirs[directory] = (real[len(mountpoint):] if real == mountpoint
                                            or real.startswith(mountpoint + "/") else None)
            return None if inside is None else f"{inside}/{name}"
        return client, to_mount
