"""Load a script of benchmarks/ as a module in a test's own process, leaving the test process's imports as they were.

The dock benchmarks put benchmarks/ first on ``sys.path`` and ``import dock`` (benchmarks/dock.py); left behind, that
``dock`` would shadow the tests' own ``dock`` package (``from dock.conftest import s3_server``) in every later test
module the same pytest worker collects.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as the module ``<name>_benchmark``, its own ``import dock`` benchmarks/dock.py;
    ``sys.path`` and ``sys.modules['dock']`` restored after."""
    path, dock = list(sys.path), sys.modules.pop("dock", None)
    try:
        spec = importlib.util.spec_from_file_location(f"{name}_benchmark", BENCHMARKS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses resolve their module by name
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path[:] = path
        if dock is None:
            sys.modules.pop("dock", None)
        else:
            sys.modules["dock"] = dock
