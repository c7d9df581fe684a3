"""The ``env`` section's rules: a known environment or an import path, and the sandbox's ranges."""

from __future__ import annotations

import math
import re

from dockrl.config.env_sections import EnvConfig
from dockrl.config.errors import fail

BUILT_IN_ENVIRONMENTS = ("python", "calculator")
"""The environments ``env.name`` may name without an import path."""

_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def check_env(e: EnvConfig) -> None:
    """The ``env`` section's ranges and names.

    Raises:
        ConfigError: names the field (``env.name``, ``env.timeout_s``, ``env.sandbox.*``), its value and the rule.
    """
    if e.name and e.name not in BUILT_IN_ENVIRONMENTS and not _IMPORT_PATH.match(e.name):
        raise fail("env.name", e.name, f"expected '' (single-turn), one of {', '.join(repr(n) for n in BUILT_IN_ENVIRONMENTS)}, "
                    "or an import path 'package.module:Class' of a user environment")
    if not (0 < e.timeout_s < math.inf):
        raise fail("env.timeout_s", e.timeout_s, "expected a finite number of seconds > 0")
    s = e.sandbox
    if not (0 < s.wall_s < math.inf):
        raise fail("env.sandbox.wall_s", s.wall_s, "expected a finite number of seconds > 0")
    for where, v, low in (("env.sandbox.cpu_s", s.cpu_s, 1), ("env.sandbox.memory_mb", s.memory_mb, 64),
                          ("env.sandbox.output_bytes", s.output_bytes, 1), ("env.sandbox.file_mb", s.file_mb, 1),
                          ("env.sandbox.max_processes", s.max_processes, 1)):
        if v < low:
            why = " (the Python interpreter itself needs about that much address space)" if where.endswith("memory_mb") else ""
            raise fail(where, v, f"expected an integer >= {low}{why}")
