"""Typed run configuration: frozen dataclasses loaded from YAML, validated at load.

``load_config(path, overrides)`` (``loading``) parses and validates a config and probes nothing:
fields that may be ``auto`` stay ``auto``. ``resolve_auto(cfg)`` (``resolve``) is the one step that
asks the machine (device, bf16 speed, whether vLLM runs); each process that needs the answer calls
it where it runs. The sections' dataclasses are in ``sections``; ``Config`` and the cross-field rules
it checks when built in ``rules``.
The defaults are the demo run.
"""

from dockrl.config.loading import dump_config, load_config, load_config_text, parse_overrides, save_config
from dockrl.config.resolve import AUTO_ENGINE_ENV, auto_rollout_engine, resolve_auto
from dockrl.config.rules import Config, ConfigError, check_rules, critic_batches, s3_endpoint
from dockrl.config.sections import (
    DEFAULT_SYSTEM_PROMPT,
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    DockConfig,
    FilterGroupsConfig,
    ModelConfig,
    OverlongBufferConfig,
    RewardModelConfig,
    RewardModelPathConfig,
    RolloutConfig,
    RunConfig,
    TrainerConfig,
)

__all__ = [
    "AUTO_ENGINE_ENV", "DEFAULT_SYSTEM_PROMPT", "AlgorithmConfig", "Config", "ConfigError", "CriticConfig", "DataConfig",
    "DockConfig", "FilterGroupsConfig", "ModelConfig", "OverlongBufferConfig", "RewardModelConfig", "RewardModelPathConfig",
    "RolloutConfig", "RunConfig", "TrainerConfig", "auto_rollout_engine", "check_rules", "critic_batches", "dump_config",
    "load_config", "load_config_text", "parse_overrides", "resolve_auto", "s3_endpoint", "save_config",
]
