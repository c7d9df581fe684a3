"""CPU device layer for megatron-core: its few ``torch.cuda`` calls, redirected inside a scope.

megatron-core 0.16 runs on CPU over gloo (``use_cpu_initialization=True``, fusions off), except
for a handful of calls that name CUDA outright. ``cpu_device()`` redirects exactly those to their
CPU equivalents while it is active and restores every original on exit:

* ``REDIRECTIONS``: ``torch.cuda`` functions and megatron's RNG-state helpers, replaced as module
  attributes, each listed with the megatron-core function that needs it;
* ``CudaFactoriesOnCpu``: a torch-function mode for the few tensors megatron allocates with a
  literal ``device="cuda"``.

The list was found by running GPTModel forward/backward with TP=2 and PP=2, megatron's
pipeline schedules and its RNG tracker on a CPU-only torch build (what
``dockrl.engines.megatron.engine`` uses). Not covered: megatron's own DDP wrapper, its optimizer and
dist-checkpointing, which call more of ``torch.cuda`` (``current_stream``, ``Stream``, ...).

The attribute redirections apply to the whole process while a scope is active: keep scopes
around megatron-core calls only. Scopes nest and may be entered from several threads; the
originals come back when the last scope exits.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

CPU = torch.device("cpu")


def _current_device() -> torch.device:
    return CPU


def _get_rng_state(device: Any = None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    state = torch.get_rng_state()
    return state.clone() if clone else state


def _set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _manual_seed(seed: int) -> None:
    torch.manual_seed(seed)


def _synchronize(device: Any = None) -> None:
    """CPU ops run eagerly on the calling thread: there is nothing to wait for."""


@dataclass(frozen=True)
class Redirection:
    """``module.name`` is replaced by ``replacement`` inside ``cpu_device()``; ``needed_by`` says why."""

    module: str
    name: str
    replacement: Callable
    needed_by: str


REDIRECTIONS: tuple[Redirection, ...] = (
    Redirection(
        "torch.cuda", "current_device", _current_device,
        "RotaryEmbedding.get_emb moves inv_freq to torch.cuda.current_device(); "
        "P2PCommunicator._communicate allocates its receive buffers there",
    ),
    Redirection(
        "torch.cuda", "synchronize", _synchronize,
        "P2PCommunicator._communicate_shapes and _communicate wait for the stream after "
        "batched p2p ops (PP > 1); gloo's wait() has already completed them on CPU",
    ),
    Redirection(
        "torch.cuda", "manual_seed", _manual_seed,
        "model_parallel_cuda_manual_seed and CudaRNGStatesTracker.add seed the device generator "
        "(on a CPU build the call is queued by _lazy_call and never runs)",
    ),
    Redirection(
        "torch.cuda", "get_rng_state", _get_rng_state,
        "CudaRNGStatesTracker.add reads the device generator state",
    ),
    Redirection(
        "megatron.core.tensor_parallel.random", "_get_cuda_rng_state", _get_rng_state,
        "CudaRNGStatesTracker.fork (dropout in attention) saves the generator state",
    ),
    Redirection(
        "megatron.core.tensor_parallel.random", "_set_cuda_rng_state", _set_rng_state,
        "CudaRNGStatesTracker.add/fork restore the generator state (on a CPU build the CUDA "
        "version is queued by _lazy_call and never runs: the fork would silently not fork)",
    ),
)


def _is_cuda(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, int) and not isinstance(device, bool)  # a bare index means a CUDA device


class CudaFactoriesOnCpu(TorchFunctionMode):
    """Calls with ``device='cuda'`` (or a CUDA index) given literally run with ``device='cpu'``.

    megatron-core allocates a few tensors on a hard-coded ``"cuda"``:
    ``transformer.utils.get_default_causal_mask`` (the causal mask of
    ``FusedScaleMaskSoftmax.forward_torch_softmax`` when no attention mask is passed) and
    ``total_num_tokens`` in ``pipeline_parallel.schedules.forward_backward_no_pipelining`` and
    ``forward_backward_pipelining_without_interleaving``; and with PP > 1 and tied embeddings
    ``LanguageModule.setup_embeddings_and_output_layer`` moves the shared weight with
    ``Tensor.cuda()`` before all-reducing it (here it stays on CPU). A torch-function mode sees
    those calls; every other call passes through unchanged. Like every torch-function mode
    it applies to the thread that entered it (and to the autograd work that thread starts).
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0].cpu()
        if _is_cuda(kwargs.get("device")):
            kwargs = {**kwargs, "device": CPU}
        return func(*args, **kwargs)


_lock = threading.Lock()
_depth = 0
_saved: list[tuple[Any, str, Any]] = []


@contextlib.contextmanager
def cpu_device() -> Iterator[torch.device]:
    """Run megatron-core on CPU inside this scope; yields the device (``cpu``).

    Every attribute in ``REDIRECTIONS`` is replaced on entry of the outermost scope and
    restored on its exit, also when the body raises; ``CudaFactoriesOnCpu`` is active on the
    entering thread for the scope.
    """
    global _depth
    with _lock:
        if _depth == 0:
            for r in REDIRECTIONS:
                module = importlib.import_module(r.module)
                _saved.append((module, r.name, getattr(module, r.name)))
                setattr(module, r.name, r.replacement)
        _depth += 1
    try:
        with CudaFactoriesOnCpu():
            yield CPU
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                while _saved:
                    module, name, original = _saved.pop()
                    setattr(module, name, original)
