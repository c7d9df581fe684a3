"""Device kinds, collective backends, placement, the weight channel's group."""

from __future__ import annotations

import datetime
import importlib.util
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from dockrl.parallel import device


def test_backends_of_the_device_kinds():
    assert [device.backend_for(k) for k in ("cpu", "cuda", "npu")] == ["gloo", "nccl", "hccl"]
    with pytest.raises(ValueError, match="parallel.device: got 'tpu'; expected one of 'cpu', 'cuda', 'npu'"):
        device.backend_for("tpu")


def test_torch_npu_is_imported_only_when_an_npu_is_asked_for():
    code = "import dockrl.resharding.allgather_swap, dockrl.parallel.device, sys; print('torch_npu' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed here")
def test_npu_without_torch_npu_fails_clearly():
    with pytest.raises(RuntimeError, match="parallel.device='npu' needs the torch_npu package"):
        device.torch_device("npu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_cuda_without_a_gpu_fails_clearly():
    with pytest.raises(RuntimeError, match="parallel.device=.cuda.: no cuda device is available"):
        device.torch_device("cuda")


def test_cpu_device_and_bad_local_rank():
    assert device.torch_device("cpu", 3) == torch.device("cpu")
    with pytest.raises(ValueError, match="local_rank: got -1"):
        device.torch_device("cpu", -1)
    assert device.allocator_peak_bytes(torch.device("cpu")) is None
    device.synchronize(torch.device("cpu"))


class FakeAccelerator:
    """Stands in for ``torch.accelerator.current_accelerator``: reports a device of ``kind`` (or none)."""

    def __init__(self, kind: str | None) -> None:
        self.kind = kind

    def __call__(self, check_available: bool = False):
        return None if self.kind is None else torch.device(self.kind)


class FakeDeviceModule:
    """Stands in for ``torch.cuda`` / ``torch.npu``: ``count`` visible devices; records ``set_device``."""

    def __init__(self, count: int) -> None:
        self.count, self.current = count, None

    def is_available(self) -> bool:
        return self.count > 0

    def device_count(self) -> int:
        return self.count

    def set_device(self, index: int) -> None:
        self.current = index


def test_auto_picks_the_accelerator_torch_reports(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "current_accelerator", FakeAccelerator(None))
    assert device.resolve_kind("auto") == "cpu"
    monkeypatch.setattr(torch.accelerator, "current_accelerator", FakeAccelerator("cuda"))
    assert device.resolve_kind("auto") == "cuda"
    assert device.resolve_kind("cpu") == "cpu" and device.resolve_kind("npu") == "npu"  # explicit kinds as given
    with pytest.raises(ValueError, match="parallel.device: got 'tpu'"):
        device.resolve_kind("tpu")


class FakeNpuDevice:
    """What ``current_accelerator`` returns on Ascend (``torch.device('npu')`` needs torch_npu's registration)."""

    type = "npu"


def test_auto_imports_torch_npu_only_where_it_is_installed(monkeypatch):
    imported = []

    class FakeNpuAccelerator(FakeAccelerator):
        """An NPU becomes visible to torch once torch_npu is imported (it registers the backend)."""

        def __call__(self, check_available: bool = False):
            return FakeNpuDevice() if imported else None

    monkeypatch.setattr(torch.accelerator, "current_accelerator", FakeNpuAccelerator(None))
    monkeypatch.setattr(device.importlib.util, "find_spec", lambda name: None)
    assert device.detect_kind() == "cpu" and not imported  # not installed: never imported

    monkeypatch.setattr(device.importlib.util, "find_spec", lambda name: object() if name == "torch_npu" else None)
    monkeypatch.setattr(device.importlib, "import_module", lambda name: imported.append(name))
    assert device.detect_kind() == "npu" and imported == ["torch_npu"]


def test_auto_falls_back_to_cpu_when_torch_npu_does_not_import(monkeypatch, caplog):
    def fail(name):
        raise OSError("libhccl.so: cannot open shared object file")

    monkeypatch.setattr(torch.accelerator, "current_accelerator", FakeAccelerator(None))
    monkeypatch.setattr(device.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(device.importlib, "import_module", fail)
    assert device.detect_kind() == "cpu"
    assert "torch_npu is installed but does not import" in caplog.text


def test_a_process_takes_the_device_of_its_local_rank(monkeypatch):
    fake = FakeDeviceModule(count=2)
    monkeypatch.setattr(torch, "get_device_module", lambda kind: fake)
    assert device.process_device("cuda", 1) == torch.device("cuda", 1) and fake.current == 1
    assert device.local_rank_of("cuda", 5) == 1 and device.local_rank_of("cpu", 5) == 0
    with pytest.raises(RuntimeError, match=r"parallel.device='cuda': local rank 2 needs device cuda:2, but only 2"):
        device.process_device("cuda", 2)
    fake.count = 0
    with pytest.raises(RuntimeError, match=r"parallel.device='cuda': no cuda device is available.*Fix: .*parallel.device=auto"):
        device.process_device("cuda", 0)


def test_channel_backend_per_kind():
    assert [device.channel_backend(k) for k in ("cpu", "cuda", "npu")] == ["gloo", "nccl", "gloo"]


def test_channel_group_on_cpu():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
    group = device.channel_group("cpu", store, prefix="test", rank=0, world_size=1, timeout_s=30)
    x = torch.arange(4.0)
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    group.broadcast([x], opts).wait()
    assert torch.equal(x, torch.arange(4.0)) and not dist.is_initialized()  # the default group is untouched
