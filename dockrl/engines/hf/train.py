"""Training on torch + transformers: ``HFTrainEngine``, the actor (or frozen reference) on one device.

It computes per-token log-probs of given responses (``hf.logprobs.response_log_probs``) and runs
GRPO updates on them (``micro_batching``: micro-batch loops, AdamW, a clipped step), on any local
HF causal-LM directory (Llama, Qwen2, ...). The model is moved to ``device`` (the process's device
from the layout, ``dockrl.parallel.device.process_device``) once; each call packs its rows into
padded host tensors and moves them there in one copy per tensor, and the results come back in one
copy per call (never a transfer per row). With ``lora`` (``trainer.lora``) it trains LoRA adapters
only (``dockrl.engines.hf.lora``), and its ``reference()`` is the same module with them disabled.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from dockrl.config import LoraConfig
from dockrl.engines.hf.load import load_model, load_tokenizer
from dockrl.engines.hf.logprobs import packing_works, response_log_probs
from dockrl.engines.micro_batching import adamw, backward_per_micro_batch, clipped_step, forward_per_micro_batch
from dockrl.engines.train_engine import LossFn


def checkpoint_layers(model: Any, model_path: str | Path) -> None:
    """Gradient checkpointing of ``model``'s decoder layers with the rest left in eval mode.

    transformers checkpoints a ``GradientCheckpointingLayer`` only while that module is in
    training mode; the engine keeps every module in eval mode (no dropout anywhere), so only the
    layers themselves are put in training mode, not their submodules (attention, MLP, dropout):
    their own ``training`` flag, which no Llama-like layer reads for anything else. The rollout
    sharing this module puts it in eval mode while it generates (``HFRolloutEngine._generating``),
    so generation keeps its KV cache.

    Raises:
        ValueError: the model has no layer transformers can checkpoint (names ``trainer.gradient_checkpointing``).
    """
    from transformers.modeling_layers import GradientCheckpointingLayer  # lazy: only with checkpointing on

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not getattr(model, "supports_gradient_checkpointing", False) or not layers:
        raise ValueError(f"trainer.gradient_checkpointing=true: the model at {model_path} ({type(model).__name__}) has no "
                         "decoder layers transformers can checkpoint; set trainer.gradient_checkpointing=false")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for layer in layers:
        layer.training = True


class HFTrainEngine:
    """The actor (or frozen reference) on torch: fp32 weights, optional bf16 autocast, AdamW.

    Implements ``dockrl.engines.train_engine.TrainEngine``.

    Args:
        model_path: local HF model directory.
        trainable: build an optimizer and allow updates (False for the reference).
        device: where the model computes (the process's device); weights stay fp32 there
            (the master weights of the update), bf16 only inside autocast.
        lora: with ``rank`` > 0, LoRA adapters (Hu et al. 2021, arXiv 2106.09685) injected into
            ``model`` (``hf.lora.add_adapters``), the only parameters that train; ``self.model``
            stays the transformers module (adapters on) and ``self.peft`` is peft's wrapper
            (None without LoRA). ``named_weights`` and ``save`` then give merged weights.
        gradient_checkpointing: recompute each decoder layer's activations in the backward pass
            instead of keeping them (Chen et al. 2016, arXiv 1604.06174; transformers'
            ``gradient_checkpointing_enable``, non-reentrant): the update's activation memory
            falls from every layer's to one layer's plus the layers' inputs, for about one more
            forward pass of compute; the output head's logits are computed in chunks and recomputed
            too (``hf.logprobs.head_log_probs``). The same gradients (``tests/engines/test_hf.py``).

    Raises:
        ValueError: ``lora.target_modules`` matches no module of the model; ``gradient_checkpointing``
            with a model whose decoder layers transformers cannot checkpoint.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        trainable: bool,
        lr: float = 1e-6,
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        autocast_bf16: bool = False,
        trust_remote_code: bool = False,
        device: torch.device | str = "cpu",
        lora: LoraConfig | None = None,
        gradient_checkpointing: bool = False,
    ) -> None:
        self.device = torch.device(device)
        self.tokenizer = load_tokenizer(model_path, trust_remote_code)
        self.pad_id = self.tokenizer.pad_token_id
        self.model = load_model(model_path, "float32", trust_remote_code, self.device)
        self.peft = None
        if lora is not None and lora.enabled:
            from dockrl.engines.hf.lora import add_adapters  # lazy: peft only where LoRA is on

            self.peft = add_adapters(self.model, lora)  # in place: self.model holds the adapters, base weights frozen
        self.autocast_bf16 = autocast_bf16
        self.grad_clip = grad_clip
        self.optimizer = None
        # Eval mode in every forward, also the trained ones: dropout would make the log-probs of
        # one policy differ between passes (the on-policy ratio ≠ 1, old vs new log-probs noisy).
        # Zeroing nn.Dropout modules is not enough: attention implementations read
        # config.attention_dropout and apply it when the module is in train mode (as verl and TRL,
        # RL runs without any dropout). A causal LM has no other train-mode behaviour.
        self.model.eval()
        self.gradient_checkpointing = gradient_checkpointing and trainable  # also the output head's (hf_logprobs.head_log_probs)
        if self.gradient_checkpointing:
            checkpoint_layers(self.model, model_path)
        self.pack = packing_works(self.model, lambda ps, rs, pack: response_log_probs(
            self.model, ps, rs, pad_id=self.pad_id, temperature=1.0, autocast_bf16=False, pack=pack)[0], "the actor's micro-batches")
        if trainable:
            self.optimizer = adamw(self.model, lr=lr, weight_decay=weight_decay)
        else:
            self.model.requires_grad_(False)

    @torch.no_grad()
    def log_probs(
        self, prompts, responses, *, temperature: float, micro_batch: int, micro_batch_tokens: int = 0,
    ) -> list[list[float]]:
        """Per-token log-probs (nats) of each response, in the caller's row order, computed over
        micro-batches (``micro_batches``: ``micro_batch`` consecutive rows, or rows sorted by length,
        at most ``micro_batch_tokens`` tokens each, when > 0); they come back to host memory in one copy for the
        whole call."""
        def forward(p: list[Sequence[int]], r: list[Sequence[int]]) -> torch.Tensor:
            return response_log_probs(self.model, p, r, pad_id=self.pad_id, temperature=temperature,
                                      autocast_bf16=self.autocast_bf16, pack=self.pack)[0]

        return forward_per_micro_batch(prompts, responses, micro_batch, micro_batch_tokens, forward)

    def forward_backward(
        self, prompts, responses, *, temperature: float, micro_batch: int, loss_fn: LossFn, entropy_grad: bool = False,
        micro_batch_tokens: int = 0,
    ) -> list[Any]:
        """For each micro-batch (``micro_batches``: ``micro_batch`` consecutive rows, or rows sorted by
        length, at most ``micro_batch_tokens`` tokens each, when > 0): ``response_log_probs`` (with entropy,
        differentiable with ``entropy_grad``), ``loss_fn(rows, ...)``, backward.

        Returns:
            The ``aux`` of each micro-batch, in micro-batch order.
        """
        def forward(p: list[Sequence[int]], r: list[Sequence[int]]) -> tuple[torch.Tensor, ...]:
            return response_log_probs(self.model, p, r, pad_id=self.pad_id, temperature=temperature, autocast_bf16=self.autocast_bf16,
                                      with_entropy=True, entropy_grad=entropy_grad, pack=self.pack,
                                      checkpoint_head=self.gradient_checkpointing)

        return backward_per_micro_batch(prompts, responses, micro_batch, forward, loss_fn, micro_batch_tokens)

    def sum_over_replicas(self, values: Sequence[float]) -> list[float]:
        """One process, one replica: ``values`` unchanged."""
        return [float(v) for v in values]

    def optimizer_step(self, accumulate: Callable[[], dict[str, float]]) -> dict[str, float]:
        """Zero grads, run ``accumulate`` (forward/backward over micro-batches), clip, step.

        Returns:
            The metrics of ``accumulate`` plus ``actor/grad_norm`` (before clipping).
        """
        if self.optimizer is None:
            raise RuntimeError("optimizer_step on a frozen engine (trainable=False)")
        metrics, grad_norm = clipped_step(self.model, self.optimizer, self.grad_clip, accumulate)
        metrics["actor/grad_norm"] = grad_norm
        return metrics

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The current policy's weights by the base model's parameter names; with LoRA each targeted
        weight merged with its adapter (``hf.lora.merged_weights``), a new tensor per call."""
        if self.peft is not None:
            from dockrl.engines.hf.lora import merged_weights  # lazy: peft loads only for a LoRA actor

            return merged_weights(self.model)
        return ((n, p.detach()) for n, p in self.model.named_parameters())

    def adapter_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The LoRA adapter tensors alone (``hf.lora.adapter_weights``: names, order and shapes of a
        rollout copy with the same adapters), no copy: an adapter-only weight sync.

        Raises:
            ValueError: the engine has no adapters (``lora`` off).
        """
        if self.peft is None:
            raise ValueError("adapter_weights(): the engine has no LoRA adapters (trainer.lora.rank is 0)")
        from dockrl.engines.hf.lora import adapter_weights  # lazy: peft loads only for a LoRA actor

        return adapter_weights(self.model)

    def reference(self) -> AdaptersDisabled:
        """The frozen reference of a LoRA actor: this engine's module with its adapters disabled
        (the initial policy exactly; no second copy of the weights).

        Raises:
            ValueError: the engine has no adapters (``lora`` off).
        """
        if self.peft is None:
            raise ValueError("reference(): the engine has no LoRA adapters to disable (trainer.lora.rank is 0)")
        return AdaptersDisabled(self)

    def save(self, path: str | Path) -> Path:
        """Write an HF checkpoint (safetensors + tokenizer) loadable with ``from_pretrained``; with
        LoRA the merged weights (``hf.lora.merged_state_dict``), and the adapter in ``PATH/adapter``
        (``hf.lora.save_adapter``)."""
        path = Path(path)
        if self.peft is not None:
            from dockrl.engines.hf.lora import merged_state_dict, save_adapter  # lazy: peft loads only for a LoRA actor

            self.model.save_pretrained(path, state_dict=merged_state_dict(self.model))
            save_adapter(self.peft, path)
        else:
            self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        return path


class AdaptersDisabled:
    """The reference stage's engine over a LoRA actor (``HFTrainEngine.reference``): ``log_probs``
    of the actor's module inside peft's ``disable_adapter()``, which computes with the base weights
    alone. Only ``log_probs`` (the reference stage's one call); nothing of it trains."""

    def __init__(self, actor: HFTrainEngine) -> None:
        assert actor.peft is not None, "AdaptersDisabled: an engine with adapters"
        self.actor, self.optimizer = actor, None

    def log_probs(self, prompts, responses, *, temperature: float, micro_batch: int, micro_batch_tokens: int = 0) -> list[list[float]]:
        """``HFTrainEngine.log_probs`` of the base model (the actor's adapters disabled for the call)."""
        assert self.actor.peft is not None
        with self.actor.peft.disable_adapter():
            return self.actor.log_probs(prompts, responses, temperature=temperature, micro_batch=micro_batch,
                                        micro_batch_tokens=micro_batch_tokens)
