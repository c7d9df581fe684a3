"""A user's code named by import path (``package.module:Class``), as custom scorers (``algorithm.scorer``) and
user environments (``env.name``) name it: imported here, in the child process each runs in.
"""

from __future__ import annotations

import importlib
from typing import Any

START_TIMEOUT_S = 120.0
"""Longest a user's child process may take to start and build its class, seconds."""


def import_object(path: str) -> Any:
    """The object ``module:Name`` names (nested names with dots: ``module:Outer.Inner``).

    Raises:
        ImportError, AttributeError: it does not import.
    """
    module, _, name = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj
