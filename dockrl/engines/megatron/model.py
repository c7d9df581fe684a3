"""The megatron-core pieces of the megatron engine: a Llama/Qwen2 ``TransformerConfig``, log-probs
under vocab-parallel logits, and the HF checkpoint the engine loads into its shards.

``transformer_config`` sets megatron-core up for a Llama/Qwen2 GPTModel that runs on CPU as on
CUDA/NPU (fp32, every fusion off); ``vocab_parallel_log_probs`` computes the log-prob of each
token and the entropy from this TP rank's vocabulary columns with sums over the TP group;
``load_hf_state_dict`` reads a safetensors checkpoint. ``MegatronTrainEngine``
(``dockrl/engines/megatron/engine.py``) builds on them.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors import safe_open

from dockrl.engines.megatron.convert import GPTArch

with warnings.catch_warnings():  # "Apex/Transformer Engine not installed": the local fallbacks are what CPU needs
    warnings.simplefilter("ignore", UserWarning)
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
    from megatron.core.transformer import TransformerConfig


def transformer_config(arch: GPTArch, *, tp: int, pp: int) -> TransformerConfig:
    """megatron-core config of a Llama/Qwen2 model: RMSNorm, SwiGLU, GQA, fp32, CPU-safe flags."""
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,  # dropout would make the on-policy ratio differ from 1
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=False,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
        # perform_initialization stays on: with CPU initialization it is also what marks the
        # TP-sharded parameters (tensor_model_parallel, partition_dim)
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
        variable_seq_lengths=True,  # micro-batches are padded to their own longest row
        moe_token_dispatcher_type="alltoall",  # no MoE; the default 'allgather' rejects variable lengths
        calculate_per_token_loss=True,  # the schedule must not rescale our (already normalized) loss
    )


def vocab_parallel_log_probs(
    logits: torch.Tensor, targets: torch.Tensor, *, vocab_start: int, tp_group: dist.ProcessGroup | None,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of ``targets`` and entropy under vocab-parallel logits, over the TP group.

    Args:
        logits: ``(B, T, V_r)`` fp32, this rank's vocabulary columns ``[vocab_start, vocab_start + V_r)``.
        targets: ``(B, T)`` global token ids.
        tp_group: the TP group (``None`` when TP = 1).

    Returns:
        ``log_prob (B, T)`` = ``z_t − m − log Σ_v exp(z_v − m)`` (``m`` the global max), whose
        gradient on this rank's logits is ``onehot − softmax`` (the sums are all-reduced with
        megatron's ``reduce_from_tensor_model_parallel_region``: identity backward, as in its
        vocab-parallel cross entropy); ``entropy (B, T)`` = ``log S − Σ p (z − m)``, no grad
        unless ``entropy_grad`` (its sums are reduced the same way, so each rank's gradient is
        that of its own columns; ``m`` is a constant shift, which the entropy does not depend on).
    """
    with torch.no_grad():
        m = logits.max(dim=-1).values
        if tp_group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - m.unsqueeze(-1)
    sum_exp = reduce_from_tensor_model_parallel_region(shifted.exp().sum(dim=-1))
    local = targets - vocab_start
    here = (local >= 0) & (local < logits.shape[-1])
    target = shifted.gather(-1, local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)).squeeze(-1) * here
    log_prob = reduce_from_tensor_model_parallel_region(target.contiguous()) - sum_exp.log()
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        # Σ p (z − m) = (Σ_v e^(z_v − m)(z_v − m)) / S with the sum reduced first: S depends on every
        # rank's columns, so dividing each rank's part by S before the reduction would lose, in the
        # identity backward, the other ranks' terms' dependence on this rank's logits
        p_z = reduce_from_tensor_model_parallel_region((shifted.exp() * shifted).sum(dim=-1).contiguous()) / sum_exp
        entropy = sum_exp.log() - p_z
    return log_prob, entropy


def load_hf_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors checkpoint (single file or sharded with an index).

    Raises:
        FileNotFoundError: the directory has no ``*.safetensors`` file.
    """
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model.path {path}: no *.safetensors files; the megatron engine loads safetensors checkpoints")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(f, framework="pt") as st:
            out.update({k: st.get_tensor(k).float() for k in st.keys()})
    return out
