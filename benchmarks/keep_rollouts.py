"""Kept rollouts: what ``run.keep_rollouts=all`` costs an iteration against ``off``, side by side in one run.

Runs the same GRPO run once per side and repeat (the sides alternate: off, all, then all, off, ...,
so a drift of the machine's speed hits both alike) and prints one table: seconds per iteration
(``timing_s/iteration``, the driver's loop time; no checkpoints, no evaluation) over the iterations
after ``--warmup``, the rows and bytes kept, the time closes waited for a writer that was
``dockrl.dock.shard.kept_rollouts.QUEUE`` iterations behind (``rollouts/wait_s``), and the ratio all/off. The
shards write in the background (``dockrl.dock.shard.kept_rollouts.RolloutWriter``): the ratio is the price of
that thread and its Parquet encoding competing for the cores, which issue 28 bounds at 5%.

Run::

    python benchmarks/keep_rollouts.py                       # in-process dock, tiny model, 3 repeats × 8 iterations
    python benchmarks/keep_rollouts.py --set dock.mode=distributed --set dock.shards=2
    python benchmarks/keep_rollouts.py --quick               # 1 repeat × 3 tiny iterations: the test suite's
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

SIDES = {"off": ("run.keep_rollouts=off",), "all": ("run.keep_rollouts=all",)}
"""The two sides: a label and the overrides that make it."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="a local HF model folder (default: the tiny random model, built here)")
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1, help="first iterations of each run left out (model loads, first compiles)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", type=int, default=8, help="trainer.global_batch")
    p.add_argument("--samples", type=int, default=8, help="rollout.n")
    p.add_argument("--max-tokens", type=int, default=64, help="rollout.max_response_length")
    p.add_argument("--set", action="append", default=[], help="a config override for every side (repeatable)")
    p.add_argument("--quick", action="store_true", help="1 repeat of 3 iterations of 2 prompts × 4 samples × 8 tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.iterations, args.repeats, args.prompts, args.samples, args.max_tokens = 3, 1, 2, 4, 8
    if args.warmup >= args.iterations:
        p.error(f"--warmup {args.warmup}: expected fewer than --iterations {args.iterations}")
    return args


def base_overrides(model: str, out: Path, work: Path, args: argparse.Namespace) -> list[str]:
    """The run's config, the same for every side."""
    return [
        f"model.path={model}", f"run.output_dir={out}", f"run.cache_dir={work / 'cache'}", "run.progress=false",
        f"trainer.iterations={args.iterations}", f"trainer.global_batch={args.prompts}", f"trainer.mini_batch={args.prompts}",
        f"trainer.micro_batch={args.prompts * args.samples}", f"rollout.n={args.samples}",
        f"rollout.max_response_length={args.max_tokens}", "rollout.engine=hf", "rollout.dtype=float32", "trainer.autocast_bf16=false",
        "trainer.save_every=0", "trainer.eval_before=false", "trainer.eval_after=false", "data.generate_train=64",
        "data.generate_test=4", "data.eval_size=4",
    ]


def run_side(model: str, out: Path, work: Path, overrides: tuple[str, ...], args: argparse.Namespace) -> tuple[list[dict], dict]:
    """One run; its metrics.jsonl lines after ``--warmup`` and its summary.json."""
    from dockrl import driver
    from dockrl.config import load_config

    driver.train(load_config(None, [*base_overrides(model, out, work, args), *args.set, *overrides]))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if r["iteration"] >= args.warmup], json.loads((out / "summary.json").read_text())


def summarize(runs: list[tuple[list[dict], dict]]) -> dict[str, float]:
    """Pooled numbers of a side's runs."""
    rows = [r for lines, _ in runs for r in lines]
    n = len(rows)
    return {
        "iterations": float(n),
        "s_per_iteration": sum(r["timing_s/iteration"] for r in rows) / n,
        "rows_kept": float(sum(s.get("rollouts/rows", 0) for _, s in runs)),
        "bytes_per_run": sum(s.get("rollouts/bytes", 0) for _, s in runs) / len(runs),
        "writer_wait_s": sum(s.get("rollouts/wait_s", 0.0) for _, s in runs),
    }


ROWS = [("iterations", "iterations measured", "{:.0f}"), ("s_per_iteration", "seconds per iteration", "{:.4f}"),
        ("rows_kept", "rows kept", "{:.0f}"), ("bytes_per_run", "bytes kept per run", "{:.0f}"),
        ("writer_wait_s", "closes waited for the writer, s", "{:.4f}")]


def table(results: dict[str, dict[str, float]]) -> str:
    """off and all side by side, with the ratio all/off of the times."""
    lines = [f"{'':36}{'off':>14}{'all':>14}{'all/off':>10}"]
    for key, label, fmt in ROWS:
        off, on = results["off"][key], results["all"][key]
        ratio = f"{on / off:>10.3f}" if key == "s_per_iteration" and off else f"{'':10}"
        lines.append(f"{label:36}{fmt.format(off):>14}{fmt.format(on):>14}{ratio}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    runs: dict[str, list[tuple[list[dict], dict]]] = {label: [] for label in SIDES}
    with tempfile.TemporaryDirectory(prefix="dockrl-keep-rollouts-") as tmp:
        work = Path(tmp)
        model = args.model
        if not model:
            from dockrl.run.models import build_tiny_model

            model = str(build_tiny_model(work / "model"))
        for r in range(args.repeats):
            order = list(SIDES) if r % 2 == 0 else list(SIDES)[::-1]
            for label in order:
                runs[label].append(run_side(model, work / f"{label}-{r}", work, SIDES[label], args))
    text = table({label: summarize(runs[label]) for label in SIDES})
    print(text, flush=True)
    return text


if __name__ == "__main__":
    main()
