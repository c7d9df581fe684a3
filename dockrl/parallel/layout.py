"""The parallel layout of the actor: one frozen object, validated when it is built (the config's ``parallel`` section).

The actor trains with tensor parallelism TP, pipeline parallelism PP and data parallelism DP
(Megatron) and generates with inference tensor parallelism TP' (vLLM) on the same
``world_size = TP × PP × DP`` devices. ``ParallelLayout`` checks the rules that need no model
when it is constructed, those that depend on the model's sizes in ``check_model`` (the config
loader calls it for a local model directory; the engines when they load the model), and answers
the rank arithmetic:

* training rank order is Megatron's default ``tp-cp-ep-dp-pp`` (TP fastest, PP slowest):
  ``rank = tp_rank + TP · (dp_rank + DP · pp_rank)``;
* inference rank order is vLLM's (TP' fastest): ``rank = infer_tp_rank + TP' · infer_dp_rank``;
* layers are split over PP stages contiguously, as evenly as possible, earlier stages taking
  the remainder;
* vocab-parallel weights are padded as the megatron engine pads them: the training vocabulary
  is rounded up to a multiple of TP (``GPTArch.padded_vocab``), the inference vocabulary to a
  multiple of TP'.

This module imports no torch: the config loader uses it to reject impossible layouts early.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, NamedTuple, get_args

DeviceKind = Literal["cpu", "cuda", "npu"]
"""Accelerator kind of the actor's devices (collective backend: gloo, nccl, hccl)."""
DEVICE_KINDS: tuple[str, ...] = get_args(DeviceKind)


class LayoutError(ValueError):
    """A parallel layout breaks a rule; the message names the field, the value and the rule."""


SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The sizes of a Llama/Qwen2-architecture model that parallel layouts depend on."""

    model_type: str
    """HF ``model_type`` (``llama``, ``qwen2``, ``mistral``)."""
    num_heads: int
    """Attention (query) heads: ``num_attention_heads``."""
    num_kv_heads: int
    """Key/value heads (GQA): ``num_key_value_heads``."""
    num_layers: int
    """Decoder layers: ``num_hidden_layers``."""
    vocab_size: int
    """Rows of the embedding and the output head."""
    hidden_size: int
    """Model width."""
    intermediate_size: int
    """MLP width."""
    head_dim: int
    """Width of one attention head."""
    tie_word_embeddings: bool
    """The output head shares the embedding's weight."""
    qkv_bias: bool
    """q/k/v projections have a bias (always in Qwen2; ``attention_bias`` in Llama)."""
    o_bias: bool
    """The output projection has a bias (``attention_bias`` in Llama)."""
    mlp_bias: bool
    """gate/up/down projections have biases (``mlp_bias`` in Llama)."""

    @classmethod
    def from_hf_config(cls, cfg: Any) -> ModelShape:
        """From an HF config object or its ``config.json`` mapping.

        Raises:
            LayoutError: the architecture is not a Llama/Qwen2-style decoder, or a size is missing.
        """
        get = cfg.get if isinstance(cfg, Mapping) else (lambda k, d=None: getattr(cfg, k, d))
        model_type = get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise LayoutError(
                f"model config: model_type {model_type!r} has no sharding spec; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        sizes = {}
        for key in ("num_attention_heads", "num_hidden_layers", "vocab_size", "hidden_size", "intermediate_size"):
            value = get(key)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"model config: {key} is {value!r}; expected a positive integer")
            sizes[key] = value
        heads = sizes["num_attention_heads"]
        attention_bias = bool(get("attention_bias") or False)
        return cls(
            model_type=model_type,
            num_heads=heads,
            num_kv_heads=int(get("num_key_value_heads") or heads),
            num_layers=sizes["num_hidden_layers"],
            vocab_size=sizes["vocab_size"],
            hidden_size=sizes["hidden_size"],
            intermediate_size=sizes["intermediate_size"],
            head_dim=int(get("head_dim") or sizes["hidden_size"] // heads),
            tie_word_embeddings=bool(get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(get("mlp_bias") or False),
        )

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ModelShape:
        """From ``<path>/config.json`` of a local HF model directory.

        Raises:
            FileNotFoundError: no ``config.json`` in ``path``.
            LayoutError: see ``from_hf_config``.
        """
        file = Path(path) / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"model.path {path}: no config.json; expected a local HF model directory")
        return cls.from_hf_config(json.loads(file.read_text()))


class TrainCoords(NamedTuple):
    tp_rank: int
    dp_rank: int
    pp_rank: int


class InferCoords(NamedTuple):
    tp_rank: int
    dp_rank: int


def round_up(n: int, multiple: int) -> int:
    """Smallest multiple of ``multiple`` that is >= ``n``."""
    return -(-n // multiple) * multiple


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """Layout of the actor's devices: training (Megatron TP/PP/DP) and rollout (vLLM TP') on the same ones.

    The config's ``parallel`` section. Rules checked at construction, each a ``LayoutError``
    naming its ``parallel.*`` field: every size a positive integer; ``infer_pp == 1``;
    ``infer_tp <= tp × dp`` and dividing it; ``bucket_mb >= 1``; ``device`` a known kind.
    ``check_model`` adds the model's: ``tp`` and ``infer_tp`` divide the heads, the KV heads and
    the MLP width; ``pp <= layers``.
    """

    tp: int = 1
    """Training tensor-parallel size; must divide the model's heads, KV heads and MLP width."""
    pp: int = 1
    """Training pipeline-parallel size; at most the model's layer count."""
    dp: int = 1
    """Training data-parallel size."""
    infer_tp: int = 1
    """Rollout tensor-parallel size TP'; at most tp × dp and dividing it."""
    infer_pp: int = 1
    """Rollout pipeline-parallel size; only 1 is supported."""
    device: Literal["auto", "cpu", "cuda", "npu"] = "auto"
    """Device kind of every process that computes (one device each: ``cuda:i``/``npu:i`` from its
    local rank); collectives use gloo, nccl or hccl. ``auto``: the accelerator present, else the
    CPU, resolved by ``dockrl.config.resolve_auto`` as the run sets up, not at load (the run's
    ``config.yaml`` shows the choice; stage processes resolve it again where they run). ``cuda``/``npu`` where none is visible fail when
    the engines are placed, naming this field."""
    bucket_mb: int = 256
    """Bound of one gathered bucket of the weight sync, in MiB."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "infer_tp", "infer_pp", "bucket_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise LayoutError(f"parallel.{name}: got {value!r}; expected a positive integer")
        if self.device != "auto" and self.device not in DEVICE_KINDS:
            raise LayoutError(f"parallel.device: got {self.device!r}; expected one of 'auto', {', '.join(map(repr, DEVICE_KINDS))}")
        tp, dp, infer_tp = self.tp, self.dp, self.infer_tp
        if self.infer_pp != 1:
            raise LayoutError(f"parallel.infer_pp: got {self.infer_pp}; the rollout engine runs without pipeline parallelism: expected 1")
        if infer_tp > tp * dp:
            raise LayoutError(
                f"parallel.infer_tp: got {infer_tp}; must not exceed parallel.tp × parallel.dp = {tp} × {dp} = {tp * dp} "
                "(an inference TP' group lies within the ranks of one pipeline stage)"
            )
        if (tp * dp) % infer_tp:
            raise LayoutError(
                f"parallel.infer_tp: got {infer_tp}; must divide parallel.tp × parallel.dp = {tp * dp} "
                "(inference TP' groups tile the ranks of each pipeline stage)"
            )

    @property
    def world_size(self) -> int:
        """Processes (devices) of the actor: tp × pp × dp."""
        return self.tp * self.pp * self.dp

    @property
    def infer_dp(self) -> int:
        """Inference data-parallel size DP' = world_size / TP'."""
        return self.world_size // self.infer_tp

    def check_model(self, model: ModelShape) -> None:
        """The rules that depend on the model's sizes.

        Raises:
            LayoutError: the first broken rule, naming the ``parallel.*`` field and the model size.
        """
        for name, value in (("tp", self.tp), ("infer_tp", self.infer_tp)):
            for what, size in (
                ("num_attention_heads", model.num_heads),
                ("num_key_value_heads", model.num_kv_heads),
                ("intermediate_size", model.intermediate_size),
            ):
                if size % value:
                    raise LayoutError(
                        f"parallel.{name}: got {value}; must divide the model's {what}={size} "
                        "(tensor parallelism splits them evenly over the ranks)"
                    )
        if self.pp > model.num_layers:
            raise LayoutError(
                f"parallel.pp: got {self.pp}; must not exceed the model's num_hidden_layers={model.num_layers} "
                "(every pipeline stage holds at least one layer)"
            )

    def train_vocab_size(self, model: ModelShape) -> int:
        """Padded training vocabulary: a multiple of ``tp`` (the megatron engine's padding)."""
        return round_up(model.vocab_size, self.tp)

    def infer_vocab_size(self, model: ModelShape) -> int:
        """Padded inference vocabulary: a multiple of ``infer_tp``."""
        return round_up(model.vocab_size, self.infer_tp)

    def check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank: got {rank}; expected 0 <= rank < world_size={self.world_size}")

    def train_coords(self, rank: int) -> TrainCoords:
        """(tp_rank, dp_rank, pp_rank) of a global rank in Megatron's ``tp-dp-pp`` order."""
        self.check_rank(rank)
        return TrainCoords(rank % self.tp, (rank // self.tp) % self.dp, rank // (self.tp * self.dp))

    def train_rank(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        """Global rank of training coordinates (inverse of ``train_coords``)."""
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def infer_coords(self, rank: int) -> InferCoords:
        """(tp_rank, dp_rank) of a global rank in the inference layout."""
        self.check_rank(rank)
        return InferCoords(rank % self.infer_tp, rank // self.infer_tp)

    def tp_groups(self) -> list[list[int]]:
        """Training TP groups: ranks with the same (dp_rank, pp_rank), in a fixed order."""
        return [[self.train_rank(t, d, p) for t in range(self.tp)] for p in range(self.pp) for d in range(self.dp)]

    def pp_groups(self) -> list[list[int]]:
        """Training PP groups: ranks with the same (tp_rank, dp_rank), stage order, in a fixed order."""
        return [[self.train_rank(t, d, p) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)]

    def dp_groups(self) -> list[list[int]]:
        """Training DP groups: ranks with the same (tp_rank, pp_rank), in a fixed order."""
        return [[self.train_rank(t, d, p) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)]

    def stage_layers(self, model: ModelShape, pp_rank: int) -> range:
        """Decoder layers of ``model`` held by pipeline stage ``pp_rank`` (contiguous; earlier stages take the remainder)."""
        if not 0 <= pp_rank < self.pp:
            raise ValueError(f"pp_rank: got {pp_rank}; expected 0 <= pp_rank < pp={self.pp}")
        base, extra = divmod(model.num_layers, self.pp)
        start = pp_rank * base + min(pp_rank, extra)
        return range(start, start + base + (1 if pp_rank < extra else 0))

    def stage_of_layer(self, model: ModelShape, layer: int) -> int:
        """The pipeline stage that holds decoder layer ``layer`` of ``model``."""
        for p in range(self.pp):
            if layer in self.stage_layers(model, p):
                return p
        raise ValueError(f"layer: got {layer}; the model has {model.num_layers} layers")
