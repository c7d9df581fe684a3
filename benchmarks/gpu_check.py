"""The prepared GPU check: device tests, GRPO throughput and MFU, and the weight sync on one GPU.

Runs from the source tree with what a bare GPU machine offers (torch with CUDA, transformers,
pyarrow, pyyaml, safetensors, pytest; no network, no vLLM, no megatron-core, no kfp):

    PYTHONPATH=. python benchmarks/gpu_check.py --out gpu-check     # or: make gpu-check / benchmarks/gpu_check.sh

1. ``tests``: ``pytest -m gpu tests/gpu`` — device placement, NCCL process groups of one, HF
   log-probs on the GPU equal to the CPU's (fp32 1e-4; bf16 autocast 0.05), an update on the
   device, the host swap's round trip bit-exact, an allgather–swap of one rank.
2. ``grpo``: GRPO iterations through the HF engines (rollout, actor) and the real stage workers
   over an in-process dock on the device, with randomly initialized models of the Qwen2.5-0.5B
   and Qwen2.5-1.5B shapes built offline from their configurations (``SHAPES``; the tokenizer is
   the test model's, whose ids all lie inside the real vocabulary). A random model's answers
   carry no signal, so a seeded synthetic 0/1 reward replaces the verifier (it only gives the
   update non-zero advantages). The first iteration warms up; the last is reported: rollout
   response tokens/s, update tokens/s (prompt + response tokens through forward and backward),
   and the update's model FLOPs utilization (``update_flops`` / seconds / peak).
3. ``reshard``: ``benchmarks/reshard.py`` on the device for the 1.5B shape (one process, NCCL
   world of 1): peak device memory (the allocator's) of naive co-residence and of the
   allgather–swap, and sync seconds per GB.

Prints one table and writes ``<out>/gpu_check.json``. A part that fails is reported and the
others still run; the exit status is 1 if any part failed. ``--cpu`` runs the same path on the
CPU with tiny shapes (the test suite does, in about a minute); megatron-core and vLLM are not
used (not on the machine: the HF engines and the sync's own code are what is measured).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script from the source tree (the repository's requires-python may not match)
    sys.path.insert(0, str(ROOT))

logger = logging.getLogger("gpu_check")

H200_BF16_DENSE_TFLOPS = 989.0
"""NVIDIA H200 SXM dense bf16 tensor-core peak (spec sheet; 1979 with sparsity)."""


@dataclass(frozen=True)
class Shape:
    """A Qwen2 decoder's sizes (``Qwen2Config`` fields)."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def decoder_params(self) -> int:
        """Parameters of the decoder layers and the final norm (no embedding, no output head)."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        attn = h * h + 2 * h * kv + h * h + h + 2 * kv  # q, k, v, o (+ q/k/v biases)
        mlp = 3 * h * self.intermediate
        return self.layers * (attn + mlp + 2 * h) + h


SHAPES = {
    # Qwen2.5-0.5B and Qwen2.5-1.5B config.json (hidden, intermediate, layers, heads, KV heads, vocab, tied embeddings)
    "qwen2.5-0.5b": Shape("qwen2.5-0.5b", 896, 4864, 24, 14, 2, 151936, True),
    "qwen2.5-1.5b": Shape("qwen2.5-1.5b", 1536, 8960, 28, 12, 2, 151936, True),
    "tiny": Shape("tiny", 64, 128, 2, 4, 2, 512, True),
}


def update_flops(shape: Shape, prompt_lens: list[int], response_lens: list[int]) -> float:
    """Model FLOPs of one forward + backward over the sequences (3 × forward; Kaplan et al. 2020,
    arXiv 2001.08361 §2.1, with the attention term of PaLM, arXiv 2204.02311 App. B):

    forward = Σ_i [2·N_dec·S_i + 2·V·H·R_i + 2·L·H_attn·S_i²]  (``S_i = P_i + R_i``)

    ``N_dec`` decoder parameters (every position), ``V·H`` the output head (response positions
    only: the engine computes no prompt logits), and causal attention (``QKᵀ`` and ``AV``,
    half of the S² products each). Padding is not counted: this is useful work.
    """
    h_attn = shape.heads * shape.head_dim
    fwd = 0.0
    for p, r in zip(prompt_lens, response_lens):
        s = p + r
        fwd += 2 * shape.decoder_params() * s + 2 * shape.vocab * shape.hidden * r + 2 * shape.layers * h_attn * s * s
    return 3 * fwd


def measure_peak_tflops(device: torch.device, dtype: torch.dtype, n: int = 8192, repeats: int = 20) -> float:
    """Measured matmul throughput of ``n × n`` products in ``dtype`` (TFLOP/s): the device's practical peak."""
    from dockrl.parallel.device import synchronize

    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    synchronize(device)
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12


def build_model(shape: Shape, folder: Path, device: torch.device, seed: int = 0) -> Path:
    """A randomly initialized Qwen2 model of ``shape`` saved in bf16, with the test model's tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from dockrl.run.models import build_tiny_model

    build_tiny_model(folder, vocab_size=512)  # tokenizer files (and a tiny model, replaced below)
    tok_cfg = json.loads((folder / "config.json").read_text())
    config = Qwen2Config(
        vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, max_position_embeddings=4096,
        tie_word_embeddings=shape.tied, rope_theta=1_000_000.0, eos_token_id=tok_cfg["eos_token_id"],
        pad_token_id=tok_cfg["pad_token_id"], bos_token_id=None,
    )
    torch.manual_seed(seed)
    with torch.device(device):  # initialized where it will run: seconds instead of minutes on the host
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.generation_config.eos_token_id = tok_cfg["eos_token_id"]
    model.generation_config.pad_token_id = tok_cfg["pad_token_id"]
    model.save_pretrained(folder)
    del model
    return folder


class SyntheticRewardWorker:
    """The reward stage for a random model: a seeded 0/1 score per response (its text means nothing)."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def run_iteration(self, dock) -> dict[str, float]:
        while claim := dock.claim("reward", ["response_ids"], dock.num_rows):
            scores = [float(self.rng.random() < 0.5) for _ in claim.rows]
            dock.put(claim.rows, {"rm_score": scores, "correct": [s > 0 for s in scores]}, ack=claim)
        return {}


def run_grpo(shape: Shape, args, device_kind: str, work: Path, peak_tflops: float) -> dict:
    """GRPO iterations of ``shape`` through the HF engines on the device; the last iteration's figures."""
    from dockrl.config import load_config, resolve_auto
    from dockrl.dock import GRPO_SCHEMA, open_dock
    from dockrl.engines.factory import build_rollout_engine, build_train_engine, process_ranks
    from dockrl.parallel import device as devices
    from dockrl.run.data import generate_problems
    from dockrl.stages.actor import ActorWorker
    from dockrl.stages.advantage import AdvantageWorker
    from dockrl.stages.rollout import RolloutWorker, rollout_metrics

    build_start = time.perf_counter()
    dev = devices.process_device(device_kind, 0)
    model_dir = build_model(shape, work / shape.name, dev)
    cfg = resolve_auto(load_config(None, [  # the engines are built here, not by a run: rollout.dtype's auto resolves here
        f"model.path={model_dir}", f"parallel.device={device_kind}", f"rollout.n={args.samples}",
        f"trainer.global_batch={args.prompts}", f"trainer.mini_batch={args.prompts}", f"trainer.micro_batch={args.micro_batch}",
        f"rollout.max_response_length={args.tokens}", f"rollout.batch_size={args.rollout_batch}", "rollout.temperature=1.0",
        "algorithm.kl_loss_coef=0.0", "trainer.lr=1e-6", "rollout.engine=hf",  # the HF engines, wherever vLLM is installed
    ]))
    ranks = process_ranks(cfg, trains=True)
    rollout_engine, actor = build_rollout_engine(cfg, model_dir, ranks), build_train_engine(cfg, model_dir, ranks)
    tokenizer = rollout_engine.tokenizer
    problems = generate_problems(args.prompts, seed=0)
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": row["question"]}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)) for row in problems]
    rollout, reward = RolloutWorker(rollout_engine, cfg.rollout), SyntheticRewardWorker(seed=0)
    advantage, update = AdvantageWorker(cfg.algorithm), ActorWorker(actor, trainer=cfg.trainer, algo=cfg.algorithm, rollout=cfg.rollout)
    dock = open_dock(cfg.dock, GRPO_SCHEMA, run="gpu_check")
    devices.reset_allocator_peak(dev)
    setup_s = time.perf_counter() - build_start
    result: dict = {}
    for it in range(args.iterations):
        n = args.samples
        dock.open_iteration(it, len(prompts) * n, n)
        dock.put(range(len(prompts) * n), {"prompt_ids": [p for p in prompts for _ in range(n)], "ground_truth": ["0"] * (len(prompts) * n)})
        lengths, truncated, gen_s = rollout.generate_iteration(dock)
        reward.run_iteration(dock)
        advantage.run_iteration(dock)
        metrics = update.run_iteration(dock)
        sync_start = time.perf_counter()
        rollout_engine.load_weights(actor.named_weights())
        devices.synchronize(dev)
        sync_s = time.perf_counter() - sync_start
        dock.close_iteration()
        prompt_lens = [len(p) for p in prompts for _ in range(n)]
        flops = update_flops(shape, prompt_lens, lengths)
        update_s = metrics["timing_s/actor"]
        result = {
            "shape": shape.name, "params_m": round(sum(p.numel() for p in actor.model.parameters()) / 1e6, 1),
            "iteration": it, "rows": len(lengths), "response_tokens": sum(lengths),
            "rollout_tokens_per_s": rollout_metrics(lengths, truncated, gen_s)["perf/rollout_tokens_per_s"], "rollout_s": gen_s,
            "update_s": update_s, "update_tokens_per_s": (sum(prompt_lens) + sum(lengths)) / update_s,
            "update_response_tokens_per_s": metrics["perf/actor_tokens_per_s"],
            "update_tflops": flops / update_s / 1e12, "mfu": flops / update_s / 1e12 / peak_tflops, "weight_sync_s": sync_s,
            "actor_loss": metrics["actor/loss"], "grad_norm": metrics["actor/grad_norm"],
            "ratio_mean": metrics["actor/ratio_mean"], "peak_device_gib": (devices.allocator_peak_bytes(dev) or 0) / 2**30,
            "setup_s": setup_s,
        }
        logger.info("%s iteration %d: %s", shape.name, it, json.dumps(result))
    dock.close()
    del rollout_engine, actor, update, rollout
    devices.empty_cache(dev)
    return result


def run_tests(out: Path, timeout_s: float) -> dict:
    """``pytest -m gpu tests/gpu`` in a subprocess; counts from its JUnit XML."""
    xml = out / "gpu_tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", f"--junitxml={xml}", str(ROOT / "tests" / "gpu")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    (out / "gpu_tests.log").write_text(proc.stdout + proc.stderr)
    counts = {"passed": 0, "failed": 0, "skipped": 0, "rc": proc.returncode}
    if xml.is_file():
        for case in ET.parse(xml).getroot().iter("testcase"):
            kind = "failed" if case.find("failure") is not None or case.find("error") is not None else \
                "skipped" if case.find("skipped") is not None else "passed"
            counts[kind] += 1
            if kind == "skipped":
                counts.setdefault("skip_reasons", sorted({case.find("skipped").get("message", "")}))
    counts["ok"] = proc.returncode == 0 or (proc.returncode == 5 and counts["failed"] == 0)  # 5: none selected
    counts["log_tail"] = (proc.stdout + proc.stderr)[-1500:] if not counts["ok"] else ""
    return counts


def run_reshard(shape: Shape, device_kind: str, out: Path, bucket_mb: float, repeats: int, timeout_s: float) -> dict:
    """``benchmarks/reshard.py`` for ``shape`` on one device (a process group of one)."""
    path = out / "reshard.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "reshard.py"), "--device", device_kind, "--nproc", "1", "--tp", "1",
           "--infer-tp", "1", "--hidden", str(shape.hidden), "--layers", str(shape.layers), "--heads", str(shape.heads),
           "--kv-heads", str(shape.kv_heads), "--ffn", str(shape.intermediate), "--vocab", str(shape.vocab),
           "--bucket-mb", str(bucket_mb), "--infer-dtype", "bfloat16", "--repeats", str(repeats), "--json", str(path)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    (out / "reshard.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmarks/reshard.py exited with {proc.returncode}: {(proc.stdout + proc.stderr)[-1500:]}")
    rows = json.loads(path.read_text())["rows"]
    return {row["mode"]: {k: row[k] for k in ("resident", "peak", "alloc_peak", "infer", "largest", "target", "seconds", "s_per_gb")}
            for row in rows}


def print_table(report: dict) -> None:
    MiB = 2**20
    print(f"\ndockrl GPU check on {report['device']} ({report['device_name']}), torch {report['torch']}, "
          f"{report['seconds']:.0f} s; peak {report['peak_tflops']:.3g} TFLOP/s ({report['peak_source']})")
    print("| part | item | result |")
    print("|---|---|---|")
    t = report["parts"].get("tests", {})
    if "error" in t:
        print(f"| tests | pytest -m gpu | ERROR {t['error']} |")
    elif t:
        print(f"| tests | pytest -m gpu | {t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped |")
    for name, g in report["parts"].get("grpo", {}).items():
        if "error" in g or "skipped" in g:
            print(f"| grpo | {name} | {'ERROR ' + g['error'] if 'error' in g else 'skipped: ' + g['skipped']} |")
            continue
        print(f"| grpo | {name} ({g['params_m']}M params, {g['rows']} rows, {g['response_tokens']} response tokens) | "
              f"rollout {g['rollout_tokens_per_s']:.0f} tok/s, update {g['update_tokens_per_s']:.0f} tok/s "
              f"({g['update_tflops']:.1f} TFLOP/s, MFU {100 * g['mfu']:.1f}%), sync {g['weight_sync_s']:.2f} s, "
              f"peak {g['peak_device_gib']:.1f} GiB |")
    r = report["parts"].get("reshard", {})
    if "error" in r or "skipped" in r:
        print(f"| reshard | {report.get('reshard_shape')} | {'ERROR ' + r['error'] if 'error' in r else 'skipped: ' + r['skipped']} |")
    for mode, row in r.items() if not ("error" in r or "skipped" in r) else ():
        alloc = "—" if row["alloc_peak"] is None else f"{row['alloc_peak'] / MiB:.1f} MiB"
        print(f"| reshard | {report.get('reshard_shape')} {mode} | peak tracked {row['peak'] / MiB:.1f} MiB, allocator {alloc}, "
              f"target {row['target'] / MiB:.1f} MiB, train state {row['resident'] / MiB:.1f} MiB, "
              f"{row['seconds']:.3f} s, {row['s_per_gb']:.3f} s/GB |")
    print(f"\nJSON: {report['json']}")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", "--dry-run", dest="cpu", action="store_true", help="the same path on the CPU with tiny shapes")
    p.add_argument("--out", default="gpu-check", help="folder of gpu_check.json and the logs")
    p.add_argument("--shapes", default="", help="comma-separated of " + ", ".join(SHAPES) + " (default: 0.5b,1.5b; --cpu: tiny)")
    p.add_argument("--prompts", type=int, default=0, help="prompts per iteration (default 32; --cpu 2)")
    p.add_argument("--samples", type=int, default=0, help="samples per prompt (default 8; --cpu 2)")
    p.add_argument("--tokens", type=int, default=0, help="response tokens at most (default 512; --cpu 8)")
    p.add_argument("--iterations", type=int, default=2, help="GRPO iterations per shape; the first warms up")
    p.add_argument("--micro-batch", type=int, default=0, help="sequences per forward/backward (default 16; --cpu 2)")
    p.add_argument("--rollout-batch", type=int, default=0, help="sequences generated together (default 128; --cpu 4)")
    p.add_argument("--peak-tflops", default="spec", help="'spec' (H200 dense bf16, 989), 'measure' (a bf16 matmul), or a number")
    p.add_argument("--reshard-shape", default="", help="shape of the weight sync (default qwen2.5-1.5b; --cpu tiny)")
    p.add_argument("--bucket-mb", type=float, default=256.0)
    p.add_argument("--skip", default="", help="comma-separated parts to skip: tests, grpo, reshard")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="seconds for the whole check: a GRPO shape or the sync is skipped (and says so) when too little is left")
    args = p.parse_args(argv)
    defaults = dict(prompts=(2, 32), samples=(2, 8), tokens=(8, 512), micro_batch=(2, 16), rollout_batch=(4, 128))
    for name, (cpu, gpu) in defaults.items():
        if not getattr(args, name):
            setattr(args, name, cpu if args.cpu else gpu)
    args.shapes = args.shapes or ("tiny" if args.cpu else "qwen2.5-0.5b,qwen2.5-1.5b")
    args.reshard_shape = args.reshard_shape or ("tiny" if args.cpu else "qwen2.5-1.5b")
    for name in [*args.shapes.split(","), args.reshard_shape]:
        if name not in SHAPES:
            p.error(f"shape {name!r}: expected one of {', '.join(SHAPES)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    from dockrl.parallel import device as devices

    start = time.perf_counter()
    kind = "cpu" if args.cpu else "cuda"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    dev = devices.process_device(kind, 0)  # fails at once, naming parallel.device, without a GPU
    name = torch.cuda.get_device_name(dev) if kind == "cuda" else "host CPU"
    if args.peak_tflops == "spec":
        peak, source = (H200_BF16_DENSE_TFLOPS, "H200 dense bf16 spec") if kind == "cuda" else (
            measure_peak_tflops(dev, torch.float32, n=512, repeats=5), "measured fp32 matmul")
    elif args.peak_tflops == "measure":
        peak, source = measure_peak_tflops(dev, torch.bfloat16 if kind == "cuda" else torch.float32), "measured matmul"
    else:
        peak, source = float(args.peak_tflops), "given"
    report = {"device": kind, "device_name": name, "torch": torch.__version__, "peak_tflops": peak, "peak_source": source,
              "settings": vars(args), "reshard_shape": args.reshard_shape, "parts": {}, "json": str(out / "gpu_check.json")}
    failed = False

    def part(label: str, fn, needs_s: float = 0.0):
        nonlocal failed
        left = args.budget_s - (time.perf_counter() - start)
        if left < needs_s:
            logger.warning("%s skipped: %.0f s of the %.0f s budget left, it needs about %.0f s", label, left, args.budget_s, needs_s)
            return {"skipped": f"time budget: {left:.0f} s left of {args.budget_s:.0f} s"}
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - one failing part must not hide the others' figures
            failed = True
            logger.error("%s failed:\n%s", label, traceback.format_exc())
            return {"error": f"{type(e).__name__}: {str(e)[:300]}"}

    if "tests" not in skip:
        report["parts"]["tests"] = part("tests", lambda: run_tests(out, timeout_s=240))
        failed |= not report["parts"]["tests"].get("ok", False)
    if "grpo" not in skip:
        report["parts"]["grpo"] = {}
        with tempfile.TemporaryDirectory(prefix="dockrl-gpu-check-") as work:
            for shape in args.shapes.split(","):
                report["parts"]["grpo"][shape] = part(f"grpo {shape}", lambda shape=shape: run_grpo(SHAPES[shape], args, kind, Path(work), peak),
                                                      needs_s=0 if args.cpu else 90)
    if "reshard" not in skip:
        report["parts"]["reshard"] = part("reshard", lambda: run_reshard(
            SHAPES[args.reshard_shape], kind, out, args.bucket_mb if not args.cpu else 0.05, repeats=1 if args.cpu else 2, timeout_s=240),
            needs_s=0 if args.cpu else 45)
    report["seconds"] = time.perf_counter() - start
    report["ok"] = not failed
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print_table(report)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
