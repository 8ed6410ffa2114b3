"""Every stat name the code counts is one the table in cachefs/stats.py declares (and
docs/stats.md documents: tests/test_stats_docs.py): a name typed wrong at a call site,
or built by an f-string that matches nothing, fails here instead of silently adding a
counter no view shows."""

import ast
import pathlib
import re

from cachefs.stats import COUNTERS, GAUGES, HISTOGRAMS

SRC = pathlib.Path(__file__).resolve().parent.parent / "src" / "cachefs"
DECLARED = set(COUNTERS) | set(GAUGES) | set(HISTOGRAMS)
CALLS = {"incr", "add_many", "gauge", "observe"}


def _names(node: ast.expr) -> list[ast.expr]:
    """The expressions that are stat names in a call's first argument."""
    if isinstance(node, ast.Dict):
        return [k for k in node.keys if k is not None]
    if isinstance(node, ast.DictComp):
        return [node.key]
    return [node]


def _pattern(node: ast.expr) -> str | None:
    """A regex for the names the expression can make; None if it is not a literal at all."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return re.escape(node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(re.escape(v.value) if isinstance(v, ast.Constant) else "[a-z_]+" for v in node.values)
    return None


def test_every_stat_name_counted_is_declared():
    unknown, checked = [], 0
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in CALLS and node.args):
                continue
            for expr in _names(node.args[0]):
                pattern = _pattern(expr)
                if pattern is None or "." not in pattern:
                    continue
                checked += 1
                if not any(re.fullmatch(pattern, name) for name in DECLARED):
                    unknown.append(f"{path.name}:{node.lineno}: {ast.unparse(expr)}")
    assert checked > 100, checked  # the scan finds the call sites
    assert not unknown, "\n".join(unknown)
