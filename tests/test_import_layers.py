"""The package's import structure: no import cycles between modules, and no import from a lower layer
into a higher one (data flows down). Imports are read with `ast`, those inside functions too, so a
lazy import counts like a top-level one."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The layers of hybridkv, lowest first: a module may import modules of its own layer and of the
# layers before it. `chat` (the model's text format) depends on nothing and sits below `engine`, so
# the offline API may use it as the server does; "hybridkv" is the package's own __init__.
LAYERS = ("errors", "config", "distributed", "presets", "ops", "model", "weights", "cache", "memory", "chat", "engine",
          "tasks", "server", "eval", "train", "tools", "demo", "cli", "hybridkv")


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package under root."""
    out = {}
    for path in sorted((root / "hybridkv").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of a dotted name that is a module of the package (None: not ours)."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def imports(root: Path) -> list[tuple[str, int, str]]:
    """Every import of one package module by another: (importer, line, imported module)."""
    modules = _modules(root)
    found = []
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [_known(a.name, modules) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                # `from pkg import sub` imports the module pkg.sub; `from pkg import name`, pkg itself
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else _known(base, modules)
                           for a in node.names]
            found += [(name, node.lineno, t) for t in dict.fromkeys(targets) if t is not None and t != name]
    return sorted(found)


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _where(root: Path, module: str, line: int) -> str:
    return f"{_modules(root)[module].relative_to(root)}:{line}"


def cycles(root: Path) -> list[list[tuple[str, int, str]]]:
    """The import cycles (strongly connected groups of modules), each as the imports inside it."""
    edges = imports(root)
    graph: dict[str, set[str]] = {}
    for a, _, b in edges:
        graph.setdefault(a, set()).add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [[e for e in edges if e[0] in g and e[2] in g] for g in groups]


def upward(root: Path) -> list[tuple[str, int, str]]:
    """The imports of a module from a higher layer than its own."""
    return [(a, line, b) for a, line, b in imports(root)
            if layer(a) in LAYERS and layer(b) in LAYERS and LAYERS.index(layer(b)) > LAYERS.index(layer(a))]


def test_no_import_cycles():
    found = cycles(ROOT)
    assert not found, "import cycles (break each so that one side depends on the other):\n" + "\n".join(
        "cycle:\n" + "\n".join(f"  {_where(ROOT, a, line)} imports {b}" for a, line, b in group) for group in found)


def test_no_upward_imports():
    found = upward(ROOT)
    assert not found, "imports from a higher layer (order, lowest first: " + " < ".join(LAYERS) + "):\n" + "\n".join(
        f"  {_where(ROOT, a, line)} imports {b} ({layer(a)} is below {layer(b)})" for a, line, b in found)


def test_every_package_has_a_layer():
    present = {layer(m) for m in _modules(ROOT)}
    assert present - set(LAYERS) == set(), f"place these in LAYERS: {sorted(present - set(LAYERS))}"
    assert set(LAYERS) - present == set(), f"LAYERS names what hybridkv does not have: {sorted(set(LAYERS) - present)}"


def test_checker_sees_lazy_imports_cycles_and_upward_imports(tmp_path):
    pkg = tmp_path / "hybridkv"
    (pkg / "ops").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "ops" / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("class E(Exception):\n    pass\n")
    (pkg / "ops" / "pack.py").write_text("import torch\n\n\ndef f():\n    from hybridkv.cache import fmt\n    return fmt\n")
    (pkg / "cache").mkdir()
    (pkg / "cache" / "__init__.py").write_text("")
    (pkg / "cache" / "fmt.py").write_text("from hybridkv.errors import E\nfrom ..ops import pack\n")
    assert sorted(imports(tmp_path)) == [("hybridkv.cache.fmt", 1, "hybridkv.errors"),
                                         ("hybridkv.cache.fmt", 2, "hybridkv.ops.pack"),
                                         ("hybridkv.ops.pack", 5, "hybridkv.cache.fmt")]
    assert upward(tmp_path) == [("hybridkv.ops.pack", 5, "hybridkv.cache.fmt")]
    assert [sorted(g) for g in cycles(tmp_path)] == [[("hybridkv.cache.fmt", 2, "hybridkv.ops.pack"),
                                                      ("hybridkv.ops.pack", 5, "hybridkv.cache.fmt")]]
