"""The tree's rules, checked by reading the source (``ast``), not by importing it.

1. Dependencies point one way: ``worker -> connector -> proto, kernels``. ``kvbridge.proto``
   and ``kvbridge.kernels`` import nothing from ``kvbridge.connector`` or ``kvbridge.worker``;
   ``kvbridge.connector`` imports nothing from ``kvbridge.worker``. Every import counts: at
   module level, inside functions, under ``TYPE_CHECKING``, relative ones, and
   ``importlib.import_module("...")`` with a literal name.
2. No module is over 400 lines, generated ``*_pb2*`` code aside. Today's offenders are listed
   in :data:`OVERSIZE` (none today); a split module must leave the list and no new one can
   join it silently.
3. Tests and examples reach kvbridge through each subpackage's public API (its
   ``__init__``'s ``__all__``) where it exports every name they import, and import no test
   module or ``examples/`` through ``sys.path``: shared helpers live in ``tests/harness``.
4. No file-level import cycles: no module imports, through others, a module that imports
   it, counting every import as in rule 1 (a package's ``__init__`` only where a name is
   taken from it). The failure names each cycle, module by module.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvbridge"
MAX_LINES = 400
OVERSIZE: set[str] = set()
FORBIDDEN = {
    "proto": ("kvbridge.connector", "kvbridge.worker"),
    "kernels": ("kvbridge.connector", "kvbridge.worker"),
    "connector": ("kvbridge.worker",),
}


def modules() -> Iterator[tuple[str, Path]]:
    """(module name, path) of every Python module in the package (through kvbridge/'s links)."""
    for top in ("proto", "kernels", "connector", "worker"):
        for path in sorted((PACKAGE / top).rglob("*.py")):
            rel = path.relative_to(PACKAGE).with_suffix("")
            parts = ["kvbridge", *rel.parts]
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join(parts), path


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module ``source`` (the text of ``module``) may import, wherever it does it."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.add(target)
            # ``from kvbridge import worker`` names a module too
            found.update(f"{target}.{alias.name}" for alias in node.names)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None))
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(node.args[0].value)
    return found


def violations(module: str, imports: set[str]) -> list[str]:
    top = module.split(".")[1]
    banned = FORBIDDEN.get(top, ())
    return sorted(
        f"{module} imports {name}"
        for name in imports
        if any(name == b or name.startswith(b + ".") for b in banned)
    )


def test_the_import_reader_sees_function_level_type_checking_and_relative_imports() -> None:
    source = """
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from kvbridge.worker.serving import Node
def f():
    import kvbridge.worker.cli
    from ..worker import engine
    importlib.import_module("kvbridge.worker.offload")
from . import layout
"""
    found = imported_modules(source, "kvbridge.connector.x")
    assert {
        "kvbridge.worker.serving",
        "kvbridge.worker.cli",
        "kvbridge.worker.engine",
        "kvbridge.worker.offload",
        "kvbridge.connector.layout",
    } <= found
    assert len(violations("kvbridge.connector.x", found)) >= 4
    assert violations("kvbridge.worker.x", found) == []


def test_dependencies_point_from_worker_to_connector_to_proto_and_kernels() -> None:
    found = [
        v
        for module, path in modules()
        for v in violations(
            module, imported_modules(path.read_text(), module, path.name == "__init__.py")
        )
    ]
    assert found == [], "imports against worker -> connector -> proto, kernels:\n" + "\n".join(
        found
    )


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_no_module_is_over_400_lines_apart_from_the_listed_ones() -> None:
    long = {
        str(path.relative_to(PACKAGE)): _lines(path)
        for _, path in modules()
        if "_pb2" not in path.name and _lines(path) > MAX_LINES
    }
    assert set(long) - OVERSIZE == set(), f"split these by concept (one concept per module): {long}"


def test_every_listed_oversize_module_is_still_oversize() -> None:
    """A module split below the limit must leave :data:`OVERSIZE` (the list only shrinks)."""
    split = sorted(m for m in OVERSIZE if _lines(PACKAGE / m) <= MAX_LINES)
    assert split == [], f"remove from OVERSIZE: {split}"


def _user_sources() -> Iterator[Path]:
    yield from sorted((ROOT / "tests").rglob("*.py"))
    yield from sorted((ROOT / "examples").glob("*.py"))


def _exported(package: str) -> set[str]:
    init = PACKAGE.joinpath(*package.split(".")[1:], "__init__.py")
    if not init.exists():
        return set()
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return set(ast.literal_eval(node.value))
    return set()


def test_tests_and_examples_import_names_from_the_subpackage_that_exports_them() -> None:
    deep = []
    for path in _user_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not node.module or node.level:
                continue
            parts = node.module.split(".")
            if parts[0] != "kvbridge" or len(parts) < 3:
                continue
            parent = ".".join(parts[:-1])
            names = {alias.name for alias in node.names}
            if names <= _exported(parent):
                deep.append(f"{path.relative_to(ROOT)}:{node.lineno}: from {parent} import ...")
    assert deep == [], "\n".join(deep)


def test_no_test_or_example_reaches_other_files_through_sys_path() -> None:
    found = []
    for path in _user_sources():
        text = path.read_text()
        tree = ast.parse(text)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "path"
                and isinstance(node.value, ast.Name)
                and node.value.id == "sys"
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: sys.path")
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            for name in names:
                first, _, rest = name.partition(".")
                other_test = first.startswith("test_") or (
                    first == "tests" and not rest.startswith("harness")
                )
                if other_test or first in ("examples", "vllm_harness"):
                    line = getattr(node, "lineno", 0)
                    found.append(f"{path.relative_to(ROOT)}:{line}: imports {name}")
    assert found == [], "\n".join(found)


def module_edges(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The package's modules that ``source`` (the text of ``module``) imports, wherever it
    does it: ``from p import m`` names the module ``p.m`` where it is one, else ``p``; a
    package's ``__init__`` counts only where a name is taken from it."""

    def home(name: str) -> str | None:
        parts = name.split(".")
        while parts and ".".join(parts) not in known:
            parts.pop()
        return ".".join(parts) or None

    package = module if is_package else module.rpartition(".")[0]
    found: set[str | None] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(home(alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else home(target))
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None))
            in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.add(home(node.args[0].value))
    return {m for m in found if m is not None and m != module}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle ``[a, b, ..., a]`` per strongly connected group of modules (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(graph, group) for group in groups]


def _cycle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    start = min(group)
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start] if v != start else [start, start]
                if w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")


def test_the_cycle_finder_sees_imports_in_functions_and_under_type_checking() -> None:
    known = {"kvbridge.a", "kvbridge.a.x", "kvbridge.a.y", "kvbridge.a.z"}
    x = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvbridge.a.y import Y\n"
    y = "def f():\n    from . import z\n"
    z = "import kvbridge.a.x\nfrom kvbridge.a import helper\n"
    graph = {
        "kvbridge.a": module_edges("from kvbridge.a import x\n", "kvbridge.a", True, known),
        "kvbridge.a.x": module_edges(x, "kvbridge.a.x", False, known),
        "kvbridge.a.y": module_edges(y, "kvbridge.a.y", False, known),
        "kvbridge.a.z": module_edges(z, "kvbridge.a.z", False, known),
    }
    assert graph["kvbridge.a.z"] == {"kvbridge.a", "kvbridge.a.x"}
    assert import_cycles(graph) == [
        ["kvbridge.a", "kvbridge.a.x", "kvbridge.a.y", "kvbridge.a.z", "kvbridge.a"]
    ]
    del graph["kvbridge.a"]
    graph["kvbridge.a.z"].discard("kvbridge.a")
    assert import_cycles(graph) == [
        ["kvbridge.a.x", "kvbridge.a.y", "kvbridge.a.z", "kvbridge.a.x"]
    ]
    graph["kvbridge.a.z"] = set()
    assert import_cycles(graph) == []


def test_no_module_imports_itself_back_through_others() -> None:
    """File-level import cycles, also those hidden in functions or under ``TYPE_CHECKING``:
    each means two modules that cannot be read (or tested) one without the other."""
    found = dict(modules())
    known = set(found)
    graph = {
        module: module_edges(path.read_text(), module, path.name == "__init__.py", known)
        for module, path in found.items()
    }
    cycles = []
    for cycle in import_cycles(graph):
        knot = _knot_of(graph, cycle[0]) - set(cycle)
        also = f" (same knot: {', '.join(sorted(knot))})" if knot else ""
        cycles.append(" -> ".join(cycle) + also)
    assert cycles == [], "import cycles:\n" + "\n".join(cycles)


def _knot_of(graph: dict[str, set[str]], module: str) -> set[str]:
    """The modules that ``module`` reaches and that reach it back."""

    def reach(start: str, edges: dict[str, set[str]]) -> set[str]:
        seen, todo = {start}, [start]
        while todo:
            for w in edges[todo.pop()] - seen:
                seen.add(w)
                todo.append(w)
        return seen

    back: dict[str, set[str]] = {m: set() for m in graph}
    for m, deps in graph.items():
        for d in deps:
            back[d].add(m)
    return reach(module, graph) & reach(module, back)
