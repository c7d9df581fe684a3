"""Actor → rollout weights over torch.distributed: a bucketed broadcast of the named parameters.

When the actor and the rollout engine are separate processes, the updated weights travel over
a process group of their own: the actor is rank 0, each rollout process one of the ranks
``1 .. world_size-1``. They meet through a ``TCPStore`` the launcher hosts (``address`` =
``host:port``). After each update the actor casts its parameters to the rollout dtype (fp32 →
bf16 halves the bytes), packs consecutive ones into buckets of at most ``bucket_bytes`` (a
larger tensor gets a bucket of its own) and broadcasts bucket by bucket; a receiver unpacks
every bucket straight into its engine's parameters, so peak extra memory is one bucket.

Both sides derive the same bucket plan from the parameter names, shapes and the dtype; a
fingerprint of those is broadcast first, so two different models fail with a clear error
instead of silently mixing weights. The channel's backend follows the device
(``dockrl.parallel.device.channel_backend``): NCCL between GPUs, the buckets on the device;
gloo on CPU; on an NPU gloo over host buffers (each bucket is copied to host once on the
sender and to the device once on the receiver).

This is the seed of the allgather–swap resharding of a hybrid actor (docs/design.md §3), which
will replace the broadcast with an all-gather of training shards into inference buckets.
"""

from __future__ import annotations

import hashlib
import logging
import time
from datetime import timedelta
from typing import Callable, Iterable, Sequence

import torch
import torch.distributed as dist

from dockrl.parallel import device as devices

CPU = torch.device("cpu")

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 64 << 20
"""Bytes per broadcast bucket (in the rollout dtype)."""
SENDER = 0
"""Rank of the actor in the weight group."""


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` → (host, port).

    Raises:
        ValueError: not ``host:port`` with a port in 1-65535.
    """
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"weight sync address: got {address!r}; expected host:port, e.g. 127.0.0.1:29500")
    return host, int(port)


def plan_buckets(numels: Sequence[int], element_size: int, bucket_bytes: int) -> list[list[int]]:
    """Group consecutive tensors (by index) into buckets of at most ``bucket_bytes``.

    A tensor larger than ``bucket_bytes`` gets a bucket of its own.

    Raises:
        ValueError: ``bucket_bytes`` < 1.
    """
    if bucket_bytes < 1:
        raise ValueError(f"weight sync: bucket_bytes={bucket_bytes}; expected a positive number of bytes")
    buckets: list[list[int]] = []
    size = 0
    for i, n in enumerate(numels):
        nbytes = n * element_size
        if not buckets or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return buckets


def fingerprint(specs: Iterable[tuple[str, Sequence[int]]], dtype: torch.dtype) -> int:
    """A signed 64-bit digest of the parameter names, shapes (in order) and the wire dtype."""
    text = ";".join(f"{name}:{tuple(shape)}" for name, shape in specs) + f"|{dtype}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little", signed=True)


class WeightChannel:
    """One process's end of the weight group (the actor sends, rollout processes receive).

    Args:
        address: ``host:port`` of the launcher's ``TCPStore``.
        rank: 0 for the actor (``SENDER``), 1.. for rollout processes.
        world_size: 1 + the number of rollout processes.
        timeout_s: longest the rendezvous and each collective may wait, seconds; a timeout
            raises from torch.distributed naming the collective.
        bucket_bytes: bucket size, bytes of the wire dtype.
        device: this end's device (its engine's); every rank of a channel uses the same kind.

    The constructor blocks until every rank joined. The channel is a process group of its own
    (``devices.channel_group``), not the process's default group, which stays free for the
    engines (vLLM makes a default group of one for itself; megatron builds its groups over the
    default group).

    Raises:
        ValueError: bad address or rank.
    """

    def __init__(
        self, address: str, *, rank: int, world_size: int = 2, timeout_s: float = 600.0, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        device: torch.device = CPU,
    ) -> None:
        host, port = parse_address(address)
        if not 0 <= rank < world_size:
            raise ValueError(f"weight sync: rank={rank}; expected 0 <= rank < world_size={world_size}")
        self.rank, self.world_size, self.bucket_bytes = rank, world_size, bucket_bytes
        backend = devices.channel_backend(device.type)
        # buckets travel on the device with NCCL, in (pinned) host memory with gloo
        self.wire_device = device if backend == "nccl" else torch.device("cpu")
        self._pinned = self.wire_device.type == "cpu" and devices.host_pinned(device)
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        # a group object of its own: collectives are called on it directly (it is not registered
        # with torch.distributed, so the default group, if any, is untouched)
        self._group: dist.ProcessGroup | None = devices.channel_group(
            device.type, store, prefix="dockrl/weights", rank=rank, world_size=world_size, timeout_s=timeout_s,
        )
        logger.info("weight channel: rank %d of %d joined at %s (%s)", rank, world_size, address, backend)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast ``tensor`` from the actor in place; bounded by the group's timeout."""
        if self._group is None:
            raise RuntimeError("weight sync: the channel is closed")
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = SENDER, 0
        self._group.broadcast([tensor], opts).wait()

    def _check_fingerprint(self, mine: int) -> None:
        theirs = torch.tensor([mine], dtype=torch.int64, device=self.wire_device)
        self._broadcast(theirs)
        if int(theirs) != mine:
            raise ValueError(
                "weight sync: the actor's parameters (names, shapes, wire dtype) differ from this rollout engine's; "
                "both must load the same model.path and use rollout.dtype"
            )

    def send(self, named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> dict[str, float]:
        """Broadcast ``named`` weights cast to ``dtype`` (rank 0 only); returns ``weight_sync/*`` metrics.

        Returns:
            ``weight_sync/bytes`` (bytes sent per receiver), ``weight_sync/buckets`` and
            ``weight_sync/seconds`` (cast, pack and broadcast, wall clock).
        """
        if self.rank != SENDER:
            raise RuntimeError(f"weight sync: send() on rank {self.rank}; only rank {SENDER} (the actor) sends")
        start = time.perf_counter()
        names, tensors = zip(*((n, t.detach()) for n, t in named))
        self._check_fingerprint(fingerprint(((n, t.shape) for n, t in zip(names, tensors)), dtype))
        element_size = torch.empty((), dtype=dtype).element_size()
        buckets = plan_buckets([t.numel() for t in tensors], element_size, self.bucket_bytes)
        sent = 0
        with torch.no_grad():
            for bucket in buckets:
                # cast and pack where the weights are; one copy per bucket to the wire's device
                flat = torch.cat([tensors[i].to(dtype).reshape(-1) for i in bucket]).to(self.wire_device)
                self._broadcast(flat)
                sent += flat.numel() * element_size
        return {"weight_sync/bytes": sent, "weight_sync/buckets": len(buckets), "weight_sync/seconds": time.perf_counter() - start}

    def receive(
        self, params: Sequence[tuple[str, torch.Tensor]], load: Callable[[Iterable[tuple[str, torch.Tensor]]], int]
    ) -> dict[str, float]:
        """Receive one broadcast into ``params`` (a rollout rank); returns ``weight_sync/*`` metrics.

        Args:
            params: this engine's ``(name, parameter)`` pairs, in the sender's order (same
                model); all of one dtype, the wire dtype.
            load: copies received ``(name, tensor)`` pairs into the engine and returns the
                bytes copied (``HFRolloutEngine.load_weights``).

        Returns:
            ``weight_sync/bytes`` (bytes loaded), ``weight_sync/buckets``,
            ``weight_sync/seconds`` (from the first byte to the last copy, wall clock).

        Raises:
            ValueError: the sender's parameters differ (fingerprint), or ``params`` mix dtypes.
        """
        if self.rank == SENDER:
            raise RuntimeError("weight sync: receive() on the sending rank")
        dtypes = {p.dtype for _, p in params}
        if len(dtypes) != 1:
            raise ValueError(f"weight sync: the rollout parameters mix dtypes {sorted(map(str, dtypes))}; expected one")
        (dtype,) = dtypes
        self._check_fingerprint(fingerprint(((n, p.shape) for n, p in params), dtype))
        start = time.perf_counter()  # after the fingerprint: waiting for the sender is not transfer time
        element_size = torch.empty((), dtype=dtype).element_size()
        buckets = plan_buckets([p.numel() for _, p in params], element_size, self.bucket_bytes)
        loaded = 0
        for bucket in buckets:
            flat = torch.empty(sum(params[i][1].numel() for i in bucket), dtype=dtype, device=self.wire_device, pin_memory=self._pinned)
            self._broadcast(flat)  # the engine's load copies each view to its device
            views = flat.split([params[i][1].numel() for i in bucket])
            loaded += load((params[i][0], v.view(params[i][1].shape)) for i, v in zip(bucket, views))
        return {"weight_sync/bytes": loaded, "weight_sync/buckets": len(buckets), "weight_sync/seconds": time.perf_counter() - start}

    def close(self) -> None:
        """Leave the group (idempotent)."""
        self._group = None
