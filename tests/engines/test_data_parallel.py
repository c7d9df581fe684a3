"""Data-parallel replicas train on the global mini-batch: DP = 2 gives the DP = 1 gradient.

Two gloo processes (DP = 2, TP = PP = 1) each take one prompt group of a 12-row mini-batch whose
groups differ ~10× in response length; one process takes the whole mini-batch. Their summed
gradients must agree to fp32 precision, for ``loss_agg_mode`` token-mean and seq-mean-token-mean, on both paths that
train with data parallelism:

* the megatron engine under ``accumulate_mini_batch`` (off-policy, clipped, with KL);
* the hybrid actor's update stage (``UpdateThenSync`` over ``ActorWorker(replicas=2)``): each
  rank claims its group from its dock, updates, and the gradient is read before the sync. Its
  rollout engine is the HF one (vLLM is not needed to train; the sync serves any engine).

A per-replica token mean (each replica dividing by its own token count, the replicas' gradients
averaged) fails this by far: relative error ~1 on such lengths.
"""

from __future__ import annotations

import os
import random
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dockrl.config import AlgorithmConfig, RolloutConfig, TrainerConfig
from dockrl.engines.hf.train import HFTrainEngine

TEMPERATURE = 0.7
N = 6  # samples per prompt; one group per replica
MODES = ("token-mean", "seq-mean-token-mean")


def _free_ports(n: int) -> tuple[int, ...]:
    """``n`` distinct free ports: the sockets stay bound until all are chosen (one after the other,
    the system may hand out the same port twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return tuple(s.getsockname()[1] for s in socks)
    finally:
        for s in socks:
            s.close()


def _batch(model_dir: Path) -> dict[str, list]:
    """Two groups: short responses (1–4 tokens) then long ones (25–40), float32-exact values."""
    reference = HFTrainEngine(model_dir, trainable=False)
    rng = random.Random(0)
    vocab, eos = len(reference.tokenizer), reference.tokenizer.eos_token_id
    prompts, responses = [], []
    for lo, hi in ((1, 4), (25, 40)):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(5, 9))]
        for _ in range(N):
            prompts.append(prompt)
            responses.append([rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi) - 1)] + [eos])
    f32 = lambda rows: [torch.tensor(r, dtype=torch.float32).tolist() for r in rows]  # noqa: E731 - as the dock stores them
    lp = f32(reference.log_probs(prompts, responses, temperature=TEMPERATURE, micro_batch=12))
    return {
        "prompt_ids": prompts, "response_ids": responses,
        "advantages": [[a] * len(r) for a, r in zip(torch.tensor([rng.uniform(-1, 1) for _ in prompts]).tolist(), responses)],
        "old_log_prob": f32([[x - rng.uniform(0, 0.4) for x in row] for row in lp]),
        "ref_log_prob": f32([[x + rng.uniform(-0.3, 0.3) for x in row] for row in lp]),
        "rollout_log_prob": lp,
    }


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _engine_step(actor, part: dict, loss_agg: str):
    """The megatron engine's gradient of ``part`` after the data-parallel reduction, and its metrics."""
    from dockrl.stages.actor import accumulate_mini_batch

    actor.start_training()
    engine = actor.train_engine
    algo = AlgorithmConfig(loss_agg_mode=loss_agg, kl_loss_coef=0.1)
    actor.optimizer.zero_grad(set_to_none=True)
    metrics = accumulate_mini_batch(engine, dict(part), algo=algo, temperature=TEMPERATURE, micro_batch=4)
    actor.train._finish_grads()
    grads = _grads(actor.train.model)
    actor.sync()
    return grads, metrics


def _hybrid_step(actor, batch: dict, rank: int, world: int, loss_agg: str):
    """The hybrid update stage on this rank's dock; the gradient is read before the sync."""
    from dockrl.config import DockConfig
    from dockrl.dock import GRPO_SCHEMA, open_dock
    from dockrl.stages.actor import ActorWorker
    from dockrl.stages.hybrid import UpdateThenSync

    trainer = TrainerConfig(global_batch=2, mini_batch=2, micro_batch=4)
    worker = ActorWorker(actor.train_engine, trainer=trainer, algo=AlgorithmConfig(loss_agg_mode=loss_agg),
                         rollout=RolloutConfig(n=N, temperature=TEMPERATURE), replicas=world)
    update = UpdateThenSync(actor, worker, dp_group=actor.ranks.dp_group)
    dock = open_dock(DockConfig(), GRPO_SCHEMA, run="test")
    dock.open_iteration(0, len(batch["prompt_ids"]), N)
    dock.put(range(len(batch["prompt_ids"])), {k: batch[k] for k in ("prompt_ids", "response_ids", "advantages", "rollout_log_prob")}
             | {"weight_version": [[0] * len(r) for r in batch["response_ids"]]})  # sampled by the initial weights
    for _ in range(rank):  # the replicas before this one claimed their groups from the shared dock
        dock.ack(dock.claim("actor", ["prompt_ids"], N, whole_groups=True))
    seen: dict = {}
    metrics = update.run_iteration(dock, before_sync=lambda: seen.update(_grads(actor.train.model)))
    dock.close()
    return seen, metrics


def _rank_main(index: int, ports: tuple[int, int], model_dir: str, batch: dict, out: str) -> None:
    """Processes 0 and 1 are the two ranks of DP = 2, process 2 is DP = 1 alone (all three at once,
    which saves a second start of megatron). One hybrid actor (megatron + HF rollout) per process,
    lr = 0 so that every step starts from the same weights: both paths, both modes."""
    rank, world = (index, 2) if index < 2 else (0, 1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[world - 1]))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        from dockrl.engines.hf.rollout import HFRolloutEngine
        from dockrl.engines.hybrid import HybridActor
        from dockrl.engines.megatron.engine import MegatronTrainEngine
        from dockrl.parallel.layout import ParallelLayout
        from dockrl.parallel.ranks import join_groups

        ranks = join_groups(ParallelLayout(dp=world, device="cpu"), rank=rank, timeout_s=120, megatron=True)
        train = MegatronTrainEngine(model_dir, trainable=True, ranks=ranks, lr=0.0, grad_clip=0.0)
        actor = HybridActor(train, HFRolloutEngine(model_dir, dtype="float32"))
        rows = range(len(batch["prompt_ids"])) if world == 1 else range(rank * N, (rank + 1) * N)
        part = {k: [v[i] for i in rows] for k, v in batch.items() if k != "rollout_log_prob"}
        result = {}
        for mode in MODES:
            result[("engine", mode)] = _engine_step(actor, part, mode)
            result[("hybrid", mode)] = _hybrid_step(actor, batch, rank, world, mode)
        torch.save(result, Path(out) / f"world{world}-rank{rank}.pt")
    finally:
        from dockrl.parallel.ranks import leave_groups

        leave_groups()


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("dp")
    batch = _batch(tiny_model_dir)
    mp.spawn(_rank_main, args=(_free_ports(2), str(tiny_model_dir), batch, str(out)), nprocs=3, join=True)
    return {(w, r): torch.load(out / f"world{w}-rank{r}.pt") for w, r in ((1, 0), (2, 0), (2, 1))}, batch


def relative_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, float]:
    """``‖g − g₁‖ / ‖g₁‖`` and the cosine over all parameters, in float64."""
    g = torch.cat([got[n].double().flatten() for n in want])
    w = torch.cat([want[n].double().flatten() for n in want])
    return float((g - w).norm() / w.norm()), float(g @ w / (g.norm() * w.norm()))


def test_the_two_replicas_hold_very_different_token_counts(tiny_model_dir):
    batch = _batch(tiny_model_dir)
    short, long = (sum(len(r) for r in batch["response_ids"][g * N : (g + 1) * N]) for g in (0, 1))
    assert long > 8 * short


@pytest.mark.slow
@pytest.mark.parametrize("path", ["engine", "hybrid"])
@pytest.mark.parametrize("mode", MODES)
def test_two_replicas_give_the_one_rank_gradient_of_the_global_batch(runs, path, mode):
    results, _ = runs
    want, want_metrics = results[(1, 0)][(path, mode)]
    assert sum(float(g.norm()) for g in want.values()) > 0
    for rank in (0, 1):
        got, metrics = results[(2, rank)][(path, mode)]
        error, cosine = relative_error(got, want)
        assert error < 1e-5, (path, mode, rank, error, cosine)
        for key in ("actor/loss", "actor/pg_loss", "actor/entropy", "actor/ratio_mean", "actor/kl"):
            assert metrics[key] == pytest.approx(want_metrics[key], rel=1e-5, abs=1e-7), key
