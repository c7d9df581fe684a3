"""The micro-batch loops and the optimizer step of an engine that keeps its model on one device.

A call's rows are cut into micro-batches (``micro_batches``: consecutive rows, or rows sorted by
length under a token budget); ``forward_per_micro_batch`` gathers a no-grad per-token output back
to the host in one copy, ``backward_per_micro_batch`` accumulates the gradients of a loss, and
``clipped_step`` clips and steps the optimizer (``adamw``). Used by ``HFTrainEngine`` and the critic.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch

from dockrl.engines.hf.load import model_device

logger = logging.getLogger(__name__)


def to_host_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Micro-batch results ``(b_k, T_k)`` as one ``(Σ b_k, max T_k)`` host tensor (right-padded
    with 0), moved from the device in a single copy."""
    if not parts:
        return torch.zeros((0, 0))
    T = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, T - p.shape[1])) for p in parts]).cpu()


def micro_batches(lengths: Sequence[int], micro_batch: int, max_tokens: int = 0) -> list[list[int]]:
    """The rows of each micro-batch of a call.

    With ``max_tokens`` 0 (``trainer.micro_batch_tokens``' default): the caller's consecutive rows,
    ``micro_batch`` at a time, so a micro-batch mixes long and short sequences that ``pack_rows``
    packs into a few rows; its peak memory is what ``micro_batch`` consecutive rows take.
    With ``max_tokens`` > 0: the rows sorted by ``lengths`` (prompt + response tokens), longest
    first (ties in the caller's order), cut in runs of as many rows as keep
    ``rows × longest ≤ max_tokens`` (the tokens the micro-batch computes right-padded: a bound on
    its activations and on its peak memory; a row longer than ``max_tokens`` goes alone), so short
    sequences go in bigger micro-batches with little padding; ``micro_batch`` does not cap them.
    verl's ``use_dynamic_bsz`` / ``ppo_max_token_len_per_gpu`` does the same.

    Returns:
        The micro-batches' row indices into ``lengths``; every row in exactly one.

    Raises:
        ValueError: ``micro_batch < 1`` or ``max_tokens < 0``.
    """
    if micro_batch < 1:
        raise ValueError(f"micro_batch: got {micro_batch}; expected >= 1")
    if max_tokens < 0:
        raise ValueError(f"micro_batch_tokens: got {max_tokens}; expected >= 0 (0: micro_batch rows per micro-batch)")
    if max_tokens == 0:
        return [list(range(s, min(s + micro_batch, len(lengths)))) for s in range(0, len(lengths), micro_batch)]
    out: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= max_tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def sequence_lengths(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> list[int]:
    """``len(prompt) + len(response)`` of each row.

    Raises:
        ValueError: different numbers of prompts and responses.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"prompts/responses: got {len(prompts)} prompts and {len(responses)} responses")
    return [len(p) + len(r) for p, r in zip(prompts, responses)]


def forward_per_micro_batch(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], micro_batch: int, max_tokens: int,
    forward: Callable[[list[Sequence[int]], list[Sequence[int]]], torch.Tensor],
) -> list[list[float]]:
    """A no-grad per-token output (log-probs, values) of every response: ``forward`` on each of
    ``micro_batches(...)``, back to host memory in one copy, returned in the caller's row order
    (row ``i`` has ``len(responses[i])`` floats)."""
    groups = micro_batches(sequence_lengths(prompts, responses), micro_batch, max_tokens)
    host = to_host_rows([forward([prompts[i] for i in g], [responses[i] for i in g]) for g in groups])
    at = {i: k for k, i in enumerate(i for g in groups for i in g)}  # row -> its row in host
    return [host[at[i], : len(r)].tolist() for i, r in enumerate(responses)]


def backward_per_micro_batch(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], micro_batch: int,
    forward: Callable[[list[Sequence[int]], list[Sequence[int]]], tuple[torch.Tensor, ...]],
    loss_fn: Callable[..., tuple[torch.Tensor, Any]], max_tokens: int = 0,
) -> list[Any]:
    """The ``forward_backward`` of an engine on one device: for the rows of each micro-batch
    (``micro_batches``: ``micro_batch`` consecutive rows, or by length ``max_tokens`` tokens at most),
    ``loss, aux = loss_fn(rows, *forward(their prompts, their responses))``, then ``loss.backward()``.

    The gradients accumulate, so they are those of the sum of the micro-batches' losses whichever
    rows go together, as long as ``loss_fn`` normalizes by mini-batch totals (up to float rounding).
    Returns each micro-batch's ``aux``, in micro-batch order (``loss_fn`` knows its ``rows``)."""
    out = []
    for rows in micro_batches(sequence_lengths(prompts, responses), micro_batch, max_tokens):
        loss, aux = loss_fn(rows, *forward([prompts[i] for i in rows], [responses[i] for i in rows]))
        loss.backward()
        out.append(aux)
    return out


def adamw(model: torch.nn.Module, *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters (``requires_grad``), with torch's fused kernel where its device has one (CPU,
    CUDA): one pass over each parameter and its two moments instead of a dozen elementwise ops
    (the same update up to float rounding; the for-loop default elsewhere)."""
    fused = model_device(model).type in ("cpu", "cuda")
    trained = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapters only (hf_lora)
    return torch.optim.AdamW(trained, lr=lr, weight_decay=weight_decay, fused=fused or None)


def clipped_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float, accumulate: Callable[[], dict[str, float]],
) -> tuple[dict[str, float], float]:
    """One optimizer step of an engine on one device: zero the gradients, ``accumulate`` them
    (forward/backward over micro-batches), clip their global norm to ``grad_clip`` (0: no clip),
    step — skipped, with a warning, when the norm is not finite. Returns ``accumulate``'s metrics
    and the gradient norm before clipping."""
    optimizer.zero_grad(set_to_none=True)
    metrics = accumulate()
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if not torch.isfinite(grad_norm):
        logger.warning("non-finite gradient norm %s: optimizer step skipped", grad_norm.item())
    else:
        optimizer.step()
    return metrics, float(grad_norm)
