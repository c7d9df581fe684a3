"""The package's import graph has no circle: imports only go down (driver -> runners -> stages ->
engines -> dock, resharding, algorithms). Every import counts, including those inside functions."""

from __future__ import annotations

import grimp


def find_cycle(graph: grimp.ImportGraph) -> list[str] | None:
    """One import circle of ``graph`` as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if state.get(imported) == 1:
                return path[path.index(imported):] + [imported]
            if imported not in state and (cycle := visit(imported)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph.modules):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_find_cycle_finds_a_planted_circle() -> None:
    graph = grimp.ImportGraph()
    for name in ("pkg", "pkg.a", "pkg.b", "pkg.c"):
        graph.add_module(name)
    graph.add_import(importer="pkg.a", imported="pkg.b")
    graph.add_import(importer="pkg.b", imported="pkg.c")
    assert find_cycle(graph) is None
    graph.add_import(importer="pkg.c", imported="pkg.a")
    assert find_cycle(graph) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]


def test_dockrl_has_no_import_circle() -> None:
    graph = grimp.build_graph("dockrl", cache_dir=None)
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)
