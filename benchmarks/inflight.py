"""Iterations in flight: the actor's bubble with ``dock.max_inflight`` 1 (on-policy) and 2 (one-step off-policy).

Runs the same distributed GRPO run (every stage its own process, the tiny random model unless
``--model``) once per ``dock.max_inflight`` and prints one table side by side. The bubble is the
actor's idle time over the iterations' wall clock: ``1 - Σ (timing_s/actor - timing_s/actor_claim) / Σ timing_s/iteration``
(the driver's loop time; no checkpoints, no evaluation). With one iteration in flight the actor
waits for every rollout; with two the rollout of iteration k+1 runs while the actor updates on k
(verl's one-step-off-policy recipe; MindSpeed RL, arXiv 2507.19017).

Response lengths are the model's own samples, cut at ``--max-tokens``; the tiny random model
almost never emits EOS, so its responses are about that long (no heavy tail).

Run::

    python benchmarks/inflight.py                 # tiny model, 6 iterations per side
    python benchmarks/inflight.py --quick         # 3 iterations, seconds to a minute: the test suite's
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

SIDES = (1, 2)


def run_side(model: str, work: Path, inflight: int, args: argparse.Namespace) -> dict[str, float]:
    """One distributed run with ``dock.max_inflight=inflight``; its per-run numbers."""
    from dockrl import driver
    from dockrl.config import load_config

    out = work / f"inflight-{inflight}"
    cfg = load_config(None, [
        f"model.path={model}", f"run.output_dir={out}", f"run.cache_dir={work / 'cache'}", "run.progress=false",
        "dock.mode=distributed", f"dock.max_inflight={inflight}", "dock.timeout_s=300",
        f"trainer.iterations={args.iterations}", f"trainer.global_batch={args.prompts}", f"trainer.mini_batch={args.prompts}",
        f"trainer.micro_batch={args.prompts * args.samples}", f"rollout.n={args.samples}",
        f"rollout.max_response_length={args.max_tokens}", "rollout.engine=hf", "rollout.dtype=float32",
        "trainer.autocast_bf16=false", "trainer.save_every=0", "trainer.eval_before=false", "trainer.eval_after=false",
        "algorithm.kl_loss_coef=0", "data.generate_train=64", "data.generate_test=4", "data.eval_size=4",
    ])
    driver.train(cfg)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "timing_s/iteration" in r]
    wall = sum(r["timing_s/iteration"] for r in rows)
    actor = sum(r["timing_s/actor"] - r.get("timing_s/actor_claim", 0.0) for r in rows)  # computing, not waiting for its rows
    rollout = sum(r["timing_s/rollout"] for r in rows)
    tokens = sum(r["rollout/response_length_mean"] * r["rollout/responses"] for r in rows)
    return {"iterations": len(rows), "wall_s": wall, "actor_s": actor, "rollout_s": rollout, "bubble": 1 - actor / wall,
            "tokens_per_s": tokens / wall, "staleness": max(r.get("rollout/staleness", 0.0) for r in rows)}


def table(results: dict[int, dict[str, float]]) -> str:
    """The sides as columns, with the ratio of the last to the first."""
    first, last = results[SIDES[0]], results[SIDES[-1]]
    lines = [f"{'':32}" + "".join(f"{f'max_inflight={m}':>18}" for m in SIDES) + f"{'ratio 2/1':>12}"]
    for key, label in [("wall_s", "iterations' wall clock, s"), ("actor_s", "actor busy, s"), ("rollout_s", "rollout busy, s"),
                       ("bubble", "actor bubble (idle / wall)"), ("tokens_per_s", "response tokens/s, end to end"),
                       ("staleness", "max rollout staleness")]:
        ratio = last[key] / first[key] if first[key] else float("nan")
        lines.append(f"{label:32}" + "".join(f"{results[m][key]:>18.3f}" for m in SIDES) + f"{ratio:>12.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="HF model directory (default: the tiny random model)")
    parser.add_argument("--quick", action="store_true", help="3 iterations of 2 prompts × 2 samples × 8 tokens per side")
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per iteration (trainer.global_batch)")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt (rollout.n)")
    parser.add_argument("--max-tokens", type=int, default=32, help="rollout.max_response_length")
    args = parser.parse_args(argv)
    if args.quick:
        args.iterations, args.prompts, args.samples, args.max_tokens = 3, 2, 2, 8
    with tempfile.TemporaryDirectory(prefix="dockrl-inflight-") as tmp:
        work = Path(tmp)
        model = args.model
        if not model:
            from dockrl.models import build_tiny_model

            model = str(build_tiny_model(work / "tiny-model"))
        results = {m: run_side(model, work, m, args) for m in SIDES}
    text = table(results)
    print(text)
    return text


if __name__ == "__main__":
    main()
