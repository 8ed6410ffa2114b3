"""`cachefs diagnose`: the verdict as a pure function of its figures, and real runs on a
small local JPEG tree (the mounted run is in tests/fuse/test_torch.py)."""

import json
import os

import pytest

from cachefs.cli import main
from cachefs.diagnose import DEFAULT_TARGET, judge

pytest.importorskip("torch", reason="the torch extra (torch and Pillow) is not installed")


def figures(rate, read_ms, cpu_ms, busy, workers=2):
    raw = {"workers": workers, "files_per_s": 1000 / max(read_ms, 0.01) * workers, "bytes_per_s": 1e8,
           "latency_p50_ms": read_ms, "latency_p99_ms": read_ms * 2}
    load = {"images_per_s": rate, "read_share": read_ms / (read_ms + cpu_ms), "workers": workers,
            "cpu_ms_per_image": cpu_ms, "read_ms_per_image": read_ms, "system": {"cpu_busy": busy}}
    return raw, load


def test_slow_storage_is_storage_bound_and_the_advice_is_cachefs():
    raw, load = figures(rate=180, read_ms=6.0, cpu_ms=4.0, busy=0.35)
    out = judge(raw, load, DEFAULT_TARGET, None, cores=2, path="/nfs/imagenet")
    assert out["verdict"] == "storage-bound"
    assert any("cachefs mount /nfs/imagenet" in a for a in out["advice"])
    assert any("2.5x faster" in r for r in out["reasons"])      # 1 / (1 - 0.6)
    assert any("num_workers above the core count" in a for a in out["advice"])


def test_on_a_cold_or_small_cache_the_advice_is_about_the_cache():
    raw, load = figures(rate=300, read_ms=3.0, cpu_ms=3.0, busy=0.5)
    cache = {"block_hit_rate": 0.4, "ram_hit_rate": 0.25, "disk_hits": 100}
    out = judge(raw, load, DEFAULT_TARGET, cache, cores=2, path="/mnt/x")
    assert out["verdict"] == "storage-bound"
    assert any("cachefs warm" in a for a in out["advice"])
    assert any("HintedSampler" in a for a in out["advice"])
    assert not any("cachefs mount" in a for a in out["advice"])


def test_heavy_transforms_are_cpu_bound_and_cachefs_is_not_the_fix():
    raw, load = figures(rate=40, read_ms=0.2, cpu_ms=48.0, busy=0.97)
    out = judge(raw, load, DEFAULT_TARGET, None, cores=2, path="/data")
    assert out["verdict"] == "cpu-bound"
    assert any("decode on the GPU" in a for a in out["advice"])
    assert any("will not make this loader faster" in a for a in out["advice"])
    assert not any("raise num_workers" in a for a in out["advice"])
    few = judge(*figures(rate=40, read_ms=0.2, cpu_ms=24.0, busy=0.5, workers=1), DEFAULT_TARGET, None, 2, "/d")
    assert any("raise num_workers to 2" in a for a in few["advice"])


def test_a_loader_at_or_above_the_target_is_fine_whatever_it_waits_on():
    raw, load = figures(rate=1500, read_ms=0.5, cpu_ms=0.1, busy=0.6)
    assert judge(raw, load, 1000, None, cores=8, path="/d")["verdict"] == "fine"
    raw, load = figures(rate=400, read_ms=0.2, cpu_ms=4.0, busy=0.99)
    assert judge(raw, load, 300, None, cores=2, path="/d")["verdict"] == "fine"
    assert judge(raw, load, 1000, None, cores=2, path="/d")["verdict"] == "cpu-bound"


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    from tools.mkdataset import build

    root = tmp_path_factory.mktemp("ds") / "train"
    build(str(root), classes=3, per_class=20, seed=1, mean_kb=20, progress=False)
    return root


def test_a_real_run_prints_figures_and_a_verdict(tree, capsys):
    assert main(["diagnose", str(tree), "--seconds", "1", "--workers", "2", "--batch-size", "8"]) == 0
    out, err = capsys.readouterr()
    assert "raw reads" in out and "DataLoader" in out and "verdict:" in out and "advice:" in out
    assert "1/2 raw reads" in err and "2/2 DataLoader" in err   # progress, one line a phase off a tty


def test_json_report_has_the_measurements(tree, capsys):
    assert main(["diagnose", str(tree), "--seconds", "1", "--workers", "1", "--batch-size", "4",
                 "--transform", "none", "--target", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr()[0])
    assert report["files"] == 60 and report["verdict"] == "fine" and report["cache"] is None
    assert report["raw"]["files"] > 0 and report["raw"]["bytes"] > 0
    load = report["loader"]
    assert load["images"] > 0 and load["images_per_s"] > 0 and load["transform"].startswith("none")
    assert load["cpu_ms_per_image"] < 5 and 0 <= load["read_share"] <= 1   # bytes only: nothing decoded
    # a mean over the images read in one second of a random order: between the tree's smallest and largest
    # file (a per-batch or per-worker count would be 4x or more), not near the tree's mean
    sizes = [p.stat().st_size for p in tree.rglob("*") if p.is_file()]
    assert min(sizes) <= load["mean_file_bytes"] <= max(sizes)
    assert 0 <= load["system"]["cpu_busy"] <= 1 and len(load["system"]["cpu_per_core"]) == load["system"]["cores"]


def test_your_own_transform_by_module_and_name(tree, tmp_path, capsys, monkeypatch):
    (tmp_path / "mytf.py").write_text("def tiny(img):\n    return img.resize((8, 8)).tobytes()\n")
    monkeypatch.chdir(tmp_path)
    assert main(["diagnose", str(tree), "--seconds", "1", "--workers", "1", "--transform", "mytf:tiny", "--json"]) == 0
    assert json.loads(capsys.readouterr()[0])["loader"]["transform"] == "mytf:tiny (yours)"
    assert main(["diagnose", str(tree), "--seconds", "1", "--transform", "mytf:nothere"]) == 2
    err = capsys.readouterr()[1]
    assert "cannot load transform 'mytf:nothere'" in err and err.count("\n") == 1


@pytest.mark.parametrize("make,needle", [
    (lambda p: p / "missing", "does not exist"),
    (lambda p: (p / "flat").mkdir() or (p / "flat"), "has no class folders"),
    (lambda p: (p / "empty" / "cls").mkdir(parents=True) or (p / "empty"), "no images"),
    (lambda p: (p / "f.txt").write_text("x") and (p / "f.txt"), "is not a directory"),
])
def test_bad_paths_are_one_line_and_exit_2(tmp_path, capsys, make, needle):
    path = make(tmp_path)
    assert main(["diagnose", str(path), "--seconds", "1"]) == 2
    err = capsys.readouterr()[1]
    assert needle in err and err.count("\n") == 1, err
    assert os.listdir(tmp_path) == [path.name] or not path.exists()


def test_the_daemon_and_the_cli_never_import_torch():
    import subprocess
    import sys

    code = ("import sys, cachefs.cli, cachefs.mount, cachefs.core, cachefs.fs, cachefs.fuse, cachefs.hints, "
            "cachefs.diagnose; print(sorted(m for m in ('torch', 'PIL', 'torchvision') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_job_side_helpers_never_import_the_daemon():
    """cachefs.torch and diagnose run inside training jobs: they talk to a mount through
    its control socket and xattrs, and load nothing of the daemon (FUSE, core, tiers)."""
    import subprocess
    import sys

    daemon = ("cachefs.core", "cachefs.fs", "cachefs.fuse", "cachefs.daemon", "cachefs.mount", "cachefs.hints",
              "cachefs.tiers", "cachefs.fetcher", "cachefs.prefetch", "cachefs.source")
    code = ("import sys, cachefs.diagnose, cachefs.hintclient, cachefs.mounttable\n"
            "try:\n    import cachefs.torch\nexcept ImportError:\n    pass\n"
            f"print(sorted(m for m in sys.modules for d in {daemon!r} if m == d or m.startswith(d + '.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_without_torch_diagnose_says_how_to_get_it(tmp_path, capsys, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_torch(name, *a, **k):
        if name == "torch":
            raise ImportError("No module named 'torch'", name="torch")
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    assert main(["diagnose", str(tmp_path)]) == 2
    err = capsys.readouterr()[1]
    assert "needs PyTorch and Pillow (torch is missing): pip install torch pillow (into the environment" in err
