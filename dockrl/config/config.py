"""``Config``, the whole run configuration, and the rules across its sections, checked whenever it is built.

``Config`` lives beside its rules, above the sections (``dockrl.config.sections``,
``dockrl.config.algorithm_sections``, ``dockrl.config.run_sections``, ``dockrl.config.env_sections``):
building one runs ``check_rules``, also by ``dataclasses.replace``; ``auto`` fields stay ``auto``
(``dockrl.config.resolve``). Each section's own rules are beside its class; ``check_rules`` runs
them, then those across sections, here (the multi-turn rollout's among them: what runs with an
environment; ``multi_turn``).
Each error names the field, the value, the rule and the fix (docs/bad-inputs.md). The rules read
nothing of the machine but a local model directory's ``config.json`` (``_check_parallel``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dockrl.config.algorithm_sections import (
    AlgorithmConfig,
    RewardModelConfig,
    TeacherConfig,
    check_algorithm,
    check_dapo,
    check_reward_model,
    check_teacher,
)
from dockrl.config.env_sections import BUILT_IN_ENVIRONMENTS, EnvConfig, check_env
from dockrl.config.errors import ConfigError, fail
from dockrl.config.estimators import ESTIMATORS, estimator_names
from dockrl.config.run_sections import DockConfig, RunConfig, check_dock, check_keep_rollouts, check_rollouts_uri, check_run
from dockrl.config.sections import (
    CriticConfig,
    DataConfig,
    ModelConfig,
    RolloutConfig,
    SFTConfig,
    TrainerConfig,
    check_critic,
    check_data,
    check_rollout,
    check_sft,
    check_trainer,
)
from dockrl.parallel.layout import LayoutError, ModelShape, ParallelLayout


@dataclass(frozen=True, kw_only=True)
class Config:
    """A whole run's configuration: one field per section of the YAML file."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    dock: DockConfig = field(default_factory=DockConfig)
    parallel: ParallelLayout = field(default_factory=ParallelLayout)
    run: RunConfig = field(default_factory=RunConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)

    def __post_init__(self) -> None:
        check_rules(self)  # every Config is valid, also one made by dataclasses.replace

    def to_dict(self) -> dict[str, Any]:
        """The config as nested plain dicts (``dataclasses.asdict``)."""
        return dataclasses.asdict(self)


def check_rules(c: Config) -> None:
    """Every rule and range of ``c``: each section's own (beside its class), then those across
    sections; the first broken one is raised.

    Raises:
        ConfigError: names the field, its value, the rule and the fix.
    """
    check_data(c.data)
    check_rollout(c.rollout)
    check_trainer(c.trainer)
    check_critic(c.critic)
    check_algorithm(c.algorithm, c.critic)
    check_dock(c.dock)
    check_run(c.run)
    check_reward_model(c.reward_model)
    check_teacher(c.teacher, c.algorithm)
    check_env(c.env)
    check_sft(c.sft)
    t, r, a, k = c.trainer, c.rollout, c.algorithm, c.dock
    if r.n < 2 and ESTIMATORS[a.adv_estimator].grouped:  # gae and reinforce_plus_plus need no group (verl's PPO)
        raise fail("rollout.n", r.n, f"algorithm.adv_estimator={a.adv_estimator!r} compares the responses to one prompt: "
                   f"it needs a group of at least 2 samples per prompt (or {estimator_names(grouped=False)}, which do not)")
    if r.n < 2 and a.filter_groups.enable:
        raise fail("rollout.n", r.n, "algorithm.filter_groups.enable keeps the groups whose responses differ: it needs "
                    "a group of at least 2 samples per prompt")
    if (t.mini_batch * r.n) % t.micro_batch:
        raise fail("trainer.micro_batch", t.micro_batch, f"must divide trainer.mini_batch × rollout.n = {t.mini_batch * r.n} sequences")
    if k.shards > t.global_batch:
        raise fail("dock.shards", k.shards, f"expected at most trainer.global_batch={t.global_batch}: a shard holds whole prompt groups")
    _check_inflight(c)
    _check_partial(c)
    check_keep_rollouts(c.dock.warehouse, c.run)
    check_rollouts_uri(c.run.rollouts_uri, c.dock)
    check_dapo(c.algorithm, c.rollout, c.dock, c.critic)
    _check_parallel(c)
    _check_engines(c)
    _check_lora(c)
    _check_critic(c)
    _check_judge(c)
    check_turns(c.rollout, c.env, c.trainer, c.algorithm)


def _check_judge(c: Config) -> None:
    """A vLLM judge has a process of its own: vLLM runs one engine per process, and in-process the judge would share
    the rollout's (``dockrl.engines.vllm.engine``)."""
    m = c.reward_model
    if m.enable and m.kind == "generative" and m.generative.engine == "vllm" and c.dock.mode == "inprocess" \
            and c.rollout.engine != "hf":
        raise fail("reward_model.generative.engine", m.generative.engine, f"with dock.mode='inprocess' the judge shares the "
                   f"rollout's process, and rollout.engine={c.rollout.engine!r} may be vLLM too (one vLLM engine per process): "
                   "set dock.mode=distributed, rollout.engine=hf, or reward_model.generative.engine=hf")


def _check_inflight(c: Config) -> None:
    """``dock.max_inflight`` above 1 only where iterations overlap and resume exactly."""
    k = c.dock
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
    """The critic's batches split as the actor's do, it serves an estimator that uses values, and it warms
    up for fewer iterations than the run has (its own ranges: ``check_critic``)."""
    k, t, n = c.critic, c.trainer, c.rollout.n
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
    """What LoRA runs with (the hf training engine; a vLLM rollout up to vLLM's largest adapter rank); each
    refusal says why (its own ranges: ``check_lora``)."""
    lo, t = c.trainer.lora, c.trainer
    if not lo.enabled:
        return
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
    environment (``env.name``) or an agent behind the gateway (``env.agent.command``, ``dockrl.stages.gateway``); its
    rows then carry ``loss_mask`` and the turn columns."""
    return bool(env.name or env.agent.command)


def check_turns(r: RolloutConfig, env: EnvConfig, t: TrainerConfig, a: AlgorithmConfig) -> None:
    """``rollout.max_turns`` and ``rollout.max_total_tokens`` read only with an environment,
    ``env.tool_call_reward`` below the answer's, and the features a multi-turn rollout does not run with.

    Raises:
        ConfigError: names the field, its value, the rule and the fix.
    """
    if env.tool_call_reward and env.name not in BUILT_IN_ENVIRONMENTS:
        raise fail("env.tool_call_reward", env.tool_call_reward, f"only the built-in environments "
                    f"({', '.join(BUILT_IN_ENVIRONMENTS)}) give it; env.name={env.name!r} "
                    + ("is none" if not env.name else "gives its own rewards (Step.reward)") + ": set env.tool_call_reward=0")
    paid_turns = 1 if env.tool_call_reward_once else r.max_turns
    if env.tool_call_reward * paid_turns >= a.correct_reward:
        times = "once: env.tool_call_reward_once" if env.tool_call_reward_once else f"× rollout.max_turns={r.max_turns}"
        raise fail("env.tool_call_reward", env.tool_call_reward, f"the most a trajectory can earn from tool calls "
                    f"({times}) must stay below algorithm.correct_reward={a.correct_reward:g}, "
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
    source = f"env.name={env.name!r}" if env.name else f"env.agent.command={env.agent.command!r}"
    for where, (value, bad, why, off) in refused.items():
        if bad:
            raise fail(where, value, f"not supported with an environment or an agent ({source}: a multi-turn rollout; {why}); "
                        f"set {where}={str(off).lower()}, or {source.split('=')[0]}=''")
