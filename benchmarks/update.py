"""The actor update against its compute floor: achieved FLOP/s over the machine's measured matmul rate.

One update is what the actor does per mini-batch: forward and backward of every micro-batch of
``--rows`` sequences (prompts of the generated arithmetic problems, responses of random tokens
with lengths drawn from ``--lengths``), then the AdamW step. Its floor is the time the machine
needs for ``6 · params · tokens`` FLOPs (forward 2, backward 4 per parameter and token, prompt
tokens included; Kaplan et al., 2020, arXiv 2001.08361 §2.1) at the rate measured in the same
run: the best of several matmuls of the model's own shapes (micro-batch tokens × hidden
size × intermediate size), in fp32, or in bf16 with ``--bf16`` (the update then runs under bf16
autocast, ``trainer.autocast_bf16``, over fp32 weights). The ratio ``update / floor`` is the number
to watch (target ≤ 1.5).

    python benchmarks/update.py --model .cache/dockrl/models/SmolLM2-135M-Instruct
    python benchmarks/update.py --model tiny --rows 8   # the tiny random model, seconds
    python benchmarks/update.py --model ... --micro-batch-tokens 1024   # token-budget micro-batches
    python benchmarks/update.py --model ... --bf16   # bf16 autocast against the bf16 matmul rate

Prints one table: tokens (prompt + response); the tokens computed by micro-batches of consecutive
rows right-padded ("padded") and packed (``dockrl.engines.hf.logprobs.pack_rows``, "packed"), and by the
micro-batches the engine forms ("now", ``dockrl.engines.micro_batching.micro_batches`` with
``--micro-batch-tokens`` as ``trainer.micro_batch_tokens``: by default 0, consecutive rows as
"packed"; with a budget, rows sorted by length, at most that many tokens each); FLOPs, matmul rate, update seconds
(median), achieved rate, fraction of the floor.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dockrl.config import DEFAULT_SYSTEM_PROMPT
from dockrl.engines import micro_batching
from dockrl.engines.hf import logprobs as hf_logprobs
from dockrl.engines.hf.train import HFTrainEngine
from dockrl.run.data import generate_problems, prompt_token_ids
from dockrl.run.models import build_tiny_model

pack_rows = getattr(hf_logprobs, "pack_rows", None)  # absent in versions that right-pad every micro-batch
micro_batches = getattr(micro_batching, "micro_batches", None)  # absent in versions that cut micro-batches of consecutive rows


def matmul_rate(m: int, k: int, n: int, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """Best FLOP/s of ``(m, k) @ (k, n)`` in ``dtype`` on this machine's CPU threads over ``repeats`` tries."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2.0 * m * k * n / best


def response_lengths(kind: str, rows: int, max_len: int, rng: random.Random) -> list[int]:
    """``uniform``: 1..max_len; ``heavy``: most short, a few at the limit (a lognormal, clipped)."""
    if kind == "uniform":
        return [rng.randint(1, max_len) for _ in range(rows)]
    return [max(1, min(max_len, int(rng.lognormvariate(3.0, 0.9)))) for _ in range(rows)]


def computed_tokens(prompts, responses, micro_batch: int, max_tokens: int, pad_id: int, pack: bool) -> int:
    """Tokens the engine's forward passes compute over its micro-batches (``micro_batches``), each
    packed when that saves rows (``model_inputs``), else right-padded; 0 in versions without it."""
    if micro_batches is None:
        return 0
    total = 0
    for rows in micro_batches([len(p) + len(r) for p, r in zip(prompts, responses)], micro_batch, max_tokens):
        ps, rs = [prompts[i] for i in rows], [responses[i] for i in rows]
        padded = len(rows) * max(len(p) + len(r) for p, r in zip(ps, rs))
        total += min(pack_rows(ps, rs, pad_id)[0].numel(), padded) if pack else padded
    return total


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF model directory, or 'tiny' for the test model")
    parser.add_argument("--rows", type=int, default=32, help="sequences per update (the mini-batch)")
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--micro-batch-tokens", type=int, default=0, help="trainer.micro_batch_tokens (0: off)")
    parser.add_argument("--max-response", type=int, default=128)
    parser.add_argument("--lengths", choices=["uniform", "heavy"], default="heavy")
    parser.add_argument("--repeats", type=int, default=3, help="timed updates after one warm-up")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (trainer.autocast_bf16), against the bf16 matmul rate")
    args = parser.parse_args(argv)
    for flag, value, least in (("--rows", args.rows, 1), ("--micro-batch", args.micro_batch, 1), ("--micro-batch-tokens", args.micro_batch_tokens, 0),
                               ("--max-response", args.max_response, 1), ("--repeats", args.repeats, 1), ("--threads", args.threads, 0)):
        if value < least:
            parser.error(f"{flag}: got {value}; expected an integer >= {least}")
    if args.rows % args.micro_batch:
        parser.error(f"--micro-batch={args.micro_batch} must divide --rows={args.rows} (as trainer.micro_batch divides the mini-batch)")
    if args.model != "tiny" and not Path(args.model).is_dir():
        parser.error(f"--model: {args.model!r} is not a directory (an HF model folder, or 'tiny')")
    if args.threads:
        torch.set_num_threads(args.threads)

    model = build_tiny_model(tempfile.mkdtemp(prefix="tiny-model-")) if args.model == "tiny" else args.model
    engine = HFTrainEngine(model, trainable=True, lr=1e-7, autocast_bf16=args.bf16)
    tok, cfg = engine.tokenizer, engine.model.config
    rng = random.Random(0)
    prompts = [prompt_token_ids(tok, p["question"], system_prompt=DEFAULT_SYSTEM_PROMPT) for p in generate_problems(args.rows, seed=0)]
    lengths = response_lengths(args.lengths, args.rows, args.max_response, rng)
    responses = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in lengths]
    tokens = sum(len(p) + len(r) for p, r in zip(prompts, responses))
    padded = packed = 0
    for s in range(0, args.rows, args.micro_batch):  # what right-padded and packed micro-batches compute
        ps, rs = prompts[s : s + args.micro_batch], responses[s : s + args.micro_batch]
        this = max(len(p) + len(r) for p, r in zip(ps, rs)) * len(ps)
        padded += this
        packed += min(pack_rows(ps, rs, engine.pad_id)[0].numel(), this) if pack_rows else 0
    now = computed_tokens(prompts, responses, args.micro_batch, args.micro_batch_tokens, engine.pad_id, engine.pack)
    params = sum(p.numel() for p in engine.model.parameters())
    flops = 6.0 * params * tokens

    def loss_fn(rows, log_prob, mask, entropy):
        return -(log_prob * mask).sum() / tokens, None

    budget = {"micro_batch_tokens": args.micro_batch_tokens} if micro_batches else {}

    def update() -> float:
        start = time.perf_counter()
        engine.optimizer_step(lambda: (engine.forward_backward(prompts, responses, temperature=1.0, micro_batch=args.micro_batch,
                                                               loss_fn=loss_fn, **budget), {})[1])
        return time.perf_counter() - start

    update()  # warm-up
    seconds = [update() for _ in range(args.repeats)]
    micro_tokens = max(tokens // max(args.rows // args.micro_batch, 1), 1)
    rate = matmul_rate(micro_tokens, cfg.hidden_size, getattr(cfg, "intermediate_size", 4 * cfg.hidden_size),
                       dtype=torch.bfloat16 if args.bf16 else torch.float32)
    took = statistics.median(seconds)
    floor = flops / rate
    head = ["tokens", "padded tokens", "packed tokens", "now tokens", "params", "TFLOP", "matmul GFLOP/s", "update s",
            "achieved GFLOP/s", "update / floor"]
    cells = [f"{tokens:,}", f"{padded:,}", f"{packed:,}" if pack_rows else "-", f"{now:,}" if now else "-",
             f"{params / 1e6:.1f}M", f"{flops / 1e12:.3f}",
             f"{rate / 1e9:.1f}", f"{took:.2f}",
             f"{flops / took / 1e9:.1f}", f"{took / floor:.2f}x"]
    budget_note = f" or ≤{args.micro_batch_tokens} tokens" if args.micro_batch_tokens else ""
    precision = "bf16 autocast" if args.bf16 else "fp32"
    out = (f"{args.rows} rows × micro-batch {args.micro_batch}{budget_note}, responses ≤{args.max_response} ({args.lengths}), {precision}, "
           f"{torch.get_num_threads()} threads\n\n| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n| " + " | ".join(cells) + " |")
    print(out)
    return out


if __name__ == "__main__":
    main()
