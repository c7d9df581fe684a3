"""Parallel layout: every rule rejected with its field, Megatron/vLLM rank arithmetic, stage split."""

from __future__ import annotations

import dataclasses
import re

import pytest

from dockrl.parallel.layout import LayoutError, ModelShape, ParallelLayout

# heads 4, KV heads 2, 3 layers, MLP width 64: TP ∈ {1, 2}
SHAPE = ModelShape.from_hf_config(
    {
        "model_type": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 3,
        "vocab_size": 251, "hidden_size": 32, "intermediate_size": 64, "tie_word_embeddings": False,
    }
)


def layout(**kw) -> ParallelLayout:
    return ParallelLayout(**({"device": "cpu"} | kw))


def test_model_shape_from_hf_config():
    assert SHAPE.head_dim == 8 and SHAPE.num_kv_heads == 2 and SHAPE.num_layers == 3
    assert SHAPE.qkv_bias and not SHAPE.o_bias and not SHAPE.mlp_bias  # Qwen2: q/k/v biases only
    llama = ModelShape.from_hf_config(dataclasses.asdict(SHAPE) | {"model_type": "llama", "num_attention_heads": 4,
                                                                   "num_hidden_layers": 3, "attention_bias": True})
    assert llama.qkv_bias and llama.o_bias and llama.num_kv_heads == 4  # no num_key_value_heads: MHA


def test_model_shape_rejects_unknown_architecture_and_missing_sizes():
    with pytest.raises(LayoutError, match="model_type 'gpt2'"):
        ModelShape.from_hf_config({"model_type": "gpt2"})
    with pytest.raises(LayoutError, match="num_hidden_layers is None"):
        ModelShape.from_hf_config({"model_type": "qwen2", "num_attention_heads": 4, "vocab_size": 8})


def test_model_shape_of_the_tiny_model_dir(tiny_model_dir):
    shape = ModelShape.from_model_dir(tiny_model_dir)
    assert (shape.num_heads, shape.num_kv_heads, shape.num_layers, shape.tie_word_embeddings) == (4, 2, 2, True)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelShape.from_model_dir(tiny_model_dir / "missing")


REJECTED = {
    "infer_tp above tp x dp": (dict(pp=2, infer_tp=2), ["parallel.infer_tp: got 2", "parallel.tp × parallel.dp = 1 × 1 = 1"]),
    "infer_tp not dividing tp x dp": (dict(dp=3, infer_tp=2), ["parallel.infer_tp: got 2", "must divide"]),
    "inference pp": (dict(infer_pp=2), ["parallel.infer_pp: got 2", "expected 1"]),
    "zero dp": (dict(dp=0), ["parallel.dp: got 0", "positive"]),
    "unknown device": (dict(device="tpu"), ["parallel.device: got 'tpu'", "'npu'"]),
}


@pytest.mark.parametrize("name", list(REJECTED))
def test_impossible_layouts_are_rejected_with_the_reason(name):
    kw, fragments = REJECTED[name]
    with pytest.raises(LayoutError) as info:
        layout(**kw)
    assert isinstance(info.value, ValueError)
    for fragment in fragments:
        assert fragment in str(info.value)


@pytest.mark.parametrize("field", ["tp", "pp", "dp", "infer_tp", "infer_pp", "bucket_mb"])
@pytest.mark.parametrize("value", [0, -1, True, 1.5, "2"])
def test_every_size_error_names_its_field(field, value):
    with pytest.raises(LayoutError, match="^" + re.escape(f"parallel.{field}: got {value!r}; expected a positive integer") + "$"):
        layout(**{field: value})


MODEL_REJECTED = {
    "tp does not divide heads": (dict(tp=3), dataclasses.replace(SHAPE, num_kv_heads=3), ["parallel.tp: got 3", "num_attention_heads=4"]),
    "tp does not divide kv heads": (dict(tp=4), SHAPE, ["parallel.tp: got 4", "num_key_value_heads=2"]),
    "tp does not divide the MLP": (dict(tp=2), dataclasses.replace(SHAPE, intermediate_size=63), ["parallel.tp: got 2", "intermediate_size=63"]),
    "infer_tp does not divide kv heads": (dict(dp=4, infer_tp=4), SHAPE, ["parallel.infer_tp: got 4", "num_key_value_heads=2"]),
    "pp above layers": (dict(pp=4), SHAPE, ["parallel.pp: got 4", "num_hidden_layers=3"]),
}


@pytest.mark.parametrize("name", list(MODEL_REJECTED))
def test_layouts_that_do_not_fit_the_model_are_rejected_with_the_reason(name):
    kw, model, fragments = MODEL_REJECTED[name]
    lay = layout(**kw)  # the counts alone are fine
    with pytest.raises(LayoutError) as info:
        lay.check_model(model)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_world_size_is_the_product_and_no_field():
    assert layout(tp=2, pp=3, dp=2, infer_tp=2).world_size == 12
    assert "world_size" not in {f.name for f in dataclasses.fields(ParallelLayout)}
    with pytest.raises(TypeError):
        ParallelLayout(world_size=4)


def test_layout_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout().tp = 2


def test_megatron_rank_order_tp_then_dp_then_pp():
    lay = layout(tp=2, pp=2, dp=2, infer_tp=2)
    coords = [lay.train_coords(r) for r in range(8)]
    assert coords[:4] == [(0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0)]  # (tp_rank, dp_rank, pp_rank)
    assert coords[5] == (1, 0, 1)
    assert all(lay.train_rank(*c) == r for r, c in enumerate(coords))
    assert lay.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert [lay.infer_coords(r) for r in (0, 1, 2, 7)] == [(0, 0), (1, 0), (0, 1), (1, 3)]
    assert lay.infer_dp == 4
    with pytest.raises(ValueError, match="rank: got 8"):
        lay.train_coords(8)


def test_layers_split_contiguously_earlier_stages_take_the_remainder():
    lay = layout(pp=2)
    assert [lay.stage_layers(SHAPE, p) for p in range(2)] == [range(0, 2), range(2, 3)]
    assert [lay.stage_of_layer(SHAPE, i) for i in range(3)] == [0, 0, 1]
    lay3 = layout(pp=3)
    assert [list(lay3.stage_layers(SHAPE, p)) for p in range(3)] == [[0], [1], [2]]


def test_vocab_padding_megatron_and_inference():
    assert layout().train_vocab_size(SHAPE) == 251
    assert layout(tp=2).train_vocab_size(SHAPE) == 252  # a multiple of TP, as the megatron engine pads it
    assert layout(dp=2, infer_tp=2).infer_vocab_size(SHAPE) == 252
    assert layout().infer_vocab_size(SHAPE) == 251
