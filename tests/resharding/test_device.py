"""Device kinds, collective backends, process-group init from explicit arguments."""

from __future__ import annotations

import datetime
import importlib.util
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from dockrl.resharding import device


def test_backends_of_the_device_kinds():
    assert [device.backend_for(k) for k in ("cpu", "cuda", "npu")] == ["gloo", "nccl", "hccl"]
    with pytest.raises(ValueError, match="parallel.device: got 'tpu'; expected one of 'cpu', 'cuda', 'npu'"):
        device.backend_for("tpu")


def test_torch_npu_is_imported_only_when_an_npu_is_asked_for():
    code = "import dockrl.resharding.allgather_swap, dockrl.resharding.device, sys; print('torch_npu' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here")
def test_npu_without_torch_npu_fails_clearly():
    with pytest.raises(RuntimeError, match="parallel.device='npu' needs the torch_npu package"):
        device.torch_device("npu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cuda_without_a_gpu_fails_clearly():
    with pytest.raises(RuntimeError, match="no cuda device is available"):
        device.torch_device("cuda")


def test_cpu_device_and_bad_local_rank():
    assert device.torch_device("cpu", 3) == torch.device("cpu")
    with pytest.raises(ValueError, match="local_rank: got -1"):
        device.torch_device("cpu", -1)
    assert device.allocator_peak_bytes(torch.device("cpu")) is None
    device.synchronize(torch.device("cpu"))


@pytest.mark.parametrize(
    ("kw", "fragment"),
    [
        ({"rank": 2, "world_size": 2}, "rank: got 2; expected 0 <= rank < world_size=2"),
        ({"world_size": 0}, "world_size: got 0"),
        ({"master_port": 70000}, "master_port: got 70000"),
        ({"timeout_s": 0}, "timeout_s: got 0"),
    ],
)
def test_init_rejects_bad_arguments(kw, fragment):
    args = {"kind": "cpu", "rank": 0, "world_size": 1, "master_addr": "127.0.0.1", "master_port": 29500, "timeout_s": 5} | kw
    with pytest.raises(ValueError, match=fragment):
        device.init_process_group(**args)


def test_init_joins_a_gloo_group_from_explicit_arguments(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(var, "garbage")  # never read
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
    dev = device.init_process_group(
        kind="cpu", rank=0, world_size=1, master_addr="127.0.0.1", master_port=store.port, timeout_s=30, external_store=True
    )
    try:
        assert dev == torch.device("cpu") and dist.get_backend() == "gloo" and dist.get_world_size() == 1
        x = torch.ones(3)
        dist.all_reduce(x)
        assert torch.equal(x, torch.ones(3))
        with pytest.raises(RuntimeError, match="already belongs to a process group"):
            device.init_process_group(kind="cpu", rank=0, world_size=1, master_addr="127.0.0.1", master_port=store.port, timeout_s=30)
    finally:
        device.destroy_process_group()
    assert not dist.is_initialized()
