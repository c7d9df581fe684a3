"""On-policy distillation (``teacher``) beside GRPO from the same student at the same budget, side by side.

Three sides train the same student (``--model``; default the packaged SmolLM2-135M-Instruct) on the same generated
arithmetic prompts for ``--iterations`` iterations of ``--prompts`` prompts × ``--n`` samples: GRPO alone (the
baseline), GRPO with the teacher's per-token reverse-KL advantage added (``teacher.coef=1``), and distillation
alone (``teacher.reward_weight=0``). The teacher is ``--teacher`` (the issue's: the SFT → GRPO model; it must have
the student's tokenizer). Each side runs in this process, one after the other, in-process dock, fp32.

    python benchmarks/distillation.py --teacher runs/align/export             # SmolLM2-135M student
    python benchmarks/distillation.py --model TINY --teacher TINY_TEACHER --quick

Prints one markdown table, a row per side: greedy accuracy before → after (``--eval-size`` held-out prompts),
seconds per iteration (median, the first not counted), response tokens per second (``perf/response_tokens_per_s``,
median), the teacher stage's seconds per iteration, and the reverse KL to the teacher (``distill/reverse_kl``)
at the first and the last iteration.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

SIDES = {"GRPO": [], "GRPO + teacher": ["teacher.coef=1.0"], "distillation alone": ["teacher.coef=1.0", "teacher.reward_weight=0"]}
"""Each side's overrides over the common ones; a side with any sets ``teacher.enable``."""


def run_side(args: argparse.Namespace, side: str, out: Path) -> dict[str, float]:
    """One ``dockrl train`` run of ``side``; its numbers."""
    from dockrl import driver
    from dockrl.config import load_config

    extra = SIDES[side]
    teacher = ["teacher.enable=true", f"teacher.model.path={args.teacher}", *extra] if extra else []
    cfg = load_config(None, [
        f"model.path={args.model}", f"run.output_dir={out / side.replace(' ', '_')}", f"run.cache_dir={args.cache}", "run.progress=false",
        f"rollout.engine={args.engine}", "rollout.dtype=float32", "trainer.autocast_bf16=false", f"rollout.n={args.n}",
        f"rollout.max_response_length={args.max_new_tokens}", f"trainer.iterations={args.iterations}",
        f"trainer.global_batch={args.prompts}", f"trainer.mini_batch={args.prompts}", f"trainer.micro_batch={args.micro_batch}",
        f"trainer.lr={args.lr}", "trainer.save_every=0", f"data.eval_size={args.eval_size}", f"trainer.seed={args.seed}", *teacher,
    ])
    steps: list[dict[str, float]] = []
    summary = driver.train(cfg, on_iteration=lambda _, m: steps.append(dict(m)))
    counted = steps[1:] or steps
    kl = [s["distill/reverse_kl"] for s in steps if "distill/reverse_kl" in s]
    return {"accuracy_before": summary["eval/accuracy_before"], "accuracy_after": summary["eval/accuracy_after"],
            "seconds_per_iteration": statistics.median(s["timing_s/iteration"] for s in counted),
            "tokens_per_s": statistics.median(s["perf/response_tokens_per_s"] for s in counted),
            "teacher_s": statistics.median(s.get("timing_s/teacher", 0.0) for s in counted),
            "kl_first": kl[0] if kl else float("nan"), "kl_last": kl[-1] if kl else float("nan")}


def table(results: dict[str, dict[str, float]]) -> str:
    rows = ["| side | accuracy before → after | s/iteration | response tokens/s | teacher s/iteration | reverse KL first → last |",
            "|---|---|---|---|---|---|"]
    for side, r in results.items():
        kl = "—" if r["kl_first"] != r["kl_first"] else f"{r['kl_first']:.4f} → {r['kl_last']:.4f}"
        rows.append(f"| {side} | {r['accuracy_before']:.3f} → {r['accuracy_after']:.3f} | {r['seconds_per_iteration']:.2f} | "
                    f"{r['tokens_per_s']:.1f} | {r['teacher_s']:.2f} | {kl} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="the student (default: the packaged SmolLM2-135M-Instruct)")
    p.add_argument("--teacher", required=True, help="the teacher's HF folder, with the student's tokenizer")
    p.add_argument("--engine", default="auto", choices=("auto", "hf", "vllm"))
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--eval-size", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", default="", help="run.cache_dir (default: a temporary folder)")
    p.add_argument("--quick", action="store_true", help="3 iterations of 2 prompts × 2, 8 new tokens, 4 eval prompts")
    args = p.parse_args(argv)
    if args.quick:
        args.iterations, args.prompts, args.n, args.max_new_tokens, args.eval_size, args.micro_batch, args.lr = 3, 2, 2, 8, 4, 4, 1e-3
    with tempfile.TemporaryDirectory(prefix="distill-bench-") as tmp:
        args.cache = args.cache or str(Path(tmp) / "cache")
        results = {side: run_side(args, side, Path(tmp)) for side in SIDES}
    out = table(results)
    print(out)
    return out


if __name__ == "__main__":
    main()
