"""Build the engines a run's config asks for: ``rollout.engine`` and ``trainer.engine``.

Shared by the in-process stages (``dockrl/driver.py``), the stage processes
(``dockrl/stages/``) and the hybrid actor (``dockrl/stages/hybrid.py``). vLLM and
megatron-core are imported only when chosen. Every engine is placed on this process's device,
which its entry point chose once with the process's ranks (``process_ranks``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Iterable

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from dockrl.config import Config, LoraConfig
from dockrl.engines.hf.rollout import HFRolloutEngine
from dockrl.engines.hf.train import HFTrainEngine
from dockrl.engines.rollout_engine import RolloutEngine
from dockrl.engines.train_engine import ScoringEngine, TrainEngine
from dockrl.engines.vllm.engine import VLLMRolloutEngine
from dockrl.parallel.ranks import ProcessRanks, join_groups

logger = logging.getLogger(__name__)


def process_ranks(cfg: Config, *, trains: bool, replica: int = 0, replicas: int = 1, store_address: str = "",
                  local_rank: int | None = None) -> ProcessRanks:
    """This process's ranks, made once by its entry point and passed to every engine and worker.

    Args:
        trains: the process holds the actor's training engine.
        replica, replicas: this process's index among the members of its launcher group, and their
            number (a megatron actor's members are the layout's ranks, one process each).
        store_address: ``host:port`` of the launcher's ``TCPStore`` where several actor ranks meet.
        local_rank: this rank's device index on its node, where a launcher says (``dockrl node``);
            None derives it from the rank (``devices.local_rank_of``).

    A process that trains with ``trainer.engine=megatron`` joins its process groups as rank
    ``replica`` (``join_groups``); any other process is alone on its device.

    Raises:
        RuntimeError: no device of ``parallel.device`` is visible.
        ValueError: the launcher started another number of actor members than ``parallel.tp × pp × dp``,
            or no store for several ranks.
    """
    if trains and cfg.trainer.engine == "megatron":
        world = cfg.parallel.world_size
        if replicas != world:
            raise ValueError(f"megatron actor: {replicas} members started, the layout parallel.tp × pp × dp has {world} ranks")
        return join_groups(cfg.parallel, rank=replica, store_address=store_address, timeout_s=cfg.dock.timeout_s, megatron=True,
                           local_rank=local_rank)
    return ProcessRanks.alone(cfg.parallel, replica=replica, replicas=replicas)


def build_rollout_engine(cfg: Config, model_path: Path, ranks: ProcessRanks, *, actor: TrainEngine | None = None) -> RolloutEngine:
    """``HFRolloutEngine`` or ``VLLMRolloutEngine`` (``rollout.engine``, which ``resolve_auto`` resolved
    from ``auto`` where the run set up) with ``rollout.dtype`` weights, on this process's device (``ranks.device``).

    ``actor``: the actor's engine when it lives in this process (the in-process stages). Where the
    rollout can generate with the actor's module itself (``shares_actor_module``) the engine is
    built over it (``HFRolloutEngine.sharing``): no second copy of the weights, none to sync.

    Several rollout engines generating side by side (the hybrid actor's ranks) seed vLLM's
    sampler with ``trainer.seed + ranks.rank``, so that they draw apart.

    With LoRA (``trainer.lora``) and ``adapter_sync`` the engine holds the base weights of
    ``model_path`` and the adapters (HF: ``hf.lora.add_rollout_adapters``; vLLM: ``vllm.lora``); a
    resumed run (``run.resume``) loads the checkpoint's adapter, or with ``sync=merged`` starts from
    the checkpoint's merged weights.

    Raises:
        ImportError: ``rollout.engine=vllm`` without vLLM installed (the message says how to install it).
        RuntimeError: no device of ``parallel.device`` is visible.
    """
    assert cfg.rollout.engine != "auto", "rollout.engine is resolved by the run before any engine is built (dockrl.config.resolve_auto)"
    if cfg.trainer.lora.enabled and cfg.run.resume and not adapter_sync(cfg):
        model_path = Path(cfg.run.resume)  # a merged-weights rollout starts from the checkpoint's merged weights
    engine = _rollout_engine(cfg, model_path, ranks, actor)
    if adapter_sync(cfg) and cfg.run.resume and not (actor is not None and shares_actor_module(cfg, actor)):
        from dockrl.engines.hf.lora import checkpoint_adapter  # lazy: peft loads only for a LoRA run

        engine.load_weights(checkpoint_adapter(Path(cfg.run.resume)))  # the resumed policy: base weights + its adapter
    return engine


KV_BLOCK_TOKENS = 128
"""Tokens per KV-cache block that ``kv_cache_size`` rounds each sequence up to: vLLM's CPU block
size (``CpuPlatform``; 16 on CUDA, so the cache there is a little larger than needed)."""


def kv_cache_size(cfg: Config, model_path: Path) -> tuple[float, int | None]:
    """``(GiB, max_model_len)`` of the vLLM engine's KV cache, sized to the run instead of a fixed space.

    Single-turn: ``rollout.batch_size`` sequences of ``data.max_prompt_length +
    rollout.max_response_length`` tokens (each rounded up to ``KV_BLOCK_TOKENS``), at ``2 × layers ×
    kv_heads × head_dim × bytes(rollout.dtype)`` bytes per token (keys and values of every layer,
    from the model's ``config.json``); ``max_model_len`` is that sequence length. vLLM schedules a
    larger batch (the evaluation's ``trainer.eval_batch_size``) as the cache frees. Multi-turn
    (``rollout.max_turns`` > 1; the observations have no cap): 1 GiB and the model's own length.
    SmolLM2-135M, 32 × (256 + 128) tokens in fp32: 0.53 GiB.
    """
    r = cfg.rollout
    if r.max_turns > 1:
        return 1.0, None
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    config = getattr(config, "text_config", config)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_token = 2 * config.num_hidden_layers * (getattr(config, "num_key_value_heads", None) or heads) * head_dim
    per_token *= 4 if r.dtype == "float32" else 2
    length = cfg.data.max_prompt_length + r.max_response_length
    blocks = -(-length // KV_BLOCK_TOKENS)
    return r.batch_size * blocks * KV_BLOCK_TOKENS * per_token / 2**30, length


def hf_rollout_engine(cfg: Config, model_path: Path, device: torch.device, *, seed: int, lora: LoraConfig | None,
                      sized: bool) -> RolloutEngine:
    """``HFRolloutEngine`` with ``rollout.dtype`` weights (``seed`` and ``sized`` are vLLM's: HF samples with torch's generator)."""
    return HFRolloutEngine(model_path, dtype=cfg.rollout.dtype, trust_remote_code=cfg.model.trust_remote_code, device=device, lora=lora)


def vllm_rollout_engine(cfg: Config, model_path: Path, device: torch.device, *, seed: int, lora: LoraConfig | None,
                        sized: bool) -> RolloutEngine:
    """``VLLMRolloutEngine`` with ``rollout.dtype`` weights, its sampler seeded with ``seed``; ``sized``: its KV cache
    sized to the run (``kv_cache_size``), else vLLM's default."""
    sizes = dict(zip(("kv_cache_gib", "max_model_len"), kv_cache_size(cfg, model_path))) if sized else {}
    return VLLMRolloutEngine(model_path, dtype=cfg.rollout.dtype, trust_remote_code=cfg.model.trust_remote_code, seed=seed,
                             device=device, lora=lora, **sizes)  # type: ignore[arg-type]  # the sizes' own types


ROLLOUT_ENGINES: dict[str, Callable[..., RolloutEngine]] = {"hf": hf_rollout_engine, "vllm": vllm_rollout_engine}
"""Every rollout engine by its ``rollout.engine`` name (``auto`` resolves to one of them): the one factory of the
rollout stage, the hybrid actor and the evaluate step. ``tests/engines/test_factory.py`` keeps the config's
``Literal`` equal to these names and ``auto``."""


def _rollout_engine(cfg: Config, model_path: Path, ranks: ProcessRanks, actor: TrainEngine | None) -> RolloutEngine:
    if cfg.rollout.engine == "hf" and actor is not None and shares_actor_module(cfg, actor):
        assert isinstance(actor, HFTrainEngine), "shares_actor_module: an HFTrainEngine"
        return HFRolloutEngine.sharing(actor.model, actor.tokenizer, model_path)
    return ROLLOUT_ENGINES[cfg.rollout.engine](cfg, model_path, ranks.device, seed=cfg.trainer.seed + ranks.rank,
                                               lora=cfg.trainer.lora if adapter_sync(cfg) else None, sized=True)


def adapter_sync(cfg: Config) -> bool:
    """Whether each weight sync sends the LoRA adapter alone (``trainer.lora.rank`` > 0 with
    ``trainer.lora.sync=adapter``): the rollout engine then holds the base weights and the adapters."""
    return cfg.trainer.lora.enabled and cfg.trainer.lora.sync == "adapter"


def weights_to_send(cfg: Config, actor: TrainEngine) -> tuple[Iterable[tuple[str, torch.Tensor]], torch.dtype]:
    """What one weight sync sends the rollout engine, and in which dtype: the adapter tensors in fp32
    (``adapter_sync``: a few MB, and the rollout computes B·A in fp32 as the actor does), else the
    current policy's weights (``named_weights``: merged with a LoRA actor) in ``rollout.dtype``."""
    if adapter_sync(cfg):
        assert isinstance(actor, HFTrainEngine), "trainer.lora: an HFTrainEngine actor (the config refuses megatron)"
        return actor.adapter_weights(), torch.float32
    return actor.named_weights(), getattr(torch, cfg.rollout.dtype)


def shares_actor_module(cfg: Config, actor: TrainEngine) -> bool:
    """Whether the rollout generates with the actor's module itself instead of a copy: an HF rollout
    (``rollout.engine=hf``) beside an ``HFTrainEngine`` actor in the same process, whose fp32
    weights are what ``rollout.dtype=float32`` asks for (the actor's module is on the process's
    device, where the rollout would be). A ``bfloat16`` rollout keeps its own bf16 copy (faster
    sampling where bf16 is native); vLLM and megatron hold weights in their own layouts.
    """
    return cfg.rollout.engine == "hf" and cfg.rollout.dtype == "float32" and isinstance(actor, HFTrainEngine) \
        and next(actor.model.parameters()).dtype == torch.float32


def build_reference_engine(cfg: Config, model_path: Path, ranks: ProcessRanks, *, actor: object = None) -> ScoringEngine:
    """The frozen reference policy on this process's device: a LoRA actor's own module with its
    adapters disabled when the actor lives in this process (``actor``, an ``HFTrainEngine`` with
    ``trainer.lora.rank`` > 0: ``HFTrainEngine.reference``, no second copy of the weights), else
    an ``HFTrainEngine`` (``trainable=False``) over ``model_path``."""
    if isinstance(actor, HFTrainEngine) and actor.peft is not None:
        return actor.reference()
    return HFTrainEngine(model_path, trainable=False, autocast_bf16=cfg.trainer.autocast_bf16 is True,
                         trust_remote_code=cfg.model.trust_remote_code, device=ranks.device)


def build_teacher_engine(cfg: Config, teacher_path: Path, ranks: ProcessRanks) -> ScoringEngine:
    """The frozen distillation teacher (``teacher.model``) on this process's device: an ``HFTrainEngine``
    (``trainable=False``, fp32 weights; ``trainer.autocast_bf16`` as the reference)."""
    return HFTrainEngine(teacher_path, trainable=False, autocast_bf16=cfg.trainer.autocast_bf16 is True,
                         trust_remote_code=cfg.teacher.model.trust_remote_code, device=ranks.device)


def build_train_engine(cfg: Config, model_path: Path, ranks: ProcessRanks) -> TrainEngine:
    """The trainable actor engine of ``trainer.engine``, on this process's device.

    ``megatron``: a ``MegatronTrainEngine`` sharded by ``ranks`` (``process_ranks(trains=True)``:
    ``parallel.tp``/``pp``/``dp`` and megatron's groups); fp32 without autocast, so
    ``trainer.autocast_bf16`` is ignored (one warning).

    Raises:
        ValueError: ``megatron`` with ranks that joined no megatron groups.
    """
    t = cfg.trainer
    if t.engine == "megatron":
        from dockrl.engines.megatron.engine import MegatronTrainEngine  # lazy: it imports megatron-core, an optional extra

        if t.autocast_bf16 is True:
            logger.warning("trainer.autocast_bf16=true is ignored by trainer.engine=megatron: it trains in fp32")
        if t.gradient_checkpointing:
            logger.warning("trainer.gradient_checkpointing=true is ignored by trainer.engine=megatron: it keeps every activation")
        return MegatronTrainEngine(
            model_path, trainable=True, ranks=ranks, lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip, seed=t.seed,
            trust_remote_code=cfg.model.trust_remote_code,
        )
    engine = HFTrainEngine(
        model_path, trainable=True, lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip,
        autocast_bf16=t.autocast_bf16 is True, trust_remote_code=cfg.model.trust_remote_code, device=ranks.device,
        lora=t.lora, gradient_checkpointing=t.gradient_checkpointing,
    )
    if t.lora.enabled and cfg.run.resume:
        from dockrl.engines.hf.lora import load_checkpoint_adapter  # lazy: peft loads only for a LoRA actor

        assert engine.peft is not None
        load_checkpoint_adapter(engine.peft, Path(cfg.run.resume))  # over the base weights of model.path (weights_path)
    if t.lora.enabled and t.lora.sync == "merged":
        from dockrl.engines.hf.lora import adapter_numel  # lazy: peft loads only for a LoRA actor

        adapters, total = adapter_numel(engine.model), sum(p.numel() for p in engine.model.parameters())
        logger.warning("trainer.lora.sync=merged: each weight sync sends all %d merged weights instead of the %d adapter "
                       "parameters (%.0f× the bytes); use it only where the rollout engine cannot load adapters, "
                       "else set trainer.lora.sync=adapter", total - adapters, adapters, (total - adapters) / max(adapters, 1))
    return engine


def receive_params(engine: RolloutEngine, cfg: Config, model_path: Path) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every parameter the actor sends over the weight channel, in its order,
    in ``rollout.dtype``: the receiving side of ``WeightChannel.receive``.

    An HF engine receives into its own parameters; a vLLM engine, which holds its weights in its
    own (fused, repacked) layout, gets meta tensors of the HF model's parameters that give only
    names, shapes and dtype (the received buckets are loaded through ``load_weights``). With
    ``adapter_sync`` only the adapter's tensors, in fp32 (``weights_to_send``).
    """
    model = getattr(engine, "model", None)
    if model is not None:
        return [(n, p) for n, p in model.named_parameters() if not adapter_sync(cfg) or ".lora_" in n]
    if adapter_sync(cfg):
        from dockrl.engines.hf.lora import adapter_shapes  # lazy: peft loads only for a LoRA run

        return [(n, torch.empty(shape, dtype=torch.float32, device="meta"))
                for n, shape in adapter_shapes(model_path, cfg.trainer.lora, cfg.model.trust_remote_code)]
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.model.trust_remote_code)
    dtype = getattr(torch, cfg.rollout.dtype)
    return [(n, torch.empty(p.shape, dtype=dtype, device="meta")) for n, p in meta.named_parameters()]
