"""Tests of the typed run configuration: loading, overrides, validation messages, round trip."""

from __future__ import annotations

import dataclasses
import re
import time
import tracemalloc
import types
import typing

import pytest
import torch
import yaml

from dockrl.config import (
    DEFAULT_SYSTEM_PROMPT,
    Config,
    ConfigError,
    TrainerConfig,
    dump_config,
    load_config,
    load_config_text,
    parse_overrides,
    resolve_auto,
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
            elif isinstance(tp, types.UnionType):  # run.keep_rollouts: str | float | bool
                assert type(v) in typing.get_args(tp), f"{section.name}.{f.name}"
            elif typing.get_origin(tp) is tuple:  # run.trackers: tuple[a registry's name, ...]
                assert type(v) is tuple and all(type(x) is str for x in v), f"{section.name}.{f.name}"
            else:
                assert type(v) is tp, f"{section.name}.{f.name}: {v!r} is not {tp.__name__}"


def test_empty_yaml_file_gives_defaults(tmp_path):
    assert load_config(write_yaml(tmp_path, "")) == Config()


def test_a_bad_value_of_a_config_file_names_the_file_and_one_of_an_override_does_not(tmp_path):
    path = write_yaml(tmp_path, "trainer:\n  lr: abc\n  nosuch: 1\nrollout:\n  n: 4\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: trainer: unknown field\(s\) \['nosuch'\]"):
        load_config(path)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: trainer.lr: got 'abc'; expected a number"):
        load_config(write_yaml(tmp_path, "trainer:\n  lr: abc\n"))
    with pytest.raises(ConfigError, match=r"^rollout.n: got 0"):  # the override's value, not the file's
        load_config(write_yaml(tmp_path, "rollout:\n  n: 4\n"), ["rollout.n=0"])
    with pytest.raises(ConfigError, match=r"^trainer.mini_batch: got 4; .*trainer.global_batch"):  # a rule the override broke
        load_config(write_yaml(tmp_path, "trainer:\n  mini_batch: 4\n"), ["trainer.global_batch=6"])
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: config: unknown field\(s\) \['trainr'\]"):
        load_config(write_yaml(tmp_path, "trainr:\n  lr: 1\n"), ["trainer.lr=1e-5"])
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: not valid YAML: line 2, column 1: expected ',' or ']', "
                       r"but got '<stream end>' \(while parsing a flow sequence at line 1, column 10\)$"):
        load_config(write_yaml(tmp_path, "trainer: [1\n"))  # one line, where the parser stopped and what it was reading
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: not valid YAML: line 2, column 1: found character '\\t' "
                       r"that cannot start any token \(while scanning for the next token\)$"):
        load_config(write_yaml(tmp_path, "trainer:\n\tlr: 1\n"))
    with pytest.raises(FileNotFoundError, match="is not a regular file"):
        load_config(tmp_path)


def test_an_error_names_the_file_when_the_value_or_key_at_fault_came_from_it(tmp_path):
    """Not merely when an override touches the same section: the file's key or value is still at fault."""
    path = write_yaml(tmp_path, "trainer:\n  foo: 1\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: trainer: unknown field\(s\) \['foo'\]"):
        load_config(path, ["trainer.lr=1e-5"])
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: trainer: got 5; expected a mapping of fields$"):
        load_config(write_yaml(tmp_path, "trainer: 5\n"), ["trainer.lr=1e-5"])
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: reward_model.model: got 'x'; expected a mapping of fields$"):
        load_config(write_yaml(tmp_path, "reward_model:\n  model: x\n"), ["reward_model.model.path=rm"])
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: trainer.mini_batch: got 6; must divide trainer.global_batch=2"):
        load_config(write_yaml(tmp_path, "trainer:\n  global_batch: 2\n"))  # the rule broke on the file's global_batch
    # what an override gave is not the file's
    with pytest.raises(ConfigError, match=r"^trainer: unknown field\(s\) \['foo'\]"):
        load_config(write_yaml(tmp_path, "trainer:\n  lr: 1e-5\n"), ["trainer.foo=1"])
    with pytest.raises(ConfigError, match=r"^trainer.lr: got \{'x': 1\}; expected a number$"):  # the override replaced the file's lr
        load_config(write_yaml(tmp_path, "trainer:\n  lr: 1e-5\n"), ["trainer.lr.x=1"])


def test_a_yaml_alias_bomb_is_refused_in_milliseconds_naming_the_field():
    """A few hundred bytes of nested aliases, as one config value, expand to 9**9 strings once walked or
    printed; the loader refuses it before (under 1 s and 100 MB)."""
    levels = ["&a [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for prev, name in zip("abcdefgh", "bcdefghi"):
        levels.append(f"&{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    bomb = "trainer:\n  lr: [" + ", ".join(levels) + "]\n"
    assert len(bomb) < 400
    tracemalloc.start()
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"^bomb.yaml: trainer\.lr\[.*more than 10000 values"):
        load_config_text(bomb, "bomb.yaml")
    seconds, (_, peak) = time.perf_counter() - start, tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert seconds < 1 and peak < 100 * 2**20, (seconds, peak)


def test_a_config_too_deep_or_too_long_is_refused():
    with pytest.raises(ConfigError, match=r"^deep: trainer\.lr(\[0\])+: nested more than 16 deep"):
        load_config_text("trainer:\n  lr: " + "[" * 30 + "]" * 30 + "\n", "deep")
    with pytest.raises(ConfigError, match="a config is at most 4194304"):
        load_config_text("#" * (4 * 2**20 + 1), "long")
    with pytest.raises(ConfigError, match=r"^long: run\.output_dir: a text of 1048577 characters"):
        load_config_text("run:\n  output_dir: " + "x" * (2**20 + 1) + "\n", "long")
    with pytest.raises(ConfigError, match="an override is at most 1048576"):
        load_config(None, ["run.output_dir=" + "x" * 2**20])


def test_a_config_file_that_is_not_utf8_names_the_byte(tmp_path):
    path = tmp_path / "f.yaml"
    path.write_bytes(b"trainer:\n  lr: \xff\xfe\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: not UTF-8 text \(byte 0xff at position 15, line 2\)$"):
        load_config(path)
    assert load_config(write_yaml(tmp_path, "data:\n  system_prompt: 'Réponds: ½'\n")).data.system_prompt == "Réponds: ½"


def test_a_key_repeated_in_a_mapping_is_refused(tmp_path):
    path = write_yaml(tmp_path, "trainer:\n  lr: 1e-5\n  lr: 2e-5\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: trainer.lr: repeated key \(lines 2 and 3\)"):
        load_config(path)
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: trainer: repeated key \(lines 1 and 5\)"):
        load_config(write_yaml(tmp_path, "trainer:\n  lr: 1e-5\nrollout:\n  n: 4\ntrainer:\n  iterations: 3\n"))
    with pytest.raises(ConfigError, match=r"^env X: reward_model.model.path: repeated key \(lines 3 and 4\)"):
        load_config_text("reward_model:\n  model:\n    path: a\n    path: b\n", "env X")
    # one name in two mappings, and a key given again over a YAML merge key (`<<`), are no repetition
    config = load_config(write_yaml(tmp_path, "trainer:\n  <<: {lr: 1e-5, iterations: 3}\n  lr: 2e-5\ncritic:\n  lr: 1e-5\n"))
    assert (config.trainer.lr, config.trainer.iterations, config.critic.lr) == (2e-5, 3, 1e-5)


def test_a_cross_field_error_says_which_field_is_at_its_default(tmp_path):
    with pytest.raises(ConfigError, match=r"^trainer.mini_batch: got 6; must divide trainer.global_batch=2 "
                                          r"\(trainer.mini_batch is the default 6\)$"):
        load_config(None, ["trainer.global_batch=2"])
    with pytest.raises(ConfigError, match=r"^trainer.micro_batch: got 5; must divide trainer.mini_batch × rollout.n = 48 sequences "
                                          r"\(trainer.mini_batch is the default 6, rollout.n is the default 8\)$"):
        load_config(None, ["trainer.micro_batch=5"])
    # a field the file or an override sets, even to its default value, is not the default
    with pytest.raises(ConfigError, match=r"^trainer.mini_batch: got 6; must divide trainer.global_batch=2$"):
        load_config(write_yaml(tmp_path, "trainer:\n  mini_batch: 6\n"), ["trainer.global_batch=2"])
    with pytest.raises(ConfigError, match=r"^trainer.lr: got 'abc'; expected a number$"):
        load_config(None, ["trainer.lr=abc"])
    with pytest.raises(ConfigError, match=r"^trainer.lr: got \{'x': 1\}; expected a number$"):  # an override under it set it
        load_config(None, ["trainer.lr.x=1"])
    # the value the rule failed on is noted, not the fields the message suggests other values for
    with pytest.raises(ConfigError, match=r"dock.mode='distributed' for several ranks\) \(trainer.engine is the default 'hf'\)$"):
        load_config(None, ["parallel.tp=2"])


def test_yaml_file_and_overrides_merge(tmp_path):
    path = write_yaml(
        tmp_path,
        "trainer:\n  lr: 0.001\n  iterations: 3\nrollout:\n  n: 4\n  dtype: float32\nrun:\n  output_dir: runs/x\n",
    )
    config = load_config(str(path), ["trainer.iterations=7", "run.progress=false", "algorithm.loss_agg_mode=seq-mean-token-mean"])
    assert config.trainer.iterations == 7  # the override wins over the file
    assert config.trainer.lr == 0.001  # from the file
    assert config.rollout.n == 4 and config.rollout.dtype == "float32"
    assert config.run.output_dir == "runs/x"
    assert config.run.progress is False
    assert config.algorithm.loss_agg_mode == "seq-mean-token-mean"
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
    config = load_config(None, ["algorithm.kl_loss_coef=1", "rollout.temperature=2"])
    assert config.algorithm.kl_loss_coef == 1.0 and type(config.algorithm.kl_loss_coef) is float
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
    "literal loss_agg_mode": (["algorithm.loss_agg_mode=seq"], ["algorithm.loss_agg_mode: got 'seq'; expected one of 'token-mean', "
                                                                "'seq-mean-token-mean', 'seq-mean-token-sum', 'seq-mean-token-sum-norm'"]),
    "literal dtype": (["rollout.dtype=float16"], ["rollout.dtype: got 'float16'; expected one of 'auto', 'float32', 'bfloat16'"]),
    "literal engine": (["rollout.engine=sglang"], ["rollout.engine: got 'sglang'; expected one of 'auto', 'hf', 'vllm'"]),
    "literal adv_estimator": (["algorithm.adv_estimator=ppo"], ["algorithm.adv_estimator", "'ppo'", "'grpo'", "'reinforce_plus_plus'"]),
    "group of one": (["rollout.n=1"], ["rollout.n: got 1", "algorithm.adv_estimator='grpo'", "at least 2"]),
    "group of one under dynamic sampling": (
        ["rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus", "algorithm.filter_groups.enable=true"],
        ["rollout.n: got 1", "algorithm.filter_groups.enable", "at least 2"],
    ),
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
    "literal warehouse": (["dock.warehouse=minio"], ["dock.warehouse: got 'minio'; expected one of 'memory', 's3', 'directory'"]),
    "endpoint with a path": (["dock.warehouse=s3", "dock.endpoint=http://minio:9000/bucket"], ["dock.endpoint", "no path"]),
    "endpoint scheme": (["dock.warehouse=s3", "dock.endpoint=ftp://minio:9000"], ["dock.endpoint: got 'ftp://minio:9000'"]),
    "bucket name": (["dock.warehouse=s3", "dock.bucket=My_Bucket"], ["dock.bucket: got 'My_Bucket'", "S3 bucket name"]),
    "prefix with ..": (["dock.warehouse=s3", "dock.prefix=runs/../x"], ["dock.prefix: got 'runs/../x'"]),
    "key variable name": (["dock.warehouse=s3", "dock.access_key_env=MY-KEY"], ["dock.access_key_env: got 'MY-KEY'"]),
    "secret variable name": (["dock.warehouse=s3", "dock.secret_key_env="], ["dock.secret_key_env: got ''"]),
    "store timeout": (["dock.store_timeout_s=0"], ["dock.store_timeout_s: got 0.0", "finite number > 0"]),
    "store retries": (["dock.store_retries=-1"], ["dock.store_retries: got -1"]),
    "empty directory": (["dock.warehouse=directory", "dock.directory= "], ["dock.directory"]),
    "zero lease": (["dock.lease_s=0"], ["dock.lease_s: got 0.0", "finite number > 0"]),
    "infinite lease": (["dock.lease_s=.inf"], ["dock.lease_s: got inf", "finite number > 0"]),
    "literal dock mode": (["dock.mode=cluster"], ["dock.mode: got 'cluster'; expected one of 'inprocess', 'distributed'"]),
    "no shard": (["dock.shards=0"], ["dock.shards: got 0", "positive"]),
    "more shards than prompt groups": (
        ["dock.mode=distributed", "dock.shards=7", "trainer.global_batch=6"],
        ["dock.shards: got 7", "trainer.global_batch=6", "whole prompt groups"],
    ),
    "in flight in-process": (["dock.max_inflight=2"], ["dock.max_inflight: got 2", "dock.mode='inprocess'", "dock.mode=distributed"]),
    "in flight with the hybrid actor": (
        ["trainer.engine=megatron", "rollout.engine=vllm", "trainer.hybrid=true", "dock.mode=distributed", "dock.max_inflight=2"],
        ["dock.max_inflight: got 2", "trainer.hybrid=True"],
    ),
    "too many in flight": (["dock.mode=distributed", "dock.max_inflight=0"], ["dock.max_inflight: got 0", "from 1"]),
    "partial rollout on-policy": (["rollout.partial_tokens=16"],
                                  ["rollout.partial_tokens: got 16", "dock.max_inflight=1", "dock.mode=distributed dock.max_inflight=2"]),
    "partial budget of a whole response": (["dock.mode=distributed", "dock.max_inflight=2", "rollout.partial_tokens=80"],
                                           ["rollout.partial_tokens: got 80", "rollout.max_response_length - 1 = 79"]),
    "negative partial budget": (["rollout.partial_tokens=-1"], ["rollout.partial_tokens: got -1", "0 (off)"]),
    "partial age beyond the iterations in flight": (
        ["dock.mode=distributed", "dock.max_inflight=2", "rollout.partial_tokens=16", "rollout.partial_max_age=3"],
        ["rollout.partial_max_age: got 3", "from 2 to dock.max_inflight=2", "raise dock.max_inflight"],
    ),
    "partial age of one pass": (["dock.mode=distributed", "dock.max_inflight=2", "rollout.partial_tokens=16", "rollout.partial_max_age=1"],
                                ["rollout.partial_max_age: got 1"]),
    "partial age without partial rollout": (["rollout.partial_max_age=3"], ["rollout.partial_max_age: got 3", "rollout.partial_tokens > 0"]),
    "negative eval size": (["data.eval_size=-5"], ["data.eval_size: got -5", ">= 0"]),
    "negative threads": (["run.num_threads=-3"], ["run.num_threads: got -3", ">= 0"]),
    "scorer not an import path": (["algorithm.scorer=my_scorer"], ["algorithm.scorer: got 'my_scorer'", "'package.module:Class'"]),
    "clip_ratio_low of 1": (["algorithm.clip_ratio_low=1"], ["algorithm.clip_ratio_low: got 1.0", "< 1"]),
    "negative clip_ratio_high": (["algorithm.clip_ratio_high=-0.1"], ["algorithm.clip_ratio_high: got -0.1"]),
    "dual-clip bound of 1": (["algorithm.clip_ratio_c=1"], ["algorithm.clip_ratio_c: got 1.0", "> 1"]),
    "negative tis_cap": (["algorithm.tis_cap=-1"], ["algorithm.tis_cap: got -1.0"]),
    "tis_cap below 1": (["algorithm.tis_cap=0.5"], ["algorithm.tis_cap: got 0.5", ">= 1"]),
    "GSPO with a token mean": (["algorithm.ratio_level=sequence"],
                               ["algorithm.loss_agg_mode: got 'token-mean'", "algorithm.ratio_level='sequence'", "'seq-mean-token-mean'"]),
    "reward-model setting without the reward model": (["reward_model.rule_weight=2"],
                                                      ["reward_model.rule_weight: got 2.0", "reward_model.enable is false"]),
    "nested reward-model setting without the reward model": (["reward_model.model.path=rm"],
                                                             ["reward_model.model.path: got 'rm'", "reward_model.enable is false"]),
    "dynamic-sampling setting without dynamic sampling": (["algorithm.filter_groups.on_exhausted=fill"],
                                                          ["algorithm.filter_groups.on_exhausted: got 'fill'",
                                                           "algorithm.filter_groups.enable is false"]),
    "overlong setting without the overlong buffer": (["algorithm.overlong_buffer.len=8"],
                                                     ["algorithm.overlong_buffer.len: got 8", "algorithm.overlong_buffer.enable is false"]),
    "negative entropy_coeff": (["algorithm.entropy_coeff=-0.01"], ["algorithm.entropy_coeff: got -0.01"]),
    "gamma above 1": (["algorithm.gamma=1.5"], ["algorithm.gamma: got 1.5", "from 0 to 1"]),
    "lam below 0": (["algorithm.lam=-0.5"], ["algorithm.lam: got -0.5"]),
    "literal ratio_level": (["algorithm.ratio_level=group"], ["algorithm.ratio_level: got 'group'", "'token', 'sequence'"]),
    "literal kl_loss_type": (["algorithm.kl_loss_type=k3"], ["algorithm.kl_loss_type: got 'k3'", "'low_var_kl'"]),
    "gae without a critic": (["algorithm.adv_estimator=gae"], ["algorithm.adv_estimator: got 'gae'", "critic.enable=true"]),
    "dr_grpo with a token mean": (["algorithm.adv_estimator=dr_grpo"],
                                  ["algorithm.loss_agg_mode: got 'token-mean'", "'dr_grpo'", "'seq-mean-token-sum-norm'"]),
    "std switch of another estimator": (["algorithm.adv_estimator=rloo", "algorithm.norm_adv_by_std_in_grpo=false"],
                                        ["algorithm.norm_adv_by_std_in_grpo: got False", "'rloo'"]),
    "KL in the reward of an outcome estimator": (["algorithm.kl_in_reward_coef=0.1"],
                                                 ["algorithm.kl_in_reward_coef: got 0.1", "'grpo'", "algorithm.kl_loss_coef"]),
}


def test_a_zero_learning_rate_is_accepted():
    """lr = 0 is the standard check of drift between rollout and trainer log-probs; NaN is not a rate."""
    assert load_config(None, ["trainer.lr=0"]).trainer.lr == 0.0
    with pytest.raises(ConfigError, match="trainer.lr: got nan"):
        load_config(None, ["trainer.lr=.nan"])


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
        ("algorithm:\n  loss_agg_mode: seq\n", ["algorithm.loss_agg_mode: got 'seq'; expected one of 'token-mean', "
                                                 "'seq-mean-token-mean', 'seq-mean-token-sum', 'seq-mean-token-sum-norm'"]),
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


def test_warehouse_settings_are_accepted():
    config = load_config(None, ["dock.warehouse=s3", "dock.endpoint=https://minio.kubeflow:9000", "dock.bucket=rl.runs-1",
                                "dock.prefix=team/a", "dock.secure=false", "dock.store_retries=0", "dock.store_timeout_s=2"])
    dock = config.dock
    assert (dock.warehouse, dock.endpoint, dock.bucket, dock.prefix, dock.secure) == (
        "s3", "https://minio.kubeflow:9000", "rl.runs-1", "team/a", False)
    assert (dock.access_key_env, dock.secret_key_env) == ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
    assert load_config(None, ["dock.warehouse=s3", "dock.endpoint=127.0.0.1:9000"]).dock.endpoint == "127.0.0.1:9000"
    assert load_config(None, ["dock.warehouse=directory", "dock.directory=store/x"]).dock.directory == "store/x"
    # fields of an unused backend are not checked: a memory run may carry an s3 section
    assert load_config(None, ["dock.bucket=Not_Checked"]).dock.warehouse == "memory"


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
            "algorithm.loss_agg_mode=seq-mean-token-mean",
            "algorithm.norm_adv_by_std_in_grpo=false",
            "rollout.dtype=float32",
            "rollout.engine=vllm",
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


@pytest.mark.parametrize("override", ["trainer.lr=nan", "dock.timeout_s=nan", "dock.lease_s=nan"])
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


def test_megatron_is_accepted_on_every_device_kind():
    for kind in ("cpu", "cuda", "npu"):  # placement is checked where the engine is built, not at load
        assert load_config(None, ["trainer.engine=megatron", f"parallel.device={kind}"]).parallel.device == kind


class FakeCudaAccelerator:
    """Stands in for ``torch.accelerator.current_accelerator`` on a machine with a GPU."""

    def __call__(self, check_available: bool = False):
        return torch.device("cuda")


def test_auto_stays_auto_at_load_resolves_in_one_step_and_travels_as_auto(monkeypatch):
    loaded = load_config()
    assert (loaded.parallel.device, loaded.rollout.dtype, loaded.trainer.autocast_bf16, loaded.rollout.engine) == ("auto",) * 4
    assert "device: auto" in dump_config(loaded)
    config = resolve_auto(loaded)
    assert config.parallel.device == "cpu"  # no accelerator here
    assert loaded.parallel.device == "auto"  # a new config: the loaded one is left as it was
    assert "device: cpu" in dump_config(config)
    assert resolve_auto(config) is config  # nothing left to resolve
    portable = yaml.safe_load(dump_config(config, portable=True))
    assert portable["parallel"]["device"] == "auto" and portable["rollout"]["dtype"] == "auto"
    assert portable["trainer"]["autocast_bf16"] == "auto"
    # the note survives replacing another section (the launcher sets run.resume), and explicit values stay
    resumed = dataclasses.replace(config, run=dataclasses.replace(config.run, resume="x"))
    assert yaml.safe_load(dump_config(resumed, portable=True))["parallel"]["device"] == "auto"
    explicit = resolve_auto(load_config(None, ["parallel.device=cpu", "rollout.dtype=float32"]))
    kept = yaml.safe_load(dump_config(explicit, portable=True))
    assert kept["parallel"]["device"] == "cpu" and kept["rollout"]["dtype"] == "float32"

    monkeypatch.setattr(torch.accelerator, "current_accelerator", FakeCudaAccelerator())
    on_gpu = resolve_auto(load_config())
    assert on_gpu.parallel.device == "cuda"
    # auto dtypes follow the chosen device: a GPU computes bf16 natively
    assert on_gpu.rollout.dtype == "bfloat16" and on_gpu.trainer.autocast_bf16 is True


def test_parallel_layout_defaults_and_a_valid_layout(tiny_model_dir):
    from dockrl.parallel.layout import ModelShape, ParallelLayout

    p = load_config().parallel
    assert isinstance(p, ParallelLayout) and p.world_size == 1 and p.device == "auto"
    valid = ParallelLayout(tp=2, pp=2, dp=2, infer_tp=2, device="cuda")  # a valid layout of the tiny model
    valid.check_model(ModelShape.from_model_dir(tiny_model_dir))
    assert valid.world_size == 8
    # ... which the transformers engine would silently ignore: refused, naming the field
    with pytest.raises(ConfigError, match=r"parallel.tp: got 2; trainer.engine='hf' trains one unsharded copy"):
        load_config(None, [f"model.path={tiny_model_dir}", "parallel.tp=2", "parallel.pp=2", "parallel.dp=2", "parallel.infer_tp=2"])
    for name in ("pp", "dp"):
        with pytest.raises(ConfigError, match=rf"parallel.{name}: got 2; trainer.engine='hf'"):
            load_config(None, [f"parallel.{name}=2"])


PARALLEL_ERRORS = {
    # tiny model: 4 heads, 2 KV heads, 2 layers, MLP width 128
    "world size is no field": (["parallel.world_size=2"], ["parallel: unknown field(s) ['world_size']", "'tp'"]),
    "tp not dividing heads": (["parallel.tp=3"], ["parallel.tp: got 3", "num_attention_heads=4"]),
    "tp not dividing kv heads": (["parallel.tp=4"], ["parallel.tp: got 4", "num_key_value_heads=2"]),
    "infer_tp not dividing kv heads": (["parallel.dp=4", "parallel.infer_tp=4"], ["parallel.infer_tp: got 4", "num_key_value_heads=2"]),
    "infer_tp above tp x dp": (["parallel.pp=2", "parallel.infer_tp=2"], ["parallel.infer_tp: got 2", "parallel.tp × parallel.dp = 1 × 1 = 1"]),
    "inference pp": (["parallel.infer_pp=2"], ["parallel.infer_pp: got 2", "expected 1"]),
    "pp above layers": (["parallel.pp=3"], ["parallel.pp: got 3", "num_hidden_layers=2"]),
    "zero tp": (["parallel.tp=0"], ["parallel.tp: got 0", "positive"]),
    "negative dp": (["parallel.dp=-1"], ["parallel.dp: got -1", "positive"]),
    "zero infer_tp": (["parallel.infer_tp=0"], ["parallel.infer_tp: got 0", "positive"]),
    "zero infer_pp": (["parallel.infer_pp=0"], ["parallel.infer_pp: got 0", "positive"]),
    "unknown device": (["parallel.device=tpu"], ["parallel.device: got 'tpu'", "'cpu', 'cuda', 'npu'"]),
    "zero bucket": (["parallel.bucket_mb=0"], ["parallel.bucket_mb: got 0"]),
}


@pytest.mark.parametrize("name", list(PARALLEL_ERRORS))
def test_impossible_parallel_layouts_fail_at_load(tiny_model_dir, name):
    overrides, fragments = PARALLEL_ERRORS[name]
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"model.path={tiny_model_dir}", *overrides])
    for fragment in fragments:
        assert fragment in str(info.value)


def test_model_rules_wait_for_a_local_model():
    # the packaged model is exported at run time: its sizes are checked when the layout is built
    hybrid = ["trainer.engine=megatron", "rollout.engine=vllm", "trainer.hybrid=true", "dock.mode=distributed"]
    assert load_config(None, [*hybrid, "parallel.tp=3"]).parallel.tp == 3
    with pytest.raises(ConfigError, match="parallel.infer_tp: got 2; must not exceed"):
        load_config(None, ["parallel.pp=3", "parallel.infer_tp=2"])
def test_distributed_mode_settings():
    config = load_config(None, ["dock.mode=distributed", "dock.shards=3", "algorithm.scorer=my.rewards:Scorer"])
    assert (config.dock.mode, config.dock.shards, config.dock.max_inflight) == ("distributed", 3, 1)
    assert config.algorithm.scorer == "my.rewards:Scorer"
    with pytest.raises(ConfigError, match="dock.shards"):  # the same rule in the in-process mode
        load_config(None, ["dock.shards=7"])
    partial = load_config(None, ["dock.mode=distributed", "dock.max_inflight=3", "rollout.partial_tokens=16", "rollout.partial_max_age=3"])
    assert (partial.rollout.partial_tokens, partial.rollout.partial_max_age) == (16, 3)


@pytest.mark.parametrize("caps, bf16", [({"avx512_bf16": False}, False), ({"avx512_bf16": True}, False),
                                        ({"avx512_bf16": True, "amx_bf16": True}, True)])
def test_auto_bf16_is_picked_where_the_cpu_computes_it_faster_than_fp32(monkeypatch, caplog, caps, bf16):
    """``auto`` resolves in ``resolve_auto``: bf16 with AMX only (emulated on AVX2, slower with AVX512-BF16 alone)."""
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True} | caps)  # a fake CPU
    with caplog.at_level("INFO", logger="dockrl.config"):
        config = resolve_auto(load_config(None, []))
    assert config.rollout.dtype == ("bfloat16" if bf16 else "float32")
    assert config.trainer.autocast_bf16 is bf16
    said = f"precision auto: rollout.dtype={config.rollout.dtype}, trainer.autocast_bf16={str(bf16).lower()} (bf16 is "
    assert any(r.getMessage().startswith(said + ("faster" if bf16 else "not faster")) for r in caplog.records)  # the choice is logged
    explicit = resolve_auto(load_config(None, ["rollout.dtype=float32", "trainer.autocast_bf16=false"]))
    assert (explicit.rollout.dtype, explicit.trainer.autocast_bf16) == ("float32", False)


def test_explicit_bf16_on_an_emulating_cpu_warns(monkeypatch, caplog):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True, "avx512_bf16": False, "amx_bf16": False})
    with caplog.at_level("WARNING", logger="dockrl.config"):
        config = resolve_auto(load_config(None, ["rollout.dtype=bfloat16"]))
    assert config.rollout.dtype == "bfloat16" and config.trainer.autocast_bf16 is False
    assert any("no native bf16" in r.getMessage() and "emulated" in r.getMessage() for r in caplog.records)
    caplog.clear()
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True, "avx512_bf16": True, "amx_bf16": False})
    with caplog.at_level("WARNING", logger="dockrl.config"):
        resolve_auto(load_config(None, ["trainer.autocast_bf16=true"]))
    assert any("AVX512-BF16 but no AMX-BF16" in r.getMessage() for r in caplog.records)


def test_autocast_literal_is_checked_by_type():
    with pytest.raises(ConfigError, match=r"trainer.autocast_bf16: got 1; expected one of 'auto', True, False"):
        load_config(None, ["trainer.autocast_bf16=1"])
ENGINE_ERRORS = {
    "unknown training engine": (["trainer.engine=deepspeed"], ["trainer.engine: got 'deepspeed'; expected one of 'hf', 'megatron'"]),
    "megatron over several ranks": (["trainer.engine=megatron", "parallel.tp=2"],
                                    ["parallel.tp: got 2", "hybrid actor with dock.mode='distributed' only", "use 1"]),
    "megatron pipeline": (["trainer.engine=megatron", "parallel.pp=2"], ["parallel.pp: got 2", "multi-rank megatron actor"]),
    "megatron data parallel": (["trainer.engine=megatron", "parallel.dp=2"], ["parallel.dp: got 2", "multi-rank megatron actor"]),
    "hybrid data parallel on an odd batch": (
        ["trainer.engine=megatron", "rollout.engine=vllm", "trainer.hybrid=true", "dock.mode=distributed", "parallel.dp=2",
         "trainer.global_batch=6", "trainer.mini_batch=3"],
        ["trainer.mini_batch: got 3", "multiple of parallel.dp=2", "equal part"],
    ),
    "multi-rank hybrid in process": (
        ["trainer.engine=megatron", "rollout.engine=vllm", "trainer.hybrid=true", "parallel.tp=2"], ["parallel.tp: got 2", "dock.mode='distributed'"],
    ),
    "multi-rank hybrid with vLLM TP": (
        ["trainer.engine=megatron", "rollout.engine=vllm", "trainer.hybrid=true", "dock.mode=distributed", "parallel.tp=2", "parallel.infer_tp=2"],
        ["parallel.infer_tp: got 2", "inference DP' = tp × pp × dp"],
    ),
    "hybrid on hf": (["trainer.hybrid=true", "rollout.engine=vllm"],
                     ["trainer.hybrid: got True", "needs trainer.engine='megatron' (got 'hf')", "reshards"]),
    "hybrid with hf rollout": (
        ["trainer.hybrid=true", "trainer.engine=megatron", "rollout.engine=hf"],
        ["trainer.hybrid: got True", "needs rollout.engine='vllm' or 'auto' (got 'hf')", "on the devices it trains on"],
    ),
}


@pytest.mark.parametrize("name", list(ENGINE_ERRORS))
def test_engine_and_hybrid_rules_say_why(tiny_model_dir, name):
    overrides, fragments = ENGINE_ERRORS[name]
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"model.path={tiny_model_dir}", *overrides])
    for fragment in fragments:
        assert fragment in str(info.value)


def test_hybrid_actor_settings(tiny_model_dir):
    assert load_config().trainer.engine == "hf" and not load_config().trainer.hybrid
    for mode in ("inprocess", "distributed"):
        config = load_config(None, [f"model.path={tiny_model_dir}", "trainer.engine=megatron", "rollout.engine=vllm",
                                    "trainer.hybrid=true", f"dock.mode={mode}"])
        assert config.trainer.hybrid and config.trainer.engine == "megatron"
    for layout in (["parallel.tp=2"], ["parallel.pp=2"], ["parallel.dp=2"], ["parallel.tp=2", "parallel.pp=2"]):  # a process per rank
        config = load_config(None, [f"model.path={tiny_model_dir}", "trainer.engine=megatron", "rollout.engine=vllm",
                                    "trainer.hybrid=true", "dock.mode=distributed", *layout])
        p = config.parallel
        assert p.tp * p.pp * p.dp == len(layout) * 2 and p.infer_tp == 1
    for mode in ("inprocess", "distributed"):  # without the hybrid: megatron actor, weights over the channel
        assert load_config(None, ["trainer.engine=megatron", f"dock.mode={mode}"]).trainer.engine == "megatron"


def test_algorithm_defaults_are_grpo_and_verl_combinations_load():
    a = Config().algorithm
    assert (a.adv_estimator, a.loss_agg_mode, a.ratio_level, a.clip_ratio_c, a.tis_cap, a.entropy_coeff) == \
        ("grpo", "token-mean", "token", 0.0, 0.0, 0.0)
    assert not a.uses_reference
    assert load_config(None, ["algorithm.kl_loss_coef=0.1"]).algorithm.uses_reference
    dr = load_config(None, ["algorithm.adv_estimator=dr_grpo", "algorithm.loss_agg_mode=seq-mean-token-sum-norm"]).algorithm
    assert dr.adv_estimator == "dr_grpo"
    rpp = load_config(None, ["algorithm.adv_estimator=reinforce_plus_plus", "algorithm.kl_in_reward_coef=0.01",
                             "algorithm.kl_penalty=low_var_kl", "algorithm.gamma=0.99"]).algorithm
    assert rpp.uses_reference and rpp.kl_penalty == "low_var_kl"
    gspo = load_config(None, ["algorithm.ratio_level=sequence", "algorithm.loss_agg_mode=seq-mean-token-mean",
                              "algorithm.clip_ratio_low=3e-4", "algorithm.clip_ratio_high=4e-4",
                              "algorithm.clip_ratio_c=3", "algorithm.tis_cap=2"]).algorithm
    assert (gspo.ratio_level, gspo.clip_ratio_c, gspo.tis_cap) == ("sequence", 3.0, 2.0)
    for estimator in ("reinforce_plus_plus", "gae"):  # no group: one sample per prompt, as verl's PPO
        one = load_config(None, ["rollout.n=1", "trainer.micro_batch=6", f"algorithm.adv_estimator={estimator}",
                                 f"critic.enable={estimator == 'gae'}"])
        assert one.rollout.n == 1


def test_an_override_into_a_section_an_earlier_override_gave_a_value_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"^override 'reward_model.model.path=x': reward_model.model was set to 5 by an earlier"):
        load_config(None, ["reward_model.model=5", "reward_model.model.path=x"])
    with pytest.raises(ConfigError, match=r"trainer: unknown field\(s\) \[1, 'foo'\]"):  # a number among the keys
        load_config(write_yaml(tmp_path, "trainer: {1: 2, foo: 3}\n"), [])


PURE_LOAD = """
import sys


class Refuse:
    '''Makes torch and vllm unimportable: loading a config must not need them.'''

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "vllm"):
            raise ImportError(f"{name} may not be imported while a config loads")
        return None


sys.meta_path.insert(0, Refuse())
from dockrl.config import Config, dump_config, load_config

assert load_config() == Config()
cfg = load_config(sys.argv[1], ["trainer.lr=1e-4", "rollout.dtype=bfloat16"])
assert (cfg.trainer.lr, cfg.rollout.n, cfg.rollout.dtype) == (1e-4, 4, "bfloat16")
assert (cfg.parallel.device, cfg.rollout.engine, cfg.trainer.autocast_bf16) == ("cpu", "auto", "auto")
dump_config(cfg)
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "vllm")))
"""


def test_loading_imports_neither_torch_nor_vllm_and_keeps_auto(tmp_path):
    """``load_config`` is pure: with torch and vllm unimportable it loads the defaults and a file with
    overrides, leaves ``auto`` as ``auto`` (no probe of the device, bf16 or vLLM) and imports neither."""
    import subprocess
    import sys

    path = write_yaml(tmp_path, "rollout:\n  n: 4\nparallel:\n  device: cpu\n")
    done = subprocess.run([sys.executable, "-c", PURE_LOAD, str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_lora_section_loads_nested_and_round_trips():
    from dockrl.config import LoraConfig

    cfg = load_config(None, ["trainer.lora.rank=8", "trainer.lora.target_modules=q_proj, v_proj", "rollout.engine=hf"])
    assert cfg.trainer.lora == LoraConfig(rank=8, alpha=16.0, target_modules=("q_proj", "v_proj"))
    assert load_config_text(dump_config(cfg), "dumped") == cfg
    assert load_config_text("trainer:\n  lora:\n    rank: 2\n    target_modules: [o_proj]\n", "yaml").trainer.lora.target_modules == ("o_proj",)
    with pytest.raises(ConfigError, match=r"trainer.lora.target_modules\[0\]: got 3; expected a string"):
        load_config_text("trainer:\n  lora:\n    rank: 2\n    target_modules: [3]\n", "yaml")
    assert not Config().trainer.lora.enabled
