"""The critic's engine on torch + transformers: a value model V(s_t) per response token.

The value model is the policy's architecture with a scalar head on every position: transformers'
``AutoModelForTokenClassification`` with ``num_labels=1`` (a linear ``hidden → 1`` head over the
backbone's last hidden state), as verl builds its critic. Started from a causal LM (the policy, or
``critic.model_path``) it takes the backbone and a new head initialized to zero (``load_value_model``);
started from one of its own checkpoints (``CHECKPOINT/critic``) it takes both.

The steps are the actor engine's: ``forward_backward`` calls a loss function per micro-batch and
back-propagates it, ``optimizer_step`` zeroes, accumulates, clips and steps
(``dockrl.engines.micro_batching.clipped_step``); only the forward pass differs (values instead of log-probs), and
packs a micro-batch's sequences into as few rows as the actor's engine does.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from transformers import AutoConfig, AutoModelForTokenClassification, PreTrainedModel

from dockrl.engines.hf.load import autocast, model_device
from dockrl.engines.hf.logprobs import model_inputs, packing_works
from dockrl.engines.micro_batching import adamw, backward_per_micro_batch, clipped_step, forward_per_micro_batch

logger = logging.getLogger(__name__)

ValueLossFn = Callable[[list[int], torch.Tensor, torch.Tensor], tuple[torch.Tensor, Any]]
"""``loss_fn(rows, values, mask) -> (loss, aux)`` for one micro-batch: ``rows`` are the indices of its
rows in the engine call (``dockrl.engines.micro_batching.micro_batches``: consecutive, or sorted by length under a token budget),
``values (b, T)`` fp32 (differentiable) and ``mask (b, T)`` as returned by ``response_values``;
``loss`` is back-propagated unchanged, ``aux`` handed back."""


def load_value_model(path: str | Path, *, vocab_size: int, trust_remote_code: bool = False,
                     device: torch.device | str = "cpu") -> PreTrainedModel:
    """The value model of ``path`` in fp32 on ``device``, in eval mode (no dropout: see ``HFTrainEngine``).

    A new value head (``path`` is a causal LM) starts at zero, weights and bias, so that every
    value is 0 until the critic trains: GAE's first advantages are then the (whitened) returns,
    as REINFORCE with a zero baseline, instead of returns minus per-token noise. transformers'
    default initialization (normal, std ``initializer_range``) gives V with a std of ~0.5 per token
    on SmolLM2-135M, ten times the 0/1 verifier reward's mean there, and PPO then learned
    nothing (docs/benchmarks.md). The backbone still gets gradients once the head has moved
    (one step).

    Raises:
        FileNotFoundError: ``path`` has no ``config.json``.
        ValueError: its vocabulary is smaller than the policy's ``vocab_size`` token ids it must read,
            or it lacks backbone weights.
    """
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"critic.model_path {path}: no config.json; expected a local HF model directory")
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if getattr(config, "vocab_size", vocab_size) < vocab_size:
        raise ValueError(f"critic.model_path {path}: a vocabulary of {config.vocab_size} tokens, the policy's tokenizer has "
                         f"{vocab_size}: the critic reads the policy's token ids, so it needs the policy's vocabulary")
    model, info = AutoModelForTokenClassification.from_pretrained(path, num_labels=1, dtype=torch.float32,
                                                                  trust_remote_code=trust_remote_code, output_loading_info=True)
    fresh = set(info["missing_keys"])
    if fresh:  # a causal LM: its value head is new
        backbone = [k for k in fresh if k.startswith(f"{model.base_model_prefix}.")]
        if backbone:
            raise ValueError(f"critic.model_path {path}: the checkpoint lacks backbone weights {sorted(backbone)[:3]}: "
                             "expected a causal LM of the policy's architecture or a critic checkpoint")
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name in fresh:
                    param.zero_()
        logger.info("critic: a new value head %s, initialized to zero (V = 0 before the critic trains)", sorted(fresh))
    return model.to(device).eval()


def response_values(model: PreTrainedModel, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *,
                    pad_id: int, autocast_bf16: bool, pack: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token values of ``responses`` given ``prompts`` in one forward pass.

    ``V_t = head(h_{P+t-1})``: the value of response token ``t`` is read at the position that
    predicts it, the state ``(q, o_<t)`` before the token is chosen (verl's
    ``values[:, -R-1:-1]``; the same positions as the actor's log-probs). The sequences are packed
    into as few rows as the longest allows (``dockrl.engines.hf.logprobs.pack_rows``) when that saves rows
    and ``pack`` allows it (``dockrl.engines.hf.logprobs.packing_works``), else right-padded (``pack_sequences``).

    Returns:
        ``values (B, T)`` fp32 (differentiable if grad is enabled; 0 on padding) and ``mask (B, T)``,
        on the model's device.
    """
    device = model_device(model)
    inputs, index, mask, _, _ = model_inputs(prompts, responses, pad_id, pack, device)
    with autocast(device, autocast_bf16):
        scores = model(**inputs, use_cache=False).logits  # (rows, L, 1); with a cache the packed rows are not kept apart
    values = scores.float().reshape(-1)[index.reshape(-1)].view(index.shape)
    return values * mask, mask


class HFCriticEngine:
    """The critic on torch: fp32 weights, optional bf16 autocast, AdamW.

    Args:
        model_path: the value model's start (``load_value_model``).
        pad_id: the policy tokenizer's pad id (the critic reads the policy's token ids).
        vocab_size: the policy tokenizer's size.
        device: where the model computes (the process's device).
    """

    def __init__(self, model_path: str | Path, *, pad_id: int, vocab_size: int, lr: float = 1e-5, weight_decay: float = 0.0,
                 grad_clip: float = 1.0, autocast_bf16: bool = False, trust_remote_code: bool = False,
                 device: torch.device | str = "cpu") -> None:
        self.model = load_value_model(model_path, vocab_size=vocab_size, trust_remote_code=trust_remote_code, device=device)
        self.pad_id, self.autocast_bf16, self.grad_clip = pad_id, autocast_bf16, grad_clip
        self.pack = packing_works(self.model, lambda ps, rs, pack: response_values(
            self.model, ps, rs, pad_id=pad_id, autocast_bf16=False, pack=pack)[0], "the critic's micro-batches")
        self.optimizer = adamw(self.model, lr=lr, weight_decay=weight_decay)

    @torch.no_grad()
    def values(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *, micro_batch: int,
               micro_batch_tokens: int = 0) -> list[list[float]]:
        """Per-token values of each response (``response_values``), in the caller's row order, over
        micro-batches (``dockrl.engines.micro_batching.micro_batches``: ``micro_batch`` consecutive rows, or
        rows sorted by length, at most ``micro_batch_tokens`` tokens each, when > 0); back to host memory in one copy for the whole call."""
        def forward(p: list[Sequence[int]], r: list[Sequence[int]]) -> torch.Tensor:
            return response_values(self.model, p, r, pad_id=self.pad_id, autocast_bf16=self.autocast_bf16, pack=self.pack)[0]

        return forward_per_micro_batch(prompts, responses, micro_batch, micro_batch_tokens, forward)

    def forward_backward(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *, micro_batch: int,
                         loss_fn: ValueLossFn, micro_batch_tokens: int = 0) -> list[Any]:
        """For each micro-batch (``dockrl.engines.micro_batching.micro_batches``): ``response_values``,
        ``loss_fn(rows, values, mask)``, backward. Returns each ``aux``, in micro-batch order."""
        def forward(p: list[Sequence[int]], r: list[Sequence[int]]) -> tuple[torch.Tensor, ...]:
            return response_values(self.model, p, r, pad_id=self.pad_id, autocast_bf16=self.autocast_bf16, pack=self.pack)

        return backward_per_micro_batch(prompts, responses, micro_batch, forward, loss_fn, micro_batch_tokens)

    def sum_over_replicas(self, values: Sequence[float]) -> list[float]:
        """One process, one replica: ``values`` unchanged."""
        return [float(v) for v in values]

    def optimizer_step(self, accumulate: Callable[[], dict[str, float]]) -> dict[str, float]:
        """Zero grads, run ``accumulate``, clip, step; its metrics plus ``critic/grad_norm`` (before clipping)."""
        metrics, grad_norm = clipped_step(self.model, self.optimizer, self.grad_clip, accumulate)
        metrics["critic/grad_norm"] = grad_norm
        return metrics

    def save(self, path: str | Path) -> Path:
        """Write the value model as an HF checkpoint (``AutoModelForTokenClassification.from_pretrained`` loads it)."""
        path = Path(path)
        self.model.save_pretrained(path)
        return path
