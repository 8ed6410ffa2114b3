"""The import graph holds the layer order docs/design.md draws: no cycle, no import from a
lower layer to a higher one, the FUSE package knows nothing of caching, the job-side
helpers nothing of the daemon, and no module outside cachefs/tiers/ names a tier."""

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "cachefs"

# Lowest first. A module may import its own layer and the layers below it.
LAYERS = [
    ("foundation", {"errors", "identity", "config", "stats", "directio", "acl", "blocks", "policy", "readahead",
                    "hooks", "ttlcache", "heap", "__init__"}),
    ("fuse protocol", {"fuse", "fuse.kernel", "fuse.protocol", "fuse.ops", "fuse.session", "fuse.serve",
                       "fuse.servetable", "fuse.children"}),
    ("job side", {"hintclient", "mounttable", "torch", "pipeline", "diagnose"}),
    ("tiers and sources", {"tiers", "tiers.layout", "tiers.index", "tiers.entry", "tiers.store", "tiers.table",
                           "tiers.coldset", "tiers.restored", "tiers.checkpoint", "tiers.memory", "tiers.disk",
                           "tiers.checks", "tiers.shared", "tiers.promote", "tiers.multilevel", "tiers.build",
                           "source", "memsource"}),
    ("scheduling", {"gate", "prefetch", "flight", "guard"}),
    ("core parts", {"metadata", "xattrs", "dircheck", "listahead", "listings", "blockpath", "fetcher", "fills",
                    "dirahead"}),
    ("core", {"core"}),
    ("features", {"hints", "warm", "coverage", "control", "metrics"}),
    ("file system", {"nodes", "published", "tablenodes", "checkpointing", "serving", "fs"}),
    ("daemon and command line", {"daemon", "validate", "mount", "watch", "options", "cli", "mounthelper",
                                 "__main__"}),
]
RANK = {m: i for i, (_, mods) in enumerate(LAYERS) for m in mods}
# What modules outside cachefs/tiers/ may import of it: the composite cache (the one door),
# the tier protocol, the builder, the store's layout (fetch processes write entry files),
# and the entry table's format (serving processes read it, cachefs/serving.py).
TIER_DOORS = {"tiers", "tiers.multilevel", "tiers.build", "tiers.layout", "tiers.table"}


def _module(path: pathlib.Path) -> str:
    name = ".".join(path.relative_to(SRC).with_suffix("").parts)
    return name.removesuffix(".__init__") or "__init__"


def _imports() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        deps = set()
        tree = ast.parse(path.read_text())
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and ast.unparse(block.test) == "TYPE_CHECKING" for n in ast.walk(block)}
        for node in ast.walk(tree):
            if id(node) in typing_only:  # annotations only: no import at run time
                continue
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from cachefs.fuse import protocol` imports the module cachefs.fuse.protocol
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}"[len("cachefs."):] in RANK
                         else node.module for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                if name == "cachefs" or not name.startswith("cachefs."):
                    continue
                mod = name[len("cachefs."):]
                if mod in RANK:
                    deps.add(mod)
        graph[_module(path)] = deps
    return graph


def test_every_module_has_a_layer():
    assert set(_imports()) <= set(RANK), f"add to LAYERS (and docs/design.md): {set(_imports()) - set(RANK)}"


def test_no_import_goes_up_a_layer():
    up = [f"{m} ({LAYERS[RANK[m]][0]}) imports {d} ({LAYERS[RANK[d]][0]})"
          for m, deps in _imports().items() for d in deps if RANK[d] > RANK[m]]
    assert not up, "\n".join(up)


def test_no_cycle():
    graph = _imports()
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for d in graph.get(m, ()):
            if d == m:
                continue
            assert state.get(d) != 1, "import cycle: " + " -> ".join([*path, m, d])
            if d not in state:
                visit(d, [*path, m])
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m, [])


def test_no_module_outside_the_tiers_names_a_tier():
    named = [f"{m} imports {d}" for m, deps in _imports().items() if not m.startswith("tiers")
             for d in deps if d.startswith("tiers") and d not in TIER_DOORS]
    assert not named, "\n".join(named)
    tier_classes = re.compile(r"\b(MemoryTier|DiskTier|SharedTier|FileStore)\b")
    for path in SRC.rglob("*.py"):
        if "tiers" in path.relative_to(SRC).parts:
            continue
        code = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
        assert not tier_classes.search(code), f"{path.relative_to(ROOT)} names a tier class"


def test_the_layer_order_is_the_one_the_design_doc_draws():
    text = (ROOT / "docs" / "design.md").read_text()
    rows = re.findall(r"^\| ([a-z ]+) \| (.*?) \|", text, re.M)
    drawn = [(name, row) for name, row in rows if name in {n for n, _ in LAYERS}]
    assert [name for name, _ in drawn] == [name for name, _ in LAYERS], "docs/design.md draws other layers"
    for (name, row), (_, modules) in zip(drawn, LAYERS, strict=True):
        for module in modules - {"__init__", "tiers", "fuse", "__main__"}:
            leaf = module.split(".")[-1]
            assert f"{leaf}.py" in row, f"docs/design.md does not put {module} in the layer {name!r}"


def test_modules_and_functions_stay_small_or_say_why():
    """No module over 600 lines; a function over 60 lines has its reason in a comment
    right above it ("Long (N lines) for a reason: ...")."""
    big = [f"{p.relative_to(ROOT)}: {n} lines" for p in SRC.rglob("*.py")
           if (n := len(p.read_text().splitlines())) > 600]
    assert not big, "\n".join(big)
    unexplained = []
    for path in SRC.rglob("*.py"):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno - node.lineno >= 60:
                above = "\n".join(lines[max(0, node.lineno - 4):node.lineno - 1])
                if "for a reason:" not in above:
                    unexplained.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not unexplained, "\n".join(unexplained)
