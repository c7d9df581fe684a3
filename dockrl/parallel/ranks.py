"""This process's ranks and process groups: one object, built once by the process's entry point.

``ProcessRanks`` is what a process knows of its place in the run: the actor's
``ParallelLayout``, its device, its global rank and coordinates in the layout (tp/dp/pp rank),
its member index and count in its launcher group, and its process groups (TP, PP, DP, the TP × PP
ranks of one model replica, the tied-embedding group). The entry point builds it —
``ProcessRanks.alone`` for a process outside any group, ``join_groups`` for the members of the
actor — and passes it to engines and workers; they never read ``RANK``/``DOCKRL_REPLICA`` from
the environment nor megatron's ``parallel_state`` getters.

``join_groups`` is the one function that creates a process's groups: the default group (over
the launcher's ``TCPStore``, or a group of one on a loopback store), then the layout's groups —
megatron's (``parallel_state.initialize_model_parallel``, which its layers read) when the process
trains with megatron, else its own TP/PP groups (``torch.distributed.new_group``).

``serve_store`` starts a ``TCPStore`` server that listens on the one address asked for: torch's
own listens on every interface whatever host it is given, and its protocol has no authentication,
so a loopback store of a local run would otherwise be open to the machine's network.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import socket
import sys
import warnings
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from dockrl.parallel import device as devices
from dockrl.parallel.cpu_device import cpu_device
from dockrl.parallel.layout import ParallelLayout

logger = logging.getLogger(__name__)

EVERY_INTERFACE = ("", "0.0.0.0", "::")
"""Hosts that mean "listen on every interface" (a pod's own network namespace)."""


def serve_store(host: str, *, timeout_s: float) -> dist.TCPStore:
    """A ``TCPStore`` server on a free port of ``host``, listening on that address only.

    torch's ``TCPStore(host, 0, is_master=True)`` listens on every interface and ignores ``host``;
    here the listening socket is bound to ``host`` first and handed to the store
    (``master_listen_fd``). A host in ``EVERY_INTERFACE`` keeps torch's own listener.

    Args:
        host: address to listen on (``127.0.0.1`` for a local run).
        timeout_s: seconds a request to the store may wait.

    Raises:
        OSError: ``host`` is not an address of this machine.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if host in EVERY_INTERFACE:
        return dist.TCPStore(host or "0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, 0), family=family, backlog=1024)
    port = sock.getsockname()[1]
    # the store owns the socket from here on (detach: Python must not close it when sock is collected)
    return dist.TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout, master_listen_fd=sock.detach())


@dataclass(frozen=True, kw_only=True)
class ProcessRanks:
    """One process's place in the actor's layout and its process groups (see the module docstring)."""

    layout: ParallelLayout
    """The actor's layout (``parallel``), its device kind resolved."""
    device: torch.device
    """This process's device (``devices.process_device``: one per rank process)."""
    rank: int = 0
    """Global rank in the actor's process group (0 outside it)."""
    replica: int = 0
    """Index of this process among the members of its launcher group."""
    replicas: int = 1
    """Members of its launcher group (the actor's: ``layout.world_size``)."""
    tp_group: dist.ProcessGroup | None = None
    """Ranks with this rank's (dp_rank, pp_rank); ``None`` when TP = 1 (or no groups were joined)."""
    pp_group: dist.ProcessGroup | None = None
    """Ranks with this rank's (tp_rank, dp_rank), in stage order; ``None`` when PP = 1."""
    dp_group: dist.ProcessGroup | None = None
    """Ranks with this rank's (tp_rank, pp_rank): the data-parallel replicas; ``None`` when DP = 1."""
    model_group: dist.ProcessGroup | None = None
    """The TP × PP ranks of this rank's model replica (megatron groups only)."""
    embedding_group: dist.ProcessGroup | None = None
    """First and last stage of this rank's pipeline, which share a tied embedding (megatron, PP > 1; ``None`` elsewhere)."""

    def __post_init__(self) -> None:
        self.layout.check_rank(self.rank)
        if not 0 <= self.replica < self.replicas:
            raise ValueError(f"replica: got {self.replica} of {self.replicas}; expected 0 <= replica < replicas")

    @classmethod
    def alone(cls, layout: ParallelLayout, *, replica: int = 0, replicas: int = 1) -> ProcessRanks:
        """A process in no process group (a rollout, reward or reference stage, the in-process driver).

        Raises:
            RuntimeError: ``parallel.device`` names an accelerator this process cannot see.
        """
        return cls(layout=layout, device=devices.process_device(layout.device, 0), replica=replica, replicas=replicas)

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    @property
    def tp_rank(self) -> int:
        return self.layout.train_coords(self.rank).tp_rank

    @property
    def dp_rank(self) -> int:
        return self.layout.train_coords(self.rank).dp_rank

    @property
    def pp_rank(self) -> int:
        return self.layout.train_coords(self.rank).pp_rank

    @property
    def infer_tp_rank(self) -> int:
        return self.layout.infer_coords(self.rank).tp_rank

    @property
    def first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    @property
    def last_stage_rank(self) -> int:
        """Global rank of the last pipeline stage in this rank's PP group."""
        return self.layout.train_rank(self.tp_rank, self.dp_rank, self.layout.pp - 1)

    @property
    def model_leader(self) -> int:
        """Global rank of the first member (TP rank 0, stage 0) of this rank's model replica."""
        return self.layout.train_rank(0, self.dp_rank, 0)


def join_groups(
    layout: ParallelLayout, *, rank: int = 0, store_address: str = "", timeout_s: float, megatron: bool = False,
    local_rank: int | None = None,
) -> ProcessRanks:
    """Create this process's process groups — the one place that does — and return its ranks; collective.

    Args:
        layout: the actor's layout; ``layout.world_size`` processes call this, each with its ``rank``.
        rank: this process's global rank (its member index in the actor's launcher group).
        store_address: ``host:port`` of the rendezvous ``TCPStore`` the launcher (or a test)
            serves; unused by a group of one, whose store listens on a free loopback port.
        timeout_s: seconds the rendezvous and any collective of the groups may wait.
        megatron: create megatron's groups (its layers read them from ``parallel_state``) instead
            of plain TP/PP/DP groups.
        local_rank: accelerator index on this node; default ``devices.local_rank_of``.

    An existing default group of ``layout.world_size`` (a test's, or an earlier call's) is kept.

    Raises:
        ValueError: a bad rank, timeout or store address; an existing default group of another
            size; existing megatron groups of another layout.
        RuntimeError: the accelerator is not available.
    """
    world = layout.world_size
    layout.check_rank(rank)
    if not timeout_s > 0:
        raise ValueError(f"timeout_s: got {timeout_s}; expected > 0")
    kind = layout.device
    device = devices.process_device(kind, devices.local_rank_of(kind, rank) if local_rank is None else local_rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    if dist.is_initialized():
        if dist.get_world_size() != world or dist.get_rank() != rank:
            raise ValueError(f"join_groups: this process is rank {dist.get_rank()} of {dist.get_world_size()} already; "
                             f"the layout asks for rank {rank} of {world}")
    elif world > 1 and not store_address:
        raise ValueError(f"store_address: empty; {world} ranks (parallel.tp × pp × dp) meet at the launcher's TCPStore")
    else:
        if world > 1:
            host, _, port = store_address.rpartition(":")
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False)
        else:
            store = serve_store("127.0.0.1", timeout_s=timeout_s)
        dist.init_process_group(backend=devices.backend_for(kind), store=store, rank=rank, world_size=world, timeout=timeout,
                                device_id=device if kind == "cuda" else None)  # eager NCCL communicator on this GPU
        logger.info("rank %d of %d joined its %s process group at %s on %s", rank, world, devices.backend_for(kind),
                    store_address if world > 1 else "a loopback store", device)
    ranks = ProcessRanks(layout=layout, device=device, rank=rank, replica=rank, replicas=world)
    return _megatron_groups(ranks) if megatron else _own_groups(ranks)


def _own_groups(ranks: ProcessRanks) -> ProcessRanks:
    layout, found = ranks.layout, {}
    for name, size, members in (("tp_group", layout.tp, layout.tp_groups()), ("pp_group", layout.pp, layout.pp_groups()),
                                ("dp_group", layout.dp, layout.dp_groups())):
        if size == 1:
            continue
        for group_ranks in members:  # every rank creates every group, in the same order
            group = dist.new_group(group_ranks)  # group rank = index in sorted ranks = tp/pp/dp rank
            if ranks.rank in group_ranks:
                found[name] = group
    return replace(ranks, **found)


def _megatron_groups(ranks: ProcessRanks) -> ProcessRanks:
    with warnings.catch_warnings():  # "Apex/Transformer Engine not installed": the local fallbacks are what CPU needs
        warnings.simplefilter("ignore", UserWarning)
        from megatron.core import parallel_state as ps  # lazy: megatron-core is an optional extra

    layout = ranks.layout
    with cpu_device() if ranks.device.type == "cpu" else contextlib.nullcontext():
        if ps.model_parallel_is_initialized():
            have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size())
            if have != (layout.tp, layout.pp):
                raise ValueError(f"parallel layout: megatron groups exist with TP, PP = {have}; asked for {(layout.tp, layout.pp)}")
        else:
            ps.initialize_model_parallel(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp)
    # megatron's group ranks follow the same tp-dp-pp order as the layout's arithmetic
    assert (ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(), ps.get_pipeline_model_parallel_rank()) == \
        (ranks.tp_rank, ranks.dp_rank, ranks.pp_rank), "megatron's rank order differs from ParallelLayout.train_coords"
    return replace(
        ranks, tp_group=ps.get_tensor_model_parallel_group() if layout.tp > 1 else None,
        pp_group=ps.get_pipeline_model_parallel_group() if layout.pp > 1 else None,
        dp_group=ps.get_data_parallel_group() if layout.dp > 1 else None, model_group=ps.get_model_parallel_group(),
        embedding_group=ps.get_embedding_group() if layout.pp > 1 and ps.is_rank_in_embedding_group() else None,
    )


def leave_groups() -> None:
    """Destroy megatron's groups (when it made some) and leave the default group (no-op when none exists)."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None:
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()

