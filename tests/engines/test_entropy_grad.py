"""The entropy handed to the loss is differentiable when an entropy bonus asks for it
(``algorithm.entropy_coeff > 0``): on the HF engine and on megatron's vocab-parallel logits, whose
TP = 2 gradient (each rank its half of the vocabulary) must be the full-vocabulary one."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dockrl.algorithms import entropy_from_logits
from dockrl.engines.hf.logprobs import response_log_probs
from dockrl.engines.hf.train import HFTrainEngine

VOCAB = 8


def _logits() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(2, 3, VOCAB, generator=gen) * 2, torch.randint(0, VOCAB, (2, 3), generator=gen)


def test_hf_entropy_is_differentiable_only_when_asked(tiny_model_dir):
    engine = HFTrainEngine(tiny_model_dir, trainable=True)
    args = dict(pad_id=engine.pad_id, temperature=1.0, autocast_bf16=False, with_entropy=True)
    _, _, plain = response_log_probs(engine.model, [[5, 6, 7]], [[8, 9]], **args)
    _, mask, entropy = response_log_probs(engine.model, [[5, 6, 7]], [[8, 9]], **args, entropy_grad=True)
    assert not plain.requires_grad and entropy.requires_grad
    torch.testing.assert_close(entropy.detach(), plain)
    (entropy * mask).sum().backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in engine.model.parameters())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, port: int, out: str) -> None:
    from megatron.core import parallel_state

    from dockrl.engines.megatron.model import vocab_parallel_log_probs

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        logits, targets = _logits()
        half = VOCAB // 2
        local = logits[..., rank * half : (rank + 1) * half].clone().requires_grad_(True)
        group = parallel_state.get_tensor_model_parallel_group()
        _, entropy = vocab_parallel_log_probs(local, targets, vocab_start=rank * half, tp_group=group, entropy_grad=True)
        _, plain = vocab_parallel_log_probs(local, targets, vocab_start=rank * half, tp_group=group)
        grad, = torch.autograd.grad(entropy.sum(), local)
        torch.save({"entropy": entropy.detach(), "plain_grad": plain.requires_grad, "grad": grad}, Path(out) / f"rank{rank}.pt")
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


@pytest.mark.slow
def test_vocab_parallel_entropy_gradient_is_the_full_vocabulary_one(tmp_path):
    mp.spawn(_rank_main, args=(_free_port(), str(tmp_path)), nprocs=2, join=True)
    logits, _ = _logits()
    full = logits.clone().requires_grad_(True)
    want = entropy_from_logits(full)
    want_grad, = torch.autograd.grad(want.sum(), full)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for r in ranks:
        torch.testing.assert_close(r["entropy"], want.detach())
        assert r["plain_grad"] is False
    torch.testing.assert_close(torch.cat([r["grad"] for r in ranks], dim=-1), want_grad)
