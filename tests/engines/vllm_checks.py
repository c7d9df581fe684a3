"""Checks shared by the tests of every path that puts trained weights into a vLLM engine
(HF actor → vLLM in test_vllm.py, the hybrid actor's allgather–swap in test_hybrid.py)."""

from __future__ import annotations

from typing import Callable

import torch

ATOL = 1e-4  # fp32 vLLM vs an fp32 trainer (docs/design.md §7: vLLM fp32 equals HF fp32 to 1e-4)


def assert_log_probs_close(samples, reference) -> None:
    for s, ref in zip(samples, reference):
        assert len(s.log_probs) == len(s.response_ids) == len(ref)
        torch.testing.assert_close(torch.tensor(s.log_probs), torch.tensor(ref), atol=ATOL, rtol=0)


def long_prompt(tokenizer) -> list[int]:
    """A chat prompt longer than several KV blocks of the CPU backend, so vLLM prefix-caches it."""
    text = " ".join(f"Tom has {i} apples and gets {i + 2} more." for i in range(40))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert len(prompt) > 300
    return prompt


def check_sync_reaches_head_and_prefix_cache(
    generate: Callable, sync: Callable[[], object], recompute: Callable, move_embedding: Callable[[], None], tokenizer,
) -> None:
    """After a sync that moved only the input embedding (= the tied output head), vLLM's greedy
    log-probs on a prompt it has prefix-cached equal the trainer's.

    A stale head copy (vLLM keeps its own ``lm_head``) or stale cached KV of the prompt would
    leave the old log-probs (error ~0.1–2.5).

    Args:
        generate: ``generate(prompts) -> samples`` greedy, a few tokens.
        sync: pushes the trainer's weights into the engine.
        recompute: ``recompute(prompts, samples) -> log-probs`` by the trainer (τ = 1).
        move_embedding: changes the trainer's input embedding only (the tied head with it), e.g. to a fresh one.
    """
    prompt = long_prompt(tokenizer)
    sync()
    before = generate([prompt])
    assert_log_probs_close(before, recompute([prompt], before))
    move_embedding()
    sync()
    after = generate([prompt])
    assert_log_probs_close(after, recompute([prompt], after))
    assert max(abs(a - b) for a, b in zip(after[0].log_probs, before[0].log_probs)) > 1e-3  # the weights did change
