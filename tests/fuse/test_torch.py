"""A real PyTorch pipeline through the mount: a DataLoader with worker processes over an
ImageFolder tree yields the same samples (bytes and class indices) as over the source."""

import os
import random

import pytest

torch = pytest.importorskip("torch", reason="the torch extra: pip install 'cachefs[torch]'")

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
