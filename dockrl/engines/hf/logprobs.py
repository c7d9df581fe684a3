"""Per-token log-probs of responses under an HF causal LM, in one teacher-forced forward pass.

``response_log_probs`` packs ``prompt + response`` sequences into rows (``pack_rows``: several
sequences per row, or right-padded ``pack_sequences``), runs the output head on the response
tokens only and returns ``log π(o_t | q, o_<t)`` (and the entropy); ``packing_works`` checks once
per model that its attention keeps packed sequences apart. The HF train engine and the critic
score with these; the megatron engine right-pads its micro-batches with ``pack_sequences``.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import torch
from transformers import PreTrainedModel

from dockrl.algorithms import entropy_from_logits
from dockrl.engines.hf.load import autocast, model_device

logger = logging.getLogger(__name__)


def pack_sequences(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int):
    """Right-padded ``prompt + response`` batches for a teacher-forced forward pass.

    Returns:
        ``input_ids (B, L)``, ``attention_mask (B, L)``, ``positions (B, T)`` — the index in
        the sequence of the logit that predicts response token ``t`` (``P_i + t - 1``) — and
        the response ``mask (B, T)`` (1 on real response tokens, EOS included).
    """
    B = len(prompts)
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    L, T = max(lengths), max(max(len(r) for r in responses), 1)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    positions = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, : lengths[i]] = torch.tensor(list(p) + list(r), dtype=torch.long)
        attention_mask[i, : lengths[i]] = 1
        positions[i, : len(r)] = torch.arange(len(p) - 1, len(p) - 1 + len(r))
        mask[i, : len(r)] = 1.0
    return input_ids, attention_mask, positions, mask


def pack_rows(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int):
    """``prompt + response`` sequences packed into as few rows as possible, none longer than the
    longest sequence: first-fit decreasing (Johnson, 1973) of whole sequences into rows, each
    sequence's position ids starting at 0. Transformers reads a row whose position ids restart as
    several sequences that do not attend to each other (``masking_utils.find_packed_sequence_indices``,
    used when no attention mask is given), so the forward pass computes the same log-probs as on
    right-padded rows, on fewer tokens; attention per row costs no more than on a padded row.

    Returns:
        ``input_ids (R, L)``, ``position_ids (R, L)`` (the tail of a row is padding with its own
        positions 0, 1, …: a segment of its own), ``index (B, T)`` — the flat index in
        ``(R·L)`` of the logit that predicts response token ``t`` of sequence ``i`` — and the
        response ``mask (B, T)``, as ``pack_sequences``. ``R ≤ B``.
    """
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    L, T = max(lengths), max(max(len(r) for r in responses), 1)
    free: list[int] = []  # room left in each row
    place: dict[int, tuple[int, int]] = {}  # sequence -> (row, offset)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((k for k, room in enumerate(free) if room >= lengths[i]), len(free))
        if row == len(free):
            free.append(L)
        place[i] = (row, L - free[row])
        free[row] -= lengths[i]
    R = len(free)
    input_ids = torch.full((R, L), pad_id, dtype=torch.long)
    position_ids = torch.zeros((R, L), dtype=torch.long)
    index = torch.zeros((len(lengths), T), dtype=torch.long)
    mask = torch.zeros((len(lengths), T), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        row, at = place[i]
        input_ids[row, at : at + lengths[i]] = torch.tensor(list(p) + list(r), dtype=torch.long)
        position_ids[row, at : at + lengths[i]] = torch.arange(lengths[i])
        index[i, : len(r)] = row * L + at + torch.arange(len(p) - 1, len(p) - 1 + len(r))
        mask[i, : len(r)] = 1.0
    for row, room in enumerate(free):
        position_ids[row, L - room :] = torch.arange(room)
    return input_ids, position_ids, index, mask


def _plain_lm_head(model: PreTrainedModel) -> bool:
    """True when logits are exactly ``lm_head(final hidden state)`` (Llama, Qwen2, Mistral, ...)."""
    cfg = model.config
    return (
        getattr(cfg, "final_logit_softcapping", None) is None
        and getattr(cfg, "logit_scale", None) is None
        and hasattr(model, "get_decoder")
        and model.get_output_embeddings() is not None
    )


ENTROPY_CHUNK_TOKENS = 1024
"""Response tokens whose entropy is computed at once (bounds the fp32 ``(tokens, V)`` temporaries)."""


@torch.no_grad()
def chunked_entropy(logits: torch.Tensor, lse: torch.Tensor, chunk_tokens: int = ENTROPY_CHUNK_TOKENS) -> torch.Tensor:
    """The entropy of ``softmax(z)`` for ``(..., V)`` logits ``z`` (as ``entropy_from_logits``),
    ``H = lse - Σ_v exp(z_v - lse)·z_v`` with ``lse (...)`` the ``logsumexp(z)`` already computed
    for the log-probs (one pass over the vocabulary less), over at most ``chunk_tokens`` tokens at
    a time (no grad): its temporaries stay ``chunk_tokens × V``. Returns ``(...)`` nats."""
    flat, flat_lse = logits.reshape(-1, logits.shape[-1]), lse.reshape(-1, 1)
    parts = []
    for s in range(0, flat.shape[0], chunk_tokens):
        z, m = flat[s : s + chunk_tokens], flat_lse[s : s + chunk_tokens]
        parts.append(m.squeeze(1) - ((z - m).exp_() * z).sum(dim=-1))
    out = torch.cat(parts) if parts else flat.new_zeros(0)
    return out.view(logits.shape[:-1])


def model_inputs(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int, pack: bool, device: torch.device,
) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward pass's keyword inputs for ``prompts`` + ``responses`` on ``device``: packed into
    as few rows as the longest allows (``pack_rows``) when ``pack`` and that saves rows, else
    right-padded (``pack_sequences``) with an all-ones attention mask: under the causal mask a real
    token never attends to the padding after it, and with no padding to mask transformers calls
    its causal attention kernel without a mask tensor (``is_causal``).
    Returns ``(inputs, index, mask, real, at)``: ``index (B, T)`` the position in the flattened
    ``(rows·L)`` output that predicts each response token, ``mask (B, T)`` 1 on response tokens;
    ``real (N,)`` the response tokens' slots in the flattened ``(B·T)`` and ``at (N,)`` their
    ``index`` (computed on the host: no data-dependent shape on the device)."""
    packed = pack_rows(prompts, responses, pad_id) if pack else None
    if packed is not None and packed[0].shape[0] < len(prompts):
        input_ids, position_ids, index, mask = packed
        inputs = dict(input_ids=input_ids, position_ids=position_ids)  # no attention mask: the restarting positions separate them
    else:
        input_ids, _, positions, mask = pack_sequences(prompts, responses, pad_id)
        index = positions + torch.arange(input_ids.shape[0]).unsqueeze(1) * input_ids.shape[1]
        inputs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
    real = mask.view(-1).nonzero().squeeze(1)
    at = index.view(-1)[real]
    on_device = [t.to(device) for t in (*inputs.values(), index, mask, real, at)]
    return {"attention_mask": None} | dict(zip(inputs, on_device)), *on_device[len(inputs):]


def response_log_probs(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    *,
    pad_id: int,
    temperature: float,
    autocast_bf16: bool,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    pack: bool = True,
    checkpoint_head: bool = False,
):
    """Per-token log-probs of ``responses`` given ``prompts`` in one forward pass.

    ``log π(o_t | q, o_<t) = log_softmax(z_t / τ)[o_t]`` with the sampling temperature ``τ``.
    The sequences are packed into as few rows as the longest one allows (``pack_rows``) when that
    saves rows and ``pack`` allows it (``packing_works``), else right-padded (``pack_sequences``);
    the output head runs on the response tokens only (not on prompt or padding positions), the
    log-softmax never materializes (``log_softmax(z)[y] = z_y - logsumexp(z)``: one full-vocabulary
    fp32 tensor less in memory and in the backward pass) and the entropy is computed in chunks
    (``chunked_entropy``) from the same ``logsumexp``. With ``checkpoint_head`` (the actor's
    ``trainer.gradient_checkpointing``; not with ``entropy_grad``) the head's logits are computed
    ``HEAD_CHUNK_TOKENS`` at a time and recomputed in the backward pass (``head_log_probs``).

    Returns:
        ``log_prob (B, T)`` fp32 (differentiable if grad is enabled), ``mask (B, T)``, and
        ``entropy (B, T)`` when ``with_entropy`` (differentiable with ``entropy_grad``, for an
        entropy bonus in the loss; else no grad), else None; all on the model's device
        (the packed batch is moved there in one copy per tensor).
    """
    device = model_device(model)
    inputs, index, mask, real, at = model_inputs(prompts, responses, pad_id, pack, device)
    B, T = index.shape  # real (N,): the response tokens among the B·T slots; at (N,): their logits' positions
    targets = inputs["input_ids"].reshape(-1)[at + 1]  # the token each logit predicts: the next position, same row

    def spread(x: torch.Tensor) -> torch.Tensor:  # (N,) -> (B, T), 0 off the response tokens
        return x.new_zeros(B * T).index_put((real,), x).view(B, T)

    if checkpoint_head and _plain_lm_head(model) and not entropy_grad and torch.is_grad_enabled():
        with autocast(device, autocast_bf16):
            hidden = model.get_decoder()(**inputs, use_cache=False).last_hidden_state
        log_prob, entropy = head_log_probs(model.get_output_embeddings(), hidden.reshape(-1, hidden.shape[-1])[at], targets,
                                           temperature=temperature, with_entropy=with_entropy, autocast_bf16=autocast_bf16)
        return spread(log_prob), mask, None if entropy is None else spread(entropy)
    with autocast(device, autocast_bf16):
        if _plain_lm_head(model):
            # the output head only on response tokens: prompt and padding logits are never needed
            hidden = model.get_decoder()(**inputs, use_cache=False).last_hidden_state
            logits = model.get_output_embeddings()(hidden.reshape(-1, hidden.shape[-1])[at])
        else:
            logits = model(**inputs, use_cache=False).logits
            logits = logits.reshape(-1, logits.shape[-1])[at]
    logits = logits.float()  # (N, V)
    if temperature != 1.0:  # a (N, V) copy, and its backward, only when it changes something
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)
    log_prob = spread(logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse)  # z_y - logsumexp(z)
    entropy = None
    if with_entropy:  # differentiable for an entropy bonus: then the softmax of every token is kept for backward
        entropy = spread(entropy_from_logits(logits) if entropy_grad else chunked_entropy(logits.detach(), lse.detach()))
    return log_prob, mask, entropy


HEAD_CHUNK_TOKENS = 256
"""Response tokens whose head logits ``head_log_probs`` computes at once (SmolLM2: 256 × 49,152 fp32, 50 MB)."""


def head_log_probs(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, *, temperature: float, with_entropy: bool,
    autocast_bf16: bool, chunk_tokens: int = HEAD_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``log_softmax(head(h) / τ)[y]`` for ``(N, H)`` hidden states and ``(N,)`` targets, ``chunk_tokens``
    rows at a time, each chunk under activation checkpointing (``torch.utils.checkpoint``,
    non-reentrant): only the hidden states are kept for the backward pass, which recomputes one
    chunk's ``(chunk, V)`` logits at a time, instead of the ``(N, V)`` logits, their exponentials
    and their gradient together (the chunked loss of Liger-Kernel's fused linear cross-entropy,
    arXiv 2410.10989). The same values as the unchunked head (row-wise ops).

    Returns:
        ``log_prob (N,)`` fp32 (differentiable) and, with ``with_entropy``, ``entropy (N,)`` (no grad), else None.
    """
    from torch.utils.checkpoint import checkpoint  # lazy: only with the actor's gradient checkpointing

    device = hidden.device

    def chunk(h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with autocast(device, autocast_bf16):
            z = head(h)
        z = z.float()
        if temperature != 1.0:
            z = z / temperature
        lse = torch.logsumexp(z, dim=-1)
        entropy = chunked_entropy(z.detach(), lse.detach()) if with_entropy else lse.new_zeros(0)
        return z.gather(-1, y.unsqueeze(-1)).squeeze(-1) - lse, entropy

    parts = [checkpoint(chunk, hidden[s : s + chunk_tokens], targets[s : s + chunk_tokens], use_reentrant=False)
             for s in range(0, hidden.shape[0], chunk_tokens)]
    if not parts:
        return hidden.new_zeros(0, dtype=torch.float32), hidden.new_zeros(0, dtype=torch.float32) if with_entropy else None
    return torch.cat([lp for lp, _ in parts]), torch.cat([e for _, e in parts]) if with_entropy else None


PackedForward = Callable[[list[list[int]], list[list[int]], bool], torch.Tensor]
"""``(prompts, responses, pack) -> (B, T)`` per-response-token outputs of a model (log-probs, values)."""


@torch.no_grad()
def packing_works(model: torch.nn.Module, forward: PackedForward, what: str) -> bool:
    """Whether ``model`` keeps packed sequences apart (``pack_rows``): ``forward``'s outputs for two
    short sequences packed into one row (beside a longer one in a row of its own) equal those of
    each alone (1e-4), token ids 1-12. Architectures whose attention does not build its mask with
    transformers' ``masking_utils`` (some remote code) read a packed row as one sequence; their
    engine right-pads instead (a warning names ``what``), as on a device that computes no values
    (``meta``)."""
    if model_device(model).type == "meta":
        return False
    prompts, responses = [[1, 2], [3], [4]], [[5, 6, 7, 8], [9, 10], [11, 12]]
    packed = forward(prompts, responses, True)
    alone = [forward([p], [r], False)[0, : len(r)] for p, r in zip(prompts, responses)]
    works = all(torch.allclose(packed[i, : len(r)], a, atol=1e-4) for i, (r, a) in enumerate(zip(responses, alone)))
    if not works:
        logger.warning("%s does not keep packed sequences apart: %s are right-padded", type(model).__name__, what)
    return works
