"""Tests of the typed run configuration: loading, overrides, validation messages, round trip."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import yaml

from dockrl.config import (
    DEFAULT_SYSTEM_PROMPT,
    Config,
    ConfigError,
    TrainerConfig,
    load_config,
    parse_overrides,
    save_config,
)


def write_yaml(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_defaults_load():
    config = load_config()
    assert config == Config()
    assert config == load_config(None, [])
    assert config.data.system_prompt == DEFAULT_SYSTEM_PROMPT
    # every default has its declared type (a float field never holds an int, a bool never an int)
    for section in dataclasses.fields(Config):
        value = getattr(config, section.name)
        hints = typing.get_type_hints(type(value))
        for f in dataclasses.fields(value):
            tp, v = hints[f.name], getattr(value, f.name)
            if typing.get_origin(tp) is typing.Literal:
                assert v in typing.get_args(tp), f"{section.name}.{f.name}"
            else:
                assert type(v) is tp, f"{section.name}.{f.name}: {v!r} is not {tp.__name__}"


def test_empty_yaml_file_gives_defaults(tmp_path):
    assert load_config(write_yaml(tmp_path, "")) == Config()


def test_yaml_file_and_overrides_merge(tmp_path):
    path = write_yaml(
        tmp_path,
        "trainer:\n  lr: 0.001\n  iterations: 3\nrollout:\n  n: 4\n  dtype: float32\nrun:\n  output_dir: runs/x\n",
    )
    config = load_config(str(path), ["trainer.iterations=7", "run.progress=false", "algorithm.loss_agg=sequence"])
    assert config.trainer.iterations == 7  # the override wins over the file
    assert config.trainer.lr == 0.001  # from the file
    assert config.rollout.n == 4 and config.rollout.dtype == "float32"
    assert config.run.output_dir == "runs/x"
    assert config.run.progress is False
    assert config.algorithm.loss_agg == "sequence"
    # fields set nowhere keep their defaults, also in partly given sections
    assert config.trainer.global_batch == TrainerConfig().global_batch
    assert config.run.cache_dir == Config().run.cache_dir
    assert config.model == Config().model


def test_override_of_a_section_absent_from_the_file(tmp_path):
    path = write_yaml(tmp_path, "rollout:\n  n: 4\n")
    config = load_config(path, ["dock.timeout_s=30"])
    assert config.dock.timeout_s == 30.0 and isinstance(config.dock.timeout_s, float)
    assert config.rollout.n == 4


@pytest.mark.parametrize("text", ["1e-5", "1.0e-5", "0.00001", "1E-5"])
def test_scientific_learning_rate_parses_as_float(tmp_path, text):
    config = load_config(None, [f"trainer.lr={text}"])
    assert isinstance(config.trainer.lr, float) and config.trainer.lr == 1e-5
    from_file = load_config(write_yaml(tmp_path, f"trainer:\n  lr: {text}\n"))
    assert isinstance(from_file.trainer.lr, float) and from_file.trainer.lr == 1e-5


def test_integer_for_float_field_becomes_float():
    config = load_config(None, ["algorithm.kl_coef=1", "rollout.temperature=2"])
    assert config.algorithm.kl_coef == 1.0 and type(config.algorithm.kl_coef) is float
    assert type(config.rollout.temperature) is float


def test_override_string_values():
    config = load_config(None, ["data.system_prompt=", "model.path=my/model dir", "data.train_path=a=b.jsonl"])
    assert config.data.system_prompt == ""
    assert config.model.path == "my/model dir"
    assert config.data.train_path == "a=b.jsonl"  # only the first '=' splits


def test_parse_overrides_builds_nested_dict():
    assert parse_overrides(["trainer.lr=1e-5", "run.progress=false", "trainer.seed=3"]) == {
        "trainer": {"lr": "1e-5", "seed": 3},
        "run": {"progress": False},
    }


ERRORS = {
    "unknown section": (["optimizer.lr=1"], ["'optimizer'"]),
    "unknown field": (["trainer.learning_rate=1"], ["trainer", "'learning_rate'"]),
    "string for int": (["trainer.iterations=ten"], ["trainer.iterations", "'ten'", "integer"]),
    "bool for int": (["trainer.iterations=true"], ["trainer.iterations", "True", "integer"]),
    "float for int": (["rollout.n=2.5"], ["rollout.n", "2.5", "integer"]),
    "int for bool": (["run.progress=1"], ["run.progress", "1", "true or false"]),
    "string for float": (["trainer.lr=fast"], ["trainer.lr", "'fast'", "number"]),
    "bool for float": (["trainer.lr=true"], ["trainer.lr", "True", "number"]),
    "int for string": (["model.path=3"], ["model.path", "3", "string"]),
    "literal loss_agg": (["algorithm.loss_agg=seq"], ["algorithm.loss_agg: got 'seq'; expected one of 'token', 'sequence'"]),
    "literal dtype": (["rollout.dtype=float16"], ["rollout.dtype: got 'float16'; expected one of 'float32', 'bfloat16'"]),
    "literal name": (["algorithm.name=ppo"], ["algorithm.name", "'ppo'", "'grpo'"]),
    "group of one": (["rollout.n=1"], ["rollout.n: got 1", "at least 2"]),
    "mini_batch does not divide global_batch": (
        ["trainer.global_batch=12", "trainer.mini_batch=8"],
        ["trainer.mini_batch: got 8", "trainer.global_batch=12"],
    ),
    "micro_batch does not divide mini_batch x n": (
        ["trainer.global_batch=8", "trainer.mini_batch=4", "rollout.n=4", "trainer.micro_batch=5"],
        ["trainer.micro_batch: got 5", "16"],
    ),
    "max_steps below min_steps": (
        ["data.min_steps=3", "data.max_steps=2"],
        ["data.max_steps: got 2", "data.min_steps=3"],
    ),
    "non-positive": (["trainer.global_batch=0"], ["trainer.global_batch: got 0", "positive"]),
    "top_p above 1": (["rollout.top_p=1.5"], ["rollout.top_p", "1.5"]),
    "negative lr": (["trainer.lr=-1e-5"], ["trainer.lr", "-1e-05"]),
    "literal dock mode": (["dock.mode=cluster"], ["dock.mode: got 'cluster'; expected one of 'inprocess', 'distributed'"]),
    "no shard": (["dock.shards=0"], ["dock.shards: got 0", "positive"]),
    "more shards than prompt groups": (
        ["dock.mode=distributed", "dock.shards=7", "trainer.global_batch=6"],
        ["dock.shards: got 7", "trainer.global_batch=6", "whole prompt groups"],
    ),
    "off-policy in flight": (["dock.max_inflight=2"], ["dock.max_inflight: got 2", "only 1"]),
    "scorer not an import path": (["algorithm.scorer=my_scorer"], ["algorithm.scorer: got 'my_scorer'", "'package.module:Class'"]),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_errors_name_the_field(name):
    overrides, fragments = ERRORS[name]
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert isinstance(info.value, ValueError)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        ("optimizer:\n  lr: 1\n", ["'optimizer'"]),
        ("trainer:\n  lr: 1\n  epochs: 2\n", ["trainer", "'epochs'"]),
        ("trainer: 3\n", ["trainer", "mapping"]),
        ("rollout:\n  n: '8'\n", ["rollout.n", "'8'", "integer"]),
        ("algorithm:\n  loss_agg: seq\n", ["algorithm.loss_agg: got 'seq'; expected one of 'token', 'sequence'"]),
        ("- trainer\n", ["mapping"]),
    ],
)
def test_errors_from_yaml_file_name_the_field(tmp_path, text, fragments):
    with pytest.raises(ConfigError) as info:
        load_config(write_yaml(tmp_path, text))
    for fragment in fragments:
        assert fragment in str(info.value)


def test_valid_batch_combination_is_accepted():
    config = load_config(
        None, ["trainer.global_batch=12", "trainer.mini_batch=4", "rollout.n=2", "trainer.micro_batch=8"]
    )
    assert (config.trainer.global_batch, config.trainer.mini_batch, config.trainer.micro_batch) == (12, 4, 8)
    assert load_config(None, ["data.min_steps=3", "data.max_steps=3"]).data.max_steps == 3


def test_rules_also_hold_for_directly_built_configs():
    with pytest.raises(ConfigError, match="rollout.n"):
        dataclasses.replace(Config(), rollout=dataclasses.replace(Config().rollout, n=1))


@pytest.mark.parametrize("override", ["trainer.lr", "lr=1e-5", "=3", "trainer"])
def test_malformed_override(override):
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert repr(override) in str(info.value)
    assert "section.field=value" in str(info.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_save_then_load_round_trips(tmp_path):
    config = load_config(
        None,
        [
            "trainer.lr=1e-5",
            "algorithm.adv_eps=1e-8",
            "algorithm.loss_agg=sequence",
            "algorithm.norm_adv_by_std=false",
            "rollout.dtype=float32",
            "rollout.n=4",
            "run.progress=false",
            "dock.timeout_s=12.5",
            "model.path=some/dir",
        ],
    )
    tricky = "Answer: '#### <n>', \"quoted\" # not a comment\n\tsecond line"
    config = dataclasses.replace(config, data=dataclasses.replace(config.data, system_prompt=tricky))
    assert config != Config()
    path = tmp_path / "saved.yaml"
    save_config(config, path)
    loaded = load_config(path)
    assert loaded == config
    assert loaded.data.system_prompt == tricky
    assert set(yaml.safe_load(path.read_text())) == {f.name for f in dataclasses.fields(Config)}
    # the defaults round-trip too (DEFAULT_SYSTEM_PROMPT has quotes and '####')
    save_config(Config(), path)
    assert load_config(path) == Config()


@pytest.mark.parametrize("override", ["trainer.lr=nan", "dock.timeout_s=nan"])
def test_nan_is_rejected(override):
    field = override.split("=")[0]
    with pytest.raises(ConfigError, match=field):
        load_config(None, [override])


@pytest.mark.parametrize("value", ["@data.jsonl", "'open", "x: y: z"])
def test_override_value_that_is_not_yaml(value):
    try:
        config = load_config(None, [f"data.train_path={value}"])
    except ConfigError as e:
        assert "data.train_path" in str(e)
    else:
        assert config.data.train_path == value


def test_override_text_with_hash_is_kept_verbatim():
    config = load_config(None, ["data.system_prompt=Write the answer as #### N", "data.train_path='quoted.jsonl'"])
    assert config.data.system_prompt == "Write the answer as #### N"
    assert config.data.train_path == "quoted.jsonl"


def test_distributed_mode_settings():
    config = load_config(None, ["dock.mode=distributed", "dock.shards=3", "algorithm.scorer=my.rewards:Scorer"])
    assert (config.dock.mode, config.dock.shards, config.dock.max_inflight) == ("distributed", 3, 1)
    assert config.algorithm.scorer == "my.rewards:Scorer"
    assert load_config(None, ["dock.shards=7"]).dock.shards == 7  # unused, so unchecked, in the in-process mode
