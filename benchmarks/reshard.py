"""Weight sync of the hybrid actor: peak device memory and seconds per GB, naive vs allgather–swap.

Per rank, two ways to build the rollout (inference TP') weights from the training (TP, PP, DP)
shards of a random Qwen2-shaped model, after one AdamW step:

(a) naive co-residence: training weights, gradients and optimizer state stay on the device
    while a full inference copy is built bucket by bucket (``AllGatherSwap(swap=False)``);
(b) allgather–swap: optimizer state, gradients and training weights go to host first, and
    each bucket's training shards are copied back into its gathered buffer
    (``AllGatherSwap(swap=True)``).

Target for (b): peak ≤ inference weights + largest gathered bucket + 5% of the training state.

Peak device bytes: on CPU, the sync's own accounting of the tensors it holds on the "device"
(``dockrl.resharding.host_swap.MemoryTracker``: training state still resident, the gathered
buffer, inference buckets, checksum temporaries), updated at every allocation, free and
swap; on CUDA/NPU also the device allocator's peak (``max_memory_allocated`` of
``torch.get_device_module``, reset once gradients and optimizer state are out: the same span
as the accounting), checked against the same target. s/GB = sync seconds per GB (1e9 B) of
the full model in the inference dtype. ``--json PATH`` writes the rows.

Run on CPU (gloo; the numbers in the resharding report come from this):
    python benchmarks/reshard.py --nproc 2 --tp 2 --infer-tp 1
On one node with GPUs (NCCL; one process per GPU), e.g. 8 GPUs and a 1.5B-shaped model:
    python benchmarks/reshard.py --device cuda --nproc 8 --tp 4 --pp 2 --infer-tp 4 \\
        --hidden 1536 --layers 28 --heads 12 --kv-heads 2 --ffn 8960 --vocab 151936 --bucket-mb 256
On a single GPU (NCCL world of 1: the CUDA path, pinned host swap, allocator peak):
    python benchmarks/reshard.py --device cuda --nproc 1 --tp 1 --infer-tp 1 --hidden 1536 --layers 28 \\
        --heads 12 --kv-heads 2 --ffn 8960 --vocab 151936 --bucket-mb 256
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dockrl.parallel.device import empty_cache
from dockrl.parallel.layout import ModelShape, ParallelLayout
from dockrl.parallel.ranks import ProcessRanks, join_groups, leave_groups
from dockrl.resharding.allgather_swap import AllGatherSwap
from dockrl.resharding.host_swap import ParamTrainState
from dockrl.resharding.spec import cut, model_spec

MiB = 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda", "npu"], default="cpu")
    p.add_argument("--nproc", type=int, default=2, help="processes (one per GPU on cuda)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--infer-tp", type=int, default=1)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--bucket-mb", type=float, default=16.0, help="bound of one gathered bucket, MiB")
    p.add_argument("--infer-dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--repeats", type=int, default=3, help="syncs per mode; the median time is reported")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--json", default="", help="write the table's rows (and the settings) to this JSON file")
    args = p.parse_args(argv)
    if args.nproc % (args.tp * args.pp):
        p.error(f"--nproc {args.nproc} must be a multiple of --tp × --pp = {args.tp * args.pp}")
    return args


def build_state(args, layout: ParallelLayout, model: ModelShape, rank: int, device: torch.device):
    """This rank's training shard of a seeded random model, with gradients and AdamW state."""
    tp_rank, _, pp_rank = layout.train_coords(rank)
    params = {}
    for i, s in enumerate(model_spec(layout, model)):
        if s.stage != pp_rank:
            continue
        # drawn on the device itself: a 1.5B model drawn on the host takes longer than its syncs
        full = torch.randn(s.shape, generator=torch.Generator(device).manual_seed(i), device=device) * 0.02
        params[s.name] = torch.nn.Parameter(cut(full, s, layout.tp, tp_rank, layout.train_vocab_size(model)))
        del full
    optimizer = torch.optim.AdamW(params.values(), lr=1e-4)
    for p in params.values():
        p.grad = torch.randn_like(p) * 1e-3
    optimizer.step()  # creates exp_avg and exp_avg_sq; gradients stay, as after a backward
    return params, optimizer


def sync_once(args, ranks: ProcessRanks, model, swap: bool) -> dict:
    """Build a fresh training state, sync once in the given mode, finish generation; the figures."""
    device = ranks.device
    params, optimizer = build_state(args, ranks.layout, model, ranks.rank, device)
    state = ParamTrainState(params, optimizer, device=device)
    resident = sum(state.device_bytes().values())
    actor = AllGatherSwap(
        ranks=ranks, model=model, state=state, bucket_bytes=int(args.bucket_mb * MiB), train_dtype=torch.float32,
        infer_dtype=getattr(torch, args.infer_dtype), swap=swap,
    )
    dist.barrier()
    report = actor.sync()
    infer = actor.weights.nbytes
    actor.finish_generation()
    del actor, state, params, optimizer
    empty_cache(device)  # the next mode starts from an empty allocator
    return {
        "resident": resident, "peak": report.peak_tracked_bytes, "alloc_peak": report.peak_allocator_bytes,
        "infer": infer, "largest": max(b.gathered_bytes for b in report.buckets), "seconds": report.seconds,
        "buckets": len(report.buckets),
    }


def measure(args, ranks: ProcessRanks, model) -> list[dict]:
    """Both modes, interleaved ``repeats`` times (so that machine noise hits both alike); one row per mode."""
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for _ in range(args.repeats):
        for swap in (False, True):
            runs[swap].append(sync_once(args, ranks, model, swap))
    full_model = sum(s.numel() for s in model_spec(ranks.layout, model)) * torch.empty((), dtype=getattr(torch, args.infer_dtype)).element_size()
    rows = []
    for swap, results in runs.items():
        r = dict(results[-1])
        r["peak"] = max(x["peak"] for x in results)
        alloc = [x["alloc_peak"] for x in results if x["alloc_peak"] is not None]
        r["alloc_peak"] = max(alloc) if alloc else None
        r["seconds"] = statistics.median(x["seconds"] for x in results)
        r.update(rank=ranks.rank, mode="allgather-swap" if swap else "naive co-residence",
                 target=r["infer"] + r["largest"] + 0.05 * r["resident"], s_per_gb=r["seconds"] / (full_model / 1e9))
        rows.append(r)
    return rows


def worker(rank: int, args: argparse.Namespace, port: int) -> None:
    if args.device == "cpu":
        torch.set_num_threads(1)
    shape = ModelShape(
        model_type="qwen2", num_heads=args.heads, num_kv_heads=args.kv_heads, num_layers=args.layers, vocab_size=args.vocab,
        hidden_size=args.hidden, intermediate_size=args.ffn, head_dim=args.hidden // args.heads, tie_word_embeddings=False,
        qkv_bias=True, o_bias=False, mlp_bias=False,
    )
    layout = ParallelLayout(tp=args.tp, pp=args.pp, dp=args.nproc // (args.tp * args.pp), infer_tp=args.infer_tp, device=args.device)
    layout.check_model(shape)
    ranks = join_groups(layout, rank=rank, store_address=f"127.0.0.1:{port}", timeout_s=args.timeout_s)
    try:
        rows = measure(args, ranks, shape)
        gathered = [None] * args.nproc if rank == 0 else None
        dist.gather_object(rows, gathered, dst=0)
        if rank == 0:
            rows = [row for per_rank in gathered for row in per_rank]
            print_table(args, layout, shape, rows)
            if args.json:
                Path(args.json).write_text(json.dumps({"settings": vars(args), "rows": rows}, indent=2) + "\n")
    finally:
        leave_groups()


def print_table(args, layout: ParallelLayout, model: ModelShape, rows: list[dict]) -> None:
    print(
        f"weight sync, {args.device}, {args.nproc} processes: train (TP, PP, DP) = ({layout.tp}, {layout.pp}, {layout.dp}) "
        f"→ inference TP' = {layout.infer_tp}; model {sum(s.numel() for s in model_spec(layout, model)) / 1e6:.1f}M params, "
        f"inference {args.infer_dtype}, bucket ≤ {args.bucket_mb:g} MiB, median of {args.repeats} syncs"
    )
    head = ["rank", "mode", "train state MiB", "peak MiB", "allocator peak MiB", "inference MiB", "largest bucket MiB",
            "target MiB", "peak ≤ target", "allocator ≤ target", "sync s", "s/GB", "buckets"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in sorted(rows, key=lambda r: (r["mode"] != "naive co-residence", r["rank"])):
        alloc = "—" if r["alloc_peak"] is None else f"{r['alloc_peak'] / MiB:.1f}"
        alloc_ok = "—" if r["alloc_peak"] is None else ("yes" if r["alloc_peak"] <= r["target"] else "no")
        cells = [r["rank"], r["mode"], f"{r['resident'] / MiB:.1f}", f"{r['peak'] / MiB:.1f}", alloc,
                 f"{r['infer'] / MiB:.1f}", f"{r['largest'] / MiB:.1f}", f"{r['target'] / MiB:.1f}",
                 "yes" if r["peak"] <= r["target"] else "no", alloc_ok, f"{r['seconds']:.3f}", f"{r['s_per_gb']:.2f}", r["buckets"]]
        print("| " + " | ".join(str(c) for c in cells) + " |")


def main(argv=None) -> None:
    args = parse_args(argv)
    # the rendezvous store listens on a port the OS picked, held until the workers are done
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=args.timeout_s))
    mp.spawn(worker, args=(args, store.port), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
