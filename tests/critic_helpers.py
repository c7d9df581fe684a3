"""Shared by the critic's engine and worker tests: a seeded critic on the tiny model and random rows."""

from __future__ import annotations

import random

import torch

from dockrl.engines.critic import HFCriticEngine
from dockrl.engines.hf.load import load_tokenizer


def engine_of(tiny_model_dir, lr: float = 1e-3, random_head: bool = True) -> HFCriticEngine:
    """A critic on the tiny model; ``random_head``: its value head (new ones start at zero) drawn
    from a seeded normal, as a trained critic's would be non-zero, so that values differ by state."""
    tok = load_tokenizer(tiny_model_dir)
    engine = HFCriticEngine(tiny_model_dir, pad_id=tok.pad_token_id, vocab_size=len(tok), lr=lr)
    if random_head:
        torch.manual_seed(0)
        with torch.no_grad():
            torch.nn.init.normal_(engine.model.score.weight, std=0.02)
    return engine


def rows(n: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """``n`` random prompts and responses of token ids below ``vocab``."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(2, 6))] for _ in range(n)]
    responses = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 5))] for _ in range(n)]
    return prompts, responses
