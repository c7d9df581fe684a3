"""A generative reward model (LLM-as-judge): a causal LM writes a verdict on each response, a parser reads its score.

``GenerativeJudge`` renders ``reward_model.generative.template`` for each row (the prompt and response decoded
from the policy's token ids, special tokens skipped, and the row's reference answer), wraps it as a user turn of
the judge's chat template, generates greedily with a rollout engine (``HFRolloutEngine`` or ``VLLMRolloutEngine``) at
most ``max_new_tokens`` tokens, and parses each verdict (``dockrl.rewards.verdicts``). The judge may have any
tokenizer: it reads text. Nothing here is trained.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from dockrl.config import Config, GenerativeJudgeConfig
from dockrl.engines.hf.rollout import HFRolloutEngine
from dockrl.engines.rollout_engine import RolloutEngine
from dockrl.engines.vllm.engine import VLLMRolloutEngine
from dockrl.rewards.verdicts import build_parser


@dataclass(frozen=True)
class Verdict:
    """One judged response."""

    text: str
    """What the judge wrote (special tokens skipped)."""
    score: float
    """The parsed score, or ``unparsed_score``."""
    parsed: bool
    """The parser read a score from ``text``."""
    tokens: int
    """Tokens the judge generated."""


class GenerativeJudge:
    """Scores rows with a judge model's verdicts.

    Args:
        engine: the judge's rollout engine (its tokenizer renders the chat template).
        policy_tokenizer: the policy's tokenizer, which decodes the rows' token ids.
        cfg: ``reward_model.generative``.
        parser: verdict → score or None (``build_parser`` of ``cfg.parser`` when None).

    Raises:
        ConfigError: the parser does not import (``build_parser``).
    """

    def __init__(self, engine: RolloutEngine, policy_tokenizer: Any, cfg: GenerativeJudgeConfig,
                 parser: Callable[[str], float | None] | None = None) -> None:
        self.engine, self.policy_tokenizer, self.cfg = engine, policy_tokenizer, cfg
        self.parser = parser or build_parser(cfg.parser, cfg.labels)

    def judge_prompts(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                      ground_truths: Sequence[str | None]) -> list[list[int]]:
        """The judge's input ids of each row: the template filled with the row's text, as a user turn
        (``cfg.chat`` and a chat template) with the generation prompt, or as is."""
        decode = self.policy_tokenizer.batch_decode
        tok = self.engine.tokenizer
        out = []
        for p, r, g in zip(decode(list(map(list, prompts)), skip_special_tokens=True),
                           decode(list(map(list, responses)), skip_special_tokens=True), ground_truths):
            text = self.cfg.template.format(prompt=p, response=r, ground_truth="" if g is None else g)
            if self.cfg.chat and tok.chat_template:
                out.append(list(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                        tokenize=True, return_dict=False)))
            else:
                out.append(tok(text, add_special_tokens=False)["input_ids"])
        return out

    def verdicts(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], ground_truths: Sequence[str | None],
                 *, micro_batch: int) -> list[Verdict]:
        """One verdict per row, greedy, ``micro_batch`` rows per generate call.

        Raises:
            TimeoutError: the rows took longer than ``reward_model.generative.timeout_s`` (checked after each call;
                one call takes at most ``max_new_tokens`` steps).
        """
        ids = self.judge_prompts(prompts, responses, ground_truths)
        start, out = time.monotonic(), []
        for s in range(0, len(ids), micro_batch):
            for sample in self.engine.generate(ids[s : s + micro_batch], max_new_tokens=self.cfg.max_new_tokens, greedy=True,
                                               batch_size=micro_batch):
                text = self.engine.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
                score = self.parser(text)
                parsed = isinstance(score, (int, float)) and math.isfinite(score)  # a user's parser may return anything
                out.append(Verdict(text, float(score) if parsed else self.cfg.unparsed_score, parsed,  # type: ignore[arg-type]
                                   len(sample.response_ids)))
            elapsed = time.monotonic() - start
            if elapsed > self.cfg.timeout_s and len(out) < len(ids):
                raise TimeoutError(f"reward_model.generative.timeout_s: the judge took {elapsed:.1f} s for {len(out)} of "
                                   f"{len(ids)} verdicts, over the {self.cfg.timeout_s:g} s allowed; lower "
                                   "reward_model.generative.max_new_tokens or reward_model.micro_batch_size, or raise the timeout")
        return out


def build_judge(cfg: Config, model_path: Path, policy_tokenizer: Any, device: torch.device) -> GenerativeJudge:
    """The run's judge (``reward_model.model``, ``reward_model.generative``) on ``device``: a rollout engine of
    ``reward_model.generative.engine`` with ``rollout.dtype`` weights (vLLM's KV cache at its default 1 GiB).

    Raises:
        ConfigError: the parser does not import.
        ImportError: ``engine=vllm`` without vLLM installed.
    """
    m, g = cfg.reward_model.model, cfg.reward_model.generative
    engine: RolloutEngine
    if g.engine == "vllm":
        engine = VLLMRolloutEngine(model_path, dtype=cfg.rollout.dtype, trust_remote_code=m.trust_remote_code, seed=cfg.trainer.seed,
                                   device=device)
    else:
        engine = HFRolloutEngine(model_path, dtype=cfg.rollout.dtype, trust_remote_code=m.trust_remote_code, device=device)
    return GenerativeJudge(engine, policy_tokenizer, g)
