"""The megatron engine's training state as the allgather–swap sees it: HF-named TP/PP shards.

``AllGatherSwap`` (``dockrl/resharding/allgather_swap.py``) packs each rank's training shards
under HF names in the layout of ``dockrl/resharding/spec.py``; megatron-core stores some of them
fused (``megatron.convert``: ``linear_qkv`` interleaves Q, K and V per query group, and
``linear_fc1`` holds ``[gate_r; up_r]`` on TP rank ``r``). ``MegatronTrainState`` maps every
HF name the spec lists for this rank's PP stage to its slice of the megatron parameter:

* ``q_proj``/``k_proj``/``v_proj`` of TP rank ``r``: the local ``linear_qkv`` holds the
  ``n_kv / TP`` query groups of the rank, so splitting it per group gives exactly the spec's
  dim-0 shard of each (whole heads);
* ``gate_proj``/``up_proj``: the halves of the local ``linear_fc1``;
* every other parameter is the megatron parameter itself (vocab-parallel ones padded to a
  multiple of TP, as ``ParallelLayout.train_vocab_size``).

Swapping reuses ``ParamTrainState`` over the megatron parameters and the engine's optimizer. A
fused parameter goes to host once every HF tensor cut from it has been packed (a bucket
boundary may fall between Q and V of one layer).
"""

from __future__ import annotations

from functools import partial
from typing import Callable, Iterable

import torch

from dockrl.parallel.layout import ModelShape, ParallelLayout
from dockrl.resharding.host_swap import ParamTrainState
from dockrl.resharding.spec import model_spec

Extract = Callable[[torch.Tensor], torch.Tensor]


def _chunk(half: int, t: torch.Tensor) -> torch.Tensor:
    """Half ``half`` (0: gate, 1: up) of megatron's fused ``linear_fc1`` weight ``(2·F, H)``."""
    return t.chunk(2)[half]

def _qkv_part(engine, part: int) -> Extract:
    """Q (0), K (1) or V (2) rows of a local fused ``linear_qkv`` weight or bias."""
    a = engine.arch
    groups, per_group, d = a.num_kv_heads // engine.tp, a.num_heads // a.num_kv_heads, a.head_dim
    sizes = [per_group * d, d, d]

    def extract(t: torch.Tensor) -> torch.Tensor:
        rest = t.shape[1:]
        return t.view(groups, sum(sizes), *rest).split(sizes, dim=1)[part].reshape(-1, *rest)

    return extract


def hf_sources(engine, layout: ParallelLayout, model: ModelShape) -> dict[str, tuple[str, Extract]]:
    """``{hf_name: (megatron parameter name, slice of it)}`` for the spec parameters of this rank's stage."""
    whole: Extract = lambda t: t  # noqa: E731
    pp_rank = engine.pp_rank
    out: dict[str, tuple[str, Extract]] = {}
    for s in model_spec(layout, model):
        if s.stage != pp_rank:
            continue
        name = s.name
        if name == "model.embed_tokens.weight":
            out[name] = ("embedding.word_embeddings.weight", whole)
        elif name == "lm_head.weight":
            out[name] = ("output_layer.weight", whole)
        elif name == "model.norm.weight":
            out[name] = ("decoder.final_layernorm.weight", whole)
        else:
            _, _, layer, rest = name.split(".", 3)
            m = f"decoder.layers.{int(layer) - engine.layer_offset}."
            proj, _, kind = rest.rpartition(".")
            if rest == "input_layernorm.weight":
                out[name] = (m + "input_layernorm.weight", whole)
            elif rest == "post_attention_layernorm.weight":
                out[name] = (m + "pre_mlp_layernorm.weight", whole)
            elif proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                out[name] = (f"{m}self_attention.linear_qkv.{kind}", _qkv_part(engine, "qkv".index(proj[-6])))
            elif rest == "self_attn.o_proj.weight":
                out[name] = (m + "self_attention.linear_proj.weight", whole)
            elif rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
                half = 0 if "gate" in rest else 1
                out[name] = (m + "mlp.linear_fc1.weight", partial(_chunk, half))
            elif rest == "mlp.down_proj.weight":
                out[name] = (m + "mlp.linear_fc2.weight", whole)
            else:
                raise KeyError(f"HF parameter {name!r}: no megatron counterpart")
    return out


class MegatronTrainState(ParamTrainState):
    """``TrainState`` of one ``MegatronTrainEngine`` rank (see the module docstring).

    Args:
        engine: the trainable megatron engine of this rank.
        layout: the actor's parallel layout.
        model: the sizes of the model (``layout.check_model`` passed).
        device: the device its parameters live on.
        copy_on_cpu: on CPU, make real host copies when swapping (to exercise the copy path).

    Raises:
        ValueError: a spec parameter has no megatron parameter on this rank.
    """

    def __init__(self, engine, layout: ParallelLayout, model: ModelShape, *, device: torch.device, copy_on_cpu: bool = False) -> None:
        super().__init__(dict(engine.model.named_parameters()), engine.optimizer, device=device, copy_on_cpu=copy_on_cpu)
        self.sources = hf_sources(engine, layout, model)
        unknown = sorted({m for m, _ in self.sources.values()} - set(self.params))
        if unknown:
            raise ValueError(f"megatron engine rank: no parameters {unknown} for the sharding spec of {model.model_type}")
        self.hf_names: dict[str, set[str]] = {}
        for hf, (m, _) in self.sources.items():
            self.hf_names.setdefault(m, set()).add(hf)
        self._packed: set[str] = set()

    def shard(self, name: str, *, on_host: bool = False) -> torch.Tensor:
        if name not in self.sources:
            raise KeyError(f"training shard {name!r}: not held by this rank's pipeline stage")
        megatron_name, extract = self.sources[name]
        return extract(super().shard(megatron_name, on_host=on_host))

    def offload_weights(self, names: Iterable[str] | None) -> dict[str, int]:
        if names is None:
            return super().offload_weights(None)
        self._packed.update(names)
        done = [m for m, hf in self.hf_names.items() if m not in self._weights_out and hf <= self._packed]
        return super().offload_weights(done)

    def reload(self) -> dict[str, int]:
        self._packed.clear()
        return super().reload()
