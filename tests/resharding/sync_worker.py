"""Body of one process of the multi-process weight-sync tests (started by ``torch.multiprocessing.spawn``).

Each process joins a gloo group on 127.0.0.1 and, for every job (a layout and a model), cuts
its training shard from the full HF weights, runs an optimizer step on it, syncs, compares its
inference-layout weights with the full weights after the same step (bit-exact), finishes
generation, steps again and syncs again. Mismatches are written to ``<out>/rank<r>.json`` for
the test to assert on; nothing is compared with a tolerance.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from dockrl.parallel.layout import ModelShape, ParallelLayout
from dockrl.parallel.ranks import join_groups, leave_groups
from dockrl.resharding.allgather_swap import AllGatherSwap
from dockrl.resharding.buckets import bucket_checksum
from dockrl.resharding.host_swap import ParamTrainState
from dockrl.resharding.spec import model_spec, shard_state_dict

LR, MOMENTUM = 2.0**-4, 0.5


def expected_shard(full: torch.Tensor, spec, parts: int, rank: int, padded_vocab: int) -> torch.Tensor:
    """The reference shard, computed independently of the library: zero-pad the vocab, then ``torch.chunk``."""
    dim = spec.split_dim
    if dim is None:
        return full
    pad = list(full.shape)
    pad[dim] = padded_vocab - full.shape[dim] if spec.vocab else 0
    return torch.cat([full, full.new_zeros(pad)], dim=dim).chunk(parts, dim=dim)[rank]


def dyadic_grads(full: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """Gradients in multiples of 1/16 within [-1/2, 1/2], the same on every rank.

    With a power-of-two learning rate and momentum every product in SGD is exact, so a step on
    a shard equals the same step on the full tensor bit for bit, whatever the kernels' vector
    width or use of FMA (only the final addition rounds, identically).
    """
    g = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randint(-8, 9, full[n].shape, generator=g).float() / 16 for n in sorted(full)}


def run_job(rank: int, world_size: int, port: int, job: dict) -> dict:
    model_dir = Path(job["model_dir"])
    full = load_file(str(model_dir / "model.safetensors"))
    shape = ModelShape.from_hf_config(json.loads((model_dir / "config.json").read_text()))
    layout = ParallelLayout(tp=job["tp"], pp=job["pp"], dp=job["dp"], infer_tp=job["infer_tp"], device="cpu")
    assert layout.world_size == world_size
    tied = shape.tie_word_embeddings
    if tied:
        full.pop("lm_head.weight", None)  # saved by model.state_dict(), not by save_pretrained
    ranks = join_groups(layout, rank=rank, store_address=f"127.0.0.1:{port}", timeout_s=120)  # the default group is kept: new TP/PP groups
    params = {n: torch.nn.Parameter(t) for n, t in shard_state_dict(full, layout, shape, rank).items()}
    optimizer = torch.optim.SGD(params.values(), lr=LR, momentum=MOMENTUM)
    state = ParamTrainState(params, optimizer, device=torch.device("cpu"), copy_on_cpu=job["copy_on_cpu"])
    infer_dtype = getattr(torch, job["infer_dtype"])
    actor = AllGatherSwap(
        ranks=ranks, model=shape, state=state, bucket_bytes=job["bucket_bytes"], train_dtype=torch.float32, infer_dtype=infer_dtype,
    )
    reference = {n: torch.nn.Parameter(t.clone()) for n, t in full.items()}
    ref_optimizer = torch.optim.SGD(reference.values(), lr=LR, momentum=MOMENTUM)
    specs = {s.name: s for s in model_spec(layout, shape)}
    tp_rank, infer_rank = layout.train_coords(rank).tp_rank, layout.infer_coords(rank).tp_rank
    out: dict = {"job": job, "syncs": []}
    for step in range(2):
        grads = dyadic_grads(full, step)
        for n, p in params.items():
            s = specs["model.embed_tokens.weight" if n == "lm_head.weight" and tied else n]
            p.grad = expected_shard(grads[s.name], s, layout.tp, tp_rank, layout.train_vocab_size(shape)).clone()
        for n, p in reference.items():
            p.grad = grads[n]
        actor.require_training("optimizer step")
        optimizer.step()
        ref_optimizer.step()
        before = {n: p.detach().clone() for n, p in params.items()}
        report = actor.sync()
        mismatches = []
        names = []
        for name, got in actor.weights.named_tensors():
            names.append(name)
            s = specs["model.embed_tokens.weight" if name == "lm_head.weight" and tied else name]
            want = expected_shard(reference[s.name].detach(), s, layout.infer_tp, infer_rank, layout.infer_vocab_size(shape))
            want = want.to(infer_dtype)
            if got.shape != want.shape or got.dtype != want.dtype or not torch.equal(got, want):
                mismatches.append(name)
        for (bucket, flat), record in zip(actor.weights.buckets, report.buckets):
            want = torch.zeros_like(flat)
            for e in bucket.entries:
                s = e.spec
                ref = expected_shard(reference[s.name].detach(), s, layout.infer_tp, infer_rank, layout.infer_vocab_size(shape))
                want.narrow(0, e.infer_offset, math.prod(e.infer_shape)).copy_(ref.reshape(-1))
            if record.checksum != bucket_checksum(want):
                mismatches.append(f"checksum of bucket {record.index}")
        actor.finish_generation()
        restored = [n for n, p in params.items() if not torch.equal(p.detach(), before[n])]
        out["syncs"].append({
            "mismatches": mismatches, "names": names, "restored_mismatch": restored,
            "buckets": len(report.buckets), "bytes_moved": report.bytes_moved, "seconds": report.seconds,
            "peak": report.peak_tracked_bytes, "swapped": report.swapped_out_bytes,
            "checksums": [b.checksum for b in report.buckets],
            "inference_bytes": sum(b.infer_bytes for b in report.buckets),
            "largest_gathered": max(b.gathered_bytes for b in report.buckets),
            "largest_infer": max(b.infer_bytes for b in report.buckets),
        })
    return out


def main(rank: int, world_size: int, port: int, jobs: list[dict], out_dir: str) -> None:
    torch.set_num_threads(1)
    try:
        results = [run_job(rank, world_size, port, job) for job in jobs]
    finally:
        leave_groups()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
