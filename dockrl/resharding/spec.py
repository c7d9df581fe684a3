"""Sharding spec of Llama/Qwen2-architecture models in HF parameter names.

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, §3; the same split vLLM loads):

| HF parameter (per layer ``model.layers.{i}.``)        | TP split                          |
|-------------------------------------------------------|-----------------------------------|
| ``self_attn.{q,k,v}_proj.weight`` / ``.bias``          | column parallel: dim 0 (whole heads) |
| ``self_attn.o_proj.weight``                           | row parallel: dim 1               |
| ``self_attn.o_proj.bias`` (Llama ``attention_bias``)  | replicated (added after the reduce) |
| ``mlp.{gate,up}_proj.weight`` / ``.bias``             | column parallel: dim 0            |
| ``mlp.down_proj.weight``                              | row parallel: dim 1               |
| ``mlp.down_proj.bias``                                | replicated                        |
| ``input_layernorm.weight``, ``post_attention_layernorm.weight`` | replicated              |
| ``model.embed_tokens.weight``, ``lm_head.weight``     | vocab parallel: dim 0, padded     |
| ``model.norm.weight``                                 | replicated                        |

Pipeline parallelism: decoder layers are split contiguously over the stages
(``ParallelLayout.stage_layers``); the embedding lives on the first stage, the final norm and
the output head on the last. With tied embeddings the HF model has one weight; the spec lists
only ``model.embed_tokens.weight``, and, as in Megatron, a last stage other than the first
keeps a training copy of it under ``lm_head.weight`` (``shard_state_dict``), which the sync
never sends: the inference side aliases ``lm_head.weight`` to the embedding.

Vocab-parallel shards are padded with zero rows (``ParallelLayout.train_vocab_size`` /
``infer_vocab_size``): shard ``r`` of ``P`` parts of a dim padded to ``N_pad`` holds the real rows
``[r·N_pad/P, (r+1)·N_pad/P) ∩ [0, N)``, zeros after them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from dockrl.parallel.layout import ModelShape, ParallelLayout


@dataclass(frozen=True)
class ParamSpec:
    """One HF parameter: its full shape, TP split, and the pipeline stage that trains it."""

    name: str
    """HF state-dict name."""
    shape: tuple[int, ...]
    """Full (unsharded, unpadded) shape."""
    split_dim: int | None
    """Dim split over TP ranks; ``None``: replicated on every TP rank."""
    vocab: bool
    """Vocab parallel: the split dim is padded (training and inference differently)."""
    stage: int
    """PP stage holding the trained parameter."""

    def padded(self, padded_vocab: int) -> int:
        """Padded length of the split dim: ``padded_vocab`` for vocab-parallel params, else unpadded."""
        assert self.split_dim is not None
        return padded_vocab if self.vocab else self.shape[self.split_dim]

    def shard_shape(self, parts: int, padded_vocab: int) -> tuple[int, ...]:
        """Shape of one of ``parts`` shards (``padded_vocab``: the padded vocabulary of that side)."""
        if self.split_dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.split_dim] = self.padded(padded_vocab) // parts
        return tuple(shape)

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def model_spec(layout: ParallelLayout, model: ModelShape) -> list[ParamSpec]:
    """All HF parameters the sync moves, in canonical order (embedding, layers 0…L-1, norm, head).

    With tied embeddings ``lm_head.weight`` is not listed (it is the embedding).
    """
    m = model
    h, q, kv, ffn = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.intermediate_size
    last = layout.pp - 1
    specs = [ParamSpec("model.embed_tokens.weight", (m.vocab_size, h), 0, True, 0)]
    for i in range(m.num_layers):
        p, stage = f"model.layers.{i}.", layout.stage_of_layer(m, i)

        def add(name: str, shape: tuple[int, ...], split: int | None) -> None:
            specs.append(ParamSpec(p + name, shape, split, False, stage))  # noqa: B023 (called at once)

        add("input_layernorm.weight", (h,), None)
        for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            add(f"self_attn.{proj}.weight", (rows, h), 0)
            if m.qkv_bias:
                add(f"self_attn.{proj}.bias", (rows,), 0)
        add("self_attn.o_proj.weight", (h, q), 1)
        if m.o_bias:
            add("self_attn.o_proj.bias", (h,), None)
        add("post_attention_layernorm.weight", (h,), None)
        for proj in ("gate_proj", "up_proj"):
            add(f"mlp.{proj}.weight", (ffn, h), 0)
            if m.mlp_bias:
                add(f"mlp.{proj}.bias", (ffn,), 0)
        add("mlp.down_proj.weight", (h, ffn), 1)
        if m.mlp_bias:
            add("mlp.down_proj.bias", (h,), None)
    specs.append(ParamSpec("model.norm.weight", (h,), None, False, last))
    if not m.tie_word_embeddings:
        specs.append(ParamSpec("lm_head.weight", (m.vocab_size, h), 0, True, last))
    return specs


def shard_range(length: int, padded: int, parts: int, rank: int) -> tuple[int, int]:
    """Real rows ``[start, stop)`` of shard ``rank`` of ``parts`` of a dim of ``length`` padded to ``padded``.

    ``stop - start`` is below ``padded / parts`` only for the last vocab shards (padding rows).
    """
    size = padded // parts
    return min(rank * size, length), min((rank + 1) * size, length)


def cut(full: torch.Tensor, spec: ParamSpec, parts: int, rank: int, padded_vocab: int) -> torch.Tensor:
    """Shard ``rank`` of ``parts`` of a full HF tensor: a new contiguous tensor, zero padded.

    Args:
        full: the full tensor, shape ``spec.shape``.
        padded_vocab: padded vocabulary of this layout side (used by vocab-parallel params).

    Returns:
        Tensor of shape ``spec.shard_shape(parts, padded_vocab)``, ``full``'s dtype and device.
    """
    if spec.split_dim is None:
        return full.detach().clone()
    d = spec.split_dim
    out = torch.zeros(spec.shard_shape(parts, padded_vocab), dtype=full.dtype, device=full.device)
    start, stop = shard_range(spec.shape[d], spec.padded(padded_vocab), parts, rank)
    out.narrow(d, 0, stop - start).copy_(full.detach().narrow(d, start, stop - start))
    return out


def check_state_dict(full: Mapping[str, torch.Tensor], layout: ParallelLayout, model: ModelShape) -> None:
    """Check that a full HF state dict has exactly the spec's names and shapes.

    A tied ``lm_head.weight`` may be present (``model.state_dict()``) or absent (safetensors).

    Raises:
        ValueError: missing, unexpected or wrongly shaped parameters, listed by name.
    """
    specs = model_spec(layout, model)
    expected = {s.name: s.shape for s in specs}
    tied_head = model.tie_word_embeddings and "lm_head.weight" in full
    names = set(full) - ({"lm_head.weight"} if tied_head else set())
    missing, unexpected = sorted(set(expected) - names), sorted(names - set(expected))
    wrong = sorted(f"{n}: {tuple(full[n].shape)} != {expected[n]}" for n in names & set(expected) if tuple(full[n].shape) != expected[n])
    if missing or unexpected or wrong:
        raise ValueError(
            f"state dict does not match the {model.model_type} sharding spec: "
            f"missing {missing[:5]}{'…' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
            f"{'…' if len(unexpected) > 5 else ''}, wrong shapes {wrong[:5]}"
        )


def shard_state_dict(full: Mapping[str, torch.Tensor], layout: ParallelLayout, model: ModelShape, rank: int) -> dict[str, torch.Tensor]:
    """Cut a full HF state dict into the training shard of global ``rank``.

    The shard holds the parameters of the rank's PP stage, each cut to its TP rank (vocab dims
    padded to ``layout.train_vocab_size(model)``). With tied embeddings and PP > 1, the last stage also
    gets ``lm_head.weight``: a copy of its embedding shard (Megatron's shared output weight).

    Returns:
        ``{hf_name: tensor}``: new contiguous tensors in ``full``'s dtype, in spec order.

    Raises:
        ValueError: ``full`` does not match the spec (``check_state_dict``), or a bad rank.
    """
    check_state_dict(full, layout, model)
    tp_rank, _, pp_rank = layout.train_coords(rank)
    out: dict[str, torch.Tensor] = {}
    for s in model_spec(layout, model):
        if s.stage == pp_rank:
            out[s.name] = cut(full[s.name], s, layout.tp, tp_rank, layout.train_vocab_size(model))
    if model.tie_word_embeddings and layout.pp > 1 and pp_rank == layout.pp - 1:
        embed = next(s for s in model_spec(layout, model) if s.name == "model.embed_tokens.weight")
        out["lm_head.weight"] = cut(full[embed.name], embed, layout.tp, tp_rank, layout.train_vocab_size(model))
    return out


def infer_state_dict(full: Mapping[str, torch.Tensor], layout: ParallelLayout, model: ModelShape, rank: int) -> dict[str, torch.Tensor]:
    """Cut a full HF state dict into the inference (TP') shard of global ``rank``: the reference a sync must reproduce.

    Returns:
        ``{hf_name: tensor}`` for every spec parameter (vocab dims padded to
        ``layout.infer_vocab_size(model)``), in spec order.
    """
    check_state_dict(full, layout, model)
    infer_tp_rank = layout.infer_coords(rank).tp_rank
    return {s.name: cut(full[s.name], s, layout.infer_tp, infer_tp_rank, layout.infer_vocab_size(model)) for s in model_spec(layout, model)}
