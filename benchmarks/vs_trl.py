"""dockrl against TRL's GRPOTrainer on the same model, prompts, group shape and sampling settings.

Both sides train GRPO on one prompts file (generated GSM8K-format arithmetic, written once),
``--prompts`` prompts × ``--n`` samples per iteration, ≤ ``--max-new-tokens`` response tokens,
temperature ``--temperature``, top-p 1, no KL term (β = 0), the same precision (``--precision``;
or each side's default), the same learning rate, micro-batches of ``--micro-batch`` sequences and
one optimizer step per iteration; both score with dockrl's rule verifier. Each run is a process of its own; runs alternate (TRL, dockrl,
TRL, dockrl, ...) so that machine noise hits both sides alike. The first iteration of every run is
a warm-up and is not counted.

    python benchmarks/vs_trl.py --model .cache/dockrl/models/SmolLM2-135M-Instruct
    python benchmarks/vs_trl.py --model ... --precision bf16   # where the CPU has native bf16
    python benchmarks/vs_trl.py --model ... --precision defaults   # each side as it comes
    python benchmarks/vs_trl.py --quick          # the tiny random model, both sides, seconds
    python benchmarks/vs_trl.py --model ... --lora-rank 8   # both sides train LoRA adapters (alpha 2 × rank)

``--precision fp32`` (the default) runs both sides in fp32. ``--precision bf16`` runs each side's
bf16 mode: TRL's ``bf16=True`` (its default: the Trainer's bf16 autocast over fp32 weights) and
dockrl's ``trainer.autocast_bf16=true`` (the same autocast in the update) with ``rollout.dtype=bfloat16``
(the rollout engine's weights in bf16); refused where the CPU has no native bf16 (emulated bf16 is
several times slower than fp32). ``--precision defaults`` runs each side at its own defaults, as a
user gets it without choosing: TRL's ``GRPOConfig`` precision (``bf16=True`` on any CPU, emulated
where it is not native) and dockrl's ``auto`` (``rollout.dtype``, ``trainer.autocast_bf16``: bf16 only
where it is faster than fp32, ``dockrl.parallel.device.bf16_by_default``); the table's
"precision" column says what each resolved to. TRL's other defaults are kept in every mode,
gradient checkpointing included, except that ``--gradient-checkpointing`` (on: TRL's default) sets
it on both sides in the fp32 and bf16 modes (TRL's ``gradient_checkpointing``, dockrl's
``trainer.gradient_checkpointing``).

Prints one table, one row per side: the precision it ran in, seconds per iteration (median), response tokens per
iteration (the two sides sample their own responses: similar, not equal), response tokens/s end to
end, rollout tokens/s (response tokens / generation seconds: TRL's
``_generate_and_score_completions``, dockrl's ``timing_s/rollout``), update tokens/s (response
tokens / the rest of TRL's step, dockrl's ``timing_s/actor``), peak RSS, and the ratios to TRL.

Peak RSS is that of the run's whole process tree (``tree_peak_rss``): the run's process and every
process it starts (both sides' rule verifier runs in processes of its own, ~0.35 GB; dockrl's vLLM
engine core runs in the run's process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, but a default vLLM
would start one). ``ru_maxrss`` of ``RUSAGE_SELF`` misses those, and ``RUSAGE_CHILDREN`` is no fix: it
gives the largest single waited-for descendant, not a sum over processes alive together. The
column is the run process's own peak (``ru_maxrss``, exact; dockrl's stages reset it at each start,
so its largest reading is kept, ``dockrl.process.memory.process_peak_bytes``) plus the largest sum, over the
descendants alive together at one sample (every ``RSS_SAMPLE_S``), of each one's own peak (Linux
``VmHWM``): an upper bound of the tree's peak, exact when the descendants' memory is flat while the run
process peaks (the verifier's is). Descendants that never ran together are not added up: torch's
inductor compiles a few kernels on a first run in a chain of short compiler processes (g++, cc1plus,
ld, a loader check; up to 0.5 GB each, one after the other).
Sampling the tree's sum instead misses short peaks (its largest sample is the lower bound the
column never goes under). Pages that processes share count in each (the verifier's forkserver
and the process it forks: tens of MB).

TRL's GRPOTrainer module imports vLLM wherever vllm is installed (here: for dockrl's vLLM rollout), although
TRL's side generates with transformers. The ``trl`` side hides vLLM from its imports, as in an environment
where TRL is installed without it (``run_trl``: ~0.17 GB less resident at import); ``--sides ...,trl-imports-vllm``
adds TRL as it runs in this environment, its precision column ending with "vLLM imported".

Each side also reports its peak resident memory by stage (``memory/peak_rss_gb/<stage>``, the largest
over the run's iterations, ``dockrl.process.memory``): dockrl's stages in its process, TRL's generation
(``_generate_and_score_completions``) and its update (the rest of the step); ``benchmarks/memory.py``
tabulates them.

``--lora-rank r`` trains LoRA adapters of rank r (alpha 2r, dropout 0) on the attention and MLP
projections on both sides instead of the full weights: TRL's ``peft_config`` (a peft ``LoraConfig``) and
dockrl's ``trainer.lora``; the precision column then ends with ``LoRA r``.

TRL and psutil are optional dependencies of this benchmark only (``pip install 'dockrl[bench]'``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

RSS_SAMPLE_S = 0.05
"""Seconds between two samples of a run's process tree RSS (``tree_peak_rss``)."""

QUICK = dict(prompts=2, n=2, max_new_tokens=8, iterations=2, repeats=1, micro_batch=2, sides="trl,dockrl-hf")
"""The defaults of ``--quick``: a flag given with it wins."""


def _tokens_per_s(tokens: list[float], seconds: list[float]) -> float:
    return sum(tokens) / max(sum(seconds), 1e-9)


def _result(steps: list[dict[str, float]]) -> dict[str, float]:
    """The counted iterations (the first, a warm-up, dropped) of one run → its row values."""
    from dockrl.process.memory import process_peak_bytes  # lazy: the child's, after its run

    counted = steps[1:] if len(steps) > 1 else steps
    tokens = [s["tokens"] for s in counted]
    return {
        "seconds_per_iteration": statistics.median(s["seconds"] for s in counted),
        "tokens_per_iteration": statistics.mean(tokens),
        "tokens_per_s": _tokens_per_s(tokens, [s["seconds"] for s in counted]),
        "rollout_tokens_per_s": _tokens_per_s(tokens, [s["rollout_s"] for s in counted]),
        "update_tokens_per_s": _tokens_per_s(tokens, [s["update_s"] for s in counted]),
        # Linux: KiB; the stages reset the kernel's peak (dockrl.process.memory.reset_peak), which keeps the process's
        "self_peak_rss_gb": max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, process_peak_bytes() / 2**30),
    } | {k: max(s.get(k, 0.0) for s in steps) for k in sorted({k for s in steps for k in s if k.startswith("memory/")})}


def run_trl(spec: dict[str, Any], *, import_vllm: bool = False) -> dict[str, float]:
    """One TRL GRPOTrainer run; per-step seconds from a callback, generation timed around
    ``_generate_and_score_completions`` (sampling, reward, and what TRL computes with them).

    TRL's trainer module imports vLLM wherever it is installed (``trl/trainer/grpo_trainer.py`` imports
    ``trl.generation.vllm_generation``), although this side generates with transformers: unless
    ``import_vllm``, the run hides vLLM from imports (``sys.modules["vllm"] = None``), as in an environment
    where TRL is installed without it (~0.17 GB less resident, 3 s less CPU at import, 2-core AMD EPYC)."""
    if not import_vllm:
        sys.modules.setdefault("vllm", None)  # type: ignore[arg-type]  # import raises, find_spec is None
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from dockrl.config import load_config
    from dockrl.process.memory import reset_peak, stage_memory
    from dockrl.rewards.guard import build_scorer
    from dockrl.run.data import prompt_token_ids

    tok = AutoTokenizer.from_pretrained(spec["model"])
    rows = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines()]
    cfg = load_config(None, [])
    scorer = build_scorer(cfg.algorithm)
    truth = {}
    data = []
    for r in rows:
        prompt = tok.decode(prompt_token_ids(tok, r["question"], system_prompt=cfg.data.system_prompt))
        truth[prompt] = r["answer"].split("####")[-1].strip()
        data.append({"prompt": prompt})

    def reward(prompts: list[str], completions: list[str], **_: Any) -> list[float]:
        return [float(s) for s in scorer.score(completions, [truth[p] for p in prompts])]

    steps: list[dict[str, float]] = []
    generation: dict[str, float] = {"seconds": 0.0, "tokens": 0.0}

    class Timing(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            generation.update(seconds=0.0, tokens=0.0)
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            seconds = time.perf_counter() - self.start
            memory: dict[str, float] = {}
            read_peak("update", memory)  # since the generation ended: the update's micro-batches and step
            steps.append({"seconds": seconds, "tokens": generation["tokens"], "rollout_s": generation["seconds"],
                          "update_s": seconds - generation["seconds"], **memory, **{k: v for k, v in generation.items() if k.startswith("memory/")}})

    class TimedGRPOTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            with stage_memory("rollout", generation):  # sampling, reward and the log-probs computed with them
                out = super()._generate_and_score_completions(inputs)
            reset_peak()
            generation["seconds"] += time.perf_counter() - start
            generation["tokens"] += float(out["completion_mask"].sum())
            return out

    per_iteration = spec["prompts"] * spec["n"]
    precision = {} if spec["precision"] == "defaults" else {"bf16": spec["precision"] == "bf16",  # defaults: GRPOConfig's own
                                                            "gradient_checkpointing": spec["gradient_checkpointing"]}
    args = GRPOConfig(
        output_dir=spec["out"], use_cpu=True, **precision, report_to="none", save_strategy="no", logging_steps=1,
        learning_rate=spec["lr"], beta=0.0, num_generations=spec["n"], temperature=spec["temperature"], top_p=1.0,
        max_completion_length=spec["max_new_tokens"], per_device_train_batch_size=spec["micro_batch"],
        gradient_accumulation_steps=per_iteration // spec["micro_batch"], max_steps=spec["iterations"], seed=0,
        disable_tqdm=True, dataloader_num_workers=0,
    )
    peft_config = None
    if spec["lora_rank"]:
        from peft import LoraConfig

        from dockrl.config.sections import LORA_DEFAULT_TARGETS

        peft_config = LoraConfig(r=spec["lora_rank"], lora_alpha=2 * spec["lora_rank"], lora_dropout=0.0,
                                 target_modules=list(LORA_DEFAULT_TARGETS), task_type="CAUSAL_LM")
    trainer = TimedGRPOTrainer(model=spec["model"], reward_funcs=reward, args=args, train_dataset=Dataset.from_list(data),
                               callbacks=[Timing()], peft_config=peft_config)
    trainer.train()
    scorer.close()
    ran = ("bf16 autocast" if args.bf16 else "fp32") + _tags(spec, args.gradient_checkpointing)
    return _result(steps) | model_sizes(spec) | {"precision": ran + (", vLLM imported" if sys.modules.get("vllm") else "")}


def _tags(spec: dict[str, Any], checkpointing: bool) -> str:
    return (", gradient checkpointing" if checkpointing else "") + (f", LoRA {spec['lora_rank']}" if spec["lora_rank"] else "")


def model_sizes(spec: dict[str, Any]) -> dict[str, float]:
    """``params`` and ``trainable`` (LoRA: the adapters') of ``spec``'s model, counted on the meta
    device (each tensor once: a tied head is the embedding)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(spec["model"]))
    params = sum(p.numel() for p in meta.parameters())
    trainable = params
    if spec["lora_rank"]:
        from dockrl.config import LoraConfig
        from dockrl.engines.hf.lora import adapter_shapes

        lora = LoraConfig(rank=spec["lora_rank"], alpha=2 * spec["lora_rank"])
        trainable = sum(shape.numel() for _, shape in adapter_shapes(spec["model"], lora))
        params += trainable
    return {"params": float(params), "trainable": float(trainable)}


def read_peak(stage: str, into: dict[str, float]) -> None:
    """``memory/peak_rss_gb/<stage>``: this process's peak resident GiB since the last ``reset_peak``."""
    from dockrl.process.memory import GB, resident_bytes

    if (now := resident_bytes()) is not None:
        into[f"memory/peak_rss_gb/{stage}"] = now[1] / GB


def dockrl_config(spec: dict[str, Any], engine: str) -> Any:
    """The resolved config of a dockrl run of ``spec`` with ``rollout.engine=engine`` (in-process dock)."""
    from dockrl.config import load_config, resolve_auto

    per_iteration = spec["prompts"] * spec["n"]
    bf16 = spec["precision"] == "bf16"
    dtype, autocast = ("auto", "auto") if spec["precision"] == "defaults" else ("bfloat16" if bf16 else "float32", str(bf16).lower())
    checkpointing = [] if spec["precision"] == "defaults" else [f"trainer.gradient_checkpointing={str(spec['gradient_checkpointing']).lower()}"]
    return resolve_auto(load_config(None, [  # resolved here: the report states the precision 'defaults' chose
        f"model.path={spec['model']}", f"data.train_path={spec['data']}", f"data.test_path={spec['data']}",
        f"run.output_dir={spec['out']}", f"run.cache_dir={spec['out']}/cache", "run.progress=false",
        f"rollout.engine={engine}", f"rollout.n={spec['n']}", f"rollout.temperature={spec['temperature']}", "rollout.top_p=1.0",
        f"rollout.max_response_length={spec['max_new_tokens']}", f"rollout.dtype={dtype}",
        f"rollout.batch_size={per_iteration}",
        f"trainer.iterations={spec['iterations']}", f"trainer.global_batch={spec['prompts']}", f"trainer.mini_batch={spec['prompts']}",
        f"trainer.micro_batch={spec['micro_batch']}", f"trainer.lr={spec['lr']}", f"trainer.autocast_bf16={autocast}",
        "trainer.eval_before=false", "trainer.eval_after=false", "trainer.save_every=0", *checkpointing,
        *([f"trainer.lora.rank={spec['lora_rank']}", f"trainer.lora.alpha={2 * spec['lora_rank']}"] if spec["lora_rank"] else []),
    ]))


def run_dockrl(spec: dict[str, Any], engine: str) -> dict[str, float]:
    """One dockrl run (``dockrl train``'s driver, in-process dock) with ``rollout.engine=engine``."""
    from dockrl import driver

    per_iteration = spec["prompts"] * spec["n"]
    cfg = dockrl_config(spec, engine)
    steps: list[dict[str, float]] = []

    def on_iteration(_: int, m: dict[str, float]) -> None:
        steps.append({"seconds": m["timing_s/iteration"], "tokens": m["rollout/response_length_mean"] * per_iteration,
                      "rollout_s": m["timing_s/rollout"], "update_s": m["timing_s/actor"]}
                     | {k: v for k, v in m.items() if k.startswith("memory/")})

    driver.train(cfg, on_iteration=on_iteration)
    precision = ("bf16 autocast" if cfg.trainer.autocast_bf16 else "fp32") + f", rollout {cfg.rollout.dtype}"
    sizes = model_sizes(spec)
    if engine == "vllm":  # its own copy of the weights and its KV cache (dockrl.engines.factory.kv_cache_size)
        from dockrl.engines.factory import kv_cache_size

        sizes |= {"rollout_copy_gb": sizes["params"] * (4 if cfg.rollout.dtype == "float32" else 2) / 2**30,
                  "kv_cache_gb": kv_cache_size(cfg, Path(spec["model"]))[0]}
    return _result(steps) | sizes | {"precision": precision + _tags(spec, cfg.trainer.gradient_checkpointing)}


def _child(side: str, spec: dict[str, Any]) -> None:
    result = run_trl(spec, import_vllm=side == "trl-imports-vllm") if side.startswith("trl") else run_dockrl(spec, side.removeprefix("dockrl-"))
    print("RESULT " + json.dumps(result), flush=True)


def high_water(proc: Any) -> int:
    """Peak resident bytes of a ``psutil.Process`` so far: Linux's ``VmHWM``, else its current RSS."""
    try:
        for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return proc.memory_info().rss


def tree_peak_rss(proc: subprocess.Popen, timeout_s: float, every_s: float = RSS_SAMPLE_S) -> tuple[str, str, int, int]:
    """Wait for ``proc`` (stdout and stderr piped, text) while reading its process tree every ``every_s``.

    Returns:
        ``(stdout, stderr, sampled, descendants)``: ``sampled``, the largest sum of the tree's
        resident sizes at one sample (a lower bound of its peak: a short peak falls between
        samples); ``descendants``, the largest sum, over ``proc``'s descendants alive at one sample,
        of each one's own peak (``high_water``, last read before it ended). ``proc``'s own peak is
        its ``ru_maxrss``.

    Raises:
        subprocess.TimeoutExpired: ``proc`` ran longer than ``timeout_s`` (it is killed).
    """
    import psutil

    sampled, peaks, together = 0, {}, set()  # together: the sets of descendants seen alive at one sample
    done = threading.Event()

    def sample() -> None:
        nonlocal sampled
        while not done.is_set():
            total = 0
            try:
                root = psutil.Process(proc.pid)
                tree = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                tree = []
            for member in tree:
                try:
                    total += member.memory_info().rss
                    if member.pid != proc.pid:
                        peaks[member.pid] = max(peaks.get(member.pid, 0), high_water(member))
                except psutil.NoSuchProcess:  # ended between the listing and the reading
                    pass
            sampled = max(sampled, total)
            together.add(frozenset(m.pid for m in tree if m.pid != proc.pid))
            done.wait(every_s)

    sampler = threading.Thread(target=sample, name="tree-rss", daemon=True)
    sampler.start()
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    finally:
        done.set()
        sampler.join(timeout=5.0)
    return out, err, sampled, max((sum(peaks.get(pid, 0) for pid in alive) for alive in together), default=0)


def _run_side(side: str, spec: dict[str, Any], timeout_s: float) -> dict[str, float]:
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    with tempfile.TemporaryDirectory(prefix=f"vs-trl-{side}-") as out:
        cmd = [sys.executable, __file__, "--child", side, "--spec", json.dumps(spec | {"out": out})]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            stdout, stderr, sampled, descendants = tree_peak_rss(proc, timeout_s)
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"vs_trl: the {side} run did not finish within {timeout_s:.0f} s (--timeout-s)") from e
    lines = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"vs_trl: the {side} run failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    result = json.loads(lines[-1].removeprefix("RESULT "))
    result["peak_rss_gb"] = max(sampled / 2**30, result["self_peak_rss_gb"] + descendants / 2**30)  # module docstring
    return result


COLUMNS = [("seconds_per_iteration", "s/iteration", "{:.2f}"), ("tokens_per_iteration", "response tokens/iteration", "{:.0f}"),
           ("tokens_per_s", "tokens/s", "{:.1f}"),
           ("rollout_tokens_per_s", "rollout tok/s", "{:.1f}"), ("update_tokens_per_s", "update tok/s", "{:.1f}"),
           ("peak_rss_gb", "peak RSS GB (tree)", "{:.2f}"), ("self_peak_rss_gb", "run process GB", "{:.2f}")]


def table(results: dict[str, list[dict[str, float]]]) -> str:
    """A markdown table: per side the median of its runs per column, and dockrl/TRL ratios."""
    med = {side: {k: statistics.median(r[k] for r in runs) for k, _, _ in COLUMNS} for side, runs in results.items()}
    head = ["side", "runs", "precision"] + [name for _, name, _ in COLUMNS] + ["tokens/s vs TRL", "RSS vs TRL"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = med.get("trl")
    for side, m in med.items():
        ratios = [f"{m['tokens_per_s'] / base['tokens_per_s']:.2f}x", f"{m['peak_rss_gb'] / base['peak_rss_gb']:.2f}x"] if base else ["", ""]
        precision = " / ".join(sorted({r["precision"] for r in results[side]}))
        cells = [side, str(len(results[side])), precision] + [fmt.format(m[k]) for k, _, fmt in COLUMNS] + ratios
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``--quick`` changes the defaults only, so a flag given with it wins."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="HF model directory (default with --quick: the tiny random model)")
    parser.add_argument("--quick", action="store_true", help="tiny model, 2 prompts × 2 samples × 8 tokens, one run per side")
    parser.add_argument("--sides", default="", help="comma-separated of trl, dockrl-hf, dockrl-vllm (default: these three; --quick: trl, "
                        "dockrl-hf) and trl-imports-vllm (TRL with the vLLM import it makes where vllm is installed)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4, help="samples per prompt (group size)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--precision", choices=["fp32", "bf16", "defaults"], default="fp32",
                        help="both sides in fp32, both in their bf16 mode (native bf16 CPUs only), or each at its own defaults")
    parser.add_argument("--gradient-checkpointing", choices=["on", "off"], default="on",
                        help="both sides recompute activations in the backward (TRL's default: on); --precision defaults: each side's own")
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank on both sides (0: full fine-tuning)")
    parser.add_argument("--iterations", type=int, default=4, help="per run, the first a warm-up")
    parser.add_argument("--repeats", type=int, default=2, help="runs per side, alternating")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="per run")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    parser.add_argument("--spec", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return args
    if args.quick:
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    for flag, value, least in (("--prompts", args.prompts, 1), ("--max-new-tokens", args.max_new_tokens, 1),
                               ("--micro-batch", args.micro_batch, 1), ("--iterations", args.iterations, 1), ("--repeats", args.repeats, 1),
                               ("--lora-rank", args.lora_rank, 0)):
        if value < least:
            parser.error(f"{flag}: got {value}; expected an integer >= {least}")
    if args.n < 2:
        parser.error(f"--n: got {args.n}; expected an integer >= 2 (GRPO compares the samples of a prompt)")
    for flag, value in (("--temperature", args.temperature), ("--lr", args.lr), ("--timeout-s", args.timeout_s)):
        if not value > 0:
            parser.error(f"{flag}: got {value}; expected a number > 0")
    args.sides = [s.strip() for s in (args.sides or "trl,dockrl-hf,dockrl-vllm").split(",")]
    unknown = set(args.sides) - {"trl", "trl-imports-vllm", "dockrl-hf", "dockrl-vllm"}
    if unknown:
        parser.error(f"--sides: unknown {sorted(unknown)}; expected trl, trl-imports-vllm, dockrl-hf, dockrl-vllm")
    if (args.prompts * args.n) % args.micro_batch:
        parser.error(f"--prompts × --n = {args.prompts * args.n} must be a multiple of --micro-batch={args.micro_batch}")
    if not args.model and not args.quick:
        parser.error("--model is required (or --quick for the tiny random model)")
    if args.model and not Path(args.model).is_dir():
        parser.error(f"--model: {args.model!r} is not a directory (an HF model folder)")
    if args.precision == "bf16":
        from dockrl.parallel.device import native_bf16

        if not native_bf16("cpu"):
            parser.error("--precision bf16: this CPU has no native bf16 (AVX512-BF16 or AMX), so both sides would "
                         "emulate it; use --precision fp32")
    return args


def collect(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, list[dict[str, float]]]]:
    """Run every side ``args.repeats`` times, alternating, on one prompts file (and the tiny model
    without ``--model``); returns the run's spec (``model`` the folder, gone after the call) and
    each side's results (``_result`` plus ``peak_rss_gb``, ``precision``)."""
    from dockrl.run.data import generate_problems, write_jsonl

    with tempfile.TemporaryDirectory(prefix="vs-trl-") as work:
        model = args.model
        if not model:
            from dockrl.run.models import build_tiny_model

            model = str(build_tiny_model(Path(work) / "tiny-model"))
        data = write_jsonl(generate_problems(args.prompts * args.iterations * 4, seed=0), Path(work) / "prompts.jsonl")
        spec = {k: getattr(args, k) for k in ("prompts", "n", "max_new_tokens", "temperature", "micro_batch", "lr", "iterations",
                                              "precision", "lora_rank")}
        spec |= {"gradient_checkpointing": args.gradient_checkpointing == "on"}
        spec |= {"model": str(Path(model).resolve()), "data": str(data)}
        results: dict[str, list[dict[str, float]]] = {s: [] for s in args.sides}
        for r in range(args.repeats):
            for side in args.sides:
                results[side].append(_run_side(side, spec, args.timeout_s))
                print(f"run {r + 1}/{args.repeats} {side}: {json.dumps(results[side][-1])}", file=sys.stderr, flush=True)
    return spec, results


def shape_line(args: argparse.Namespace) -> str:
    """The run's shape, the table's first line."""
    checkpointing = "" if args.precision == "defaults" else f", gradient checkpointing {args.gradient_checkpointing}"
    return (f"{args.prompts} prompts × {args.n} samples × ≤{args.max_new_tokens} tokens, T={args.temperature:g}, {args.precision}, β=0, "
            f"micro-batch {args.micro_batch}{checkpointing}, "
            f"{max(args.iterations - 1, 1)} counted iteration(s) per run, {os.cpu_count()} CPUs")  # one alone is counted (_result)


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    if args.child:
        _child(args.child, json.loads(args.spec))
        return ""
    _, results = collect(args)
    out = f"{shape_line(args)}\n\n{table(results)}"
    print(out)
    return out


if __name__ == "__main__":
    main()
