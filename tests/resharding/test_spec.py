"""Sharding spec, training cuts, bucket plan and the gathered → inference copy, in one process.

The copy is checked for every (TP, TP') pair by building the gathered buffer by hand from the
training shards of all TP ranks, i.e. what the all-gather delivers; the collectives themselves
are covered by test_sync_multiprocess.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from dockrl.parallel.layout import ModelShape, ParallelLayout
from dockrl.resharding.buckets import bucket_checksum, copy_to_inference, plan_buckets
from dockrl.resharding.spec import infer_state_dict, model_spec, shard_state_dict


def make_model(tied: bool, vocab: int = 251, layers: int = 3, kv_heads: int = 4):
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=kv_heads, tie_word_embeddings=tied,
    )
    model = Qwen2ForCausalLM(config)
    return ModelShape.from_hf_config(config), {n: t.detach().clone() for n, t in model.state_dict().items()}


UNTIED = make_model(False)
TIED = make_model(True)


def layout(tp=1, pp=1, dp=1, infer_tp=1) -> ParallelLayout:
    return ParallelLayout(tp=tp, pp=pp, dp=dp, infer_tp=infer_tp, device="cpu")


def test_spec_covers_the_hf_state_dict_exactly():
    for shape, full in (UNTIED, TIED):
        specs = model_spec(layout(), shape)
        names = {s.name for s in specs}
        assert names == set(full) - ({"lm_head.weight"} if shape.tie_word_embeddings else set())
        assert all(tuple(full[s.name].shape) == s.shape for s in specs)
    by_name = {s.name: s for s in model_spec(layout(), UNTIED[0])}
    assert by_name["model.layers.0.self_attn.q_proj.weight"].split_dim == 0
    assert by_name["model.layers.0.self_attn.k_proj.bias"].split_dim == 0
    assert by_name["model.layers.0.self_attn.o_proj.weight"].split_dim == 1
    assert by_name["model.layers.0.mlp.down_proj.weight"].split_dim == 1
    assert by_name["model.layers.0.mlp.up_proj.weight"].split_dim == 0
    assert by_name["model.layers.0.input_layernorm.weight"].split_dim is None
    assert by_name["model.embed_tokens.weight"].vocab and by_name["lm_head.weight"].vocab


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_training_shards_concatenate_to_the_full_weights(tp):
    shape, full = UNTIED
    lay = layout(tp=tp)
    shards = [shard_state_dict(full, lay, shape, r) for r in range(tp)]
    for s in model_spec(lay, shape):
        if s.split_dim is None:
            assert all(torch.equal(sh[s.name], full[s.name]) for sh in shards)
            continue
        joined = torch.cat([sh[s.name] for sh in shards], dim=s.split_dim)
        real = joined.narrow(s.split_dim, 0, s.shape[s.split_dim])
        assert torch.equal(real, full[s.name]), s.name
        assert joined.shape[s.split_dim] == (lay.train_vocab_size(shape) if s.vocab else s.shape[s.split_dim])
        assert not joined.narrow(s.split_dim, s.shape[s.split_dim], joined.shape[s.split_dim] - s.shape[s.split_dim]).any()
    q = shards[-1]["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(q, full["model.layers.0.self_attn.q_proj.weight"][-32 // tp:])  # whole heads, in order


def test_pipeline_stages_hold_their_layers_and_the_tied_head_copy():
    shape, full = TIED
    lay = layout(pp=2, dp=1)
    first, last = shard_state_dict(full, lay, shape, 0), shard_state_dict(full, lay, shape, 1)
    assert "model.embed_tokens.weight" in first and "lm_head.weight" not in first
    assert {n.split(".")[2] for n in first if n.startswith("model.layers.")} == {"0", "1"}
    assert {n.split(".")[2] for n in last if n.startswith("model.layers.")} == {"2"}
    assert "model.norm.weight" in last and "model.embed_tokens.weight" not in last
    # Megatron's shared output weight: the last stage trains a copy of the embedding
    assert torch.equal(last["lm_head.weight"][: shape.vocab_size], full["model.embed_tokens.weight"])
    assert "lm_head.weight" not in shard_state_dict(full, layout(), shape, 0)  # one stage: the embedding serves


def test_state_dict_mismatch_is_named():
    shape, full = UNTIED
    bad = dict(full)
    del bad["model.norm.weight"]
    bad["model.extra.weight"] = torch.zeros(1)
    bad["lm_head.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError) as info:
        shard_state_dict(bad, layout(), shape, 0)
    text = str(info.value)
    assert "missing ['model.norm.weight']" in text and "model.extra.weight" in text and "lm_head.weight: (3, 3)" in text


def gathered_buffer(full, lay, shape, bucket) -> torch.Tensor:
    """What the TP all-gather delivers: chunk j = TP rank j's packed training shards (of the bucket's stage)."""
    chunks = []
    for tp_rank in range(lay.tp):
        shard = shard_state_dict(full, lay, shape, lay.train_rank(tp_rank, 0, bucket.stage))
        chunks.append(torch.cat([shard[e.name].reshape(-1) for e in bucket.entries]))
        assert chunks[-1].numel() == bucket.chunk_numel
    return torch.cat(chunks)


@pytest.mark.parametrize(("tp", "pp", "dp", "infer_tp"), [(1, 1, 1, 1), (2, 1, 1, 1), (2, 1, 1, 2), (4, 1, 1, 2), (2, 1, 2, 4),
                                                         (1, 1, 4, 4), (1, 1, 4, 2), (2, 3, 1, 2), (4, 1, 1, 4), (1, 3, 2, 2)])
@pytest.mark.parametrize("model", ["untied", "tied"])
def test_copy_to_inference_reproduces_the_inference_shards(tp, pp, dp, infer_tp, model):
    shape, full = UNTIED if model == "untied" else TIED
    lay = layout(tp=tp, pp=pp, dp=dp, infer_tp=infer_tp)
    plan = plan_buckets(lay, shape, bucket_bytes=12000, element_size=4)
    for infer_rank in range(infer_tp):
        want = infer_state_dict(full, lay, shape, infer_rank)  # global rank infer_rank has inference TP' rank infer_rank
        for bucket in plan:
            infer = torch.zeros(bucket.infer_numel)
            copy_to_inference(gathered_buffer(full, lay, shape, bucket), bucket, infer, lay, shape, infer_rank)
            for e in bucket.entries:
                got = infer.narrow(0, e.infer_offset, math.prod(e.infer_shape)).view(e.infer_shape)
                assert torch.equal(got, want[e.name]), (e.name, infer_rank)
    # and the reference itself: inference shards concatenate to the full weights
    for s in model_spec(lay, shape):
        if s.split_dim is not None:
            joined = torch.cat([infer_state_dict(full, lay, shape, r)[s.name] for r in range(infer_tp)], dim=s.split_dim)
            assert torch.equal(joined.narrow(s.split_dim, 0, s.shape[s.split_dim]), full[s.name])


def test_bucket_plan_bounds_and_covers():
    shape, _ = UNTIED
    lay = layout(tp=2, pp=2, dp=1, infer_tp=2)
    for bucket_bytes in (1, 5000, 12000, 1 << 30):
        plan = plan_buckets(lay, shape, bucket_bytes, element_size=4)
        names = [e.name for b in plan for e in b.entries]
        assert names == [s.name for s in model_spec(lay, shape)]  # each parameter once, in spec order
        for b in plan:
            assert len({e.spec.stage for e in b.entries}) == 1 and b.stage == b.entries[0].spec.stage
            gathered = lay.tp * b.chunk_numel * 4
            assert gathered <= bucket_bytes or len(b.entries) == 1  # only a single oversize parameter exceeds it
            assert b.infer_numel % 8 == 0
    assert len(plan_buckets(lay, shape, 1 << 30, 4)) == 2  # one per stage
    assert len(plan_buckets(lay, shape, 1, 4)) == len(model_spec(lay, shape))
    with pytest.raises(ValueError, match="bucket_bytes: got 0"):
        plan_buckets(lay, shape, 0, 4)


def test_bucket_checksum_sees_values_and_positions():
    x = torch.randn(2 * 4096 * 2 + 6)  # two rows of 4096 64-bit words and a tail
    assert bucket_checksum(x) == bucket_checksum(x.clone())
    y = x.clone()
    y[500] = torch.nextafter(y[500], torch.tensor(math.inf))  # one ulp
    assert bucket_checksum(y) != bucket_checksum(x)
    same_row = x.clone()
    same_row[[0, 1, 2, 3]] = x[[2, 3, 0, 1]]  # words 0 and 1 swapped
    same_column = x.clone()
    same_column[[0, 1, 8192, 8193]] = x[[8192, 8193, 0, 1]]  # words 0 and 4096 swapped
    tail = x.clone()
    tail[-1] += 1
    for changed in (same_row, same_column, tail):
        assert bucket_checksum(changed) != bucket_checksum(x)
    assert bucket_checksum(torch.zeros(8, dtype=torch.bfloat16)) == 0
    assert 0 <= bucket_checksum(torch.full((4096,), -1.0)) < 2**64


def test_llama_biases_follow_the_split():
    shape = dataclasses.replace(UNTIED[0], model_type="llama", qkv_bias=True, o_bias=True, mlp_bias=True)
    specs = {s.name: s for s in model_spec(layout(), shape)}
    assert specs["model.layers.0.self_attn.o_proj.bias"].split_dim is None  # added after the row-parallel reduce
    assert specs["model.layers.0.mlp.down_proj.bias"].split_dim is None
    assert specs["model.layers.0.mlp.gate_proj.bias"].split_dim == 0
