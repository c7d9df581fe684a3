"""``Config``, the whole run configuration, and the cross-field rules and ranges it checks whenever it is built.

``Config`` lives beside its rules, above the sections (``dockrl.config.sections``,
``dockrl.config.algorithm_sections``, ``dockrl.config.run_sections``): building one runs
``check_rules``, also by ``dataclasses.replace``; ``auto`` fields stay ``auto`` (``dockrl.config.resolve``).
The rules of one section group are beside its classes (``algorithm_sections``, ``run_sections``,
``env_sections``); those across sections, and the multi-turn rollout's (``rollout.max_turns``,
``rollout.max_total_tokens``, what runs with an environment; ``multi_turn``), are here.
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

from dockrl.config.algorithm_sections import AlgorithmConfig, RewardModelConfig, check_algorithm, check_dapo, check_reward_model
from dockrl.config.env_sections import BUILT_IN_ENVIRONMENTS, EnvConfig, check_env
from dockrl.config.errors import ConfigError, fail
from dockrl.config.estimators import ESTIMATORS, estimator_names
from dockrl.config.run_sections import DockConfig, RunConfig, check_dock, check_keep_rollouts, check_rollouts_uri, check_trackers
from dockrl.config.sections import CriticConfig, DataConfig, ModelConfig, RolloutConfig, TrainerConfig
from dockrl.parallel.layout import LayoutError, ModelShape, ParallelLayout


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
    env: EnvConfig = field(default_factory=EnvConfig)

    def __post_init__(self) -> None:
        check_rules(self)  # every Config is valid, also one made by dataclasses.replace

    def to_dict(self) -> dict[str, Any]:
        """The config as nested plain dicts (``dataclasses.asdict``)."""
        return dataclasses.asdict(self)


_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


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
            raise fail(where, v, "expected a positive integer")
    for where, v, zero in (("data.eval_size", d.eval_size, "all test prompts"), ("run.num_threads", c.run.num_threads, "torch's default"),
                           ("trainer.keep_checkpoints", t.keep_checkpoints, "keep all")):
        if v < 0:
            raise fail(where, v, f"expected an integer >= 0 (0: {zero})")
    if t.micro_batch_tokens < 0:
        raise fail("trainer.micro_batch_tokens", t.micro_batch_tokens, "expected an integer >= 0 (0: off, micro_batch sequences)")
    if r.n < 1:
        raise fail("rollout.n", r.n, "expected a positive integer")
    if r.n < 2 and ESTIMATORS[a.adv_estimator].grouped:  # gae and reinforce_plus_plus need no group (verl's PPO)
        raise fail("rollout.n", r.n, f"algorithm.adv_estimator={a.adv_estimator!r} compares the responses to one prompt: "
                   f"it needs a group of at least 2 samples per prompt (or {estimator_names(grouped=False)}, which do not)")
    if r.n < 2 and a.filter_groups.enable:
        raise fail("rollout.n", r.n, "algorithm.filter_groups.enable keeps the groups whose responses differ: it needs "
                    "a group of at least 2 samples per prompt")
    if not 0.0 < r.temperature:
        raise fail("rollout.temperature", r.temperature, "expected > 0")
    if not 0.0 < r.top_p <= 1.0:
        raise fail("rollout.top_p", r.top_p, "expected 0 < top_p <= 1")
    if d.max_steps < d.min_steps:
        raise fail("data.max_steps", d.max_steps, f"expected >= data.min_steps={d.min_steps}")
    if t.global_batch % t.mini_batch:
        raise fail("trainer.mini_batch", t.mini_batch, f"must divide trainer.global_batch={t.global_batch}")
    if (t.mini_batch * r.n) % t.micro_batch:
        raise fail("trainer.micro_batch", t.micro_batch, f"must divide trainer.mini_batch × rollout.n = {t.mini_batch * r.n} sequences")
    # written as `not (rule)` so that NaN, which fails every comparison, is rejected too
    finite_positive: dict[str, float] = {
        "algorithm.reward_timeout_s": a.reward_timeout_s, "dock.timeout_s": c.dock.timeout_s,
        "dock.store_timeout_s": c.dock.store_timeout_s, "dock.lease_s": c.dock.lease_s,
        "run.driver_timeout_s": c.run.driver_timeout_s,
    }
    for where, x in finite_positive.items():
        if not (0 < x < math.inf):
            raise fail(where, x, "expected a finite number > 0")
    non_negative: dict[str, float] = {  # trainer.lr=0: the standard check of drift between rollout and trainer log-probs
        "trainer.lr": t.lr, "trainer.weight_decay": t.weight_decay, "trainer.grad_clip": t.grad_clip, "trainer.save_every": t.save_every,
        "algorithm.kl_loss_coef": a.kl_loss_coef, "algorithm.kl_in_reward_coef": a.kl_in_reward_coef,
        "algorithm.adv_eps": a.adv_eps, "algorithm.clip_ratio_high": a.clip_ratio_high,
        "algorithm.entropy_coeff": a.entropy_coeff, "run.lock_wait_s": c.run.lock_wait_s,
        "algorithm.correct_reward": a.correct_reward, "algorithm.format_reward": a.format_reward,
    }
    for where, x in non_negative.items():
        if not (0 <= x < math.inf):
            raise fail(where, x, "expected a finite number >= 0")
    if not a.correct_reward > a.format_reward:
        raise fail("algorithm.correct_reward", a.correct_reward, f"must exceed algorithm.format_reward={a.format_reward}")
    if not (0 <= a.max_bad_reward_frac <= 1):
        raise fail("algorithm.max_bad_reward_frac", a.max_bad_reward_frac, "expected a fraction from 0 to 1")
    check_algorithm(c.algorithm, c.critic)
    if not 0 <= c.dock.store_retries <= 10:
        raise fail("dock.store_retries", c.dock.store_retries, "expected an integer from 0 to 10")
    if a.scorer and not _IMPORT_PATH.match(a.scorer):
        raise fail("algorithm.scorer", a.scorer, "expected an import path 'package.module:Class', or '' for the built-in verifier")
    k = c.dock
    if k.shards < 1:
        raise fail("dock.shards", k.shards, "expected a positive integer")
    if k.shards > t.global_batch:
        raise fail("dock.shards", k.shards, f"expected at most trainer.global_batch={t.global_batch}: a shard holds whole prompt groups")
    _check_inflight(c)
    _check_partial(c)
    check_dock(c.dock)
    check_keep_rollouts(c.dock.warehouse, c.run)
    check_rollouts_uri(c.run.rollouts_uri, c.dock)
    check_trackers(c.run)
    check_reward_model(c.reward_model)
    check_dapo(c.algorithm, c.rollout, c.dock, c.critic)
    _check_parallel(c)
    _check_engines(c)
    _check_lora(c)
    _check_critic(c)
    check_env(c.env)
    check_turns(c.rollout, c.env, c.trainer, c.algorithm)


def _check_inflight(c: Config) -> None:
    """``dock.max_inflight``: a positive integer; above 1 only where iterations overlap and resume exactly."""
    k = c.dock
    if not 1 <= k.max_inflight <= 8:
        raise fail("dock.max_inflight", k.max_inflight, "expected an integer from 1 (on-policy) to 8")
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
            raise fail("dock.max_inflight", k.max_inflight, f"not supported with {where}={value!r} ({why}); set dock.max_inflight=1")


def _check_partial(c: Config) -> None:
    """``rollout.partial_tokens``: 0 (off), or a budget below ``rollout.max_response_length`` with
    iterations in flight (the next pass, which continues the cut responses, opens only with them);
    ``rollout.partial_max_age`` within them."""
    r = c.rollout
    if r.partial_tokens == 0:
        if r.partial_max_age != 2:
            raise fail("rollout.partial_max_age", r.partial_max_age, "only read with rollout.partial_tokens > 0 (partial rollout)")
        return
    if not 0 < r.partial_tokens < r.max_response_length:
        raise fail("rollout.partial_tokens", r.partial_tokens,
                    f"expected 0 (off) or from 1 to rollout.max_response_length - 1 = {r.max_response_length - 1}")
    if c.dock.max_inflight < 2:
        raise fail("rollout.partial_tokens", r.partial_tokens,
                    f"not supported with dock.max_inflight={c.dock.max_inflight} (a cut response continues in the rollout's "
                    "pass for the next iteration, which is open while this one trains only with iterations in flight); "
                    "set dock.mode=distributed dock.max_inflight=2, or rollout.partial_tokens=0")
    if not 2 <= r.partial_max_age <= c.dock.max_inflight:
        raise fail("rollout.partial_max_age", r.partial_max_age,
                    f"expected from 2 to dock.max_inflight={c.dock.max_inflight} (a response cut in the pass for iteration k "
                    "ends by the pass for k + partial_max_age - 1, which opens only while k is in flight, and k's update waits "
                    "for it); raise dock.max_inflight or lower rollout.partial_max_age")


def _check_critic(c: Config) -> None:
    """The critic's own ranges, and that its batches split as the actor's do."""
    k, t, n = c.critic, c.trainer, c.rollout.n
    for where, x in {"critic.lr": k.lr, "critic.weight_decay": k.weight_decay, "critic.grad_clip": k.grad_clip}.items():
        if not (0 <= x < math.inf):
            raise fail(where, x, "expected a finite number >= 0")
    if not (0 < k.cliprange_value < math.inf):
        raise fail("critic.cliprange_value", k.cliprange_value, "expected a finite number > 0")
    if k.ppo_epochs < 1:
        raise fail("critic.ppo_epochs", k.ppo_epochs, "expected a positive integer")
    for where, v in {"critic.mini_batch": k.mini_batch, "critic.micro_batch": k.micro_batch, "critic.warmup_iterations": k.warmup_iterations}.items():
        if v < 0:
            raise fail(where, v, "expected an integer >= 0 (0: as the actor / no warm-up)")
    mini, micro = critic_batches(c)
    if t.global_batch % mini:
        raise fail("critic.mini_batch", k.mini_batch, f"must divide trainer.global_batch={t.global_batch} (0: trainer.mini_batch)")
    if (mini * n) % micro:
        raise fail("critic.micro_batch", k.micro_batch, f"must divide the critic's mini-batch × rollout.n = {mini * n} sequences")
    if k.enable and not ESTIMATORS[c.algorithm.adv_estimator].needs_values:  # no other estimator puts returns to train on
        raise fail("critic.enable", k.enable, f"the critic serves algorithm.adv_estimator={estimator_names(needs_values=True)} only (got "
                   f"{c.algorithm.adv_estimator!r}, which does not use values): set algorithm.adv_estimator=gae, or critic.enable=false")
    if k.enable and k.warmup_iterations >= t.iterations:
        raise fail("critic.warmup_iterations", k.warmup_iterations, f"must be below trainer.iterations={t.iterations}: "
                    "the actor trains only after the warm-up")
    if not k.enable:
        if k.model_path:
            raise fail("critic.model_path", k.model_path, "is set but critic.enable is false: enable the critic or leave it empty")
        if k.warmup_iterations:
            raise fail("critic.warmup_iterations", k.warmup_iterations, "warms up a critic, but critic.enable is false: "
                        "enable the critic or use 0")


def critic_batches(c: Config) -> tuple[int, int]:
    """The critic's mini-batch (prompts) and micro-batch (sequences): its own, or the actor's where 0."""
    return c.critic.mini_batch or c.trainer.mini_batch, c.critic.micro_batch or c.trainer.micro_batch


def _check_engines(c: Config) -> None:
    """What the megatron engine and the hybrid actor can run today; each rule says why.

    The hybrid actor runs TP × PP × DP ranks (one process each) with TP' = 1 on each.
    """
    t, p = c.trainer, c.parallel
    if t.engine == "hf":  # transformers trains one full copy in one process: a layout would be silently ignored
        for name in ("tp", "pp", "dp", "infer_tp"):
            if getattr(p, name) != 1:
                raise fail(f"parallel.{name}", getattr(p, name), "trainer.engine='hf' trains one unsharded copy of the model "
                            "in one process and ignores the parallel layout: use 1, or trainer.engine='megatron' (with "
                            "trainer.hybrid=true and dock.mode='distributed' for several ranks)")
    if t.engine == "megatron":
        for name in ("tp", "pp", "dp"):
            if getattr(p, name) != 1 and not (t.hybrid and c.dock.mode == "distributed"):
                raise fail(f"parallel.{name}", getattr(p, name), "a multi-rank megatron actor (one process per rank) runs "
                            "as the hybrid actor with dock.mode='distributed' only (trainer.hybrid=true); else use 1")
        if p.world_size > 1 and p.infer_tp != 1:
            raise fail("parallel.infer_tp", p.infer_tp, "vLLM with TP' > 1 inside the actor's processes is not built: use 1 "
                        "(every actor rank then generates with a full copy of the weights, inference DP' = tp × pp × dp)")
        for name in ("global_batch", "mini_batch"):  # every data-parallel replica updates on its equal part
            if getattr(t, name) % p.dp:
                raise fail(f"trainer.{name}", getattr(t, name), f"must be a multiple of parallel.dp={p.dp}: each "
                            "data-parallel replica of the actor takes an equal part of every mini-batch")
    if t.hybrid:
        if t.engine != "megatron":
            raise fail("trainer.hybrid", t.hybrid, f"needs trainer.engine='megatron' (got {t.engine!r}): the allgather–swap "
                        "reshards megatron's TP/PP training shards into the rollout layout; the hf engine holds no shards")
        if c.rollout.engine == "hf":  # 'auto' resolves to vllm with the hybrid (dockrl.config.resolve)
            raise fail("trainer.hybrid", t.hybrid, f"needs rollout.engine='vllm' or 'auto' (got {c.rollout.engine!r}): "
                        "the hybrid actor generates with vLLM on the devices it trains on")


VLLM_MAX_LORA_RANK = 512
"""The largest adapter rank vLLM 0.32 serves (its ``max_lora_rank`` choices; ``dockrl.engines.vllm.lora``)."""


def _check_lora(c: Config) -> None:
    """``trainer.lora``: its ranges, its fields only with ``rank`` > 0, and what LoRA runs with (the hf
    training engine; a vLLM rollout up to vLLM's largest adapter rank); each refusal says why."""
    lo, t = c.trainer.lora, c.trainer
    if lo.rank < 0:
        raise fail("trainer.lora.rank", lo.rank, "expected an integer >= 0 (0: off, full fine-tuning)")
    if not lo.enabled:
        for name in ("alpha", "target_modules", "sync"):
            if getattr(lo, name) != getattr(type(lo)(), name):
                raise fail(f"trainer.lora.{name}", getattr(lo, name), "is set but trainer.lora.rank is 0 (LoRA off): "
                            "set trainer.lora.rank > 0 or leave the field unset")
        return
    if not (0 < lo.alpha < math.inf):
        raise fail("trainer.lora.alpha", lo.alpha, "expected a finite number > 0 (the update is scaled by alpha / rank)")
    if not lo.target_modules or not all(m.strip() for m in lo.target_modules):
        raise fail("trainer.lora.target_modules", list(lo.target_modules), "expected one or more module names, e.g. "
                    "q_proj,v_proj (a linear module is targeted when its name ends with one)")
    refused = {  # the first that applies is named; each says what would be needed
        "trainer.hybrid": (t.hybrid, t.hybrid, "the allgather–swap moves full megatron shards, not adapters; use trainer.hybrid=false"),
        "trainer.engine": (t.engine, t.engine == "megatron", "megatron-core 0.16.1 has no LoRA adapters (NeMo adds them, "
                           "dockrl does not); use trainer.engine=hf"),
        "rollout.engine": (c.rollout.engine, c.rollout.engine == "vllm" and lo.sync == "adapter" and lo.rank > VLLM_MAX_LORA_RANK,
                           f"vLLM serves adapters up to rank {VLLM_MAX_LORA_RANK}; use a smaller rank, rollout.engine=hf or "
                           "trainer.lora.sync=merged"),
    }
    for where, (value, bad, why) in refused.items():
        if bad:
            raise fail("trainer.lora.rank", lo.rank, f"not supported with {where}={value!r}: {why}")


def _check_parallel(c: Config) -> None:
    """The layout's model rules (``ParallelLayout.check_model``) when the model is a local directory and
    the layout shards it (tp, pp or infer_tp > 1); the rest were checked when the layout was built."""
    p = c.parallel
    if max(p.tp, p.pp, p.infer_tp) > 1 and (Path(c.model.path) / "config.json").is_file():
        try:
            p.check_model(ModelShape.from_model_dir(c.model.path))
        except LayoutError as e:
            raise ConfigError(str(e)) from e


def multi_turn(env: EnvConfig) -> bool:
    """Whether the rollout runs the multi-turn loop (``dockrl.stages.multi_turn``): the run has an
    environment (``env.name``); its rows then carry ``loss_mask`` and the turn columns."""
    return bool(env.name)


def check_turns(r: RolloutConfig, env: EnvConfig, t: TrainerConfig, a: AlgorithmConfig) -> None:
    """``rollout.max_turns`` and ``rollout.max_total_tokens``: their ranges, read only with an
    environment, and the features a multi-turn rollout does not run with.

    Raises:
        ConfigError: names the field, its value, the rule and the fix.
    """
    if r.max_turns < 1:
        raise fail("rollout.max_turns", r.max_turns, "expected a positive integer (1: one model turn)")
    if r.max_total_tokens < 0:
        raise fail("rollout.max_total_tokens", r.max_total_tokens, "expected an integer >= 0 (0: no limit but the turns')")
    if not (0 <= env.tool_call_reward < math.inf):
        raise fail("env.tool_call_reward", env.tool_call_reward, "expected a finite number >= 0")
    if env.tool_call_reward and env.name not in BUILT_IN_ENVIRONMENTS:
        raise fail("env.tool_call_reward", env.tool_call_reward, f"only the built-in environments "
                    f"({', '.join(BUILT_IN_ENVIRONMENTS)}) give it; env.name={env.name!r} "
                    + ("is none" if not env.name else "gives its own rewards (Step.reward)") + ": set env.tool_call_reward=0")
    if env.tool_call_reward * r.max_turns >= a.correct_reward:
        raise fail("env.tool_call_reward", env.tool_call_reward, f"the most a trajectory can earn from tool calls "
                    f"(× rollout.max_turns={r.max_turns}) must stay below algorithm.correct_reward={a.correct_reward:g}, "
                    "so a right answer outweighs any number of calls")
    if not multi_turn(env):
        if r.max_turns != 1:
            raise fail("rollout.max_turns", r.max_turns, "a turn after the first follows an environment's observation, and "
                        "env.name is empty (no environment): set env.name, or rollout.max_turns=1")
        if r.max_total_tokens:
            raise fail("rollout.max_total_tokens", r.max_total_tokens, "only read by a multi-turn rollout (env.name set): "
                        "set env.name, or leave it 0")
        return
    refused = {
        "rollout.partial_tokens": (r.partial_tokens, r.partial_tokens > 0, "a trajectory is generated in one pass", 0),
        "trainer.hybrid": (t.hybrid, t.hybrid, "the hybrid actor's rollout generates single turns", False),
        "algorithm.overlong_buffer.enable": (a.overlong_buffer.enable, a.overlong_buffer.enable,
                                             "a trajectory's length counts observations, not rollout.max_response_length's tokens",
                                             False),
    }
    for where, (value, bad, why, off) in refused.items():
        if bad:
            raise fail(where, value, f"not supported with an environment (env.name={env.name!r}: a multi-turn rollout; {why}); "
                        f"set {where}={str(off).lower()}, or env.name=''")
