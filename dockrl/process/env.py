"""The variables a worker backend sets for every process it starts, and the readers of a
process's place in its worker group (a member of a group, or a rank process of ``dockrl node``).
Reads only the environment: no torch, no pyarrow here."""

from __future__ import annotations

import os

TOKEN_ENV = "DOCKRL_DOCK_TOKEN"
"""Environment variable with a dock shard's one bearer token (``dockrl dock-shard --token-env``), which
``dockrl worker`` reads when its stage's own (``stage_token_env``) is unset."""
DRIVER_TOKEN_ENV = "DOCKRL_DOCK_DRIVER_TOKEN"
"""Environment variable with the driver's bearer token, set for the dock shards only (the driver holds it in memory)."""
CONFIG_ENV = "DOCKRL_CONFIG_YAML"
"""Environment variable with the run's fully resolved config (YAML) for ``dockrl worker --config-env``."""
REPLICA_ENV = "DOCKRL_REPLICA"
"""Environment variable with a process's index in its worker group (every worker backend sets it)."""
REPLICAS_ENV = "DOCKRL_REPLICAS"
"""Environment variable with the number of members of a process's worker group."""
SANDBOX_URL_ENV = "DOCKRL_SANDBOX_URL"
"""Environment variable with the ``http://host:port`` of the sandbox executor a stage sends its programs to
(``env.sandbox.backend=pod``; ``dockrl.isolation.runner``)."""
SANDBOX_SECRET_ENV = "DOCKRL_SANDBOX_SECRET"
"""Environment variable with the run's secret of its sandbox executors: the one credential an executor's pod holds,
never the dock's token."""
SANDBOX_WAIT_ENV = "DOCKRL_SANDBOX_WAIT_S"
"""Environment variable with how long a stage waits for its sandbox executor to answer first, seconds (its pod may
start after the stage's)."""
RDZV_PORT = 29400
"""Port of the node launchers' rendezvous on pod 0 of a group (torchrun's customary port): set as MASTER_PORT."""
NODE_PROCS_ENV = "DOCKRL_NODE_PROCS"
"""Set by ``dockrl node`` (``dockrl/launch/node.py``) for the rank processes it starts: their
index and count are torchrun's ``RANK`` and ``WORLD_SIZE``, their device index ``LOCAL_RANK``."""
SINGLE_MACHINE_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "VLLM_HOST_IP": "127.0.0.1"}
"""Environment of the processes of a run on one machine (a local backend's members, an in-process
run): gloo's pairs and NCCL's bootstrap listen on Linux's loopback interface, and vLLM's address for
itself (``vllm.utils.network_utils.get_ip``: the rendezvous of a TCP store, ZeroMQ's ``tcp://``
sockets) is loopback. Without them they take the address the machine's hostname resolves to, or
the interface of the default route, reachable from other machines."""


def stage_token_env(stage: str) -> str:
    """Environment variable with the bearer token of stage process ``stage`` (``DOCKRL_DOCK_TOKEN_REWARD_MODEL``
    for ``reward-model``): each stage process is given its own only; the dock shards all of them."""
    return f"{TOKEN_ENV}_{stage.upper().replace('-', '_')}"


def replica() -> tuple[int, int]:
    """This member's index in its group and the group's size: ``REPLICA_ENV`` and ``REPLICAS_ENV``
    (0 and 1 when unset), or for a rank process of ``dockrl node`` torchrun's ``RANK`` and ``WORLD_SIZE``.

    Raises:
        ValueError: the variables are not integers with 0 <= index < size.
    """
    names = ("RANK", "WORLD_SIZE") if os.environ.get(NODE_PROCS_ENV) else (REPLICA_ENV, REPLICAS_ENV)
    raw = os.environ.get(names[0], "0"), os.environ.get(names[1], "1")
    try:
        index, size = int(raw[0]), int(raw[1])
    except ValueError:
        index = size = -1
    if not 0 <= index < size:
        raise ValueError(f"{names[0]}={raw[0]!r}, {names[1]}={raw[1]!r}: expected integers with 0 <= index < size")
    return index, size


def pod_index() -> str:
    """The index of this process's pod in its group, as set (``REPLICA_ENV``; '' when unset): under ``dockrl node``
    the pod's, which it leaves to its rank processes, where ``replica`` gives the rank. Checked by its reader."""
    return os.environ.get(REPLICA_ENV, "")


def local_rank() -> int | None:
    """The device index on its node of a rank process of ``dockrl node`` (torchrun's ``LOCAL_RANK``);
    None for a process that is its pod's only member (its device follows from its rank).

    Raises:
        ValueError: ``LOCAL_RANK`` is not an integer >= 0 under ``dockrl node``.
    """
    if not os.environ.get(NODE_PROCS_ENV):
        return None
    raw = os.environ.get("LOCAL_RANK", "")
    if not raw.isdigit():
        raise ValueError(f"LOCAL_RANK={raw!r}: expected an integer >= 0 (torchrun sets it for every process of `dockrl node`)")
    return int(raw)
