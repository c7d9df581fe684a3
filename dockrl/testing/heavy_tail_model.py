"""A tiny model whose sampled response lengths are heavy-tailed, and the length distribution it states.

``build_heavy_tail_model`` turns ``dockrl.run.models.build_tiny_model`` into a bigram model whose
responses end with a per-class EOS probability, so that their lengths follow a mixture of
geometric distributions (``heavy_tail_length_pmf``): a real model for the in-flight benchmark
(``benchmarks/inflight.py``) and the tests of long-tailed rollouts.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

from dockrl.run.data import prompt_token_ids
from dockrl.run.models import build_tiny_model

HEAVY_TAIL_RATES = (0.5, 0.2, 0.08, 0.03, 0.01)
"""Per-token EOS probabilities of the heavy-tailed model's classes (``build_heavy_tail_model``)."""
HEAVY_TAIL_WEIGHTS = (0.3, 0.25, 0.2, 0.15, 0.1)
"""How often a response falls in each class of ``HEAVY_TAIL_RATES``."""


def heavy_tail_length_pmf(max_len: int, rates: Sequence[float] = HEAVY_TAIL_RATES,
                          weights: Sequence[float] = HEAVY_TAIL_WEIGHTS) -> list[float]:
    """The response-length distribution of ``build_heavy_tail_model`` cut at ``max_len`` tokens.

    A response draws its class ``c`` with probability ``weights[c]``, emits one content token,
    then ends with EOS at each further step with probability ``rates[c]``: its length (EOS
    counted) is ``L = 1 + G``, ``G ~ Geometric(rates[c])`` on {1, 2, …}, so
    ``P(L = l) = Σ_c weights[c] (1 - rates[c])^(l-2) rates[c]`` for ``2 ≤ l < max_len``, and
    ``P(L = max_len)`` the rest (responses cut at the limit, or ending there). A mixture of
    geometric lengths over rates spanning orders of magnitude has a tail far heavier than any
    one geometric (the defaults at ``max_len`` 64: median 5, p90 50, p95 and p99 64, 7.7% cut).

    Returns:
        ``pmf[l]`` = P(L = l) for ``l`` in 0 … ``max_len`` (``pmf[0] = pmf[1] = 0``).

    Raises:
        ValueError: ``max_len`` < 2, rates outside (0, 1), weights not positive or not summing
            to 1, or ``rates`` and ``weights`` of different lengths.
    """
    _check_heavy_tail(rates, weights)
    if max_len < 2:
        raise ValueError(f"heavy_tail_length_pmf: max_len={max_len}; expected at least 2 (one content token and EOS)")
    pmf = [0.0] * (max_len + 1)
    for p, w in zip(rates, weights):
        for length in range(2, max_len):
            pmf[length] += w * (1 - p) ** (length - 2) * p
        pmf[max_len] += w * (1 - p) ** (max_len - 2)
    return pmf


def _check_heavy_tail(rates: Sequence[float], weights: Sequence[float]) -> None:
    if len(rates) != len(weights) or not rates:
        raise ValueError(f"heavy-tailed lengths: {len(rates)} rates and {len(weights)} weights; expected as many, at least one")
    if not all(0 < p < 1 for p in rates):
        raise ValueError(f"heavy-tailed lengths: rates {list(rates)}; expected each in (0, 1)")
    if not all(w > 0 for w in weights) or abs(sum(weights) - 1) > 1e-6:
        raise ValueError(f"heavy-tailed lengths: weights {list(weights)}; expected positive and summing to 1")


def build_heavy_tail_model(
    out_dir: str | Path,
    *,
    rates: Sequence[float] = HEAVY_TAIL_RATES,
    weights: Sequence[float] = HEAVY_TAIL_WEIGHTS,
    temperature: float = 1.0,
    seed: int = 0,
) -> Path:
    """A tiny model whose sampled response lengths are heavy-tailed: ``heavy_tail_length_pmf``.

    ``build_tiny_model`` (same tokenizer and shape) with its weights set, offline: the attention
    and MLP outputs (``o_proj``, ``down_proj``) are zeroed, so the next token depends on the
    current one only (a bigram model, still a trainable Qwen2), and the lm_head is untied. The
    content tokens (all but the special ones and the last tokens of the chat and plain prompts)
    fall into ``len(rates)`` classes. From a content token of class ``c`` the model samples
    another of class ``c`` (uniformly; another class has probability < 1e-6) or EOS with
    probability ``rates[c]``; from any other token (a prompt's end) the first response token,
    a content token whose class is ``c`` with probability ``weights[c]``. Special and prompt-end
    tokens are never sampled (probability < 1e-8). These probabilities hold when sampling at
    ``temperature`` (the logits are scaled by it) with top-p 1.

    Returns:
        The directory with ``config.json``, ``model.safetensors`` and the tokenizer files.

    Raises:
        ValueError: bad ``rates`` or ``weights`` (``heavy_tail_length_pmf``), ``temperature`` ≤ 0,
            or fewer content tokens than classes.
    """
    import torch  # lazy: torch and transformers take seconds to import, and heavy_tail_length_pmf needs neither
    from transformers import AutoTokenizer, Qwen2ForCausalLM  # lazy: as torch

    _check_heavy_tail(rates, weights)
    if temperature <= 0:
        raise ValueError(f"build_heavy_tail_model: temperature={temperature}; expected > 0")
    out = build_tiny_model(out_dir, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = Qwen2ForCausalLM.from_pretrained(out, dtype=torch.float32)
    vocab, hidden, k = model.config.vocab_size, model.config.hidden_size, len(rates)
    ends = {prompt_token_ids(tokenizer, "1 + 1", system_prompt="", chat_template=t)[-1] for t in ("auto", "none")}
    content = [t for t in range(len(tokenizer)) if t not in ends and t not in tokenizer.all_special_ids]
    if len(content) < k or hidden <= k:
        raise ValueError(f"build_heavy_tail_model: {len(content)} content tokens, hidden size {hidden}; expected more than {k}")
    generator = torch.Generator().manual_seed(seed)
    order = [content[i] for i in torch.randperm(len(content), generator=generator).tolist()]
    classes = [order[c::k] for c in range(k)]  # as many tokens per class, ±1
    big = 20.0  # logit gap that makes an excluded token's probability < e^-20 · vocab
    neutral = k  # the hidden direction of every token that is not a content token
    embed = torch.zeros(vocab, hidden)
    embed[:, neutral] = 1.0
    logits = torch.full((vocab, k + 1), -big)  # (vocab, directions): the logit of each token from each direction
    for c, members in enumerate(classes):
        embed[members, neutral] = 0.0
        embed[members, c] = 1.0
        logits[members, c] = big  # stay in the class
        logits[members, :c] = logits[members, c + 1 : k] = 0.0  # other classes: e^-20 behind
        logits[members, neutral] = math.log(weights[c] / len(members))  # the first token's class
        # EOS against the class's n tokens at e^big (the rest is < 1e-6 of it): p = e^b / (e^b + n e^big)
        logits[tokenizer.eos_token_id, c] = big + math.log(len(members)) + math.log(rates[c] / (1 - rates[c]))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(embed)
        scale = float(model.model.norm(torch.eye(1, hidden))[0, 0])  # RMSNorm of a unit direction: ≈ √hidden
        model.config.tie_word_embeddings = False
        head = torch.zeros(vocab, hidden)
        head[:, : k + 1] = logits * temperature / scale
        model.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
        model.lm_head.weight.copy_(head)
    model.save_pretrained(out)
    (out / "dockrl_tiny.json").write_text(json.dumps({"seed": seed, "heavy_tail": {"rates": list(rates),
                                                                                  "weights": list(weights),
                                                                                  "temperature": temperature}}))
    return out
