"""The package as users install it: one version string, a license pip does not warn about,
bounds on the dependencies whose private parts cachefs uses, pinned linters, and install
hints that install this project, never a namesake from the public index."""

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


def test_dependencies_cachefs_reaches_into_are_bounded():
    deps = PYPROJECT["project"]["dependencies"]
    for name in ("diskcache",):  # private attributes: a minor release may move them
        spec = _spec(deps, name)
        assert ">=" in spec and "<" in spec.replace("<=", ""), spec
        version = importlib.metadata.version(name)
        lo, hi = re.search(r">=([\d.]+),<([\d.]+)", spec).groups()
        as_tuple = lambda v: tuple(int(x) for x in v.split(".")[:3])
        assert as_tuple(lo) <= as_tuple(version) < as_tuple(hi), f"{name} {version} outside {spec}"


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
