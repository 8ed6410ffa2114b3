"""The package as users install it: one version string, a license pip does not warn about,
only dependencies it imports, pinned linters, and install hints that install this
project, never a namesake from the public index."""

import importlib.metadata
import re
from pathlib import Path

import pytest

import cachefs

tomllib = pytest.importorskip("tomllib", reason="Python 3.11 reads TOML")

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_one_version_string():
    project = PYPROJECT["project"]
    assert "version" not in project and project["dynamic"] == ["version"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "cachefs.__version__"}
    assert importlib.metadata.version("cachefs") == cachefs.__version__


def test_license_is_an_spdx_string_so_setuptools_does_not_warn():
    # A `license = { text = ... }` table made every install print a deprecation warning 3 times.
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert any(re.fullmatch(r"setuptools>=(\d+)", r) and int(r.split(">=")[1]) >= 77
               for r in PYPROJECT["build-system"]["requires"])


def _spec(requirements: list[str], name: str) -> str:
    return next(r for r in requirements if re.match(rf"{name}\b", r))


def test_every_runtime_dependency_is_one_the_package_imports():
    """A dependency nothing imports any more is only a download (diskcache stayed one for
    a round after the NVMe tier left it)."""
    deps = PYPROJECT["project"]["dependencies"]
    source = "\n".join(p.read_text() for p in (ROOT / "src" / "cachefs").rglob("*.py"))
    for spec in deps:
        name = re.match(r"[A-Za-z0-9_.-]+", spec).group(0).replace("-", "_").lower()
        assert re.search(rf"^\s*(import|from) {name}\b", source, re.M), f"{spec}: nothing in src imports it"


def test_linters_are_pinned_and_installed_as_pinned():
    dev = PYPROJECT["project"]["optional-dependencies"]["dev"]
    for name in ("ruff", "mypy"):
        spec = _spec(dev, name)
        assert re.fullmatch(rf"{name}==[\d.]+", spec), spec
        assert importlib.metadata.version(name) == spec.split("==")[1]


def test_no_user_facing_text_installs_a_namesake_from_the_public_index():
    """`pip install 'cachefs[...]'` fetches an unrelated project called cachefs."""
    texts = [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "src" / "cachefs").rglob("*.py")]
    for path in texts:
        for line in path.read_text().splitlines():
            assert not re.search(r"pip install\s+['\"]?cachefs\b", line), f"{path.name}: {line.strip()}"
