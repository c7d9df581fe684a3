"""The training-engine protocol: what the actor and reference stages need from an engine.

Two engines implement it: ``HFTrainEngine`` (torch + transformers, one process) and
``MegatronTrainEngine`` (megatron-core with TP/PP/DP). On a distributed engine every method is
a collective: all ranks call it with the same arguments (the same rows on every TP/PP rank of a
data-parallel replica) and get the same result.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Protocol, Sequence, runtime_checkable

import torch

LossFn = Callable[[list[int], torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, Any]]
"""``loss_fn(rows, log_prob, mask, entropy) -> (loss, aux)`` for one micro-batch.

``rows`` are the indices in the engine call of the micro-batch's ``b`` rows, in the order of its
outputs (the hf engine's ``dockrl.engines.micro_batching.micro_batches``: consecutive rows, or under a
token budget rows sorted by length); ``log_prob (b, T)``
(fp32, differentiable), ``mask (b, T)`` and ``entropy (b, T)`` (no grad unless the engine was
asked for ``entropy_grad``) are as returned by
``dockrl.engines.hf.logprobs.response_log_probs``. ``loss`` is a scalar the engine back-propagates
unchanged (normalize it by mini-batch totals); ``aux`` is any picklable value handed back.
"""


class ScoringEngine(Protocol):
    """What the reference stage needs: ``TrainEngine.log_probs`` alone (a ``TrainEngine``, or a LoRA
    actor's module with its adapters disabled: ``dockrl.engines.hf.train.AdaptersDisabled``)."""

    def log_probs(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *, temperature: float, micro_batch: int,
        micro_batch_tokens: int = 0,
    ) -> list[list[float]]:
        """As ``TrainEngine.log_probs``."""
        ...


@runtime_checkable
class TrainEngine(Protocol):
    """A causal LM that scores responses and takes optimizer steps (the actor or the reference)."""

    tokenizer: Any
    pad_id: int

    def log_probs(
        self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *, temperature: float, micro_batch: int,
        micro_batch_tokens: int = 0,
    ) -> list[list[float]]:
        """Per-token log-probs (nats) of each response in the caller's row order, ``micro_batch``
        rows (or at most ``micro_batch_tokens`` tokens when > 0) per forward pass, no grad."""
        ...

    def forward_backward(
        self,
        prompts: Sequence[Sequence[int]],
        responses: Sequence[Sequence[int]],
        *,
        temperature: float,
        micro_batch: int,
        loss_fn: LossFn,
        entropy_grad: bool = False,
        micro_batch_tokens: int = 0,
    ) -> list[Any]:
        """Forward and backward every micro-batch, accumulating gradients; returns each ``aux``.
        ``entropy_grad``: the entropy handed to ``loss_fn`` is differentiable (an entropy bonus);
        ``micro_batch_tokens`` > 0: micro-batches of at most that many tokens (engines that do not
        implement it warn and use ``micro_batch``)."""
        ...

    def sum_over_replicas(self, values: Sequence[float]) -> list[float]:
        """``values`` summed over the engine's data-parallel replicas (float64; a collective when
        there are several, ``values`` unchanged with one): the mini-batch's global token and
        sequence counts that every replica normalizes its loss by."""
        ...

    def optimizer_step(self, accumulate: Callable[[], dict[str, float]]) -> dict[str, float]:
        """Zero grads, run ``accumulate``, sum the gradients over data-parallel replicas, clip,
        step; returns its metrics plus ``actor/grad_norm``."""
        ...

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Full (unsharded) weights under HF parameter names, in HF ``named_parameters`` order."""
        ...

    def save(self, path: str | Path) -> Path:
        """Write an HF checkpoint loadable with ``AutoModelForCausalLM.from_pretrained``."""
        ...
