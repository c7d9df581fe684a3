"""``Config``, the whole run configuration, and the cross-field rules and ranges it checks whenever it is built.

``Config`` lives beside its rules, above the sections (``dockrl.config.sections``): building one runs
``check_rules``, also by ``dataclasses.replace``; ``auto`` fields stay ``auto`` (``dockrl.config.resolve``).
Each error names the field, the value, the rule and the fix (docs/bad-inputs.md). The rules read
nothing of the machine but a local model directory's ``config.json`` (``_check_parallel``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dockrl.config.sections import (
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    DockConfig,
    ModelConfig,
    RewardModelConfig,
    RolloutConfig,
    RunConfig,
    TrainerConfig,
)
from dockrl.parallel.layout import LayoutError, ModelShape, ParallelLayout


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, or breaks a rule."""


@dataclass(frozen=True, kw_only=True)
class Config:
    """A whole run's configuration: one field per section of the YAML file."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    dock: DockConfig = field(default_factory=DockConfig)
    parallel: ParallelLayout = field(default_factory=ParallelLayout)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        check_rules(self)  # every Config is valid, also one made by dataclasses.replace

    def to_dict(self) -> dict[str, Any]:
        """The config as nested plain dicts (``dataclasses.asdict``)."""
        return dataclasses.asdict(self)


def _fail(where: str, value: Any, rule: str) -> ConfigError:
    """The error of ``where`` holding ``value``, which breaks ``rule``."""
    return ConfigError(f"{where}: got {value!r}; {rule}")


_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?)(:[0-9]{1,5})?")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PREFIX = re.compile(r"([A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*)?")


def s3_endpoint(value: str, secure: bool, where: str) -> tuple[str, bool]:
    """``(host:port, secure)`` of an S3 endpoint given as ``host:port`` or ``http(s)://host:port``.

    Raises:
        ConfigError: empty, another scheme, a path, or not a host with an optional port.
    """
    endpoint = value
    scheme, sep, rest = value.partition("://")
    if sep:
        if scheme not in ("http", "https"):
            raise _fail(where, value, "expected host:port or an http:// or https:// URL")
        endpoint, secure = rest.rstrip("/"), scheme == "https"
    if not _HOST_PORT.fullmatch(endpoint):
        raise _fail(where, value, "expected host:port of the S3 endpoint, e.g. minio.kubeflow:9000 (no path)")
    return endpoint, secure


def _check_dock(k: DockConfig) -> None:
    if k.warehouse == "directory" and not k.directory.strip():
        raise _fail("dock.directory", k.directory, "expected a directory for warehouse 'directory'")
    if k.warehouse != "s3":
        return
    if k.endpoint:
        s3_endpoint(k.endpoint, k.secure, "dock.endpoint")
    if not _BUCKET.fullmatch(k.bucket) or ".." in k.bucket:
        raise _fail("dock.bucket", k.bucket, "expected an S3 bucket name: 3-63 of a-z 0-9 . -, starting and ending alphanumeric")
    if not _PREFIX.fullmatch(k.prefix.strip("/")) or any(p in (".", "..") for p in k.prefix.split("/")):
        raise _fail("dock.prefix", k.prefix, "expected '/'-separated names of A-Za-z0-9 . _ - (no empty, '.' or '..' parts)")
    for where, name in (("dock.access_key_env", k.access_key_env), ("dock.secret_key_env", k.secret_key_env)):
        if not _ENV_NAME.fullmatch(name):
            raise _fail(where, name, "expected the name of an environment variable, e.g. AWS_ACCESS_KEY_ID")


def check_rules(c: Config) -> None:
    """Every cross-field rule and range of ``c``; the first broken one is raised.

    Raises:
        ConfigError: names the field, its value, the rule and the fix.
    """
    t, r, a, d = c.trainer, c.rollout, c.algorithm, c.data
    positive = {
        "rollout.max_response_length": r.max_response_length, "rollout.batch_size": r.batch_size,
        "trainer.iterations": t.iterations, "trainer.global_batch": t.global_batch, "trainer.mini_batch": t.mini_batch,
        "trainer.micro_batch": t.micro_batch, "trainer.ppo_epochs": t.ppo_epochs, "trainer.eval_batch_size": t.eval_batch_size,
        "data.max_prompt_length": d.max_prompt_length, "data.min_steps": d.min_steps, "data.max_number": d.max_number,
        "data.generate_train": d.generate_train, "data.generate_test": d.generate_test,
    }
    for where, v in positive.items():
        if v < 1:
            raise _fail(where, v, "expected a positive integer")
    for where, v, zero in (("data.eval_size", d.eval_size, "all test prompts"), ("run.num_threads", c.run.num_threads, "torch's default"),
                           ("trainer.keep_checkpoints", t.keep_checkpoints, "keep all")):
        if v < 0:
            raise _fail(where, v, f"expected an integer >= 0 (0: {zero})")
    if t.micro_batch_tokens < 0:
        raise _fail("trainer.micro_batch_tokens", t.micro_batch_tokens, "expected an integer >= 0 (0: off, micro_batch sequences)")
    if r.n < 1:
        raise _fail("rollout.n", r.n, "expected a positive integer")
    if r.n < 2 and a.adv_estimator in ("grpo", "dr_grpo", "rloo"):  # gae and reinforce_plus_plus need no group (verl's PPO)
        raise _fail("rollout.n", r.n, f"algorithm.adv_estimator={a.adv_estimator!r} compares the responses to one prompt: "
                    "it needs a group of at least 2 samples per prompt (or 'reinforce_plus_plus' or 'gae', which do not)")
    if r.n < 2 and a.filter_groups.enable:
        raise _fail("rollout.n", r.n, "algorithm.filter_groups.enable keeps the groups whose responses differ: it needs "
                    "a group of at least 2 samples per prompt")
    if not 0.0 < r.temperature:
        raise _fail("rollout.temperature", r.temperature, "expected > 0")
    if not 0.0 < r.top_p <= 1.0:
        raise _fail("rollout.top_p", r.top_p, "expected 0 < top_p <= 1")
    if d.max_steps < d.min_steps:
        raise _fail("data.max_steps", d.max_steps, f"expected >= data.min_steps={d.min_steps}")
    if t.global_batch % t.mini_batch:
        raise _fail("trainer.mini_batch", t.mini_batch, f"must divide trainer.global_batch={t.global_batch}")
    if (t.mini_batch * r.n) % t.micro_batch:
        raise _fail("trainer.micro_batch", t.micro_batch, f"must divide trainer.mini_batch × rollout.n = {t.mini_batch * r.n} sequences")
    # written as `not (rule)` so that NaN, which fails every comparison, is rejected too
    finite_positive: dict[str, float] = {
        "algorithm.reward_timeout_s": a.reward_timeout_s, "dock.timeout_s": c.dock.timeout_s,
        "dock.store_timeout_s": c.dock.store_timeout_s, "dock.lease_s": c.dock.lease_s,
        "run.driver_timeout_s": c.run.driver_timeout_s,
    }
    for where, x in finite_positive.items():
        if not (0 < x < math.inf):
            raise _fail(where, x, "expected a finite number > 0")
    non_negative: dict[str, float] = {  # trainer.lr=0: the standard check of drift between rollout and trainer log-probs
        "trainer.lr": t.lr, "trainer.weight_decay": t.weight_decay, "trainer.grad_clip": t.grad_clip, "trainer.save_every": t.save_every,
        "algorithm.kl_loss_coef": a.kl_loss_coef, "algorithm.kl_in_reward_coef": a.kl_in_reward_coef,
        "algorithm.adv_eps": a.adv_eps, "algorithm.clip_ratio_high": a.clip_ratio_high,
        "algorithm.entropy_coeff": a.entropy_coeff,
        "algorithm.correct_reward": a.correct_reward, "algorithm.format_reward": a.format_reward,
    }
    for where, x in non_negative.items():
        if not (0 <= x < math.inf):
            raise _fail(where, x, "expected a finite number >= 0")
    if not a.correct_reward > a.format_reward:
        raise _fail("algorithm.correct_reward", a.correct_reward, f"must exceed algorithm.format_reward={a.format_reward}")
    if not (0 <= a.max_bad_reward_frac <= 1):
        raise _fail("algorithm.max_bad_reward_frac", a.max_bad_reward_frac, "expected a fraction from 0 to 1")
    _check_algorithm(c)
    if not 0 <= c.dock.store_retries <= 10:
        raise _fail("dock.store_retries", c.dock.store_retries, "expected an integer from 0 to 10")
    if a.scorer and not _IMPORT_PATH.match(a.scorer):
        raise _fail("algorithm.scorer", a.scorer, "expected an import path 'package.module:Class', or '' for the built-in verifier")
    k = c.dock
    if k.shards < 1:
        raise _fail("dock.shards", k.shards, "expected a positive integer")
    if k.shards > t.global_batch:
        raise _fail("dock.shards", k.shards, f"expected at most trainer.global_batch={t.global_batch}: a shard holds whole prompt groups")
    _check_inflight(c)
    _check_partial(c)
    _check_dock(c.dock)
    _check_reward_model(c.reward_model)
    _check_dapo(c)
    _check_parallel(c)
    _check_engines(c)
    _check_critic(c)


def _check_inflight(c: Config) -> None:
    """``dock.max_inflight``: a positive integer; above 1 only where iterations overlap and resume exactly."""
    k = c.dock
    if not 1 <= k.max_inflight <= 8:
        raise _fail("dock.max_inflight", k.max_inflight, "expected an integer from 1 (on-policy) to 8")
    if k.max_inflight == 1:
        return
    refused = {
        "dock.mode": (k.mode, k.mode != "distributed", "in-process stages run one after another; use dock.mode=distributed"),
        "trainer.hybrid": (c.trainer.hybrid, c.trainer.hybrid, "one hybrid actor generates and trains in turn"),
        "algorithm.filter_groups.enable": (c.algorithm.filter_groups.enable, c.algorithm.filter_groups.enable,
                                           "dynamic sampling's rounds are not supported in flight yet"),
        "critic.enable": (c.critic.enable, c.critic.enable, "the critic's checkpoint is not held back for the snapshot yet"),
        "dock.warehouse": (k.warehouse, k.warehouse != "memory", "snapshots of several open iterations keep payload in the shards"),
    }
    for where, (value, bad, why) in refused.items():
        if bad:
            raise _fail("dock.max_inflight", k.max_inflight, f"not supported with {where}={value!r} ({why}); set dock.max_inflight=1")


def _check_partial(c: Config) -> None:
    """``rollout.partial_tokens``: 0 (off), or a budget below ``rollout.max_response_length`` with
    iterations in flight (the next pass, which continues the cut responses, opens only with them);
    ``rollout.partial_max_age`` within them."""
    r = c.rollout
    if r.partial_tokens == 0:
        if r.partial_max_age != 2:
            raise _fail("rollout.partial_max_age", r.partial_max_age, "only read with rollout.partial_tokens > 0 (partial rollout)")
        return
    if not 0 < r.partial_tokens < r.max_response_length:
        raise _fail("rollout.partial_tokens", r.partial_tokens,
                    f"expected 0 (off) or from 1 to rollout.max_response_length - 1 = {r.max_response_length - 1}")
    if c.dock.max_inflight < 2:
        raise _fail("rollout.partial_tokens", r.partial_tokens,
                    f"not supported with dock.max_inflight={c.dock.max_inflight} (a cut response continues in the rollout's "
                    "pass for the next iteration, which is open while this one trains only with iterations in flight); "
                    "set dock.mode=distributed dock.max_inflight=2, or rollout.partial_tokens=0")
    if not 2 <= r.partial_max_age <= c.dock.max_inflight:
        raise _fail("rollout.partial_max_age", r.partial_max_age,
                    f"expected from 2 to dock.max_inflight={c.dock.max_inflight} (a response cut in the pass for iteration k "
                    "ends by the pass for k + partial_max_age - 1, which opens only while k is in flight, and k's update waits "
                    "for it); raise dock.max_inflight or lower rollout.partial_max_age")


def _check_critic(c: Config) -> None:
    """The critic's own ranges, and that its batches split as the actor's do."""
    k, t, n = c.critic, c.trainer, c.rollout.n
    for where, x in {"critic.lr": k.lr, "critic.weight_decay": k.weight_decay, "critic.grad_clip": k.grad_clip}.items():
        if not (0 <= x < math.inf):
            raise _fail(where, x, "expected a finite number >= 0")
    if not (0 < k.cliprange_value < math.inf):
        raise _fail("critic.cliprange_value", k.cliprange_value, "expected a finite number > 0")
    if k.ppo_epochs < 1:
        raise _fail("critic.ppo_epochs", k.ppo_epochs, "expected a positive integer")
    for where, v in {"critic.mini_batch": k.mini_batch, "critic.micro_batch": k.micro_batch, "critic.warmup_iterations": k.warmup_iterations}.items():
        if v < 0:
            raise _fail(where, v, "expected an integer >= 0 (0: as the actor / no warm-up)")
    mini, micro = critic_batches(c)
    if t.global_batch % mini:
        raise _fail("critic.mini_batch", k.mini_batch, f"must divide trainer.global_batch={t.global_batch} (0: trainer.mini_batch)")
    if (mini * n) % micro:
        raise _fail("critic.micro_batch", k.micro_batch, f"must divide the critic's mini-batch × rollout.n = {mini * n} sequences")
    if k.enable and c.algorithm.adv_estimator != "gae":  # only GAE reads values; no other estimator puts returns to train on
        raise _fail("critic.enable", k.enable, f"the critic serves algorithm.adv_estimator='gae' only (got "
                    f"{c.algorithm.adv_estimator!r}, which does not use values): set algorithm.adv_estimator=gae, or critic.enable=false")
    if k.enable and k.warmup_iterations >= t.iterations:
        raise _fail("critic.warmup_iterations", k.warmup_iterations, f"must be below trainer.iterations={t.iterations}: "
                    "the actor trains only after the warm-up")
    if not k.enable:
        if k.model_path:
            raise _fail("critic.model_path", k.model_path, "is set but critic.enable is false: enable the critic or leave it empty")
        if k.warmup_iterations:
            raise _fail("critic.warmup_iterations", k.warmup_iterations, "warms up a critic, but critic.enable is false: "
                        "enable the critic or use 0")


def critic_batches(c: Config) -> tuple[int, int]:
    """The critic's mini-batch (prompts) and micro-batch (sequences): its own, or the actor's where 0."""
    return c.critic.mini_batch or c.trainer.mini_batch, c.critic.micro_batch or c.trainer.micro_batch


def _refuse_settings_when_off(where: str, section: Any, unset: Any, switch: str = "") -> None:
    """A section whose ``enable`` (``switch``, default ``where.enable``) is false ignores its other
    fields: any of them set (not its default, nested sections included) is refused naming it, as
    the critic's settings are."""
    switch = switch or f"{where}.enable"
    for f in dataclasses.fields(section):
        value, default = getattr(section, f.name), getattr(unset, f.name)
        if dataclasses.is_dataclass(value):
            _refuse_settings_when_off(f"{where}.{f.name}", value, default, switch)
        elif f.name != "enable" and value != default:
            raise _fail(f"{where}.{f.name}", value, f"is set but {switch} is false: enable it or leave the field unset")


def _check_reward_model(m: RewardModelConfig) -> None:
    if not m.enable:
        _refuse_settings_when_off("reward_model", m, type(m)())
        return
    if not m.model.path.strip():
        raise _fail("reward_model.model.path", m.model.path, "reward_model.enable=true needs the folder of a "
                    "sequence-classification reward model (or reward_model.enable=false)")
    if m.micro_batch_size < 1:
        raise _fail("reward_model.micro_batch_size", m.micro_batch_size, "expected a positive integer")
    for where, x in (("reward_model.model_weight", m.model_weight), ("reward_model.rule_weight", m.rule_weight)):
        if not math.isfinite(x):
            raise _fail(where, x, "expected a finite number")
    if m.model_weight == 0:
        raise _fail("reward_model.model_weight", m.model_weight, "the reward model would run for nothing: "
                    "give it a weight, or set reward_model.enable=false")


def _check_algorithm(c: Config) -> None:
    """The algorithm's ranges and the combinations it can run; each error names the fields and the fix."""
    a = c.algorithm
    if not (0 <= a.clip_ratio_low < 1):
        raise _fail("algorithm.clip_ratio_low", a.clip_ratio_low, "expected 0 <= clip_ratio_low < 1")
    if not (a.clip_ratio_c == 0 or 1 < a.clip_ratio_c < math.inf):
        raise _fail("algorithm.clip_ratio_c", a.clip_ratio_c, "expected 0 (no dual-clip) or a finite bound > 1 (verl: 3.0)")
    if not (a.tis_cap == 0 or 1 <= a.tis_cap < math.inf):  # a cap below 1 would scale every token's loss down
        raise _fail("algorithm.tis_cap", a.tis_cap, "expected 0 (no truncated importance sampling) or a finite cap >= 1 (verl: 2.0)")
    if a.ratio_level == "sequence" and a.loss_agg_mode != "seq-mean-token-mean":
        raise _fail("algorithm.loss_agg_mode", a.loss_agg_mode, "algorithm.ratio_level='sequence' (GSPO) averages each "
                    "sequence's token losses, then the sequences (arXiv 2507.18071, eq. 5): set "
                    "algorithm.loss_agg_mode='seq-mean-token-mean', or algorithm.ratio_level='token'")
    for where, x in {"algorithm.gamma": a.gamma, "algorithm.lam": a.lam}.items():
        if not (0 <= x <= 1):
            raise _fail(where, x, "expected a number from 0 to 1")
    if a.adv_estimator == "gae" and not c.critic.enable:  # PPO's values come from the critic stage
        raise _fail("algorithm.adv_estimator", a.adv_estimator, "GAE needs the critic's values: set critic.enable=true, "
                    "or use 'grpo', 'rloo', 'reinforce_plus_plus' or 'dr_grpo'")
    if a.adv_estimator == "dr_grpo" and a.loss_agg_mode != "seq-mean-token-sum-norm":
        raise _fail("algorithm.loss_agg_mode", a.loss_agg_mode, "algorithm.adv_estimator='dr_grpo' pairs its unnormalized "
                    "advantages with the constant normalizer: set algorithm.loss_agg_mode='seq-mean-token-sum-norm' (or use "
                    "adv_estimator='grpo' with norm_adv_by_std_in_grpo=false for the advantages alone)")
    if not a.norm_adv_by_std_in_grpo and a.adv_estimator != "grpo":
        raise _fail("algorithm.norm_adv_by_std_in_grpo", a.norm_adv_by_std_in_grpo,
                    f"applies to adv_estimator='grpo' only (got algorithm.adv_estimator={a.adv_estimator!r}): remove it")
    if a.kl_in_reward_coef > 0 and a.adv_estimator not in ("gae", "reinforce_plus_plus"):
        raise _fail("algorithm.kl_in_reward_coef", a.kl_in_reward_coef, f"algorithm.adv_estimator={a.adv_estimator!r} scores "
                    "whole responses and has no per-token rewards to subtract a KL penalty from: use algorithm.kl_loss_coef "
                    "(KL in the loss, as GRPO), or adv_estimator 'reinforce_plus_plus' or 'gae'")


def _check_dapo(c: Config) -> None:
    """DAPO's dynamic sampling and overlong shaping: their ranges and what they combine with."""
    a, r = c.algorithm, c.rollout
    f, o = a.filter_groups, a.overlong_buffer
    if f.max_num_gen_batches < 1:
        raise _fail("algorithm.filter_groups.max_num_gen_batches", f.max_num_gen_batches,
                    "expected a positive integer: the rollout rounds of an iteration need a bound (verl's 0, no limit, "
                    "could sample forever on data the model always or never solves)")
    if o.enable and not 1 <= o.len <= r.max_response_length:
        raise _fail("algorithm.overlong_buffer.len", o.len, f"expected 1 to rollout.max_response_length={r.max_response_length}: "
                    "the buffer lies before the maximum length")
    if not (0 <= o.penalty_factor < math.inf):
        raise _fail("algorithm.overlong_buffer.penalty_factor", o.penalty_factor, "expected a finite number >= 0")
    if not o.enable:
        _refuse_settings_when_off("algorithm.overlong_buffer", o, type(o)())
    if not f.enable:
        _refuse_settings_when_off("algorithm.filter_groups", f, type(f)())
        return
    if c.dock.shards != 1:
        raise _fail("dock.shards", c.dock.shards, "algorithm.filter_groups.enable needs dock.shards=1: a claim across "
                    "shards waits on one shard at a time, and the rows of a round released later may all lie on another, "
                    "which it would see only at its timeout (docs/algorithms.md)")
    if c.critic.enable:
        raise _fail("critic.enable", c.critic.enable, "algorithm.filter_groups.enable: the critic's values feed the "
                    "advantages, so it would score every sampled group before dynamic sampling chose the trained ones; "
                    "DAPO trains without a critic: turn one of them off")
    if a.kl_in_reward_coef > 0:
        raise _fail("algorithm.kl_in_reward_coef", a.kl_in_reward_coef, "algorithm.filter_groups.enable: the reference scores only "
                    "the groups dynamic sampling keeps, after the advantage stage chose them, so the advantages cannot "
                    "wait for its log-probs; use algorithm.kl_loss_coef (KL in the loss) or turn one of them off")


def _check_engines(c: Config) -> None:
    """What the megatron engine and the hybrid actor can run today; each rule says why.

    The hybrid actor runs TP × PP × DP ranks (one process each) with TP' = 1 on each.
    """
    t, p = c.trainer, c.parallel
    if t.engine == "hf":  # transformers trains one full copy in one process: a layout would be silently ignored
        for name in ("tp", "pp", "dp", "infer_tp"):
            if getattr(p, name) != 1:
                raise _fail(f"parallel.{name}", getattr(p, name), "trainer.engine='hf' trains one unsharded copy of the model "
                            "in one process and ignores the parallel layout: use 1, or trainer.engine='megatron' (with "
                            "trainer.hybrid=true and dock.mode='distributed' for several ranks)")
    if t.engine == "megatron":
        for name in ("tp", "pp", "dp"):
            if getattr(p, name) != 1 and not (t.hybrid and c.dock.mode == "distributed"):
                raise _fail(f"parallel.{name}", getattr(p, name), "a multi-rank megatron actor (one process per rank) runs "
                            "as the hybrid actor with dock.mode='distributed' only (trainer.hybrid=true); else use 1")
        if p.world_size > 1 and p.infer_tp != 1:
            raise _fail("parallel.infer_tp", p.infer_tp, "vLLM with TP' > 1 inside the actor's processes is not built: use 1 "
                        "(every actor rank then generates with a full copy of the weights, inference DP' = tp × pp × dp)")
        for name in ("global_batch", "mini_batch"):  # every data-parallel replica updates on its equal part
            if getattr(t, name) % p.dp:
                raise _fail(f"trainer.{name}", getattr(t, name), f"must be a multiple of parallel.dp={p.dp}: each "
                            "data-parallel replica of the actor takes an equal part of every mini-batch")
    if t.hybrid:
        if t.engine != "megatron":
            raise _fail("trainer.hybrid", t.hybrid, f"needs trainer.engine='megatron' (got {t.engine!r}): the allgather–swap "
                        "reshards megatron's TP/PP training shards into the rollout layout; the hf engine holds no shards")
        if c.rollout.engine == "hf":  # 'auto' resolves to vllm with the hybrid (dockrl.config.resolve)
            raise _fail("trainer.hybrid", t.hybrid, f"needs rollout.engine='vllm' or 'auto' (got {c.rollout.engine!r}): "
                        "the hybrid actor generates with vLLM on the devices it trains on")


def _check_parallel(c: Config) -> None:
    """The layout's model rules (``ParallelLayout.check_model``) when the model is a local directory and
    the layout shards it (tp, pp or infer_tp > 1); the rest were checked when the layout was built."""
    p = c.parallel
    if max(p.tp, p.pp, p.infer_tp) > 1 and (Path(c.model.path) / "config.json").is_file():
        try:
            p.check_model(ModelShape.from_model_dir(c.model.path))
        except LayoutError as e:
            raise ConfigError(str(e)) from e

