"""``build_environment``: the run's environment from ``env.*``, or None for a single-turn run."""

from __future__ import annotations

from dockrl.config import Config, ConfigError
from dockrl.config.env_sections import BUILT_IN_ENVIRONMENTS
from dockrl.envs.base import Environment
from dockrl.envs.user import UserEnvironment
from dockrl.process.imports import import_object


def build_environment(cfg: Config) -> Environment | None:
    """The environment ``env.name`` names, built once per run in the rollout's process (close it at the end).

    Returns:
        None when ``env.name`` is empty (single-turn rollouts); else a built-in environment
        (``BUILT_IN_ENVIRONMENTS``: ``python``, ``calculator``), or the user's class running in a process of its own (``UserEnvironment``).

    Raises:
        ConfigError: ``env.name`` is an import path that does not import here (the import's error appended).
        EnvironmentFailure: the user's class does not build in its process (its traceback in the message).
    """
    e = cfg.env
    if not e.name:
        return None
    if e.name in BUILT_IN_ENVIRONMENTS:
        return import_object(BUILT_IN_ENVIRONMENTS[e.name])(e)
    try:
        import_object(e.name)  # here, so a typo fails before any process starts
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"env.name: got {e.name!r}, which does not import ({type(err).__name__}: {err}); "
                          "expected 'package.module:Class' importable here (PYTHONPATH)") from err
    return UserEnvironment(e.name, timeout_s=e.timeout_s)


def environment_tools(cfg: Config) -> list[dict]:
    """The tools of the environment ``env.name`` names (``Environment.tools``), for the prompts; empty without one.

    A user's environment is built in its process for this and closed (seconds), where the prompts are
    loaded before the rollout builds its own.

    Raises:
        as ``build_environment``.
    """
    environment = build_environment(cfg)
    if environment is None:
        return []
    try:
        return list(environment.tools)
    finally:
        environment.close()
