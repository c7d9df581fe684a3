"""Rollout on transformers: ``HFRolloutEngine`` samples responses with ``generate`` and their log-probs.

It generates from its own copy of the actor's weights (``rollout.dtype``), or from the actor's
module itself when both live in one process (``HFRolloutEngine.sharing``). The model lives on one
device (the process's device from the layout, ``dockrl.parallel.device.process_device``): each
batch of prompts goes there in one copy per tensor and the samples come back in one copy per batch.
Implements ``dockrl.engines.rollout_engine.RolloutEngine``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList, PreTrainedModel

from dockrl.config import LoraConfig
from dockrl.engines.hf.load import load_model, load_tokenizer, model_device, warn_foreign_sampling
from dockrl.engines.rollout_engine import Sample


class HFRolloutEngine:
    """Samples responses with ``transformers`` ``generate``: from a copy of the actor's weights, or
    from the actor's own module (``HFRolloutEngine.sharing``).

    Args:
        model_path: local HF model directory.
        dtype: weights of this copy (``bfloat16`` is ~3× faster on CPUs with bf16 units).
        device: where the model generates (the process's device).
        lora: with ``rank`` > 0, the copy holds the actor's LoRA adapters over the base weights
            (``hf.lora.add_rollout_adapters``; fp32 adapters over a bf16 copy) and each sync loads
            the adapter tensors alone (``trainer.lora.sync=adapter``).
    """

    def __init__(
        self, model_path: str | Path, *, dtype: str = "bfloat16", trust_remote_code: bool = False,
        device: torch.device | str = "cpu", lora: LoraConfig | None = None,
    ) -> None:
        model = load_model(model_path, dtype, trust_remote_code, torch.device(device)).eval()
        if lora is not None and lora.enabled:
            from dockrl.engines.hf.lora import add_rollout_adapters  # lazy: peft loads only for a LoRA run

            add_rollout_adapters(model, lora)
        model.requires_grad_(False)
        self._setup(model, load_tokenizer(model_path, trust_remote_code), model_path, shared=False)

    @classmethod
    def sharing(cls, model: PreTrainedModel, tokenizer: Any, model_path: str | Path) -> HFRolloutEngine:
        """An engine that generates with ``model`` itself — the actor's module, trained in the same
        process — instead of a copy: no second set of weights in memory and nothing to copy after
        an update (``load_weights`` then copies nothing), as TRL's GRPOTrainer and verl's
        colocated hybrid engine do. ``generate`` runs under ``torch.no_grad`` with the model in
        eval mode and its own generation config swapped in for the call only; it leaves the
        module's mode, generation config, ``requires_grad`` and ``.grad`` as they were.

        Args:
            model: the module to generate with (its device and dtype are the engine's).
            tokenizer: ``model``'s tokenizer (``load_tokenizer``: a PAD token set).
            model_path: the directory ``model`` was loaded from (named in warnings).
        """
        engine = cls.__new__(cls)
        engine._setup(model, tokenizer, model_path, shared=True)
        return engine

    def _setup(self, model: PreTrainedModel, tokenizer: Any, model_path: str | Path, *, shared: bool) -> None:
        self.model, self.tokenizer, self.shared = model, tokenizer, shared
        self.device = model_device(model)
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id
        # generate() fills every field left unset from the model's generation config: generate with
        # one without processors, so that only what generate() passes applies (warn_foreign_sampling)
        self.ignored_sampling = warn_foreign_sampling(model_path, model.generation_config, "hf")
        self.generation_config = GenerationConfig(
            bos_token_id=model.generation_config.bos_token_id, eos_token_id=self.eos_id, pad_token_id=self.pad_id,
        )
        if not shared:  # its own copy: set once
            model.generation_config = self.generation_config

    @contextlib.contextmanager
    def _generating(self):
        """The model in eval mode with this engine's generation config, restored afterwards (a
        shared module goes back to the actor as it was: ``save_pretrained`` writes its own config)."""
        model = self.model
        modes, config = [(m, m.training) for m in model.modules()], model.generation_config  # each module's own
        model.eval()
        model.generation_config = self.generation_config
        try:
            yield model
        finally:
            model.generation_config = config
            for module, training in modes:  # not model.train(flag): that would give every submodule the root's mode
                module.training = training

    @torch.no_grad()
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
        """One response per prompt (repeat a prompt n times for a group).

        Samples from ``softmax(z / τ)`` restricted to the ``top_p`` nucleus and nothing else: the
        processors of the model's own generation config are not applied (``warn_foreign_sampling``).
        Log-probs are ``log_softmax(logits / τ)`` of the raw logits (not the processed scores)
        at the sampled token (``SampledLogProbs``: one step's logits held at a time); prompts are left-padded and position
        ids follow the attention mask (docs/design.md §7: both matter to match a teacher-forced pass).
        A response that reaches ``max_new_tokens`` without EOS is ``truncated`` and gets no
        EOS appended.
        """
        out: list[Sample] = []
        for start in range(0, len(prompts), batch_size):
            out.extend(self._generate_batch(prompts[start : start + batch_size], max_new_tokens, temperature, top_p, greedy))
        return out

    def _generate_batch(self, prompts, max_new_tokens, temperature, top_p, greedy) -> list[Sample]:
        P = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), P), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, p in enumerate(prompts):
            input_ids[i, P - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            attention_mask[i, P - len(p) :] = 1
        sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
        config = GenerationConfig(  # exactly the configured processors: temperature and top_p (none when greedy)
            max_new_tokens=max_new_tokens, eos_token_id=self.eos_id, pad_token_id=self.pad_id,
            return_dict_in_generate=True, **sampling,
        )
        recorder = SampledLogProbs(1.0 if greedy else temperature)
        with self._generating() as model:
            gen = model.generate(
                input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device), generation_config=config,
                logits_processor=LogitsProcessorList([recorder]),
            )
        tokens = gen.sequences[:, P:]
        lps = recorder.finish(tokens).cpu()  # one copy per batch
        tokens = tokens.cpu()
        samples = []
        for i in range(len(prompts)):
            row = tokens[i].tolist()
            if self.eos_id in row:
                end, truncated = row.index(self.eos_id) + 1, False
            else:
                end, truncated = len(row), True
            samples.append(Sample(row[:end], lps[i, :end].tolist(), truncated))
        return samples

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy updated weights in place (cast to this engine's dtype); returns bytes copied. A
        tensor that already is the parameter (``sharing``: the actor's own weights; same device,
        start, dtype, shape and strides) is not copied and not counted; any other view of the
        parameter's storage (a transpose, say) is copied through a clone.

        Raises:
            KeyError: a name this model does not have.
        """
        params = dict(self.model.named_parameters(remove_duplicate=False))  # a tied head by its own name too
        copied = 0
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"rollout engine: no parameter named {name!r}")
            param = params[name]
            if tensor.device == param.device and tensor.untyped_storage().data_ptr() == param.untyped_storage().data_ptr():
                if (tensor.storage_offset() == param.storage_offset() and tensor.dtype == param.dtype
                        and tensor.shape == param.shape and tensor.stride() == param.stride()):
                    continue  # the very same weights
                tensor = tensor.clone()  # another view of the parameter's memory: copy_ refuses overlapping operands
            param.copy_(tensor)
            copied += param.numel() * param.element_size()
        return copied


class SampledLogProbs(LogitsProcessor):
    """Records ``log_softmax(z_t / τ)[o_t]`` of each sampled token during ``generate``, holding one
    step's logits at a time: ``output_logits`` would keep every step's ``(B, V)`` logits until
    ``generate`` returns (32 sequences × 128 steps × 49,152 tokens × 4 bytes = 0.8 GB for SmolLM2).

    ``generate`` calls a processor passed as ``logits_processor`` on the raw fp32 logits ``z_t``,
    before its own temperature and top-p warpers (``GenerationMixin._get_logits_processor`` of the
    pinned transformers appends the warpers after the caller's processors; were that to change,
    ``tests/engines/test_hf.py``'s rollout against a teacher-forced pass at τ = 0.7 fails); the
    token sampled from step ``t`` is ``input_ids[:, -1]`` at the next call, so each call scores the
    previous step's logits and ``finish`` the last. Returns the logits unchanged.

    Args:
        temperature: the sampling temperature τ (1 for greedy decoding).
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self.pending: torch.Tensor | None = None  # the last step's (B, V) logits, its token not yet known
        self.steps: list[torch.Tensor] = []  # (B,) log-probs per scored step

    def _score(self, sampled: torch.Tensor) -> None:
        if self.pending is not None:
            lp = torch.log_softmax(self.pending.float() / self.temperature, dim=-1)
            self.steps.append(lp.gather(1, sampled.unsqueeze(1)).squeeze(1))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self._score(input_ids[:, -1])
        self.pending = scores
        return scores

    def finish(self, tokens: torch.Tensor) -> torch.Tensor:
        """``(B, T)`` log-probs (nats) of the ``(B, T)`` generated ``tokens``.

        Raises:
            AssertionError: ``generate`` called the processor other than once per generated token.
        """
        if tokens.shape[1]:
            self._score(tokens[:, -1])
        self.pending = None
        assert len(self.steps) == tokens.shape[1], f"{len(self.steps)} log-prob steps for {tokens.shape[1]} tokens"
        return torch.stack(self.steps, dim=1) if self.steps else torch.zeros((tokens.shape[0], 0))
