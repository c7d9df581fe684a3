"""The ``env`` section's rules: a known environment or an import path, and the sandbox's ranges."""

from __future__ import annotations

import math
import re

from dockrl.config.env_sections import SANDBOX_LAYERS, EnvConfig
from dockrl.config.errors import _fail

BUILT_IN_ENVIRONMENTS = ("python", "calculator")
"""The environments ``env.name`` may name without an import path."""

_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


SANDBOX_MAX: dict[str, float] = {"wall_s": 3600.0, "cpu_s": 3600, "memory_mb": 65536, "output_bytes": 1 << 20, "file_mb": 1024,
                                 "disk_mb": 16384, "max_processes": 1024}
"""Upper bounds of ``env.sandbox.*``: no program of a rollout gets more than an hour, 64 GiB, a 1 GiB file,
16 GiB of files, 1,024 processes or 1 MiB of output (which the trainer keeps and tokenizes)."""


def check_env(e: EnvConfig) -> None:
    """The ``env`` section's ranges and names.

    Raises:
        ConfigError: names the field (``env.name``, ``env.timeout_s``, ``env.sandbox.*``), its value and the rule.
    """
    if e.name and e.name not in BUILT_IN_ENVIRONMENTS and not _IMPORT_PATH.match(e.name):
        raise _fail("env.name", e.name, f"expected '' (single-turn), one of {', '.join(repr(n) for n in BUILT_IN_ENVIRONMENTS)}, "
                    "or an import path 'package.module:Class' of a user environment")
    if not (0 < e.timeout_s < math.inf):
        raise _fail("env.timeout_s", e.timeout_s, "expected a finite number of seconds > 0")
    s = e.sandbox
    if not (0 < s.wall_s <= SANDBOX_MAX["wall_s"]):
        raise _fail("env.sandbox.wall_s", s.wall_s, f"expected seconds > 0 and <= {SANDBOX_MAX['wall_s']:g}")
    unknown = [layer for layer in s.require if layer not in SANDBOX_LAYERS]
    if unknown or len(set(s.require)) != len(s.require):
        raise _fail("env.sandbox.require", list(s.require), f"expected distinct names among {', '.join(SANDBOX_LAYERS)} "
                    "([] for none: trusted code only)")
    for name, low in (("cpu_s", 1), ("memory_mb", 64), ("output_bytes", 1), ("file_mb", 1), ("disk_mb", 1), ("max_processes", 1)):
        v, high = getattr(s, name), SANDBOX_MAX[name]
        if not low <= v <= high:
            why = " (the Python interpreter itself needs about that much address space)" if name == "memory_mb" and v < low else ""
            raise _fail(f"env.sandbox.{name}", v, f"expected an integer >= {low}{why} and <= {high}")

