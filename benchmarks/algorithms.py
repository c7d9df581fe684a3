"""GRPO, DAPO, RLOO and PPO side by side on one model with the same budget: accuracy and speed.

Every algorithm trains the same model from the same checkpoint on the same prompts in the same
order (``trainer.seed``), for the same number of iterations, prompts per iteration, samples per
prompt (group size) and maximum response length, and is evaluated greedily on the same held-out
problems before and after training. Only the algorithm's own settings differ (``RECIPES``). Each
run is a process of its own (``dockrl train``'s driver, in-process dock); an algorithm this build
cannot run (its config fields are unknown, or its stages are missing) is listed as not available,
with the reason.

    python benchmarks/algorithms.py --set run.cache_dir=.cache/dockrl     # SmolLM2-135M-Instruct, the demo's budget
    python benchmarks/algorithms.py --quick                                # the tiny random model, seconds per run

Prints one table (greedy test accuracy before and after, the training reward's accuracy in the
first and last iterations, median seconds per iteration) headed by the machine it ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ALGORITHMS = ("grpo", "dapo", "rloo", "ppo")

SHARED_LOSS = ["algorithm.clip_ratio_low=0.2", "algorithm.clip_ratio_high=0.2", "algorithm.loss_agg_mode=token-mean"]
RECIPES: dict[str, list[str]] = {
    # DeepSeekMath's GRPO (arXiv 2402.03300) without its KL term: every recipe here runs with β = 0
    "grpo": ["algorithm.adv_estimator=grpo", *SHARED_LOSS],
    # DAPO (arXiv 2503.14476): clip-higher, token-level loss, dynamic sampling, overlong reward shaping
    "dapo": ["algorithm.adv_estimator=grpo", "algorithm.clip_ratio_low=0.2", "algorithm.clip_ratio_high=0.28",
             "algorithm.loss_agg_mode=token-mean", "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc",
             "algorithm.filter_groups.max_num_gen_batches=3", "algorithm.filter_groups.on_exhausted=fill",
             "algorithm.overlong_buffer.enable=true", "algorithm.overlong_buffer.penalty_factor=1.0",
             "algorithm.overlong_buffer.len={buffer}"],  # the paper's 4k of 20k tokens: a fifth of --max-length
    # RLOO (arXiv 2402.14740): the leave-one-out baseline, with the same clipped loss as GRPO
    "rloo": ["algorithm.adv_estimator=rloo", *SHARED_LOSS],
    # PPO (arXiv 1707.06347) with a critic initialized from the policy; GAE with verl's γ = λ = 1
    "ppo": ["algorithm.adv_estimator=gae", "algorithm.gamma=1.0", "algorithm.lam=1.0", "critic.enable=true", *SHARED_LOSS],
}
"""Each algorithm's own settings, on top of the shared budget (``budget_overrides``); ``{buffer}``
is the overlong buffer, a fifth of ``--max-length``."""
STAGES = {"ppo": "critic"}
"""A stage process an algorithm needs besides the GRPO ones: without it the build cannot run it."""

QUICK = dict(iterations=2, prompts=2, n=4, max_length=8, eval_size=4, micro_batch=4, train_problems=40, test_problems=8)


def budget_overrides(args: argparse.Namespace, model: str) -> list[str]:
    """The settings every algorithm shares: model, data, budget, evaluation set, seed, plus ``--set``."""
    rows = args.prompts * args.n
    return [
        f"model.path={model}", "run.progress=false",
        f"trainer.iterations={args.iterations}", f"trainer.global_batch={args.prompts}", f"trainer.mini_batch={args.prompts}",
        f"trainer.micro_batch={args.micro_batch}", f"rollout.n={args.n}", f"rollout.max_response_length={args.max_length}",
        f"rollout.batch_size={rows}", f"data.eval_size={args.eval_size}", f"data.generate_train={args.train_problems}",
        f"data.generate_test={args.test_problems}", "trainer.save_every=0", f"trainer.seed={args.seed}",
        "trainer.eval_before=true", "trainer.eval_after=true", *args.set,
    ]


def availability(algorithm: str, overrides: list[str]) -> str:
    """'' when this build can run ``algorithm`` with ``overrides``, else why not (the config error, a missing stage)."""
    from dockrl.config import ConfigError, load_config
    from dockrl.stages.table import stage_processes

    try:
        cfg = load_config(None, overrides)
    except ConfigError as e:  # e.g. "algorithm: unknown field(s) ['adv_estimator']; expected some of [...]"
        return str(e).splitlines()[0].split("; expected some of")[0]
    stage = STAGES.get(algorithm)
    if stage and stage not in stage_processes(cfg):
        return f"no {stage!r} stage in this build"
    return ""


def run_algorithm(overrides: list[str]) -> dict[str, Any]:
    """One training run (in this process); returns its summary and per-iteration metrics."""
    from dockrl import driver
    from dockrl.config import load_config, resolve_auto

    # the table of record generates with transformers: rollout.engine=auto would pick vLLM where it
    # is installed; `--set rollout.engine=vllm` (later in the overrides) still chooses vLLM
    cfg = resolve_auto(load_config(None, ["rollout.engine=hf", *overrides]))  # resolved here: the table names the device
    metrics: list[dict[str, float]] = []
    summary = driver.train(cfg, on_iteration=lambda _, m: metrics.append(dict(m)))
    return {"summary": summary, "metrics": metrics, "device": cfg.parallel.device}


def _child(spec: dict[str, Any]) -> None:
    print("RESULT " + json.dumps(run_algorithm(spec["overrides"])), flush=True)


def _run_child(algorithm: str, overrides: list[str], timeout_s: float) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", json.dumps({"overrides": overrides})]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"algorithms: the {algorithm} run did not finish within {timeout_s:.0f} s (--timeout-s)") from e
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"algorithms: the {algorithm} run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def row(result: dict[str, Any]) -> dict[str, float]:
    """A run's table values: greedy accuracy before/after (%), the training reward's accuracy over
    the first and last quarter of the iterations (%), median seconds per iteration."""
    s, m = result["summary"], result["metrics"]
    k = max(1, len(m) // 4)
    return {
        "before": 100 * s["eval/accuracy_before"], "after": 100 * s["eval/accuracy_after"],
        "train_first": 100 * statistics.mean(x["reward/accuracy"] for x in m[:k]),
        "train_last": 100 * statistics.mean(x["reward/accuracy"] for x in m[-k:]),
        "seconds": statistics.median(x["timing_s/iteration"] for x in m),
    }


def table(rows: dict[str, dict[str, float] | str]) -> str:
    """Markdown: one line per algorithm, its values or ``not available`` and the reason."""
    head = ["algorithm", "accuracy before %", "accuracy after %", "Δ points", "train accuracy first → last %", "s/iteration"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in rows.items():
        if isinstance(r, str):
            lines.append(f"| {name} | not available ({r}) |" + " |" * (len(head) - 2))
            continue
        lines.append(f"| {name} | {r['before']:.1f} | {r['after']:.1f} | {r['after'] - r['before']:+.1f} | "
                     f"{r['train_first']:.1f} → {r['train_last']:.1f} | {r['seconds']:.2f} |")
    return "\n".join(lines)


def machine(device: str) -> str:
    """The machine in words: CPU model and cores, the accelerator the runs used, torch's version."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        names = [x.split(":", 1)[1].strip() for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("model name")]
        cpu = names[0] if names else cpu
    except OSError:
        pass
    used = device
    if device == "cuda" and torch.cuda.is_available():
        used = f"cuda ({torch.cuda.get_device_name(0)})"
    load = f", load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return f"{cpu}, {os.cpu_count()} CPUs{load}; device {used}; torch {torch.__version__}"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="HF model folder or smollm2-135m (default; --quick: the tiny random model)")
    parser.add_argument("--quick", action="store_true", help="the tiny random model, 2 iterations of 2 prompts × 4 samples × 8 tokens")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help=f"comma-separated of {', '.join(ALGORITHMS)}")
    parser.add_argument("--iterations", type=int, default=20)
    parser.add_argument("--prompts", type=int, default=6, help="prompts per iteration (trainer.global_batch)")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (rollout.n, the group size)")
    parser.add_argument("--max-length", type=int, default=80, help="most response tokens (rollout.max_response_length)")
    parser.add_argument("--micro-batch", type=int, default=8, help="sequences per forward/backward (trainer.micro_batch)")
    parser.add_argument("--eval-size", type=int, default=200, help="held-out problems of the greedy evaluation (data.eval_size)")
    parser.add_argument("--train-problems", type=int, default=2000, help="generated training problems (data.generate_train)")
    parser.add_argument("--test-problems", type=int, default=200, help="generated test problems (data.generate_test)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                        help="a config override for every run (e.g. run.cache_dir=.cache/dockrl, parallel.device=cuda); repeatable")
    parser.add_argument("--timeout-s", type=float, default=7200.0, help="per run")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(json.loads(args.child))
        return ""
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
        args.set = ["rollout.dtype=float32", "trainer.autocast_bf16=false", "dock.timeout_s=120", *args.set]
    picked = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    if not picked or set(picked) - set(ALGORITHMS):
        parser.error(f"--algorithms: got {args.algorithms!r}; expected some of {', '.join(ALGORITHMS)}")

    with tempfile.TemporaryDirectory(prefix="algorithms-") as work:
        model = args.model or "smollm2-135m"
        if args.quick and not args.model:
            from dockrl.run.models import build_tiny_model

            model = str(build_tiny_model(Path(work) / "tiny-model"))
        budget = budget_overrides(args, model)
        if not any(s.startswith("run.cache_dir=") for s in args.set):
            budget.append(f"run.cache_dir={Path(work) / 'cache'}")  # generated data and the prepared model, shared by the runs
        rows: dict[str, dict[str, float] | str] = {}
        device = ""
        for name in picked:
            recipe = [x.format(buffer=max(1, args.max_length // 5)) for x in RECIPES[name]]
            overrides = [*budget, f"run.output_dir={Path(work) / name}", *recipe]
            why = availability(name, overrides)
            if why:
                rows[name] = why
                print(f"{name}: not available ({why})", file=sys.stderr, flush=True)
                continue
            result = _run_child(name, overrides, args.timeout_s)
            rows[name], device = row(result), result["device"]
            print(f"{name}: {json.dumps(rows[name])}", file=sys.stderr, flush=True)
    shape = (f"{model if not args.quick else 'tiny random model'}: {args.iterations} iterations × {args.prompts} prompts × "
             f"{args.n} samples × ≤{args.max_length} tokens, greedy evaluation on {args.eval_size} held-out problems, seed {args.seed}")
    out = f"{shape}\nmachine: {machine(device or 'cpu')}\n\n{table(rows)}"
    print(out)
    return out


if __name__ == "__main__":
    main()
