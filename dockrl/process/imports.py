"""``import_object``: the object an import path ``module:Name`` names, the one way dockrl resolves such a path
(the registries' entries, the stage table's process bodies, user environments and scorers)."""

from __future__ import annotations

import importlib
from typing import Any


def import_object(path: str) -> Any:
    """The object ``module:Name`` names (nested names with dots: ``module:Outer.Inner``), imported now.

    Raises:
        ImportError, AttributeError: it does not import.
    """
    module, _, name = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj
