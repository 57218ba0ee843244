"""Imports point down (docs/DESIGN.md §1): the format, codecs and stores layers never import the pipelines above
them, the pipelines never import the user-facing layer, and no two modules import each other at import time (an
import cycle).

Read from the source with ``ast``, so a lazy import inside a function counts for the layers (it still reaches
up) but not for cycles (it is how a module may name one that imports it).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "src" / "ckptvault"
#: root modules every layer may use: they import nothing of the package but each other
SHARED = {"errors", "_argcheck", "_version", "_feedback"}
#: layer -> the layers (package folders) it may import besides itself and SHARED
LOWER_LAYERS = {"_codecs": set(), "stores": set(), "_format": {"_codecs"}, "testing": {"stores"}}
#: the pipelines, and the user-facing layer above them that they never import ("" is the package's __init__)
PIPELINES = ("_save", "_delta", "_restore", "_maintenance", "_reports", "_vault")
USER_FACING = {"", "manager", "cli", "demo", "distributed", "interop", "integrations"}


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, top_level_only: bool) -> set[str]:
    """The package modules ``path`` imports (``_format.schema``, ``errors``...; ``""`` for the package's own
    ``__init__``), relative to the package."""
    module = _module(path)
    parts = module.split(".") if module else []
    package = parts if path.name == "__init__.py" else parts[:-1]
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package[: len(package) - (node.level - 1)] + ([node.module] if node.module else [])
            out.update(_resolve(".".join(base), alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("ckptvault"):
            base = (node.module or "").removeprefix("ckptvault").lstrip(".")
            out.update(_resolve(base, alias.name) for alias in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name.removeprefix("ckptvault.") for a in node.names if a.name.startswith("ckptvault."))
    return out  # "" is the package itself (its __init__)


def _resolve(base: str, name: str) -> str:
    """``from base import name``: the submodule ``base.name`` if there is one, else ``base``."""
    candidate = f"{base}.{name}" if base else name
    path = PACKAGE / candidate.replace(".", "/")
    return candidate if path.with_suffix(".py").exists() or path.is_dir() else base


MODULES = {_module(p): p for p in sorted(PACKAGE.rglob("*.py"))}


@pytest.mark.parametrize("module", [m for m in MODULES if m.split(".")[0] in LOWER_LAYERS])
def test_lower_layers_never_import_the_layers_above(module: str) -> None:
    layer = module.split(".")[0]
    allowed = {layer} | LOWER_LAYERS[layer]
    above = sorted(m for m in _imports(MODULES[module], top_level_only=False)
                   if m.split(".")[0] not in allowed and m not in SHARED)
    assert not above, f"{module} imports {above}: the {layer} layer may use only {sorted(allowed | SHARED)}"


@pytest.mark.parametrize("module", [m for m in MODULES if m.split(".")[0] in PIPELINES])
def test_pipelines_never_import_the_user_facing_layer(module: str) -> None:
    above = sorted(m for m in _imports(MODULES[module], top_level_only=False) if m.split(".")[0] in USER_FACING)
    assert not above, f"{module} imports {above}: pipelines are used by the manager and the CLI, not the reverse"


def test_every_layer_named_here_exists() -> None:
    tops = {m.split(".")[0] for m in MODULES}
    assert set(LOWER_LAYERS) | set(PIPELINES) | (USER_FACING - {""}) | SHARED <= tops


def test_the_library_never_imports_its_test_helpers() -> None:
    users = sorted(m for m, p in MODULES.items() if not m.startswith("testing")
                   and any(d.split(".")[0] == "testing" for d in _imports(p, top_level_only=False)))
    assert not users, f"{users} import ckptvault.testing, which needs pytest"


def test_no_import_cycles() -> None:
    graph = {m: {d for d in _imports(p, top_level_only=True) if d in MODULES and d != m} for m, p in MODULES.items()}
    cycle = _find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(m or 'ckptvault' for m in cycle or [])}"


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that ends where it starts, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in graph:
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            child = next(stack[-1], None)
            if child is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append(iter(sorted(graph[child])))
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None
