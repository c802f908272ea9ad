"""The package's shape, read from its source with ``ast`` (nothing is imported).

- Imports between modules of the package form no cycle.  Every ``import`` statement counts,
  at module level or inside a function: a function-level import that closes a cycle is still
  a cycle (it only moves the failure to the first call).  ``from . import x``,
  ``from fxbackend.x import y`` and relative imports are resolved to the module they load;
  importing ``a.b.c`` also loads the packages ``a.b`` and ``a`` (their ``__init__``), except
  those the importing module is itself inside (they are loaded before it).
- The plan file depends one way: ``fxbackend.exporter`` -> ``fxbackend.exported`` ->
  ``fxbackend.planfile``, never back.
- The engine's functions and modules stay short.

The package is ``fxbackend/`` plus the three folders installed into it (``pyproject.toml``):
``patterns/``, ``cpu_kernels/`` and ``cuda_kernels/`` as ``fxbackend.patterns`` and so on.
Those three are the project's own extensions: they register through the public API (``from
fxbackend import register_kernel``), and the package root imports them at its end, once that
API is bound (ARCHITECTURE.md).  Their imports of the package root are that one designed edge
and are left out; every other import of theirs counts.
"""
from __future__ import annotations

import ast
import pathlib


ROOT = pathlib.Path(__file__).resolve().parents[1]
#: module name prefix -> folder (pyproject.toml's packages and package-dir)
PACKAGES = {"fxbackend": ROOT / "fxbackend",
            "fxbackend.patterns": ROOT / "patterns",
            "fxbackend.cpu_kernels": ROOT / "cpu_kernels",
            "fxbackend.cuda_kernels": ROOT / "cuda_kernels"}
EXTENSIONS = ("fxbackend.patterns", "fxbackend.cpu_kernels", "fxbackend.cuda_kernels")

#: modules whose functions stay within FUNCTION_LINES lines: the runtime plan and what was
#: split out of it (planning passes, code generation, concrete metadata, reports)
SHORT_FUNCTION_MODULES = ("executor", "codegen", "planning", "concrete", "report")
FUNCTION_LINES = 80
MODULE_LINES = 700


def modules_of(packages: dict[str, pathlib.Path]) -> dict[str, pathlib.Path]:
    """``{module name: file}`` of every module of ``packages`` (name prefix -> folder)."""
    mods = {}
    for prefix, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            mods[".".join((prefix, *parts))] = path
    return mods


MODULES = modules_of(PACKAGES)


def _imported(name: str, node: ast.Import | ast.ImportFrom, mods: dict) -> list[str]:
    """The dotted names statement ``node`` of module ``name`` imports (a submodule where
    ``from X import y`` names one, else ``X``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = name if mods[name].name == "__init__.py" else name.rpartition(".")[0]
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        source = f"{base}.{node.module}" if node.module else base
    else:
        source = node.module
    return [f"{source}.{a.name}" if f"{source}.{a.name}" in mods else source
            for a in node.names]


def import_graph(mods: dict[str, pathlib.Path] = MODULES, root: str = "fxbackend",
                 extensions: tuple = EXTENSIONS) -> dict[str, dict[str, int]]:
    """``{module: {module it loads: line of the first import that does}}`` between the
    modules ``mods`` (module docstring: what counts); the imports of the package ``root`` by
    the modules of ``extensions`` are left out."""
    graph: dict[str, dict[str, int]] = {}
    for name, path in mods.items():
        edges = graph.setdefault(name, {})
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _imported(name, node, mods):
                while target and target not in mods:  # a name inside a module
                    target = target.rpartition(".")[0]
                if not target:
                    continue  # not the package's
                if name.startswith(extensions) and target == root:
                    continue  # the public API an extension registers through
                parts = target.split(".")
                for k in range(1, len(parts) + 1):
                    loaded = ".".join(parts[:k])
                    inside = name.startswith(loaded + ".")
                    if loaded in mods and loaded != name and (loaded == target or not inside):
                        edges.setdefault(loaded, node.lineno)
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle of ``graph`` as ``[a, b, ..., a]``, or None (depth-first, in name order)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph[v]):
            if state.get(w) == 1:
                return path[path.index(w):] + [w]
            if w not in state and (found := visit(w)) is not None:
                return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state and (found := visit(v)) is not None:
            return found
    return None


def _show(graph: dict, cycle: list[str]) -> str:
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:])) + \
        f" -> {cycle[-1]}"


def _reach(graph: dict, start: str) -> dict[str, str | None]:
    """``{module reachable from start: the module it was reached from}``."""
    seen: dict[str, str | None] = {start: None}
    todo = [start]
    while todo:
        v = todo.pop()
        for w in graph[v]:
            if w not in seen:
                seen[w] = v
                todo.append(w)
    return seen


def _chain(seen: dict, end: str) -> str:
    out = [end]
    while seen[out[-1]] is not None:
        out.append(seen[out[-1]])
    return " -> ".join(reversed(out))


_MINI = {  # a package, a subpackage and an extension, with every kind of import
    "pkg/__init__.py": "from . import a\nfrom .sub import thing\n",
    "pkg/a.py": "import os\n\n\ndef f():\n    from .b import g\n",
    "pkg/b.py": "from pkg.sub import c\n",
    "pkg/sub/__init__.py": "thing = 1\n",
    "pkg/sub/c.py": "from .. import a\nfrom . import d\n",
    "pkg/sub/d.py": "from ..sub import thing\nimport pkg.a\n",
    "ext/e.py": "from pkg import register\nfrom pkg.a import f\n",
}


def test_graph_and_cycle_of_a_small_package(tmp_path):
    """What counts as an import, on a package written for it."""
    for rel, text in _MINI.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    mods = modules_of({"pkg": tmp_path / "pkg", "pkg.ext": tmp_path / "ext"})
    g = import_graph(mods, "pkg", ("pkg.ext",))
    assert g == {
        "pkg": {"pkg.a": 1, "pkg.sub": 2},  # a module; a name of a package
        "pkg.a": {"pkg.b": 5},  # inside a function
        "pkg.b": {"pkg.sub": 1, "pkg.sub.c": 1},  # the subpackage is loaded first
        "pkg.sub": {},
        "pkg.sub.c": {"pkg.a": 1, "pkg.sub.d": 2},  # two levels up; a sibling
        "pkg.sub.d": {"pkg.sub": 1, "pkg.a": 2},  # its own package's name; not pkg itself
        "pkg.ext.e": {"pkg.a": 2},  # the root's public API left out
    }
    cycle = find_cycle(g)
    assert cycle == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]
    assert _show(g, cycle) == "pkg.a (line 5) -> pkg.b (line 1) -> pkg.sub.c (line 1) -> pkg.a"
    del g["pkg.a"]["pkg.b"]
    assert find_cycle(g) is None


def test_the_package_graph_has_its_known_edges():
    g = import_graph()
    assert "fxbackend.ops" in g["fxbackend.registry"]  # from . import ops (module level)
    assert "fxbackend.ops" in g["fxbackend.codegen"]  # from .ops import get_op (in a method)
    assert "fxbackend.patterns.rmsnorm" in g["fxbackend.patterns.rope"]  # from fxbackend.x
    assert "fxbackend" not in g["fxbackend.patterns.rope"]  # the extension's public API


def test_no_import_cycle():
    g = import_graph()
    cycle = find_cycle(g)
    assert cycle is None, f"import cycle: {_show(g, cycle)}"


def test_plan_file_dependencies_run_one_way():
    """exporter -> exported -> planfile: the plan file package reaches neither the exported
    plan runtime nor the exporter, and the runtime does not reach the exporter."""
    g = import_graph()
    assert "fxbackend.exported" in g["fxbackend.exporter"]
    assert "fxbackend.planfile" in g["fxbackend.exported"]
    for start in [m for m in MODULES if m == "fxbackend.planfile" or
                  m.startswith("fxbackend.planfile.")]:
        seen = _reach(g, start)
        for banned in ("fxbackend.exported", "fxbackend.exporter"):
            assert banned not in seen, f"{start} reaches {banned}: {_chain(seen, banned)}"
    seen = _reach(g, "fxbackend.exported")
    assert "fxbackend.exporter" not in seen, _chain(seen, "fxbackend.exporter")


def _long_functions(path: pathlib.Path, limit: int) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    return [f"{path.name}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > limit]


def test_engine_functions_are_short():
    """No function (from ``def`` to its last line) over FUNCTION_LINES lines in the runtime
    plan's modules."""
    long = [f for m in SHORT_FUNCTION_MODULES
            for f in _long_functions(MODULES[f"fxbackend.{m}"], FUNCTION_LINES)]
    assert not long, f"functions over {FUNCTION_LINES} lines: {long}"


def test_engine_modules_are_short():
    """No module of ``fxbackend/`` over MODULE_LINES lines."""
    long = [f"{p.relative_to(ROOT)} ({n} lines)" for p in sorted(PACKAGES["fxbackend"].rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MODULE_LINES]
    assert not long, f"modules over {MODULE_LINES} lines: {long}"
