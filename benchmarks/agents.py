"""Does a small chat model learn to use a tool? GRPO with multi-turn rollouts over a tool environment.

The model (default: the packaged SmolLM2-135M-Instruct, ``model.path=smollm2-135m``) answers the
bundled tool task (``dockrl/envs/data/tool_arithmetic_{train,test}.jsonl``: products and sums of 3- to
5-digit numbers, which a 135M model cannot compute in its head) in an environment (``--env``:
``calculator`` or ``python``) whose tool computes them; the verifier scores the last model turn's
``#### <number>``, plus ``--tool-call-reward`` for the first model turn whose tool calls all ran (every such turn with
``--tool-call-reward-every``). One run of
``--iterations`` iterations of ``--prompts`` prompts × ``--n`` trajectories (≤ ``--max-turns`` model turns
of ≤ ``--max-new-tokens`` tokens, temperature ``--temperature``), in fp32 (``--precision``), one update per iteration.

    python benchmarks/agents.py                                   # SmolLM2-135M, calculator, fenced calls
    python benchmarks/agents.py --model TINY_DIR --engine hf --quick

Prints two markdown tables and the command that reproduces them: the greedy evaluation on
``--eval-size`` test prompts before and after training (accuracy, answers in the ``####`` format,
model turns, tool calls and tool errors per trajectory, the share of tool calls that ran, the calls that returned
the reference answer), and every training iteration's sampled trajectories (reward, the share of it the verifier
gave for the answer, accuracy, the same tool counts, seconds); each iteration's row also goes to stderr as it ends.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SYSTEM_PROMPTS = {
    "calculator": ("Compute with the calculator tool, then give the final answer. Example:\nuser: What is 12 multiplied by 34?\n"
                   "assistant: ```\n12 * 34\n```\ntool: 408\nassistant: #### 408"),
    "python": ("Compute with the python tool, then give the final answer. Example:\nuser: What is 12 multiplied by 34?\n"
               "assistant: ```python\nprint(12 * 34)\n```\ntool: 408\nassistant: #### 408"),
}
"""``data.system_prompt`` per environment: the task and one worked exchange in the fenced format; the
run appends the tools' description (``dockrl.envs.prompting``)."""


def overrides(args: argparse.Namespace, out: str) -> list[str]:
    """The run's ``section.field=value`` overrides."""
    data = HERE.parent / "dockrl" / "envs" / "data"
    return [
        f"model.path={args.model}", f"run.output_dir={out}", f"run.cache_dir={args.cache}", "run.progress=false",
        f"env.name={args.env}", f"env.tool_parser={args.tool_parser}", f"data.system_prompt={SYSTEM_PROMPTS[args.env]}",
        f"data.train_path={data / 'tool_arithmetic_train.jsonl'}", f"data.test_path={data / 'tool_arithmetic_test.jsonl'}",
        f"data.eval_size={args.eval_size}", f"data.max_prompt_length={args.max_prompt_length}", f"rollout.engine={args.engine}",
        *(["rollout.dtype=float32", "trainer.autocast_bf16=false"] if args.precision == "fp32" else []),
        f"rollout.n={args.n}", f"rollout.temperature={args.temperature}", f"rollout.max_response_length={args.max_new_tokens}",
        f"rollout.max_turns={args.max_turns}", f"rollout.max_total_tokens={args.max_total_tokens}",
        f"trainer.iterations={args.iterations}", f"trainer.global_batch={args.prompts}", f"trainer.mini_batch={args.prompts}",
        f"trainer.micro_batch={args.micro_batch}", f"trainer.lr={args.lr}", "algorithm.kl_loss_coef=0", "trainer.save_every=0",
        f"trainer.seed={args.seed}", f"env.tool_call_reward={args.tool_call_reward}",
        f"env.tool_call_reward_once={str(not args.tool_call_reward_every).lower()}",
        *(["run.keep_rollouts=all"] if args.keep_rollouts else []),
        *([f"algorithm.format_reward={args.format_reward}"] if args.format_reward is not None else []),
    ]


def success(calls: float, errors: float) -> str:
    """The share of tool calls that ran (``1 - errors / calls``), or ``-`` without a call."""
    return f"{1 - errors / calls:.2f}" if calls else "-"


def answer_share(s: dict[str, float]) -> str:
    """The share of the mean reward the verifier gave for the answers (``reward/verifier_mean / reward/mean``), or ``-``
    without a reward."""
    return f"{s['reward/verifier_mean'] / s['reward/mean']:.2f}" if s["reward/mean"] > 0 else "-"


ITERATION_HEADER = ["| iteration (sampled) | reward | from the answer | accuracy | turns / trajectory | tool calls / trajectory | "
                    "tool errors / trajectory | tool-call success | right calls / trajectory | seconds |",
                    "|---|---|---|---|---|---|---|---|---|---|"]


def iteration_row(i: int, s: dict[str, float]) -> str:
    """One training iteration's row of the sampled table."""
    return (f"| {i} | {s['reward/mean']:.3f} | {answer_share(s)} | {s['reward/accuracy']:.3f} | {s['rollout/turns_mean']:.2f} | "
            f"{s['rollout/tool_calls_mean']:.2f} | {s['rollout/tool_errors_mean']:.2f} | "
            f"{success(s['rollout/tool_calls_mean'], s['rollout/tool_errors_mean'])} | {s['rollout/tool_calls_right_mean']:.2f} | "
            f"{s['timing_s/iteration']:.0f} |")


def tables(summary: dict[str, float], steps: list[dict[str, float]]) -> str:
    e = {tag: {k: summary.get(f"eval/{k}_{tag}", float("nan")) for k in
               ("accuracy", "format_rate", "turns_mean", "tool_calls_mean", "tool_errors_mean", "tool_calls_right_mean")}
         for tag in ("before", "after")}
    rows = ["| greedy, test prompts | accuracy | `####` format | turns / trajectory | tool calls / trajectory | "
            "tool errors / trajectory | tool-call success | right calls / trajectory |", "|---|---|---|---|---|---|---|---|"]
    for tag in ("before", "after"):
        m = e[tag]
        rows.append(f"| {tag} | {m['accuracy']:.3f} | {m['format_rate']:.3f} | {m['turns_mean']:.2f} | {m['tool_calls_mean']:.2f} | "
                    f"{m['tool_errors_mean']:.2f} | {success(m['tool_calls_mean'], m['tool_errors_mean'])} | "
                    f"{m['tool_calls_right_mean']:.2f} |")
    rows += ["", *ITERATION_HEADER, *(iteration_row(i, s) for i, s in enumerate(steps))]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="model.path (default: the packaged SmolLM2-135M-Instruct)")
    parser.add_argument("--cache", default=str(HERE / ".cache" / "dockrl"), help="run.cache_dir (the packaged model is exported there once)")
    parser.add_argument("--env", default="calculator", choices=sorted(SYSTEM_PROMPTS), help="env.name")
    parser.add_argument("--tool-parser", default="fenced", choices=["fenced", "hermes"], help="env.tool_parser")
    parser.add_argument("--engine", default="vllm", choices=["hf", "vllm"], help="rollout.engine")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-turns", type=int, default=3, help="rollout.max_turns: room for calls and the answer")
    parser.add_argument("--max-new-tokens", type=int, default=40, help="rollout.max_response_length: tokens of one model turn")
    parser.add_argument("--max-total-tokens", type=int, default=96)
    parser.add_argument("--max-prompt-length", type=int, default=384, help="data.max_prompt_length (the tools' description is in it)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--eval-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--precision", default="fp32", choices=["fp32", "auto"],
                        help="auto: the config's defaults (bf16 where the CPU computes it faster, docs/benchmarks.md)")
    parser.add_argument("--tool-call-reward", type=float, default=0.0,
                        help="env.tool_call_reward: the reward of a model turn whose tool calls all ran (0: the verifier's reward only)")
    parser.add_argument("--tool-call-reward-every", action="store_true",
                        help="env.tool_call_reward_once=false: every such turn earns it, not only the first")
    parser.add_argument("--keep-rollouts", action="store_true", help="run.keep_rollouts=all: the sampled rows under --out/rollouts")
    parser.add_argument("--format-reward", type=float, default=None,
                        help="algorithm.format_reward: the reward of a wrong answer in the #### format (default: the config's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", help="run.output_dir (default: a temporary folder)")
    parser.add_argument("--quick", action="store_true", help="2 prompts × 2 trajectories × 8 tokens, 2 iterations, 4 test prompts "
                        "(a check of the plumbing, e.g. with the tiny test model)")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompts, args.n, args.max_new_tokens, args.max_total_tokens, args.iterations, args.eval_size = 2, 2, 8, 32, 2, 4
        args.micro_batch, args.max_prompt_length = 4, 1024  # the tiny model's tokenizer splits finer
    from dockrl import driver  # lazy: torch and transformers load in seconds; --help needs neither
    from dockrl.config import load_config

    steps: list[dict[str, Any]] = []

    def progress(_: int, metrics: dict[str, Any]) -> None:  # a run cut short (a timeout) still shows its iterations
        steps.append(dict(metrics))
        print(*(ITERATION_HEADER if len(steps) == 1 else []), iteration_row(len(steps) - 1, steps[-1]), sep="\n", file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="agents-bench-") as tmp:
        summary = driver.train(load_config(None, overrides(args, args.out or tmp)), on_iteration=progress)
    out = tables(summary, steps) + "\n\n" + shlex.join([Path(sys.executable).name, "benchmarks/agents.py", *(argv or sys.argv[1:])])
    print(out)
    print(json.dumps({"summary": summary, "iterations": steps}), file=sys.stderr)
    return out


if __name__ == "__main__":
    main()
