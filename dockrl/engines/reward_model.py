"""A frozen HF reward model that scores (prompt, response) token rows, batched, on one device.

``HFRewardModel`` loads a one-label sequence-classification checkpoint
(``AutoModelForSequenceClassification``: ``Qwen2ForSequenceClassification``,
``LlamaForSequenceClassification``, … as TRL's ``RewardTrainer`` saves them), or a decoder with a
one-label value head per token (``AutoModelForTokenClassification``, as verl's reward model and
critic), and returns one scalar per row: the ``score`` head on the final hidden state of the
row's last token. The rows
are the policy's token ids; a reward model with another vocabulary gets them as text, re-encoded
by its own tokenizer. Nothing here is trained.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Sequence

import torch
from transformers import AutoModelForSequenceClassification, AutoModelForTokenClassification

from dockrl.config import Config, ConfigError
from dockrl.engines.hf.load import autocast, load_tokenizer
from dockrl.engines.micro_batching import to_host_rows
from dockrl.parallel.ranks import ProcessRanks

logger = logging.getLogger(__name__)

FIELD = "reward_model.model.path"
HEADS = {"ForSequenceClassification": AutoModelForSequenceClassification, "ForTokenClassification": AutoModelForTokenClassification}
"""Architecture name suffix → the auto class that loads it: a score per sequence, or a value per token (read at the last)."""


def check_reward_model_dir(path: Path) -> Any:
    """Check that ``path``'s ``config.json`` describes a one-label classifier (``HEADS``); returns its auto class.

    Raises:
        ConfigError: naming ``reward_model.model.path``: no readable ``config.json``, another
            architecture (a causal LM would get a random, untrained head), or ``num_labels != 1``.
    """
    try:
        doc: dict[str, Any] = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{FIELD}: {path / 'config.json'} is not readable JSON ({e})") from None
    archs = doc.get("architectures") or []
    auto = next((cls for a in archs for suffix, cls in HEADS.items() if str(a).endswith(suffix)), None)
    if auto is None:
        raise ConfigError(f"{FIELD}: {path} holds {archs or 'no architectures'}; expected a sequence-classification "
                          "reward model (e.g. Qwen2ForSequenceClassification with num_labels=1, as TRL's RewardTrainer saves) "
                          "or a value head per token (…ForTokenClassification with num_labels=1, as verl's)")
    labels = len(doc["id2label"]) if isinstance(doc.get("id2label"), dict) else doc.get("num_labels", 2)
    if labels != 1:
        raise ConfigError(f"{FIELD}: {path} has {labels} labels; a reward model has one (num_labels=1): one score per response")
    return auto


class HFRewardModel:
    """Scores rows with a frozen sequence-classification reward model (fp32 weights, optional bf16 autocast).

    Args:
        model_path: local HF folder (``check_reward_model_dir``).
        policy_tokenizer: the policy's tokenizer; when its vocabulary differs from the reward
            model's, rows are decoded with it and re-encoded with the reward model's.
        device: where the model computes (the process's device, ``ProcessRanks.device``).

    Raises:
        ConfigError: naming ``reward_model.model.path``: not a one-label classifier, weights
            missing from the checkpoint, or an architecture whose classifier is not a ``score``
            head over a decoder's last hidden state.
    """

    def __init__(
        self, model_path: str | Path, *, policy_tokenizer: Any, autocast_bf16: bool = False, trust_remote_code: bool = False,
        device: torch.device | str = "cpu",
    ) -> None:
        path = Path(model_path)
        auto = check_reward_model_dir(path)
        self.device, self.autocast_bf16 = torch.device(device), autocast_bf16
        self.tokenizer = load_tokenizer(path, trust_remote_code)
        self.policy_tokenizer = policy_tokenizer
        self.same_vocab = policy_tokenizer.get_vocab() == self.tokenizer.get_vocab()
        model, info = auto.from_pretrained(
            path, dtype=torch.float32, trust_remote_code=trust_remote_code, output_loading_info=True)
        if info["missing_keys"]:  # a head or layers that from_pretrained would initialize at random
            raise ConfigError(f"{FIELD}: {path} lacks weights {sorted(info['missing_keys'])[:5]}; a reward model's "
                              "checkpoint holds the whole classifier, its score head included")
        base, head = getattr(model, model.base_model_prefix, None), getattr(model, "score", None)
        if not isinstance(head, torch.nn.Linear) or not isinstance(base, torch.nn.Module):
            raise ConfigError(f"{FIELD}: {type(model).__name__} is not a decoder with a `score` head (Llama, Qwen2, "
                              "Mistral, … For(Sequence|Token)Classification)")
        self.model = model.to(self.device).eval()
        self.model.requires_grad_(False)
        self.base, self.head = base, head
        self.pad_id = self.tokenizer.pad_token_id

    def rows(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> list[list[int]]:
        """The reward model's input ids of each ``prompt + response`` (policy ids when the vocabularies agree)."""
        if self.same_vocab:
            return [list(p) + list(r) for p, r in zip(prompts, responses)]
        texts = self.policy_tokenizer.batch_decode([list(p) + list(r) for p, r in zip(prompts, responses)])
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    @torch.no_grad()
    def score(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], *, micro_batch: int) -> list[float]:
        """One score per row, ``micro_batch`` rows per forward pass; back to host memory in one copy.

        ``s_i = w · h_i[L_i - 1] (+ b)``: the ``score`` head (``w``, ``(1, H)``) on the final hidden
        state of the row's last token (position ``L_i - 1`` of ``prompt + response``, EOS included
        when emitted), as ``GenericForSequenceClassification`` pools and verl reads a token-level
        value head (the value of the last token; eval mode, no dropout) — read at the row's length here,
        so a pad id that equals EOS cannot move it. Rows are right-padded; a row's score does
        not depend on the others in its micro-batch.
        """
        ids = self.rows(prompts, responses)
        parts: list[torch.Tensor] = []
        for s in range(0, len(ids), micro_batch):
            chunk = ids[s : s + micro_batch]
            lengths = torch.tensor([len(r) for r in chunk])
            input_ids = torch.full((len(chunk), int(lengths.max())), self.pad_id, dtype=torch.long)
            for i, r in enumerate(chunk):
                input_ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
            attention_mask = (torch.arange(input_ids.shape[1]) < lengths.unsqueeze(1)).long()
            input_ids, attention_mask, last = input_ids.to(self.device), attention_mask.to(self.device), (lengths - 1).to(self.device)
            with autocast(self.device, self.autocast_bf16):
                hidden = self.base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
                scores = self.head(hidden[torch.arange(len(chunk), device=self.device), last])
            parts.append(scores.float())  # (b, 1)
        return to_host_rows(parts)[:, 0].tolist() if parts else []


def build_reward_model(cfg: Config, model_path: Path, policy_tokenizer: Any, ranks: ProcessRanks) -> HFRewardModel:
    """The run's reward model (``reward_model.model``) on this process's device, with the
    actor's bf16 autocast setting (``trainer.autocast_bf16``, as the reference)."""
    m = cfg.reward_model.model
    return HFRewardModel(model_path, policy_tokenizer=policy_tokenizer, autocast_bf16=cfg.trainer.autocast_bf16 is True,
                         trust_remote_code=m.trust_remote_code, device=ranks.device)
