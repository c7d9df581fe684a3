"""MegatronTrainState's HF view of megatron shards, for every TP/PP layout, without processes.

The megatron shards come from ``hf_to_megatron`` (checked against the model in
test_megatron.py); each HF-named slice the allgather–swap packs must equal the spec's cut of
the full tensor for that rank (``spec.cut``), so a TP/PP > 1 group gathers the right bytes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from dockrl.engines.megatron.convert import GPTArch, hf_param_names, hf_to_megatron
from dockrl.engines.megatron.state import hf_sources
from dockrl.parallel.layout import ModelShape, ParallelLayout
from dockrl.resharding.spec import cut, model_spec


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("tied", [True, False])
def test_hf_slices_of_megatron_shards_are_the_spec_shards(tp, pp, tied):
    config = Qwen2Config(vocab_size=101, hidden_size=16, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=tied)
    arch = GPTArch.from_hf(config)
    gen = torch.Generator().manual_seed(0)
    shapes = {n: t.shape for n, t in Qwen2ForCausalLM(config).named_parameters()}
    full = {n: torch.randn(shapes[n], generator=gen) for n in hf_param_names(arch)}
    layout, model = ParallelLayout(tp=tp, pp=pp, device="cpu"), ModelShape.from_hf_config(config)
    assert layout.train_vocab_size(model) == arch.padded_vocab(tp)  # the engine's padding, as the spec sees it
    specs = {s.name: s for s in model_spec(layout, model)}
    covered = set()
    for rank in range(layout.world_size):
        tp_rank, _, pp_rank = layout.train_coords(rank)
        shard = hf_to_megatron(full, arch, tp=tp, tp_rank=tp_rank, pp=pp, pp_rank=pp_rank)
        engine = SimpleNamespace(arch=arch, tp=tp, pp=pp, pp_rank=pp_rank, layer_offset=pp_rank * (arch.num_layers // pp))
        sources = hf_sources(engine, layout, model)
        assert set(sources) == {n for n, s in specs.items() if s.stage == pp_rank}
        for name, (megatron_name, extract) in sources.items():
            want = cut(full[name], specs[name], tp, tp_rank, layout.train_vocab_size(model))
            assert torch.equal(extract(shard[megatron_name]), want), (rank, name)
        covered |= set(sources)
    assert covered == set(specs)
