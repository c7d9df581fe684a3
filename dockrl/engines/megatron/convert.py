"""HF Llama/Qwen2 checkpoints ↔ megatron-core GPTModel TP/PP shards, as pure tensor functions.

megatron-core's layout (``get_gpt_layer_local_spec``, parameter names of ``GPTModel``):

* ``linear_qkv`` fuses Q, K and V **per query group**: for each of the ``n_kv`` groups, the
  ``n_q / n_kv`` query heads of the group, then its key head, then its value head
  (``SelfAttention.get_query_key_value_tensors`` views the output as
  ``(.., n_kv, (n_q/n_kv + 2) · d)``). TP splits dim 0, i.e. whole query groups per rank.
* ``linear_fc1`` fuses the SwiGLU gate and up projections **per TP rank**: rank ``r`` holds
  ``[gate_r; up_r]`` (``MLP`` splits its local output in two halves: ``silu(x[0]) * x[1]``).
* ``linear_proj`` and ``linear_fc2`` are row-parallel (TP splits dim 1); embedding and output
  layer are vocab-parallel (dim 0), the vocabulary padded with zero rows to a multiple of TP.
* PP stage ``p`` of ``P`` holds layers ``[p·L/P, (p+1)·L/P)`` renumbered from 0; the first stage
  holds the embedding, the last the final norm and output layer. With tied embeddings and
  ``P > 1`` the last stage holds its own copy of the embedding as ``output_layer.weight``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


@dataclass(frozen=True)
class GPTArch:
    """The facts of an HF Llama/Qwen2 config that the model and the conversion need."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    qkv_bias: bool
    tied_embeddings: bool
    max_position_embeddings: int

    @classmethod
    def from_hf(cls, config: Any) -> GPTArch:
        """Read an HF ``PretrainedConfig``.

        Raises:
            ValueError: an architecture or option this conversion does not map (named).
        """
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model config model_type: got {model_type!r}; the megatron engine supports {SUPPORTED_MODEL_TYPES}")
        if config.hidden_act != "silu":
            raise ValueError(f"model config hidden_act: got {config.hidden_act!r}; expected 'silu' (SwiGLU)")
        rope = getattr(config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": config.rope_theta}
        if rope.get("rope_type", "default") != "default":
            raise ValueError(f"model config rope_parameters.rope_type: got {rope['rope_type']!r}; only 'default' RoPE is mapped")
        for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
            if getattr(config, flag, False):
                raise ValueError(f"model config {flag}: got True; the megatron engine maps only models without it")
        return cls(
            num_layers=config.num_hidden_layers,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            ffn_hidden_size=config.intermediate_size,
            vocab_size=config.vocab_size,
            rms_norm_eps=config.rms_norm_eps,
            rope_theta=float(rope["rope_theta"]),
            qkv_bias=model_type == "qwen2",
            tied_embeddings=bool(config.tie_word_embeddings),
            max_position_embeddings=config.max_position_embeddings,
        )

    def padded_vocab(self, tp: int) -> int:
        """Vocabulary rounded up to a multiple of ``tp`` (megatron splits it evenly)."""
        return -(-self.vocab_size // tp) * tp

    def check_layout(self, tp: int, pp: int) -> None:
        """Raises ValueError when TP does not divide heads, query groups and FFN, or PP the layers."""
        for field, value, by, name in (
            ("num_attention_heads", self.num_heads, tp, "TP"),
            ("num_key_value_heads", self.num_kv_heads, tp, "TP"),
            ("intermediate_size", self.ffn_hidden_size, tp, "TP"),
            ("num_hidden_layers", self.num_layers, pp, "PP"),
        ):
            if by < 1 or value % by:
                raise ValueError(f"model config {field}: got {value}; it must be divisible by {name}={by}")


def hf_param_names(arch: GPTArch) -> list[str]:
    """HF parameter names in ``named_parameters()`` order (a tied ``lm_head`` is not listed)."""
    names = ["model.embed_tokens.weight"]
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj"):
            names += [p + f"self_attn.{proj}.weight"] + ([p + f"self_attn.{proj}.bias"] if arch.qkv_bias else [])
        names += [p + "self_attn.o_proj.weight"] + [p + f"mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
    names.append("model.norm.weight")
    if not arch.tied_embeddings:
        names.append("lm_head.weight")
    return names


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: GPTArch) -> torch.Tensor:
    """``(n_q·d, ...)``, ``(n_kv·d, ...)`` ×2 → ``((n_q + 2·n_kv)·d, ...)`` interleaved per query group."""
    n, g, d, rest = arch.num_kv_heads, arch.num_heads // arch.num_kv_heads, arch.head_dim, q.shape[1:]
    return torch.cat([q.reshape(n, g * d, *rest), k.reshape(n, d, *rest), v.reshape(n, d, *rest)], dim=1).reshape(-1, *rest)


def _split_qkv(qkv: torch.Tensor, arch: GPTArch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of ``_fuse_qkv`` on the full (TP-concatenated) fused tensor."""
    n, g, d, rest = arch.num_kv_heads, arch.num_heads // arch.num_kv_heads, arch.head_dim, qkv.shape[1:]
    q, k, v = qkv.reshape(n, (g + 2) * d, *rest).split([g * d, d, d], dim=1)
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if rows > t.shape[0] else t


def hf_to_megatron(hf: Mapping[str, torch.Tensor], arch: GPTArch, *, tp: int, tp_rank: int, pp: int, pp_rank: int) -> dict[str, torch.Tensor]:
    """The GPTModel parameters of one (TP rank, PP stage) from a full HF state dict.

    Returns:
        ``{megatron name: tensor}`` exactly matching that shard's ``named_parameters()``.

    Raises:
        KeyError: an HF tensor the architecture needs is missing.
    """
    arch.check_layout(tp, pp)

    def shard(t: torch.Tensor, dim: int) -> torch.Tensor:
        return t.chunk(tp, dim)[tp_rank].clone()

    vocab = arch.padded_vocab(tp)
    per_stage, out = arch.num_layers // pp, {}
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = shard(_pad_rows(hf["model.embed_tokens.weight"], vocab), 0)
    for i in range(per_stage):
        h, m = f"model.layers.{pp_rank * per_stage + i}.", f"decoder.layers.{i}."
        q, k, v = (f"{h}self_attn.{p}_proj" for p in "qkv")
        out[m + "input_layernorm.weight"] = hf[h + "input_layernorm.weight"].clone()
        out[m + "self_attention.linear_proj.weight"] = shard(hf[h + "self_attn.o_proj.weight"], 1)
        out[m + "self_attention.linear_qkv.weight"] = shard(_fuse_qkv(hf[q + ".weight"], hf[k + ".weight"], hf[v + ".weight"], arch), 0)
        if arch.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = shard(_fuse_qkv(hf[q + ".bias"], hf[k + ".bias"], hf[v + ".bias"], arch), 0)
        out[m + "pre_mlp_layernorm.weight"] = hf[h + "post_attention_layernorm.weight"].clone()
        gate, up = hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat([shard(gate, 0), shard(up, 0)])
        out[m + "mlp.linear_fc2.weight"] = shard(hf[h + "mlp.down_proj.weight"], 1)
    if pp_rank == pp - 1:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        if not arch.tied_embeddings or pp > 1:
            head = hf["model.embed_tokens.weight" if arch.tied_embeddings else "lm_head.weight"]
            out["output_layer.weight"] = shard(_pad_rows(head, vocab), 0)
    return out


def megatron_param_to_hf(name: str, shards: Sequence[torch.Tensor], arch: GPTArch, *, layer_offset: int) -> list[tuple[str, torch.Tensor]]:
    """One GPTModel parameter, given all its TP shards in rank order, as HF tensors.

    A replicated parameter (norms) may be given as one shard. ``layer_offset`` is the first
    global layer of the PP stage the name comes from. A tied output layer maps to nothing
    (the embedding carries it).

    Raises:
        KeyError: a parameter name this conversion does not know.
    """
    if name == "embedding.word_embeddings.weight":
        return [("model.embed_tokens.weight", torch.cat(list(shards))[: arch.vocab_size])]
    if name == "output_layer.weight":
        return [] if arch.tied_embeddings else [("lm_head.weight", torch.cat(list(shards))[: arch.vocab_size])]
    if name == "decoder.final_layernorm.weight":
        return [("model.norm.weight", shards[0])]
    match = _LAYER.fullmatch(name)
    if match is None:
        raise KeyError(f"megatron parameter {name!r}: no HF counterpart")
    h, rest = f"model.layers.{layer_offset + int(match.group(1))}.", match.group(2)
    if rest == "input_layernorm.weight":
        return [(h + "input_layernorm.weight", shards[0])]
    if rest == "pre_mlp_layernorm.weight":
        return [(h + "post_attention_layernorm.weight", shards[0])]
    if rest in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        kind = rest.rsplit(".", 1)[1]
        q, k, v = _split_qkv(torch.cat(list(shards)), arch)
        return [(f"{h}self_attn.{p}_proj.{kind}", t) for p, t in zip("qkv", (q, k, v))]
    if rest == "self_attention.linear_proj.weight":
        return [(h + "self_attn.o_proj.weight", torch.cat(list(shards), dim=1))]
    if rest == "mlp.linear_fc1.weight":
        halves = [s.chunk(2) for s in shards]
        return [(h + "mlp.gate_proj.weight", torch.cat([g for g, _ in halves])), (h + "mlp.up_proj.weight", torch.cat([u for _, u in halves]))]
    if rest == "mlp.linear_fc2.weight":
        return [(h + "mlp.down_proj.weight", torch.cat(list(shards), dim=1))]
    raise KeyError(f"megatron parameter {name!r}: no HF counterpart")


def megatron_to_hf(stages: Sequence[Sequence[Mapping[str, torch.Tensor]]], arch: GPTArch) -> dict[str, torch.Tensor]:
    """A full HF state dict from all shards, ``stages[pp_rank][tp_rank]`` = that shard's parameters.

    Raises:
        ValueError: the shards do not cover exactly the HF parameters of ``arch``.
    """
    pp = len(stages)
    per_stage, out = arch.num_layers // pp, {}
    for pp_rank, tp_shards in enumerate(stages):
        for name in tp_shards[0]:
            for hf_name, t in megatron_param_to_hf(name, [s[name] for s in tp_shards], arch, layer_offset=pp_rank * per_stage):
                out[hf_name] = t
    expected = hf_param_names(arch)
    if set(out) != set(expected):
        raise ValueError(f"megatron shards: HF names missing {sorted(set(expected) - set(out))}, unexpected {sorted(set(out) - set(expected))}")
    return {n: out[n] for n in expected}
