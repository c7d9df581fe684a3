"""The one step that turns a config's ``auto`` fields into this machine's answer: ``resolve_auto``.

Loading a config (``dockrl.config.loading``) probes nothing and keeps ``auto``; each process that
needs the answer resolves here, where it runs: the run's set-up (``dockrl.run.setup.plan_run``),
every stage process (``dockrl worker``), the pipeline's evaluate step. A portable dump
(``dump_config(portable=True)``) writes ``auto`` again, so a stage pod on another node resolves
for its own device and the packages of its own image.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Literal

from dockrl.config.config import Config
from dockrl.config.errors import fail

_logger = logging.getLogger(__name__)

FROM_AUTO = "_from_auto"
"""Attribute of a resolved config section: the names of its fields that were ``auto`` before resolution."""

AUTO_ENGINE_ENV = "DOCKRL_AUTO_ROLLOUT_ENGINE"
"""Environment variable: what ``rollout.engine=auto`` resolves to without probing (``hf`` or
``vllm``), for every process started with it (a test suite that must not start vLLM, a node
whose vLLM should not be used). An explicit ``rollout.engine`` wins over it."""


def resolve_auto(cfg: Config) -> Config:
    """``cfg`` with its ``auto`` fields replaced by what they mean here, as a new ``Config`` (``cfg`` is never changed).

    ``parallel.device=auto`` → the accelerator kind present, else ``cpu``
    (``dockrl.parallel.device.resolve_kind``); ``rollout.dtype`` and ``trainer.autocast_bf16`` →
    bf16 where that device computes it faster than fp32 (``bf16_by_default``), stated in one log
    line, with a warning when bf16 is asked for explicitly where it is slower; ``rollout.engine`` →
    ``auto_rollout_engine``, stated in one log line per process. A config without ``auto`` fields
    comes back as it is. Imports torch (the device probe) when a field is ``auto`` or a CPU is asked for bf16.

    Raises:
        ConfigError: ``$DOCKRL_AUTO_ROLLOUT_ENGINE`` is set to something else than ``hf`` or ``vllm``, or a
            cross-field rule breaks on a resolved value (the rules run again on the new config).
    """
    r, t = cfg.rollout, cfg.trainer
    device: str = cfg.parallel.device
    if device == "auto":
        from dockrl.parallel.device import resolve_kind  # torch: only where the device is asked for

        device = resolve_kind("auto")
    dtype: str = r.dtype
    autocast: Any = t.autocast_bf16
    if "auto" in (dtype, autocast) or (device == "cpu" and (dtype == "bfloat16" or autocast)):
        dtype, autocast = _precision(device, dtype, autocast)
    engine = r.engine
    if engine == "auto":
        engine, reason = auto_rollout_engine(device, hybrid=t.hybrid)
        if (engine, reason) not in _STATED:  # once per process: a pipeline step resolves its config several times
            _STATED.add((engine, reason))
            _logger.info("rollout.engine=auto: %s (%s)", engine, reason)
    sections = {
        "parallel": _resolved(cfg.parallel, device=device),
        "rollout": _resolved(r, dtype=dtype, engine=engine),
        "trainer": _resolved(t, autocast_bf16=autocast),
    }
    changed = {name: section for name, section in sections.items() if section is not getattr(cfg, name)}
    return dataclasses.replace(cfg, **changed) if changed else cfg


def _precision(device: str, dtype: str, autocast: Any) -> tuple[str, Any]:
    """``rollout.dtype`` and ``trainer.autocast_bf16`` on ``device`` (a resolved kind), ``auto`` replaced by
    bf16 where the device computes it faster than fp32; warns when bf16 is asked for explicitly where it is slower."""
    from dockrl.parallel.device import bf16_by_default, native_bf16  # torch: only where precision is decided here

    faster = bf16_by_default(device)
    new_dtype = ("bfloat16" if faster else "float32") if dtype == "auto" else dtype
    new_autocast = faster if autocast == "auto" else autocast
    if "auto" in (dtype, autocast):
        _logger.info("precision auto: rollout.dtype=%s, trainer.autocast_bf16=%s (bf16 is %s than float32 on this %s)",
                     new_dtype, str(new_autocast).lower(), "faster" if faster else "not faster", device)
    if not faster and (dtype == "bfloat16" or autocast is True):
        why = ("has AVX512-BF16 but no AMX-BF16: bf16 measured 1.4-1.7x slower than float32 on such a CPU"
               if native_bf16(device) else "has no native bf16, so bf16 is emulated and runs several times slower than float32")
        _logger.warning("rollout.dtype=%s, trainer.autocast_bf16=%s: this %s %s ('auto' picks float32 here)",
                        dtype, autocast, device, why)
    return new_dtype, new_autocast


def _resolved(section: Any, **values: Any) -> Any:
    """``section`` with its ``auto`` fields among ``values`` replaced, noting which they were
    (``dump_config(portable=True)`` writes them as ``auto`` again); ``section`` itself when none was ``auto``.

    The note is set on the new object before anything else holds it, and survives ``dataclasses.replace``
    of other sections."""
    changed = {name: value for name, value in values.items() if getattr(section, name) == "auto" and value != "auto"}
    if not changed:
        return section
    new = dataclasses.replace(section, **changed)
    object.__setattr__(new, FROM_AUTO, frozenset(getattr(section, FROM_AUTO, frozenset()) | set(changed)))
    return new


def auto_rollout_engine(device: str, *, hybrid: bool) -> tuple[Literal["hf", "vllm"], str]:
    """What ``rollout.engine=auto`` means on ``device`` (a resolved ``parallel.device``) here, and why.

    The one place that decides: the hybrid actor generates with vLLM; else ``$DOCKRL_AUTO_ROLLOUT_ENGINE``
    when set; else vLLM where a vLLM build for ``device`` is installed and can run
    (``dockrl.process.vllm_support.vllm_support``), as it generates several times faster than
    transformers' ``generate`` (docs/engines.md), and HF otherwise.

    Raises:
        ConfigError: ``$DOCKRL_AUTO_ROLLOUT_ENGINE`` is set to something else than ``hf`` or ``vllm``.
    """
    if hybrid:
        return "vllm", "trainer.hybrid=true generates with vLLM"
    pinned = os.environ.get(AUTO_ENGINE_ENV, "")
    if pinned:
        if pinned not in ("hf", "vllm"):
            raise fail(AUTO_ENGINE_ENV, pinned, "expected 'hf' or 'vllm' (what rollout.engine=auto resolves to), or unset")
        return ("hf" if pinned == "hf" else "vllm"), f"{AUTO_ENGINE_ENV}={pinned} in the environment"
    from dockrl.process.vllm_support import vllm_support  # lazy: only where auto is probed

    support = vllm_support(device)
    return ("vllm" if support.ok else "hf"), support.reason


_STATED: set[tuple[str, str]] = set()
"""The ``rollout.engine=auto`` resolutions this process has logged."""
