"""The package's import graph has no circle and imports only go down (cli and train_task -> driver ->
runners -> stages -> engines -> dock, resharding, algorithms). Every import counts, including those
inside functions."""

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


def test_stages_and_backends_do_not_import_the_driver() -> None:
    """The stage processes (``dockrl.stages``) and the worker backends (``dockrl.launch``) sit below
    the driver: none of them imports it, directly or through another module."""
    graph = grimp.build_graph("dockrl", cache_dir=None)
    above = {m for m in graph.modules if m in ("dockrl.stages", "dockrl.launch") or m.startswith(("dockrl.stages.", "dockrl.launch."))}
    assert above
    for module in sorted(above):
        assert not graph.chain_exists(importer=module, imported="dockrl.driver"), graph.find_shortest_chain(module, "dockrl.driver")
