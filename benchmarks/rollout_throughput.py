"""Rollout throughput: HF ``generate`` against vLLM on the same prompts, side by side.

The demo's rollout by default: 6 generated arithmetic prompts × 8 samples, ≤ 80 new tokens,
temperature 0.7, bf16. Engines alternate (HF, vLLM, HF, vLLM, ...) after one warm-up call
each, so machine noise hits both alike; the ratio is the number to compare.

    python benchmarks/rollout_throughput.py --model tiny
    python benchmarks/rollout_throughput.py --model .cache/dockrl/models/SmolLM2-135M-Instruct

Prints one row per engine: response tokens per repeat, seconds (median), tokens/s, ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from dockrl.config import DEFAULT_SYSTEM_PROMPT
from dockrl.engines.hf.rollout import HFRolloutEngine
from dockrl.engines.vllm.engine import VLLMRolloutEngine
from dockrl.run.data import generate_problems
from dockrl.run.models import build_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF model directory, or 'tiny' for the test model")
    parser.add_argument("--prompts", type=int, default=6, help="distinct prompts (trainer.global_batch)")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (rollout.n)")
    parser.add_argument("--max-new-tokens", type=int, default=80)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    model = build_tiny_model(tempfile.mkdtemp(prefix="tiny-model-")) if args.model == "tiny" else args.model
    engines = {"hf": HFRolloutEngine(model, dtype=args.dtype), "vllm": VLLMRolloutEngine(model, dtype=args.dtype)}
    tok = engines["hf"].tokenizer
    questions = [p["question"] for p in generate_problems(args.prompts, seed=0)]
    prompts = [
        tok.apply_chat_template(
            [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, {"role": "user", "content": q}],
            add_generation_prompt=True, tokenize=True, return_dict=False,
        )
        for q in questions
        for _ in range(args.n)
    ]
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, batch_size=len(prompts))
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    tokens: dict[str, list[int]] = {name: [] for name in engines}
    for engine in engines.values():
        engine.generate(prompts, **kwargs)  # warm-up
    for _ in range(args.repeats):
        for name, engine in engines.items():
            start = time.perf_counter()
            samples = engine.generate(prompts, **kwargs)
            seconds[name].append(time.perf_counter() - start)
            tokens[name].append(sum(len(s.response_ids) for s in samples))
    rate = {name: sum(tokens[name]) / sum(seconds[name]) for name in engines}
    print(f"{len(prompts)} sequences ({args.prompts} prompts × {args.n}), ≤{args.max_new_tokens} tokens, "
          f"τ={args.temperature}, {args.dtype}, {args.repeats} repeats, {torch.get_num_threads()} threads")
    print(f"{'engine':<8}{'tokens':>10}{'seconds':>10}{'tokens/s':>12}{'× hf':>8}")
    for name in engines:
        print(f"{name:<8}{statistics.median(tokens[name]):>10.0f}{statistics.median(seconds[name]):>10.2f}"
              f"{rate[name]:>12.1f}{rate[name] / rate['hf']:>8.2f}")


if __name__ == "__main__":
    main()
