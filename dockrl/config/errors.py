"""``ConfigError``, the error of a configuration value, and ``fail``, which words it.

Each error names the field, the value, the rule and the fix (docs/bad-inputs.md).
"""

from __future__ import annotations

from typing import Any


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, or breaks a rule."""


def fail(where: str, value: Any, rule: str) -> ConfigError:
    """The error of ``where`` holding ``value``, which breaks ``rule``."""
    return ConfigError(f"{where}: got {value!r}; {rule}")
