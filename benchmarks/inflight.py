"""Iterations in flight: the actor's bubble with ``dock.max_inflight`` 1 (on-policy), 2 (one-step off-policy), and 2 with partial rollout.

Runs the same distributed GRPO run (every stage its own process) once per side and prints one
table per length block, the sides side by side. The bubble is the actor's idle time over the
iterations' wall clock: ``1 - Σ (timing_s/actor - timing_s/actor_claim) / Σ timing_s/iteration``
(the driver's loop time; no checkpoints, no evaluation), over the iterations after ``--warmup``. With one iteration in flight the actor
waits for every rollout; with two the rollout of iteration k+1 runs while the actor updates on k
(verl's one-step-off-policy recipe; MindSpeed RL, arXiv 2507.19017).

Length blocks: ``heavy``, the tiny model of ``dockrl.testing.heavy_tail_model.build_heavy_tail_model`` (a mixture
of geometric lengths: most responses short, a tail cut at ``--max-tokens``); ``uniform``, the
tiny random model of ``build_tiny_model`` (it almost never emits EOS: every response is about
``--max-tokens`` long). With ``--model`` one block, that model's own lengths. Each block first
samples ``--length-samples`` responses from its model with the HF rollout engine at the run's
settings and prints their length distribution. Sides: ``dock.max_inflight`` 1, 2, and 2 with
partial rollout (``rollout.partial_tokens``, ``--partial-tokens``: a quarter of ``--max-tokens``
unless given; docs/distributed.md), and any ``--side``; ``--set`` overrides go to every side; with ``--repeats`` the sides alternate
(1 2 3, 3 2 1, ...) and the table pools the repeats.

Run::

    python benchmarks/inflight.py                  # heavy and uniform, 6 iterations per side
    python benchmarks/inflight.py --side "inflight 2 + X:dock.max_inflight=2,rollout.x=1"
    python benchmarks/inflight.py --quick          # heavy only, two sides, 3 tiny iterations: the test suite's
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dockrl.config import Config

TEMPERATURE = 1.0
"""``rollout.temperature`` of every run (the heavy-tailed model's rates hold at it)."""
ROWS = [  # key in run_side's numbers, label
    ("s_per_iteration", "seconds per iteration"),
    ("actor_s_per_iteration", "actor busy per iteration, s"),
    ("rollout_s_per_iteration", "rollout busy per iteration, s"),
    ("bubble", "actor bubble (idle / wall)"),
    ("tokens_per_s", "response tokens/s, end to end"),
    ("length_mean", "response length mean, tokens"),
    ("truncated", "responses cut at the limit"),
    ("partial_cut", "responses cut at the pass budget"),
    ("staleness", "max rollout staleness"),
]


def default_sides(args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    """The sides every run compares: a label and the overrides that make it."""
    return {
        "max_inflight=1": ("dock.max_inflight=1",),
        "max_inflight=2": ("dock.max_inflight=2",),
        "2 + partial": ("dock.max_inflight=2", f"rollout.partial_tokens={args.partial_tokens}"),
    }


def parse_side(text: str) -> tuple[str, tuple[str, ...]]:
    """``LABEL:KEY=VALUE[,KEY=VALUE...]`` → (label, overrides).

    Raises:
        argparse.ArgumentTypeError: no ``:``, an empty label, or an override without ``=``.
    """
    label, sep, rest = text.partition(":")
    overrides = tuple(o.strip() for o in rest.split(",") if o.strip())
    if not sep or not label.strip() or not overrides or not all("=" in o for o in overrides):
        raise argparse.ArgumentTypeError(f"--side {text!r}: expected LABEL:KEY=VALUE[,KEY=VALUE...]")
    return label.strip(), overrides


def base_overrides(model: str, out: Path, work: Path, args: argparse.Namespace) -> list[str]:
    """The run's config, the same for every side."""
    return [
        f"model.path={model}", f"run.output_dir={out}", f"run.cache_dir={work / 'cache'}", "run.progress=false",
        "dock.mode=distributed", "dock.timeout_s=300",
        f"trainer.iterations={args.iterations}", f"trainer.global_batch={args.prompts}", f"trainer.mini_batch={args.prompts}",
        f"trainer.micro_batch={args.prompts * args.samples}", f"rollout.n={args.samples}",
        f"rollout.max_response_length={args.max_tokens}", f"rollout.temperature={TEMPERATURE}", "rollout.engine=hf",
        "rollout.dtype=float32", "trainer.autocast_bf16=false", "trainer.save_every=0", "trainer.eval_before=false",
        "trainer.eval_after=false", "algorithm.kl_loss_coef=0", "data.generate_train=64", "data.generate_test=4",
        "data.eval_size=4",
    ]


def side_config(model: str, out: Path, work: Path, overrides: tuple[str, ...], args: argparse.Namespace) -> Config:
    """A side's config: the base one, then ``--set``, then the side's ``overrides`` (the last wins).

    Raises:
        ConfigError: a bad override, naming it.
    """
    from dockrl.config import load_config

    return load_config(None, [*base_overrides(model, out, work, args), *args.set, *overrides])


def run_side(model: str, out: Path, work: Path, overrides: tuple[str, ...], args: argparse.Namespace) -> list[dict]:
    """One distributed run of ``side_config``; its metrics.jsonl lines of the iterations after
    the ``--warmup`` ones (the first holds every process's start: imports, model loads)."""
    from dockrl import driver

    driver.train(side_config(model, out, work, overrides, args))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [r for r in rows if "timing_s/iteration" in r and r["iteration"] >= args.warmup]


def summarize(rows: list[dict]) -> dict[str, float]:
    """Pooled numbers of a side's iterations (of every repeat)."""
    n, wall = len(rows), sum(r["timing_s/iteration"] for r in rows)
    actor = sum(r["timing_s/actor"] - r.get("timing_s/actor_claim", 0.0) for r in rows)  # computing, not waiting for its rows
    responses = sum(r["rollout/responses"] for r in rows)
    tokens = sum(r["rollout/response_length_mean"] * r["rollout/responses"] for r in rows)
    return {
        "iterations": n, "s_per_iteration": wall / n, "actor_s_per_iteration": actor / n,
        "rollout_s_per_iteration": sum(r["timing_s/rollout"] for r in rows) / n, "bubble": 1 - actor / wall,
        "tokens_per_s": tokens / wall, "length_mean": tokens / responses,
        "truncated": sum(r["rollout/truncated_ratio"] * r["rollout/responses"] for r in rows) / responses,
        "partial_cut": sum(r.get("rollout/partial_cut", 0) for r in rows) / responses,
        "staleness": max(r.get("rollout/staleness", 0.0) for r in rows),
    }


def table(results: dict[str, dict[str, float]]) -> str:
    """The sides as columns, with the ratio of each later side to the first."""
    labels = list(results)
    first = results[labels[0]]
    width = max(18, *(len(x) + 2 for x in labels))
    head = f"{'':32}" + "".join(f"{x:>{width}}" for x in labels) + "".join(f"{f'ratio {i + 1}/1':>12}" for i in range(1, len(labels)))
    lines = [head]
    for key, label in ROWS:
        ratios = [f"{results[x][key] / first[key]:>12.2f}" if first[key] else f"{'':12}" for x in labels[1:]]
        lines.append(f"{label:32}" + "".join(f"{results[x][key]:>{width}.3f}" for x in labels) + "".join(ratios))
    return "\n".join(lines)


def quantile(lengths: list[int], q: float) -> int:
    """The ``q`` quantile of ``lengths`` (the order statistic at ``⌊q · n⌋``)."""
    ordered = sorted(lengths)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def length_line(model: str, args: argparse.Namespace) -> str:
    """The length distribution of ``--length-samples`` responses of ``model`` sampled by the HF
    rollout engine at the run's settings (and the stated one for the heavy-tailed model)."""
    import torch

    from dockrl.config import load_config
    from dockrl.engines.hf.rollout import HFRolloutEngine
    from dockrl.run.data import generate_problems, prompt_token_ids

    system = load_config(None, []).data.system_prompt
    engine = HFRolloutEngine(model, dtype="float32")
    questions = [p["question"] for p in generate_problems(64, seed=0)]
    prompts = [prompt_token_ids(engine.tokenizer, questions[i % 64], system_prompt=system) for i in range(args.length_samples)]
    torch.manual_seed(0)
    samples = engine.generate(prompts, max_new_tokens=args.max_tokens, temperature=TEMPERATURE, batch_size=64)
    lengths = [len(s.response_ids) for s in samples]
    text = (f"response lengths, {len(lengths)} samples of the model, at most {args.max_tokens} tokens: "
            f"median {quantile(lengths, 0.5)}, p90 {quantile(lengths, 0.9)}, p99 {quantile(lengths, 0.99)}, "
            f"max {max(lengths)}, mean {sum(lengths) / len(lengths):.1f}, "
            f"cut at the limit {sum(s.truncated for s in samples) / len(samples):.1%}")
    spec = json.loads((Path(model) / "dockrl_tiny.json").read_text()) if (Path(model) / "dockrl_tiny.json").is_file() else {}
    if "heavy_tail" in spec:
        from dockrl.testing.heavy_tail_model import heavy_tail_length_pmf

        pmf = heavy_tail_length_pmf(args.max_tokens, spec["heavy_tail"]["rates"], spec["heavy_tail"]["weights"])
        cdf = [sum(pmf[: i + 1]) for i in range(len(pmf))]
        at = [next(i for i, c in enumerate(cdf) if c >= q) for q in (0.5, 0.9, 0.99)]
        text += (f"\n  stated (heavy_tail_length_pmf): median {at[0]}, p90 {at[1]}, p99 {at[2]}, "
                 f"mean {sum(i * p for i, p in enumerate(pmf)):.1f}, at the limit {pmf[-1]:.1%}")
    return text


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``--quick`` sets the sizes of the test suite's run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="HF model directory (default: the tiny models, heavy and uniform)")
    parser.add_argument("--lengths", nargs="+", choices=["heavy", "uniform"], default=["heavy", "uniform"],
                        help="length blocks with the tiny models")
    parser.add_argument("--quick", action="store_true",
                        help="heavy only, max_inflight=1 and 2 + partial (budget 4), 3 iterations (all counted) of 2 prompts × 2 samples × 16 tokens")
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per iteration (trainer.global_batch)")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt (rollout.n)")
    parser.add_argument("--max-tokens", type=int, default=64, help="rollout.max_response_length")
    parser.add_argument("--partial-tokens", type=int, default=0,
                        help="rollout.partial_tokens of the partial-rollout side (default: a quarter of --max-tokens)")
    parser.add_argument("--warmup", type=int, default=1, help="first iterations of each run left out of the table")
    parser.add_argument("--repeats", type=int, default=1, help="runs per side, alternating the sides' order")
    parser.add_argument("--length-samples", type=int, default=256, help="responses sampled for the length distribution")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override of every side")
    parser.add_argument("--side", action="append", default=[], type=parse_side, metavar="LABEL:KEY=VALUE[,KEY=VALUE]",
                        help="one more side (a label of a default side replaces it)")
    args = parser.parse_args(argv)
    if args.quick:
        args.iterations, args.prompts, args.samples, args.max_tokens, args.length_samples, args.warmup = 3, 2, 2, 16, 64, 0
        args.lengths = ["heavy"]
    args.partial_tokens = args.partial_tokens or max(args.max_tokens // 4, 1)
    if not 0 <= args.warmup < args.iterations:
        parser.error(f"--warmup {args.warmup}: expected at least 0 and fewer than --iterations ({args.iterations})")
    if bad := [s for s in args.set if "=" not in s]:
        parser.error(f"--set {bad[0]!r}: expected KEY=VALUE")
    return args


def main(argv: list[str] | None = None) -> str:
    args = parse_args(argv)
    sides = default_sides(args)
    if args.quick:  # two runs: the on-policy one and one with both in-flight iterations and partial rollout
        del sides["max_inflight=2"]
    sides |= dict(args.side)
    texts = []
    with tempfile.TemporaryDirectory(prefix="dockrl-inflight-") as tmp:
        work = Path(tmp)
        blocks = {"model": args.model} if args.model else {}
        for name in [] if args.model else args.lengths:
            from dockrl.run.models import build_tiny_model
            from dockrl.testing.heavy_tail_model import build_heavy_tail_model

            build = build_heavy_tail_model if name == "heavy" else build_tiny_model
            blocks[name] = str(build(work / f"{name}-model"))
        for name, model in blocks.items():
            lengths = length_line(model, args)
            print(f"== {name} lengths ==\n{lengths}", flush=True)
            rows: dict[str, list[dict]] = {label: [] for label in sides}
            for r in range(args.repeats):
                order = list(sides) if r % 2 == 0 else list(sides)[::-1]
                for i, label in enumerate(order):
                    rows[label] += run_side(model, work / f"{name}-{r}-{i}", work, sides[label], args)
            block = table({label: summarize(rows[label]) for label in sides})
            print(block, flush=True)
            texts.append(f"== {name} lengths ==\n{lengths}\n{block}")
    return "\n\n".join(texts)


if __name__ == "__main__":
    main()
