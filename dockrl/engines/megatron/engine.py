"""Training engine on megatron-core: a GPTModel (Llama/Qwen2) sharded by the process's ranks (TP/PP/DP).

``MegatronTrainEngine`` implements ``dockrl.engines.train_engine.TrainEngine`` like
``HFTrainEngine``: it loads a local HF checkpoint into its TP/PP shard
(``megatron.convert.hf_to_megatron``), scores responses with megatron's pipeline schedules,
steps a torch AdamW on its shard, and hands weights back under HF names.

Every method is a collective over all ranks. The engine takes its layout, ranks and process
groups from a ``ProcessRanks`` made by ``dockrl.parallel.ranks.join_groups(megatron=True)``
(which also builds the megatron state its layers read); collectives time out after the process
group's ``timeout``. Ranks of one data-parallel replica pass the same rows; the results are the
same on all of them.

The model is built on the host (``use_cpu_initialization=True``, every fusion off) and moved
to ``device`` once; each micro-batch goes there in one copy per tensor. On CUDA/NPU megatron
runs as it is (NCCL/HCCL groups over the default process group). On CPU it runs in fp32 over
gloo inside ``dockrl.parallel.cpu_device.cpu_device()``, the only place that redirects
megatron-core's CUDA calls. ``get_megatron_optimizer`` hard-codes
CUDA, so the optimizer is ``torch.optim.AdamW`` over the local shard and the gradient norm is
computed here from megatron's shared/duplicate parameter predicates.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from dockrl.engines.hf.load import load_tokenizer
from dockrl.engines.hf.logprobs import pack_sequences
from dockrl.engines.megatron.convert import GPTArch, hf_param_names, hf_to_megatron, megatron_param_to_hf
from dockrl.engines.megatron.model import load_hf_state_dict, transformer_config, vocab_parallel_log_probs
from dockrl.engines.train_engine import LossFn
from dockrl.parallel.cpu_device import cpu_device
from dockrl.parallel.ranks import ProcessRanks

with warnings.catch_warnings():  # "Apex/Transformer Engine not installed": the local fallbacks are what CPU needs
    warnings.simplefilter("ignore", UserWarning)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed, param_is_not_tensor_parallel_duplicate
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region
    from megatron.core.transformer.module import param_is_not_shared

logger = logging.getLogger(__name__)


class MegatronTrainEngine:
    """The actor (or frozen reference) on megatron-core: fp32 TP/PP shard, torch AdamW.

    Args:
        model_path: local HF Llama/Qwen2 directory with safetensors weights.
        trainable: build an optimizer and allow updates (False for the reference).
        ranks: this process's ranks and megatron's groups (``join_groups(..., megatron=True)``):
            TP, PP and DP from its layout, the device from it.
        seed: megatron's model-parallel RNG seed (reseeds torch's CPU generator).

    Raises:
        ValueError: unsupported architecture, a layout that does not divide the model, or
            ranks without megatron's groups.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        trainable: bool,
        ranks: ProcessRanks,
        lr: float = 1e-6,
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        seed: int = 0,
        trust_remote_code: bool = False,
    ) -> None:
        if ranks.model_group is None:
            raise ValueError("MegatronTrainEngine: ranks without megatron's groups; build them with join_groups(..., megatron=True)")
        self.ranks, self.device = ranks, ranks.device
        tp, pp = ranks.layout.tp, ranks.layout.pp
        self.tokenizer = load_tokenizer(model_path, trust_remote_code)
        self.pad_id = self.tokenizer.pad_token_id
        self._warned_token_budget = False
        self.model_path = Path(model_path)
        self.hf_config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
        self.arch = GPTArch.from_hf(self.hf_config)
        self.arch.check_layout(tp, pp)
        self.tp, self.pp, self.grad_clip = tp, pp, grad_clip
        self.tp_rank, self.pp_rank, self.dp = ranks.tp_rank, ranks.pp_rank, ranks.layout.dp
        with self._scope():
            model_parallel_cuda_manual_seed(seed)
            self.model = GPTModel(
                transformer_config(self.arch, tp=tp, pp=pp),
                get_gpt_layer_local_spec(normalization="RMSNorm"),
                vocab_size=self.arch.padded_vocab(tp),
                max_sequence_length=self.arch.max_position_embeddings,
                pre_process=ranks.first_stage,
                post_process=ranks.last_stage,
                share_embeddings_and_output_weights=self.arch.tied_embeddings,
                position_embedding_type="rope",
                rotary_base=self.arch.rope_theta,
            ).to(self.device)
        self.load_hf_weights(load_hf_state_dict(model_path))
        self.layer_offset = self.pp_rank * (self.arch.num_layers // pp)
        per_rank = self.arch.padded_vocab(tp) // tp
        self.vocab_start = self.tp_rank * per_rank
        self.vocab_local = min(per_rank, self.arch.vocab_size - self.vocab_start)  # padded columns dropped
        self.optimizer = None
        # eval mode in every forward, the trained ones too: no dropout of any kind (its config sets
        # hidden and attention dropout to 0 as well, whatever the HF config says)
        self.model.eval()
        if trainable:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, weight_decay=weight_decay)
        else:
            self.model.requires_grad_(False)

    def _scope(self):
        """Where megatron-core runs: on CPU inside the CPU device layer, elsewhere as it is."""
        return cpu_device() if self.device.type == "cpu" else contextlib.nullcontext()

    @torch.no_grad()
    def load_hf_weights(self, hf: dict[str, torch.Tensor]) -> None:
        """Copy this rank's shard of a full HF state dict into the model.

        Raises:
            ValueError: the converted names differ from the model's parameters.
        """
        shard = hf_to_megatron(hf, self.arch, tp=self.tp, tp_rank=self.tp_rank, pp=self.pp, pp_rank=self.pp_rank)
        params = dict(self.model.named_parameters())
        if set(shard) != set(params):
            raise ValueError(f"megatron shard: missing {sorted(set(params) - set(shard))}, unexpected {sorted(set(shard) - set(params))}")
        for name, tensor in shard.items():
            params[name].copy_(tensor)

    def _warn_token_budget(self, micro_batch_tokens: int) -> None:
        if micro_batch_tokens > 0 and not self._warned_token_budget:
            self._warned_token_budget = True
            logger.warning("trainer.micro_batch_tokens=%d: the megatron engine forms micro-batches of trainer.micro_batch "
                           "consecutive rows and ignores it", micro_batch_tokens)

    def _micro_batches(self, prompts, responses, micro_batch: int) -> list[dict[str, Any]]:
        if micro_batch < 1:
            raise ValueError(f"micro_batch: got {micro_batch}; expected >= 1")
        if len(prompts) != len(responses):
            raise ValueError(f"prompts/responses: got {len(prompts)} prompts and {len(responses)} responses")
        out = []
        for s in range(0, len(prompts), micro_batch):
            ids, _, positions, mask = pack_sequences(prompts[s : s + micro_batch], responses[s : s + micro_batch], self.pad_id)
            targets = ids.gather(1, (positions + 1).clamp(max=ids.shape[1] - 1))
            # right padding under a causal mask never reaches the real tokens: no attention mask needed
            pos_ids = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
            tensors = dict(input_ids=ids, position_ids=pos_ids, positions=positions, targets=targets, mask=mask)
            out.append(dict(start=s, rows=list(range(s, s + len(mask)))) | {k: v.to(self.device) for k, v in tensors.items()})
        return out

    def _score(self, temperature: float, loss_fn: LossFn | None, mb: dict[str, Any], logits: torch.Tensor, entropy_grad: bool = False):
        """Last-stage loss function of megatron's schedule: ``(loss, num_tokens, reported)``.

        ``logits (b, L, V_r)``: this TP rank's vocabulary columns of every position.
        """
        B, T = mb["positions"].shape
        z = logits.gather(1, mb["positions"].unsqueeze(-1).expand(B, T, logits.shape[-1]))
        z = z[..., : self.vocab_local].float() / temperature
        log_prob, entropy = vocab_parallel_log_probs(z, mb["targets"], vocab_start=self.vocab_start, tp_group=self.ranks.tp_group,
                                                     entropy_grad=entropy_grad)
        mask = mb["mask"]
        log_prob, entropy = log_prob * mask, entropy * mask
        one = torch.ones((), dtype=torch.long, device=self.device)
        if loss_fn is None:
            return torch.zeros((), device=self.device), one, log_prob.detach()
        loss, aux = loss_fn(mb["rows"], log_prob, mask, entropy)
        return loss, one, aux

    def _run_schedule(self, micro_batches: list[dict[str, Any]], score: Callable, forward_only: bool) -> list[Any]:
        """megatron's forward/backward schedule (1F1B when PP > 1) over ``micro_batches``.

        ``score(mb, logits) -> (loss, num_tokens, reported)`` runs on the last stage; the
        ``reported`` values of all micro-batches are returned on every rank.
        """

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            return model(mb["input_ids"], mb["position_ids"], None), partial(score, mb)

        with self._scope():
            reported = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iter(micro_batches),
                model=self.model,
                num_microbatches=len(micro_batches),
                seq_length=max(mb["input_ids"].shape[1] for mb in micro_batches),
                micro_batch_size=max(mb["input_ids"].shape[0] for mb in micro_batches),
                forward_only=forward_only,
            )
        if self.pp > 1:  # only the last stage computed them
            box = [reported if self.ranks.last_stage else None]
            dist.broadcast_object_list(box, src=self.ranks.last_stage_rank, group=self.ranks.pp_group)
            reported = box[0]
        return list(reported)

    @torch.no_grad()
    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits ``(B, L, vocab)`` fp32 of right-padded ``input_ids (B, L)``, on every rank."""
        input_ids = input_ids.to(self.device)
        mb = dict(input_ids=input_ids, position_ids=torch.arange(input_ids.shape[1], device=self.device).expand_as(input_ids))

        def gather(mb, logits):
            full = gather_from_tensor_model_parallel_region(logits)[..., : self.arch.vocab_size]
            return torch.zeros((), device=self.device), torch.ones((), dtype=torch.long, device=self.device), full.float()

        return self._run_schedule([mb], gather, forward_only=True)[0]

    def log_probs(self, prompts, responses, *, temperature: float, micro_batch: int, micro_batch_tokens: int = 0) -> list[list[float]]:
        """Per-token log-probs (nats) of each response, ``micro_batch`` rows at a time in the
        caller's order, no grad (``micro_batch_tokens`` is not implemented here: ignored, with a warning)."""
        self._warn_token_budget(micro_batch_tokens)
        if not prompts:
            return []
        mbs = self._micro_batches(prompts, responses, micro_batch)
        with torch.no_grad():
            rows = [lp.cpu() for lp in self._run_schedule(mbs, partial(self._score, temperature, None), forward_only=True)]
        return [lp[i, : len(r)].tolist() for mb, lp in zip(mbs, rows) for i, r in enumerate(responses[mb["start"] : mb["start"] + micro_batch])]

    def forward_backward(
        self, prompts, responses, *, temperature: float, micro_batch: int, loss_fn: LossFn, entropy_grad: bool = False,
        micro_batch_tokens: int = 0,
    ) -> list[Any]:
        """Forward and backward every micro-batch through megatron's (pipelined) schedule
        (the entropy handed to ``loss_fn`` differentiable with ``entropy_grad``): ``micro_batch``
        consecutive rows each (``micro_batch_tokens`` is ignored, with a warning).

        ``loss_fn`` runs on the last PP stage; its ``aux`` values are broadcast to every stage.
        Gradients accumulate into ``.grad``.
        """
        self._warn_token_budget(micro_batch_tokens)
        if not prompts:
            return []
        mbs = self._micro_batches(prompts, responses, micro_batch)
        return self._run_schedule(mbs, partial(self._score, temperature, loss_fn, entropy_grad=entropy_grad), forward_only=False)

    def sum_over_replicas(self, values: Sequence[float]) -> list[float]:
        """``values`` summed over megatron's data-parallel group (float64 all-reduce; a collective
        of the replicas when DP > 1, ``values`` unchanged when DP = 1)."""
        out = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)  # NCCL reduces device tensors
        if self.dp > 1:
            dist.all_reduce(out, group=self.ranks.dp_group)
        return out.tolist()

    def _finish_grads(self) -> torch.Tensor:
        """Tied-embedding and data-parallel gradient reductions; returns the global grad norm."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if self.arch.tied_embeddings and self.ranks.embedding_group is not None:
            # the first stage's embedding and the last stage's output layer are one HF tensor
            dist.all_reduce(self.model.shared_embedding_or_output_weight().grad, group=self.ranks.embedding_group)
        if self.dp > 1:  # the sum: each replica's loss is already normalized by the global mini-batch totals
            for p in params:
                dist.all_reduce(p.grad, group=self.ranks.dp_group)
        # each element once: TP-replicated norms on TP rank 0 only, a tied copy on the first stage only
        sq = sum((p.grad.double().pow(2).sum() for p in params if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p)),
                 torch.zeros((), dtype=torch.float64, device=self.device))
        dist.all_reduce(sq, group=self.ranks.model_group)
        return sq.sqrt().float()

    def optimizer_step(self, accumulate: Callable[[], dict[str, float]]) -> dict[str, float]:
        """Zero grads, run ``accumulate`` (``forward_backward`` calls), reduce, clip, step.

        Clipping scales every shard by ``min(1, clip / (‖g‖ + 1e-6))`` with the global norm,
        as ``torch.nn.utils.clip_grad_norm_`` does on the full model.

        Returns:
            The metrics of ``accumulate`` plus ``actor/grad_norm`` (before clipping).
        """
        if self.optimizer is None:
            raise RuntimeError("optimizer_step on a frozen engine (trainable=False)")
        self.optimizer.zero_grad(set_to_none=True)
        metrics = accumulate()
        grad_norm = self._finish_grads()
        if not torch.isfinite(grad_norm):
            logger.warning("non-finite gradient norm %s: optimizer step skipped", grad_norm.item())
        else:
            if self.grad_clip > 0:
                torch.nn.utils.clip_grads_with_norm_(self.model.parameters(), self.grad_clip, grad_norm)
            self.optimizer.step()
        metrics["actor/grad_norm"] = float(grad_norm)
        return metrics

    @torch.no_grad()
    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """Full weights under HF names, in HF ``named_parameters`` order, on every rank.

        All-gathers each sharded parameter over TP, then every stage's tensors over PP. A
        parameter that is whole on this rank is returned as a view of the live weight, as in
        ``HFTrainEngine``: clone it to keep it across an optimizer step.
        """
        local: list[tuple[str, torch.Tensor]] = []
        for name, p in self.model.named_parameters():
            shards = [p.detach()]
            if self.tp > 1 and getattr(p, "tensor_model_parallel", False):
                shards = [torch.empty_like(p) for _ in range(self.tp)]
                dist.all_gather(shards, p.detach().contiguous(), group=self.ranks.tp_group)
            local += megatron_param_to_hf(name, shards, self.arch, layer_offset=self.layer_offset)
        if self.pp > 1:
            stages: list[Any] = [None] * self.pp
            dist.all_gather_object(stages, local, group=self.ranks.pp_group)
            local = [item for stage in stages for item in stage]
        weights = dict(local)
        return [(n, weights[n]) for n in hf_param_names(self.arch)]

    def save(self, path: str | Path) -> Path:
        """Write an HF checkpoint (safetensors, config, tokenizer) from global rank 0; all ranks return after it."""
        path = Path(path)
        weights = dict(self.named_weights())
        if self.ranks.rank == 0:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(self.hf_config, dtype=torch.float32)
            missing, unexpected = model.load_state_dict(weights, strict=False, assign=True)
            if unexpected or set(missing) - {"lm_head.weight"}:
                raise ValueError(f"HF export: missing {missing}, unexpected {unexpected}")
            if self.arch.tied_embeddings:
                model.tie_weights()
            if (self.model_path / "generation_config.json").is_file():
                model.generation_config = GenerationConfig.from_pretrained(self.model_path)
            model.save_pretrained(path)
            self.tokenizer.save_pretrained(path)
        dist.barrier()
        return path
