"""Host swap of the training state and the device-memory accounting of a weight sync.

``TrainState`` is what the sync needs from a training engine: its training shards under HF
names, and moving optimizer state, gradients and weights to host memory and back.
``ParamTrainState`` implements it for HF-named parameter shards and a torch optimizer (tests,
the benchmark, engines whose parameters are HF-named). An engine with other storage (Megatron's
fused QKV, contiguous gradient buffers) implements the protocol itself.

On ``cuda``/``npu`` a swap copies into pinned host memory and re-points ``param.data``, so
the device memory returns to the allocator. On ``cpu`` host and device are the same memory:
the swap only moves the accounting (``copy_on_cpu=True`` makes real copies, to exercise the
same path in tests).

``MemoryTracker`` counts the device bytes a sync holds, by kind (``weights``, ``grads``,
``optimizer``: the training state still on the device; ``gather``: the gathered buffer;
``buckets``: inference buckets; ``checksum``: its temporaries), and their peak. It is explicit
accounting, updated wherever the sync allocates, frees or swaps a tensor, so it works on CPU
where there is no allocator to ask; on CUDA the allocator's peak is reported beside it.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Iterable, Mapping, Protocol

import torch

from dockrl.parallel.device import host_pinned, synchronize

logger = logging.getLogger(__name__)


class MemoryTracker:
    """Live device bytes by kind and their peak (explicit accounting; see the module docstring)."""

    def __init__(self) -> None:
        self.by_kind: dict[str, int] = defaultdict(int)
        self.current = 0
        self.peak = 0

    def alloc(self, kind: str, nbytes: int) -> None:
        self.by_kind[kind] += nbytes
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def free(self, kind: str, nbytes: int) -> None:
        assert self.by_kind[kind] >= nbytes, f"freeing {nbytes} B of {kind}, only {self.by_kind[kind]} B tracked"
        self.by_kind[kind] -= nbytes
        self.current -= nbytes

    def reset_peak(self) -> None:
        self.peak = self.current


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class TrainState(Protocol):
    """What a weight sync needs from the training engine of one rank."""

    def shard(self, name: str, *, on_host: bool = False) -> torch.Tensor:
        """This rank's training shard of HF parameter ``name``, in the spec's shard layout: on the
        device, or with ``on_host`` its host copy when the weights are swapped out."""
        ...

    def device_bytes(self) -> dict[str, int]:
        """Bytes of ``weights``, ``grads`` and ``optimizer`` state now on the device."""
        ...

    def offload_optimizer_and_grads(self) -> dict[str, int]:
        """Move optimizer state and gradients to host; return the bytes moved by kind."""
        ...

    def offload_weights(self, names: Iterable[str] | None) -> dict[str, int]:
        """Move the weights ``names`` (``None``: all still on the device) to host; return bytes by kind."""
        ...

    def reload(self) -> dict[str, int]:
        """Bring weights, gradients and optimizer state back to the device; return bytes by kind."""
        ...


class ParamTrainState:
    """``TrainState`` of HF-named parameter shards and an optional torch optimizer over them.

    Args:
        params: ``{hf_name: parameter}`` of this rank (e.g. ``nn.Parameter`` of ``shard_state_dict``).
        optimizer: optimizer whose state is swapped with the gradients; ``None``: none.
        device: the device the training state lives on.
        copy_on_cpu: on a CPU device, make real host copies instead of moving only the accounting.

    Raises:
        ValueError: a parameter is not on ``device``.
    """

    def __init__(
        self,
        params: Mapping[str, torch.Tensor],
        optimizer: torch.optim.Optimizer | None = None,
        *,
        device: torch.device,
        copy_on_cpu: bool = False,
    ) -> None:
        for name, p in params.items():
            if p.device != device:
                raise ValueError(f"params[{name!r}]: on {p.device}; expected the training device {device}")
        self.params = dict(params)
        self.optimizer = optimizer
        self.device = device
        self._copy = device.type != "cpu" or copy_on_cpu
        self._pinned = host_pinned(device)
        self._weights_out: set[str] = set()
        self._grads_out: dict[str, torch.Tensor | None] = {}
        self._optim_out: list[tuple[dict, str]] | None = None  # (state, key) swapped to host

    def shard(self, name: str, *, on_host: bool = False) -> torch.Tensor:
        if name in self._weights_out and not on_host:
            raise RuntimeError(f"training weight {name!r} is swapped out to host; reload() first")
        return self.params[name].detach()

    def _optim_tensors(self) -> Iterable[tuple[dict, str, torch.Tensor]]:
        if self.optimizer is None:
            return
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and value.device == self.device:
                    yield state, key, value

    def device_bytes(self) -> dict[str, int]:
        grads = sum(nbytes(p.grad) for n, p in self.params.items() if p.grad is not None and n not in self._grads_out)
        weights = sum(nbytes(p) for n, p in self.params.items() if n not in self._weights_out)
        optim = 0 if self._optim_out is not None else sum(nbytes(v) for _, _, v in self._optim_tensors())
        return {"weights": weights, "grads": grads, "optimizer": optim}

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        if not self._copy:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self._pinned)
        host.copy_(t, non_blocking=self._pinned)
        return host

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=self._pinned) if self._copy else t

    def offload_optimizer_and_grads(self) -> dict[str, int]:
        moved = {"grads": 0, "optimizer": 0}
        for name, p in self.params.items():
            if name not in self._grads_out:
                moved["grads"] += nbytes(p.grad) if p.grad is not None else 0
                self._grads_out[name] = None if p.grad is None else self._to_host(p.grad)
                p.grad = None
        if self._optim_out is None:
            self._optim_out = []
            for state, key, value in list(self._optim_tensors()):
                moved["optimizer"] += nbytes(value)
                state[key] = self._to_host(value)
                self._optim_out.append((state, key))
        synchronize(self.device)
        return moved

    def offload_weights(self, names: Iterable[str] | None) -> dict[str, int]:
        moved = 0
        for name in self.params if names is None else names:
            if name in self._weights_out:
                continue
            p = self.params[name]
            moved += nbytes(p)
            p.data = self._to_host(p.data)
            self._weights_out.add(name)
        return {"weights": moved}

    def reload(self) -> dict[str, int]:
        moved = {"weights": 0, "grads": 0, "optimizer": 0}
        for name in list(self._weights_out):
            p = self.params[name]
            p.data = self._to_device(p.data)
            moved["weights"] += nbytes(p)
        self._weights_out.clear()
        for name, grad in self._grads_out.items():
            if grad is not None:
                self.params[name].grad = self._to_device(grad)
                moved["grads"] += nbytes(grad)
        self._grads_out.clear()
        for state, key in self._optim_out or ():
            state[key] = self._to_device(state[key])
            moved["optimizer"] += nbytes(state[key])
        self._optim_out = None
        synchronize(self.device)
        return moved
