"""The package's modules import each other in one direction only (no cycles, counting
``TYPE_CHECKING`` imports): a module that reads a plan depends on the plan's types, never on
the planner that imports it back (issue 34, item 6)."""

from __future__ import annotations

import ast
from pathlib import Path

import ap_epchunk

PACKAGE = Path(ap_epchunk.__file__).parent


def _edges() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.glob("_*.py")):
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module is not None:
                    deps.add(node.module.split(".")[0])
                else:
                    deps.update(alias.name for alias in node.names)
        edges[path.stem] = deps
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(mod: str) -> list[str] | None:
        state[mod] = 1
        stack.append(mod)
        for dep in sorted(edges.get(mod, ())):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (found := visit(dep)) is not None:
                return found
        stack.pop()
        state[mod] = 2
        return None

    for mod in sorted(edges):
        if mod not in state and (found := visit(mod)) is not None:
            return found
    return None


def test_private_modules_import_each_other_in_one_direction() -> None:
    assert _cycle(_edges()) is None, " -> ".join(_cycle(_edges()) or [])


def test_plan_types_are_shared_not_imported_from_the_planner() -> None:
    edges = _edges()
    assert "_plan_types" in edges["_region_collectives"]
    assert "_plan" not in edges["_region_collectives"]
    assert "_region_collectives" in edges["_plan"]
    assert "_plan" not in edges["_plan_types"]
