"""Typed run configuration: frozen dataclasses loaded from YAML, validated at load.

``load_config(path, overrides)`` (``loading``) parses and validates a config and probes nothing:
fields that may be ``auto`` stay ``auto``. ``resolve_auto(cfg)`` (``resolve``) is the one step that
asks the machine (device, bf16 speed, whether vLLM runs); each process that needs the answer calls
it where it runs. The sections' dataclasses are in ``sections`` (model, data, rollout, trainer, critic, sft),
``algorithm_sections`` (algorithm, reward_model, teacher), ``env_sections`` (env) and ``run_sections`` (dock, run), the
last three with their rules beside them; ``Config`` and the cross-field rules it checks when built (those of
``sections``' fields among them) in ``config``; the advantage estimators' registry in ``estimators``;
``ConfigError`` in ``errors``.
The defaults are the demo run.
"""

from dockrl.config.algorithm_sections import (
    AlgorithmConfig,
    FilterGroupsConfig,
    GenerativeJudgeConfig,
    OverlongBufferConfig,
    RewardModelConfig,
    RewardModelPathConfig,
    TeacherConfig,
    TeacherPathConfig,
)
from dockrl.config.config import Config, check_rules, critic_batches, multi_turn
from dockrl.config.errors import ConfigError
from dockrl.config.loading import dump_config, load_config, load_config_text, parse_override_lines, parse_overrides, save_config
from dockrl.config.resolve import AUTO_ENGINE_ENV, auto_rollout_engine, resolve_auto
from dockrl.config.run_sections import DockConfig, RunConfig, pyarrow_s3_query, s3_endpoint
from dockrl.config.sections import (
    DEFAULT_SYSTEM_PROMPT,
    CriticConfig,
    DataConfig,
    LoraConfig,
    ModelConfig,
    RolloutConfig,
    SFTConfig,
    TrainerConfig,
)

__all__ = [
    "AUTO_ENGINE_ENV", "DEFAULT_SYSTEM_PROMPT", "AlgorithmConfig", "Config", "ConfigError", "CriticConfig", "DataConfig",
    "DockConfig", "FilterGroupsConfig", "GenerativeJudgeConfig", "LoraConfig", "ModelConfig", "OverlongBufferConfig",
    "RewardModelConfig", "RewardModelPathConfig", "RolloutConfig", "RunConfig", "SFTConfig", "TeacherConfig", "TeacherPathConfig",
    "TrainerConfig", "auto_rollout_engine", "check_rules", "critic_batches", "dump_config", "load_config", "load_config_text",
    "multi_turn", "parse_override_lines", "parse_overrides", "pyarrow_s3_query", "resolve_auto", "s3_endpoint", "save_config",
]
