"""ProcessRanks and join_groups: one object for a process's ranks and groups, one function that makes the groups."""

from __future__ import annotations

import datetime
import ipaddress
import re
import socket
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist

from dockrl.parallel.layout import ParallelLayout
from dockrl.parallel.ranks import ProcessRanks, join_groups, leave_groups, serve_store

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[2]


def test_a_process_alone_has_rank_zero_and_no_groups():
    ranks = ProcessRanks.alone(ParallelLayout(device="cpu"))
    assert (ranks.rank, ranks.world_size, ranks.replica, ranks.replicas, ranks.device) == (0, 1, 0, 1, CPU)
    assert (ranks.tp_rank, ranks.dp_rank, ranks.pp_rank, ranks.first_stage, ranks.last_stage) == (0, 0, 0, True, True)
    assert ranks.tp_group is ranks.pp_group is ranks.dp_group is ranks.model_group is ranks.embedding_group is None


def test_coordinates_follow_the_layout():
    layout = ParallelLayout(tp=2, pp=2, dp=2, infer_tp=2, device="cpu")
    ranks = ProcessRanks(layout=layout, device=CPU, rank=5, replica=5, replicas=8)
    assert (ranks.tp_rank, ranks.dp_rank, ranks.pp_rank) == (1, 0, 1) == layout.train_coords(5)
    assert ranks.last_stage and not ranks.first_stage and ranks.last_stage_rank == 5 and ranks.infer_tp_rank == 1
    assert ProcessRanks(layout=layout, device=CPU, rank=3).last_stage_rank == 7  # (tp 1, dp 1): stage 1 is rank 7
    assert ProcessRanks(layout=layout, device=CPU, rank=7).model_leader == 2  # tp 0, dp 1, stage 0
    with pytest.raises(ValueError, match="rank: got 8; expected 0 <= rank < world_size=8"):
        ProcessRanks(layout=layout, device=CPU, rank=8)
    with pytest.raises(ValueError, match="replica: got 2 of 2"):
        ProcessRanks(layout=layout, device=CPU, replica=2, replicas=2)


@pytest.mark.parametrize(
    ("layout", "kw", "fragment"),
    [
        (ParallelLayout(device="cpu"), {"rank": 1}, "rank: got 1; expected 0 <= rank < world_size=1"),
        (ParallelLayout(device="cpu"), {"timeout_s": 0}, "timeout_s: got 0"),
        (ParallelLayout(dp=2, device="cpu"), {}, "store_address: empty; 2 ranks"),
    ],
)
def test_join_rejects_bad_arguments(layout, kw, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        join_groups(layout, **({"timeout_s": 5} | kw))
    assert not dist.is_initialized()


def test_join_alone_makes_a_group_of_one_and_keeps_it(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "DOCKRL_REPLICA"):
        monkeypatch.setenv(var, "garbage")  # never read
    layout = ParallelLayout(device="cpu")
    try:
        ranks = join_groups(layout, timeout_s=30)
        assert ranks.device == CPU and dist.get_backend() == "gloo" and dist.get_world_size() == 1
        assert ranks.tp_group is ranks.pp_group is ranks.dp_group is None  # sizes of 1: no groups
        again = join_groups(layout, timeout_s=30, megatron=True)  # the default group is kept; megatron's made over it
        assert again.model_group is not None and dist.get_process_group_ranks(again.model_group) == [0]
        with pytest.raises(ValueError, match="this process is rank 0 of 1 already; the layout asks for rank 0 of 2"):
            join_groups(ParallelLayout(tp=2, device="cpu"), timeout_s=30, store_address="127.0.0.1:1", megatron=True)
    finally:
        leave_groups()
    assert not dist.is_initialized()
    from megatron.core import parallel_state

    assert not parallel_state.model_parallel_is_initialized()


RANK_READS = {
    "megatron's globals": re.compile(r"megatron\.core(\.| import )parallel_state"),
    "the default group's rank or size": re.compile(r"dist\.get_rank\(|dist\.get_world_size\(\)"),
    "a rank variable of the environment": re.compile(
        r"environ(\.get\(|\[)\s*([\"'](RANK|WORLD_SIZE|LOCAL_RANK|DOCKRL_REPLICAS?)[\"']|REPLICAS?_ENV)"),
    "the launcher's member index": re.compile(r"\breplica\(\)"),
}
ALLOWED = {
    "dockrl/parallel/ranks.py": {"megatron's globals", "the default group's rank or size"},  # builds the ranks object
    "dockrl/process/env.py": {"a rank variable of the environment", "the launcher's member index"},  # defines replica()
    "dockrl/stages/main.py": {"the launcher's member index"},  # the stage processes' entry point: reads it once
    "dockrl/launch/node.py": {"the launcher's member index"},  # `dockrl node` / `dockrl ranks`: entry points, read it once
    "dockrl/dock/flight/shards.py": {"the launcher's member index"},  # `dockrl dock-shard`, the shards' entry point: its index, once
}


def test_engines_and_workers_get_ranks_only_from_the_ranks_object():
    found = []
    for path in sorted((ROOT / "dockrl").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for what, pattern in RANK_READS.items():
                if pattern.search(line) and what not in ALLOWED.get(rel, ()):
                    found.append(f"{rel}:{number}: {what}: {line.strip()}")
    assert not found, "ranks read outside the ranks object and the entry point:\n" + "\n".join(found)


def outside_addresses() -> list[str]:
    """This machine's IPv4 addresses other than loopback (the network's view of it)."""
    return [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback]


def listening(port: int) -> set[str]:
    """The addresses this process listens on at ``port``."""
    return {c.laddr.ip for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_a_loopback_store_is_not_reachable_from_the_network():
    store = serve_store("127.0.0.1", timeout_s=10)
    assert listening(store.port) == {"127.0.0.1"}  # torch's own server listens on every interface ('*', '::')
    client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=10))
    client.set("k", "v")
    assert store.get("k") == b"v"
    for address in outside_addresses():
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((address, store.port), timeout=5).close()


def test_a_pod_store_listens_on_every_interface():
    store = serve_store("0.0.0.0", timeout_s=10)  # a pod's own network namespace: members reach it at the pod's IP
    assert listening(store.port) & {"0.0.0.0", "::"}
    for address in outside_addresses():
        socket.create_connection((address, store.port), timeout=5).close()
