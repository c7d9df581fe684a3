"""The actor's LoRA adapter in the vLLM rollout engine (``trainer.lora.sync=adapter`` with ``rollout.engine=vllm``).

vLLM serves LoRA adapters from peft folders (``enable_lora``, a ``LoRARequest`` per request). Each
weight sync writes the received adapter tensors as a peft folder (``adapter_config.json``,
``adapter_model.safetensors``: a few MB) and registers it under a new adapter id, so that no cached
copy of an older update (vLLM's adapter cache, its prefix cache, whose keys include the id) can
serve; the previous id is removed from vLLM and its folder deleted. The base weights in vLLM never
change. vLLM 0.32 has no in-memory adapter path: the folder lives in a temporary directory of the
engine's (``tempfile``; tmpfs where ``TMPDIR`` points to one).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors.torch import save_file

from dockrl.config import LoraConfig

VLLM_MAX_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32 accepts for ``max_lora_rank`` (``vllm.config.lora.MaxLoRARanks``)."""


def max_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that holds ``rank`` (vLLM pads smaller adapters).

    Raises:
        ValueError: ``rank`` above vLLM's largest (names ``trainer.lora.rank``).
    """
    for allowed in VLLM_MAX_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"trainer.lora.rank: got {rank}; vLLM serves adapters up to rank {VLLM_MAX_RANKS[-1]}")


def peft_key(name: str) -> str:
    """A parameter name of a model with injected adapters (``model.layers.0.self_attn.q_proj.lora_A.default.weight``)
    → its key in a peft folder (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``)."""
    return "base_model.model." + name.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")


class VLLMAdapters:
    """The adapter one vLLM engine generates with: folders written per update, one id each.

    Args:
        llm: the engine's ``vllm.LLM`` (built with ``enable_lora``).
        lora: ``trainer.lora`` (rank, alpha, target modules: the folder's ``adapter_config.json``).
        names: the adapter's parameter names, in the actor's order (``hf.lora.adapter_shapes``): a
            sync must carry all of them.
    """

    def __init__(self, llm: Any, lora: LoraConfig, names: Iterable[str]) -> None:
        from peft import LoraConfig as PeftLoraConfig  # lazy: peft loads only for a LoRA run (vllm.py imports this module)

        self.llm, self.names = llm, frozenset(names)
        self.config = PeftLoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0,  # type: ignore[arg-type]  # float alpha: peft divides
                                     target_modules=list(lora.target_modules), bias="none")
        self.root = Path(tempfile.mkdtemp(prefix="dockrl-vllm-lora-"))
        self.request: Any = None  # None: the base model (the actor's adapters start with B = 0)
        self.updates = 0

    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Write the adapter tensors as a new folder and serve it from the next ``generate``; returns
        the bytes written (fp32 tensors).

        Raises:
            ValueError: not exactly the adapter's tensors (names the missing or foreign ones).
        """
        from vllm.lora.request import LoRARequest  # lazy: vllm is an optional extra (already imported: the engine runs)

        tensors = {peft_key(n): t.detach().to("cpu", torch.float32).contiguous() for n, t in named}
        got = {n for n in self.names if peft_key(n) in tensors}
        if got != self.names or len(tensors) != len(self.names):
            missing = sorted(self.names - got)[:4]
            foreign = sorted(set(tensors) - {peft_key(n) for n in self.names})[:4]
            raise ValueError(f"vLLM adapter sync: expected the {len(self.names)} adapter tensors; missing {missing}, foreign {foreign}")
        self.updates += 1
        folder = self.root / f"update-{self.updates}"
        self.config.save_pretrained(str(folder))
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        previous, self.request = self.request, LoRARequest(f"policy-{self.updates}", self.updates, str(folder))
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        self.llm.reset_prefix_cache()
        return sum(t.numel() * t.element_size() for t in tensors.values())

    def close(self) -> None:
        """Delete the folders (idempotent)."""
        shutil.rmtree(self.root, ignore_errors=True)
