"""docs/design.md's module map against the tree: every module of ``dockrl/`` has its row, and
every module a row names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]


def mapped_modules(text: str) -> set[str]:
    """The module paths of the map's rows: ``| `dockrl/....py` | what |``."""
    return set(re.findall(r"^\| `(dockrl/[\w/]+\.py)` \|", text, flags=re.M))


def tree_modules() -> set[str]:
    """Every module of the package but the packages' ``__init__.py`` and ``__main__.py``."""
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / "dockrl").rglob("*.py") if p.name not in ("__init__.py", "__main__.py")}


def test_mapped_modules_reads_the_rows_only():
    text = "| `dockrl/a.py` | one |\n| `dockrl/b/c.py` | two |\nsee `dockrl/d.py` in the text\n"
    assert mapped_modules(text) == {"dockrl/a.py", "dockrl/b/c.py"}


def test_the_design_map_has_every_module_and_no_other():
    mapped = mapped_modules((ROOT / "docs" / "design.md").read_text())
    tree = tree_modules()
    assert not tree - mapped, f"modules without a row in docs/design.md §5: {sorted(tree - mapped)}"
    assert not mapped - tree, f"rows of docs/design.md §5 naming no module: {sorted(mapped - tree)}"
