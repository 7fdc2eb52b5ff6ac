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
