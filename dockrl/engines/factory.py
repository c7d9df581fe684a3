"""Build the engines a run's config asks for: ``rollout.engine`` and ``trainer.engine``.

Shared by the in-process stages (``dockrl/driver.py``), the stage processes
(``dockrl/workers/``) and the hybrid actor (``dockrl/workers/hybrid.py``). vLLM and
megatron-core are imported only when chosen. Every engine is placed on this process's device
(``engine_device``: ``parallel.device`` and the process's local rank).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from dockrl.config import Config
from dockrl.engines.protocols import RolloutEngine
from dockrl.engines.train_protocol import TrainEngine
from dockrl.resharding import device as devices

logger = logging.getLogger(__name__)


def engine_device(cfg: Config, local_rank: int = 0) -> torch.device:
    """This process's device: ``parallel.device`` (resolved from ``auto`` at load) and its local rank
    (``cuda:i``/``npu:i``; one device per rank process), made current.

    Raises:
        RuntimeError: ``parallel.device`` names an accelerator this process cannot see (the
            message names the field and the fix).
    """
    return devices.process_device(cfg.parallel.device, local_rank)


def build_rollout_engine(cfg: Config, model_path: Path, *, rank: int = 0, local_rank: int = 0) -> RolloutEngine:
    """``HFRolloutEngine`` or ``VLLMRolloutEngine`` (``rollout.engine``) with ``rollout.dtype`` weights,
    on this process's device (``engine_device``).

    ``rank``: of a rollout engine among several generating side by side (the hybrid actor's
    ranks); vLLM's sampler is seeded with ``trainer.seed + rank`` so that they draw apart.

    Raises:
        ImportError: ``rollout.engine=vllm`` without vLLM installed (the message says how to install it).
        RuntimeError: no device of ``parallel.device`` is visible.
    """
    r = cfg.rollout
    device = engine_device(cfg, local_rank)
    if r.engine == "vllm":
        from dockrl.engines.vllm import VLLMRolloutEngine

        return VLLMRolloutEngine(model_path, dtype=r.dtype, trust_remote_code=cfg.model.trust_remote_code, seed=cfg.trainer.seed + rank,
                                 device=device)
    from dockrl.engines.hf import HFRolloutEngine

    return HFRolloutEngine(model_path, dtype=r.dtype, trust_remote_code=cfg.model.trust_remote_code, device=device)


def build_reference_engine(cfg: Config, model_path: Path, *, local_rank: int = 0) -> TrainEngine:
    """The frozen reference policy (``HFTrainEngine``, ``trainable=False``) on this process's device."""
    from dockrl.engines.hf import HFTrainEngine

    return HFTrainEngine(model_path, trainable=False, autocast_bf16=cfg.trainer.autocast_bf16,
                         trust_remote_code=cfg.model.trust_remote_code, device=engine_device(cfg, local_rank))


def init_single_process_group(cfg: Config, local_rank: int = 0) -> torch.device:
    """The default group of this process alone (``devices.init_single_process_group``: gloo, nccl or
    hccl by ``parallel.device``), unless one exists; returns this process's device."""
    return devices.init_single_process_group(cfg.parallel.device, cfg.dock.timeout_s, local_rank)


def build_train_engine(cfg: Config, model_path: Path, *, local_rank: int = 0) -> TrainEngine:
    """The trainable actor engine of ``trainer.engine``.

    ``megatron``: a ``MegatronTrainEngine`` with ``parallel.tp``/``pp`` over this process's
    default process group (a group of one is created when none exists); fp32 without autocast,
    so ``trainer.autocast_bf16`` is ignored (one warning). Both on this process's device.

    Raises:
        RuntimeError: no device of ``parallel.device`` is visible.
    """
    t = cfg.trainer
    if t.engine == "megatron":
        from dockrl.engines.megatron import MegatronTrainEngine

        if t.autocast_bf16:
            logger.warning("trainer.autocast_bf16=true is ignored by trainer.engine=megatron: it trains in fp32")
        device = init_single_process_group(cfg, local_rank)
        return MegatronTrainEngine(
            model_path, trainable=True, tp=cfg.parallel.tp, pp=cfg.parallel.pp, lr=t.lr, weight_decay=t.weight_decay,
            grad_clip=t.grad_clip, seed=t.seed, trust_remote_code=cfg.model.trust_remote_code, device=device,
        )
    from dockrl.engines.hf import HFTrainEngine

    return HFTrainEngine(
        model_path, trainable=True, lr=t.lr, weight_decay=t.weight_decay, grad_clip=t.grad_clip,
        autocast_bf16=t.autocast_bf16, trust_remote_code=cfg.model.trust_remote_code, device=engine_device(cfg, local_rank),
    )


def receive_params(engine: RolloutEngine, cfg: Config, model_path: Path) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every parameter the actor sends over the weight channel, in its order,
    in ``rollout.dtype``: the receiving side of ``WeightChannel.receive``.

    An HF engine receives into its own parameters; a vLLM engine, which holds its weights in its
    own (fused, repacked) layout, gets meta tensors of the HF model's parameters that give only
    names, shapes and dtype (the received buckets are loaded through ``load_weights``).
    """
    model = getattr(engine, "model", None)
    if model is not None:
        return list(model.named_parameters())
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.model.trust_remote_code)
    dtype = getattr(torch, cfg.rollout.dtype)
    return [(n, torch.empty(p.shape, dtype=dtype, device="meta")) for n, p in meta.named_parameters()]
