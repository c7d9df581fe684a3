"""Loading a local HF model directory: its tokenizer and causal LM on a device, and the sampling
settings of its generation config that the rollout engines ignore.

Shared by the HF engines (``hf.rollout``, ``hf.train``), the vLLM rollout, the megatron engine and
the reward model; ``autocast`` and ``model_device`` are the device helpers of an engine that keeps
its whole model on one device.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


SAMPLING_PROCESSORS: dict[str, Any] = {
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "sequence_bias": None, "suppress_tokens": None,
    "begin_suppress_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None, "min_length": 0,
    "min_new_tokens": 0, "exponential_decay_length_penalty": None, "top_k": 0, "min_p": 0.0, "typical_p": 1.0,
    "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None, "guidance_scale": 1.0, "renormalize_logits": False,
    "watermarking_config": None,
}
"""Generation-config fields that change the sampling distribution besides ``rollout.temperature``
and ``rollout.top_p`` (what ``transformers`` turns into logits processors), with their neutral value."""


def foreign_sampling_settings(generation_config: Any) -> dict[str, Any]:
    """The fields of a model's generation config (``generation_config.json``) that would change the
    sampling distribution beyond temperature and nucleus: ``{field: value}`` for every
    ``SAMPLING_PROCESSORS`` field set to something else than its neutral value (or empty)."""
    found = {}
    for name, neutral in SAMPLING_PROCESSORS.items():
        value = getattr(generation_config, name, None)
        if value is None or value == neutral or (isinstance(value, (list, tuple, dict)) and not value):
            continue
        found[name] = value
    return found


def warn_foreign_sampling(model_path: str | Path, generation_config: Any, engine: str) -> dict[str, Any]:
    """One warning naming every ``foreign_sampling_settings`` field: the rollout samples without them.

    Rollout log-probs, the actor's ratio and the KL all assume the plain tempered policy
    ``softmax(z / τ)`` (with ``top_p``); a processor the checkpoint adds (a repetition penalty,
    ``min_p``, suppressed tokens, …) would make every update silently off-policy, and the two
    rollout engines sample differently. Returns the fields found.
    """
    found = foreign_sampling_settings(generation_config)
    if found:
        fields = ", ".join(f"{k}={v!r}" for k, v in found.items())
        logger.warning(
            "model.path %s: its generation config sets %s; the %s rollout ignores them and samples with exactly "
            "rollout.temperature and rollout.top_p, the policy the loss assumes (remove them from generation_config.json "
            "to silence this warning)", model_path, fields, engine,
        )
    return found


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    """Tokenizer of a model directory; PAD falls back to EOS (the pad == eos case)."""
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tok.eos_token_id is None:
        raise ValueError(f"model {path}: tokenizer has no EOS token")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(
    path: str | Path, dtype: str, trust_remote_code: bool = False, device: torch.device | str = "cpu",
) -> PreTrainedModel:
    """A causal LM from a local HF directory, in ``dtype`` (``float32`` / ``bfloat16``), on ``device``."""
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"model.path {path}: no config.json; expected a local HF model directory")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype], trust_remote_code=trust_remote_code)
    return model.to(device)  # type: ignore[arg-type]  # transformers types .to() for its own wrapper


def autocast(device: torch.device, enabled: bool):
    """bf16 autocast on ``device``'s kind (weights stay as they are), or nothing."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's parameters (an engine keeps all of them on one)."""
    return next(model.parameters()).device
