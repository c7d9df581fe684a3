"""LoRA adapters on the hf engine's actor (``trainer.lora``; Hu et al. 2021, arXiv 2106.09685), with peft.

``add_adapters`` injects the adapters into a transformers model in place (peft's ``LoraConfig``,
dropout 0); the module stays the transformers model the engine, the rollout and the log-probs code
call, and ``model.peft`` is peft's wrapper (``disable_adapter``, ``save_pretrained``).
``merged_weights`` and ``merged_state_dict`` give the current policy as the base model's tensors,
W + (alpha / rank) · B·A per targeted layer, computed beside W: merging into W and unmerging after
(peft's ``merge_adapter`` / ``unmerge_adapter``) would leave W off by a rounding each time, and the
base weights are the reference policy, which must stay exactly the initial model's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

import torch
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from peft.utils import load_peft_weights
from transformers import AutoConfig, AutoModelForCausalLM

from dockrl.config import LoraConfig

ADAPTER_DIR = "adapter"
"""The adapter's folder in a checkpoint (peft's ``save_pretrained``: ``adapter_config.json``,
``adapter_model.safetensors``), beside the merged HF weights."""
ADAPTER = "default"
"""peft's name of the one adapter."""


def add_adapters(model: torch.nn.Module, lora: LoraConfig) -> PeftModel:
    """Inject LoRA adapters into ``model`` (in place) and freeze everything else.

    Each linear module whose name ends with one of ``lora.target_modules`` gets A ``(rank, in)``
    (Kaiming-uniform, from torch's generator) and B ``(out, rank)`` (zeros): the adapted model
    starts as the base model exactly. Dropout is 0 (``LoraConfig``'s docstring says why).

    Returns:
        peft's wrapper of ``model``; ``model`` itself keeps its type and now holds the adapters.

    Raises:
        ValueError: no module of ``model`` matches ``lora.target_modules`` (peft's message names them).
    """
    # peft annotates lora_alpha as int but computes scaling = lora_alpha / r: a float alpha is exact
    config = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0,  # type: ignore[arg-type]
                            target_modules=list(lora.target_modules), bias="none")
    return get_peft_model(model, config)


def _base_name(name: str) -> str:
    """A parameter's name in the model without adapters (peft moves W under ``<layer>.base_layer``)."""
    return name.replace(".base_layer.", ".")


def _deltas(model: torch.nn.Module) -> dict[str, LoraLayer]:
    """The adapted layers of ``model`` by the name of the weight they change (``....q_proj.weight``)."""
    return {f"{name}.weight": m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


@torch.no_grad()
def _merged(name: str, tensor: torch.Tensor, deltas: dict[str, LoraLayer]) -> torch.Tensor:
    layer = deltas.get(name)
    if layer is None:
        return tensor.detach()
    delta = layer.get_delta_weight(ADAPTER)  # type: ignore[attr-defined]  # each LoRA layer kind (Linear, Embedding...) defines it
    return tensor.detach() + delta.to(tensor.dtype)


def _merged_items(model: torch.nn.Module, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``items`` of ``model`` (its parameters or state dict) under the base model's names, adapters left out,
    each targeted weight merged with its adapter."""
    deltas = _deltas(model)
    for name, t in items:
        if ".lora_" not in name:
            base = _base_name(name)
            yield base, _merged(base, t, deltas)


def merged_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every parameter of the model without adapters (``named_parameters``'
    names and order, a tied weight once), each targeted weight merged with its adapter: the
    current policy for a rollout copy of the base model (``HFRolloutEngine.load_weights``).
    Untargeted weights are the parameters themselves (no copy); merged ones are new tensors."""
    return _merged_items(model, model.named_parameters())


def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` of the model without adapters, the targeted weights merged (what
    ``save_pretrained(state_dict=...)`` writes: a plain HF checkpoint of the current policy)."""
    return dict(_merged_items(model, model.state_dict().items()))


def adapter_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every adapter parameter of ``model`` (``....q_proj.lora_A.default.weight``
    A ``(rank, in)``, ``lora_B`` B ``(out, rank)``), in ``named_parameters``' order, detached, no
    copy: what an adapter-only weight sync sends (``trainer.lora.sync=adapter``) to a rollout copy
    that holds the same adapters (``add_rollout_adapters``) over the base weights."""
    return ((n, p.detach()) for n, p in model.named_parameters() if ".lora_" in n)


def add_rollout_adapters(model: torch.nn.Module, lora: LoraConfig) -> None:
    """Give a rollout copy of the base model the actor's adapters (same names and shapes), in place,
    frozen; their values come with each sync (``adapter_weights``). B starts at zero as the actor's, so
    the copy is the base model until the first sync. Torch's generator is left as it was (A's
    initialisation draws from it, and the rollout's sampling must not depend on whether it exists).
    peft keeps the adapters in fp32 over a bf16 copy (its ``autocast_adapter_dtype``): the update
    B·A is not rounded twice.

    Raises:
        ValueError: no module of ``model`` matches ``lora.target_modules``.
    """
    device = next(model.parameters()).device
    on_device = [] if device.type == "cpu" else [device.index or 0]
    with torch.random.fork_rng(devices=on_device, device_type="cuda" if device.type == "cpu" else device.type):
        add_adapters(model, lora)
    model.requires_grad_(False)


def adapter_numel(model: torch.nn.Module) -> int:
    """Number of adapter (trainable) parameters of ``model``."""
    return sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)


def save_adapter(peft_model: PeftModel, checkpoint: Path) -> Path:
    """Write the adapter to ``CHECKPOINT/adapter`` (peft's ``save_pretrained``; loadable with
    ``PeftModel.from_pretrained(base, CHECKPOINT/adapter)`` over the run's ``model.path``)."""
    out = Path(checkpoint) / ADAPTER_DIR
    peft_model.save_pretrained(str(out))
    return out


def adapter_shapes(model_path: str | Path, lora: LoraConfig, trust_remote_code: bool = False) -> list[tuple[str, torch.Size]]:
    """``(name, shape)`` of the adapter tensors an actor over ``model_path`` sends (``adapter_weights``'
    names and order), from ``config.json`` alone: the model and its adapters are built on the meta
    device (no weights read or allocated). For a rollout engine that holds its weights in its own
    layout (vLLM)."""
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
        add_adapters(meta, lora)
    return [(n, p.shape) for n, p in meta.named_parameters() if ".lora_" in n]


def checkpoint_adapter(checkpoint: Path) -> list[tuple[str, torch.Tensor]]:
    """The adapter tensors of ``CHECKPOINT/adapter`` (peft's ``load_peft_weights``) under the names of a
    model with injected adapters (``adapter_weights``' names): what a rollout copy loads on resume.

    Raises:
        FileNotFoundError: the checkpoint has no adapter folder (not written by a LoRA run).
    """
    folder = Path(checkpoint) / ADAPTER_DIR
    if not (folder / "adapter_config.json").is_file():
        raise FileNotFoundError(f"run.resume {checkpoint}: no {ADAPTER_DIR}/adapter_config.json; expected a checkpoint of a "
                                "trainer.lora run")
    tensors = load_peft_weights(str(folder), device="cpu")
    def name(key: str) -> str:  # peft's key in the folder → the parameter's name in the model (adapter ``default``)
        return key.removeprefix("base_model.model.").replace(".lora_A.", f".lora_A.{ADAPTER}.").replace(".lora_B.", f".lora_B.{ADAPTER}.")

    return [(name(k), t) for k, t in tensors.items()]


def load_checkpoint_adapter(peft_model: PeftModel, checkpoint: Path) -> None:
    """Set the adapter of ``peft_model`` (the actor's) to ``CHECKPOINT/adapter``'s, in place: a resumed
    LoRA run continues from it over the base weights.

    Raises:
        FileNotFoundError: the checkpoint has no adapter folder.
        ValueError: the folder's tensors are not this model's adapter (names the unexpected ones).
    """
    named = checkpoint_adapter(checkpoint)
    params = dict(peft_model.model.named_parameters())
    unknown = [n for n, _ in named if n not in params]
    if unknown or len(named) != sum(1 for n in params if ".lora_" in n):
        raise ValueError(f"run.resume {checkpoint}: its adapter does not match trainer.lora (unexpected {unknown[:4]}, "
                         f"{len(named)} tensors)")
    with torch.no_grad():
        for n, t in named:
            params[n].copy_(t)
