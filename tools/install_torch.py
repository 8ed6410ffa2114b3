#!/usr/bin/env python3
"""Give the test venv a PyTorch, without pulling a GPU build nobody asked for (`make test`).

The tests of the torch extra (`cachefs.torch`, `cachefs diagnose`) need torch, but a plain
`pip install torch` from the public index is the CUDA build: about 2.7 GB of wheels in 28
packages. In order:

1. a torch already in this environment is used as it is;
2. a torch wheel pip can see without the network (pip's configured find-links, a
   wheelhouse) is installed, then only its small dependencies from the index;
3. the CPU build from PyTorch's own CPU index (about 190 MB), dependencies from the index;
4. none of these: say so and go on. The tests of the torch extra are then skipped, the rest run.

Exit status 0 in every case but a broken pip.
"""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _installed() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def _pip(*args: str, timeout: float = 1800) -> bool:
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args]
    try:
        return subprocess.run(cmd, timeout=timeout).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def main() -> int:
    version = _installed()
    if version:
        print(f"torch {version} is installed: using it")
        return 0
    # 2. no network: only wheels pip finds locally (--no-index keeps the public index out)
    if _pip("--no-index", "--no-deps", "torch", timeout=600) and (version := _installed()):
        _pip(f"torch=={version}")  # its dependencies, torch itself already satisfied
        print(f"installed torch {version} from a local wheel")
        return 0
    # 3. PyTorch's CPU index, and nothing else (--isolated: no configured extra indexes
    # that could offer a CUDA build under the same name)
    print(f"fetching PyTorch's CPU build from {CPU_INDEX} (about 190 MB)")
    if _pip("--isolated", "--no-deps", "--index-url", CPU_INDEX, "--timeout", "15", "--retries", "1", "torch") \
            and (version := _installed()):
        _pip(f"torch=={version}")
        print(f"installed torch {version} (CPU build)")
        return 0
    print("no CPU build of PyTorch could be had here: the tests of the torch extra will be skipped. "
          f"Install one into {sys.prefix} and run make test again to include them.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
