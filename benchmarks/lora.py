"""GRPO with LoRA (``trainer.lora``) against full fine-tuning at the same budget, side by side.

Both sides train the same model (default: the packaged SmolLM2-135M-Instruct, ``model.path=smollm2-135m``)
on the same generated arithmetic prompts for ``--iterations`` iterations of ``--prompts`` prompts ×
``--n`` samples (≤ ``--max-new-tokens`` tokens, temperature 1), in the same precision (fp32), with
the same rollout engine (``--engine``, ``--rollout-dtype``: a separate copy of the weights that each weight sync updates);
only ``trainer.lora`` and the learning rate differ (LoRA's update is scaled by alpha / rank and usually
takes a larger rate: ``--lora-lr``). Each side is a process of its own, run one after the other.

    python benchmarks/lora.py                                  # SmolLM2-135M, vLLM rollout
    python benchmarks/lora.py --model TINY_DIR --engine hf --quick

Prints one markdown table, a row per side: greedy test accuracy before and after training
(``eval/before/accuracy``, ``eval/after/accuracy`` on ``--eval-size`` test prompts), seconds per
iteration (median, the first iteration not counted), peak RSS of the run's process tree
(``vs_trl.tree_peak_rss``), bytes sent per weight sync (``weight_sync/bytes``); then a second table of the
stages' seconds per iteration (``timing_s/<stage>``, median), which says where the two sides differ.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

from vs_trl import tree_peak_rss

STAGES = ("rollout", "reward", "reference", "old_log_prob", "actor", "weight_sync")
"""The stages whose seconds per iteration (``timing_s/<stage>``, median) the second table shows."""


def run_side(spec: dict[str, Any]) -> dict[str, float]:
    """One ``dockrl train`` run (in-process dock) of ``spec``; its metrics."""
    from dockrl import driver
    from dockrl.config import load_config

    lora = [f"trainer.lora.rank={spec['rank']}", f"trainer.lora.alpha={2 * spec['rank']}"] if spec["side"] == "lora" else []
    cfg = load_config(None, [
        f"model.path={spec['model']}", f"run.output_dir={spec['out']}/run", f"run.cache_dir={spec['cache']}", "run.progress=false",
        f"rollout.engine={spec['engine']}", f"rollout.dtype={spec['rollout_dtype']}", "trainer.autocast_bf16=false", f"rollout.n={spec['n']}",
        "rollout.temperature=1.0", f"rollout.max_response_length={spec['max_new_tokens']}",
        f"trainer.iterations={spec['iterations']}", f"trainer.global_batch={spec['prompts']}", f"trainer.mini_batch={spec['prompts']}",
        f"trainer.micro_batch={spec['micro_batch']}", f"trainer.lr={spec['lora_lr'] if spec['side'] == 'lora' else spec['lr']}",
        "trainer.save_every=0", f"data.eval_size={spec['eval_size']}", f"trainer.seed={spec['seed']}", *lora,
    ])
    steps: list[dict[str, float]] = []
    summary = driver.train(cfg, on_iteration=lambda _, m: steps.append(dict(m)))
    counted = steps[1:] or steps  # the first iteration warms up (vLLM's first adapter load, allocator)
    return {
        "accuracy_before": summary["eval/accuracy_before"], "accuracy_after": summary["eval/accuracy_after"],
        "format_before": summary["eval/format_rate_before"], "format_after": summary["eval/format_rate_after"],
        "seconds_per_iteration": statistics.median(s["timing_s/iteration"] for s in counted),
        "sync_bytes": statistics.median(s["weight_sync/bytes"] for s in steps),
    } | {f"{stage}_s": statistics.median(s.get(f"timing_s/{stage}", 0.0) for s in counted) for stage in STAGES}


def measure(side: str, spec: dict[str, Any], timeout_s: float) -> dict[str, float]:
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with tempfile.TemporaryDirectory(prefix=f"lora-bench-{side}-") as out:
        cmd = [sys.executable, __file__, "--child", json.dumps(spec | {"side": side, "out": out})]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        stdout, stderr, sampled, descendants = tree_peak_rss(proc, timeout_s)
    lines = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"lora benchmark: the {side} run failed (exit {proc.returncode}):\n{stderr[-3000:]}")
    result = json.loads(lines[-1].removeprefix("RESULT "))
    result["peak_rss_gb"] = max(sampled / 2**30, result["self_peak_rss_gb"] + descendants / 2**30)
    return result


def table(results: dict[str, dict[str, float]]) -> str:
    rows = ["| side | accuracy before → after | format before → after | s/iteration | peak RSS GB (tree) | bytes per weight sync |",
            "|---|---|---|---|---|---|"]
    for side, r in results.items():
        rows.append(f"| {side} | {r['accuracy_before']:.3f} → {r['accuracy_after']:.3f} | {r['format_before']:.3f} → "
                    f"{r['format_after']:.3f} | {r['seconds_per_iteration']:.3g} | "
                    f"{r['peak_rss_gb']:.2f} | {r['sync_bytes']:,.0f} |")
    rows += ["", "| side (s per iteration, median) | " + " | ".join(STAGES) + " |", "|---|" + "---|" * len(STAGES)]
    rows += [f"| {side} | " + " | ".join(f"{r[f'{stage}_s']:.2f}" for stage in STAGES) + " |" for side, r in results.items()]
    full, lora = results.get("full fine-tuning"), results.get("LoRA")
    if full and lora and full["sync_bytes"]:
        rows.append(f"\nLoRA / full: {lora['seconds_per_iteration'] / full['seconds_per_iteration']:.2f}× s/iteration, "
                    f"{lora['peak_rss_gb'] / full['peak_rss_gb']:.2f}× peak RSS, "
                    f"{100 * lora['sync_bytes'] / full['sync_bytes']:.2f}% of the bytes per weight sync")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="model.path (default: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--cache", default=".cache/dockrl", help="run.cache_dir (where the packaged model is exported once)")
    parser.add_argument("--engine", default="vllm", choices=["hf", "vllm"], help="rollout.engine of both sides")
    parser.add_argument("--rollout-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="rollout.dtype (an fp32 HF rollout shares the actor's module and syncs nothing: use vllm or bfloat16)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument("--eval-size", type=int, default=50)
    parser.add_argument("--lr", type=float, default=1e-6, help="full fine-tuning's trainer.lr")
    parser.add_argument("--lora-lr", type=float, default=2e-5, help="LoRA's trainer.lr")
    parser.add_argument("--rank", type=int, default=8, help="trainer.lora.rank (alpha = 2 × rank)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="per side")
    parser.add_argument("--quick", action="store_true", help="2 prompts × 2 samples × 8 tokens, 2 iterations, 4 test prompts")
    parser.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        from dockrl.process.memory import process_peak_bytes

        result = run_side(json.loads(args.child))
        result["self_peak_rss_gb"] = process_peak_bytes() / 2**30  # across the stages' resets of the kernel's peak
        print("RESULT " + json.dumps(result), flush=True)
        return ""
    if args.quick:
        args.prompts, args.n, args.max_new_tokens, args.iterations, args.eval_size, args.micro_batch = 2, 2, 8, 2, 4, 4
    spec = {k: getattr(args, k) for k in ("model", "engine", "rollout_dtype", "prompts", "n", "max_new_tokens", "micro_batch", "iterations",
                                          "eval_size", "lr", "lora_lr", "rank", "seed")} | {"cache": os.path.abspath(args.cache)}
    results = {name: measure(side, spec, args.timeout_s) for name, side in (("full fine-tuning", "full"), ("LoRA", "lora"))}
    out = table(results)
    print(out)
    return out


if __name__ == "__main__":
    main()
