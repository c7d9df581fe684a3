"""``ConfigError``, the error of a configuration value, ``fail``, which words it, and the checks
several sections share.

Each error names the field, the value, the rule and the fix (docs/bad-inputs.md).
"""

from __future__ import annotations

import re
from typing import Any

IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
"""A user extension's import path, ``package.module:Class`` (``env.name``, ``algorithm.scorer``)."""


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, or breaks a rule."""


def fail(where: str, value: Any, rule: str) -> ConfigError:
    """The error of ``where`` holding ``value``, which breaks ``rule``."""
    return ConfigError(f"{where}: got {value!r}; {rule}")


def require_positive(values: dict[str, int]) -> None:
    """Each ``field: value`` of ``values`` a positive integer, else the first other one is raised."""
    for where, v in values.items():
        if v < 1:
            raise fail(where, v, "expected a positive integer")


def require_finite(values: dict[str, float], *, zero: bool) -> None:
    """Each ``field: value`` of ``values`` a finite number > 0 (``zero``: >= 0), else the first other one is raised.

    Written as ``not (rule)`` so that NaN, which fails every comparison, is refused too.
    """
    for where, x in values.items():
        if not ((0 <= x if zero else 0 < x) and x < float("inf")):
            raise fail(where, x, f"expected a finite number {'>=' if zero else '>'} 0")
