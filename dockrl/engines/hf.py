"""Reference engines on torch + transformers: rollout with ``generate``, log-probs, training.

``HFRolloutEngine`` samples responses and their log-probs; ``HFTrainEngine`` computes
per-token log-probs of given responses and runs GRPO updates on them. Both accept any local
HF causal-LM directory (Llama, Qwen2, ...).

Both live on one device (``device``: the process's device from the layout,
``dockrl.parallel.device.process_device``): the model is moved there once, each call packs
its rows into padded host tensors and moves them there in one copy per tensor, and the
results come back in one copy per call (never a transfer per row).
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel

from dockrl.algorithms import entropy_from_logits
from dockrl.engines.train_engine import LossFn

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


SAMPLING_PROCESSORS: dict[str, Any] = {
    "repetition_penalty": 1.0, "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
    "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None, "sequence_bias": None, "suppress_tokens": None,
    "begin_suppress_tokens": None, "forced_bos_token_id": None, "forced_eos_token_id": None, "min_length": 0,
    "min_new_tokens": 0, "exponential_decay_length_penalty": None, "top_k": 0, "min_p": 0.0, "typical_p": 1.0,
    "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "top_h": None, "guidance_scale": 1.0, "renormalize_logits": False,
    "watermarking_config": None,
}
"""Generation-config fields that change the sampling distribution besides ``rollout.temperature``
and ``rollout.top_p`` (what ``transformers`` turns into logits processors), with their neutral value."""


def foreign_sampling_settings(generation_config: Any) -> dict[str, Any]:
    """The fields of a model's generation config (``generation_config.json``) that would change the
    sampling distribution beyond temperature and nucleus: ``{field: value}`` for every
    ``SAMPLING_PROCESSORS`` field set to something else than its neutral value (or empty)."""
    found = {}
    for name, neutral in SAMPLING_PROCESSORS.items():
        value = getattr(generation_config, name, None)
        if value is None or value == neutral or (isinstance(value, (list, tuple, dict)) and not value):
            continue
        found[name] = value
    return found


def warn_foreign_sampling(model_path: str | Path, generation_config: Any, engine: str) -> dict[str, Any]:
    """One warning naming every ``foreign_sampling_settings`` field: the rollout samples without them.

    Rollout log-probs, the actor's ratio and the KL all assume the plain tempered policy
    ``softmax(z / τ)`` (with ``top_p``); a processor the checkpoint adds (a repetition penalty,
    ``min_p``, suppressed tokens, …) would make every update silently off-policy, and the two
    rollout engines sample differently. Returns the fields found.
    """
    found = foreign_sampling_settings(generation_config)
    if found:
        fields = ", ".join(f"{k}={v!r}" for k, v in found.items())
        logger.warning(
            "model.path %s: its generation config sets %s; the %s rollout ignores them and samples with exactly "
            "rollout.temperature and rollout.top_p, the policy the loss assumes (remove them from generation_config.json "
            "to silence this warning)", model_path, fields, engine,
        )
    return found


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    """Tokenizer of a model directory; PAD falls back to EOS (the pad == eos case)."""
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tok.eos_token_id is None:
        raise ValueError(f"model {path}: tokenizer has no EOS token")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(
    path: str | Path, dtype: str, trust_remote_code: bool = False, device: torch.device | str = "cpu",
) -> PreTrainedModel:
    """A causal LM from a local HF directory, in ``dtype`` (``float32`` / ``bfloat16``), on ``device``."""
    if not (Path(path) / "config.json").is_file():
        raise FileNotFoundError(f"model.path {path}: no config.json; expected a local HF model directory")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype], trust_remote_code=trust_remote_code)
    return model.to(device)  # type: ignore[arg-type]  # transformers types .to() for its own wrapper


def autocast(device: torch.device, enabled: bool):
    """bf16 autocast on ``device``'s kind (weights stay as they are), or nothing."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if enabled else contextlib.nullcontext()


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of a model's parameters (an engine keeps all of them on one)."""
    return next(model.parameters()).device


def pack_sequences(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int):
    """Right-padded ``prompt + response`` batches for a teacher-forced forward pass.

    Returns:
        ``input_ids (B, L)``, ``attention_mask (B, L)``, ``positions (B, T)`` — the index in
        the sequence of the logit that predicts response token ``t`` (``P_i + t - 1``) — and
        the response ``mask (B, T)`` (1 on real response tokens, EOS included).
    """
    B = len(prompts)
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    L, T = max(lengths), max(max(len(r) for r in responses), 1)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.long)
    positions = torch.zeros((B, T), dtype=torch.long)
    mask = torch.zeros((B, T), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        input_ids[i, : lengths[i]] = torch.tensor(list(p) + list(r), dtype=torch.long)
        attention_mask[i, : lengths[i]] = 1
        positions[i, : len(r)] = torch.arange(len(p) - 1, len(p) - 1 + len(r))
        mask[i, : len(r)] = 1.0
    return input_ids, attention_mask, positions, mask


def pack_rows(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int):
    """``prompt + response`` sequences packed into as few rows as possible, none longer than the
    longest sequence: first-fit decreasing (Johnson, 1973) of whole sequences into rows, each
    sequence's position ids starting at 0. Transformers reads a row whose position ids restart as
    several sequences that do not attend to each other (``masking_utils.find_packed_sequence_indices``,
    used when no attention mask is given), so the forward pass computes the same log-probs as on
    right-padded rows, on fewer tokens; attention per row costs no more than on a padded row.

    Returns:
        ``input_ids (R, L)``, ``position_ids (R, L)`` (the tail of a row is padding with its own
        positions 0, 1, …: a segment of its own), ``index (B, T)`` — the flat index in
        ``(R·L)`` of the logit that predicts response token ``t`` of sequence ``i`` — and the
        response ``mask (B, T)``, as ``pack_sequences``. ``R ≤ B``.
    """
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    L, T = max(lengths), max(max(len(r) for r in responses), 1)
    free: list[int] = []  # room left in each row
    place: dict[int, tuple[int, int]] = {}  # sequence -> (row, offset)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((k for k, room in enumerate(free) if room >= lengths[i]), len(free))
        if row == len(free):
            free.append(L)
        place[i] = (row, L - free[row])
        free[row] -= lengths[i]
    R = len(free)
    input_ids = torch.full((R, L), pad_id, dtype=torch.long)
    position_ids = torch.zeros((R, L), dtype=torch.long)
    index = torch.zeros((len(lengths), T), dtype=torch.long)
    mask = torch.zeros((len(lengths), T), dtype=torch.float32)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        row, at = place[i]
        input_ids[row, at : at + lengths[i]] = torch.tensor(list(p) + list(r), dtype=torch.long)
        position_ids[row, at : at + lengths[i]] = torch.arange(lengths[i])
        index[i, : len(r)] = row * L + at + torch.arange(len(p) - 1, len(p) - 1 + len(r))
        mask[i, : len(r)] = 1.0
    for row, room in enumerate(free):
        position_ids[row, L - room :] = torch.arange(room)
    return input_ids, position_ids, index, mask


def _plain_lm_head(model: PreTrainedModel) -> bool:
    """True when logits are exactly ``lm_head(final hidden state)`` (Llama, Qwen2, Mistral, ...)."""
    cfg = model.config
    return (
        getattr(cfg, "final_logit_softcapping", None) is None
        and getattr(cfg, "logit_scale", None) is None
        and hasattr(model, "get_decoder")
        and model.get_output_embeddings() is not None
    )


ENTROPY_CHUNK_TOKENS = 1024
"""Response tokens whose entropy is computed at once (bounds the fp32 ``(tokens, V)`` temporaries)."""


@torch.no_grad()
def chunked_entropy(logits: torch.Tensor, lse: torch.Tensor, chunk_tokens: int = ENTROPY_CHUNK_TOKENS) -> torch.Tensor:
    """The entropy of ``softmax(z)`` for ``(..., V)`` logits ``z`` (as ``entropy_from_logits``),
    ``H = lse - Σ_v exp(z_v - lse)·z_v`` with ``lse (...)`` the ``logsumexp(z)`` already computed
    for the log-probs (one pass over the vocabulary less), over at most ``chunk_tokens`` tokens at
    a time (no grad): its temporaries stay ``chunk_tokens × V``. Returns ``(...)`` nats."""
    flat, flat_lse = logits.reshape(-1, logits.shape[-1]), lse.reshape(-1, 1)
    parts = []
    for s in range(0, flat.shape[0], chunk_tokens):
        z, m = flat[s : s + chunk_tokens], flat_lse[s : s + chunk_tokens]
        parts.append(m.squeeze(1) - ((z - m).exp_() * z).sum(dim=-1))
    out = torch.cat(parts) if parts else flat.new_zeros(0)
    return out.view(logits.shape[:-1])


def model_inputs(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int, pack: bool, device: torch.device,
) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward pass's keyword inputs for ``prompts`` + ``responses`` on ``device``: packed into
    as few rows as the longest allows (``pack_rows``) when ``pack`` and that saves rows, else
    right-padded (``pack_sequences``) with an all-ones attention mask: under the causal mask a real
    token never attends to the padding after it, and with no padding to mask transformers calls
    its causal attention kernel without a mask tensor (``is_causal``).
    Returns ``(inputs, index, mask, real, at)``: ``index (B, T)`` the position in the flattened
    ``(rows·L)`` output that predicts each response token, ``mask (B, T)`` 1 on response tokens;
    ``real (N,)`` the response tokens' slots in the flattened ``(B·T)`` and ``at (N,)`` their
    ``index`` (computed on the host: no data-dependent shape on the device)."""
    packed = pack_rows(prompts, responses, pad_id) if pack else None
    if packed is not None and packed[0].shape[0] < len(prompts):
        input_ids, position_ids, index, mask = packed
        inputs = dict(input_ids=input_ids, position_ids=position_ids)  # no attention mask: the restarting positions separate them
    else:
        input_ids, _, positions, mask = pack_sequences(prompts, responses, pad_id)
        index = positions + torch.arange(input_ids.shape[0]).unsqueeze(1) * input_ids.shape[1]
        inputs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids))
    real = mask.view(-1).nonzero().squeeze(1)
    at = index.view(-1)[real]
    on_device = [t.to(device) for t in (*inputs.values(), index, mask, real, at)]
    return {"attention_mask": None} | dict(zip(inputs, on_device)), *on_device[len(inputs):]


def response_log_probs(
    model: PreTrainedModel,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    *,
    pad_id: int,
    temperature: float,
    autocast_bf16: bool,
    with_entropy: bool = False,
    entropy_grad: bool = False,
    pack: bool = True,
):
    """Per-token log-probs of ``responses`` given ``prompts`` in one forward pass.

    ``log π(o_t | q, o_<t) = log_softmax(z_t / τ)[o_t]`` with the sampling temperature ``τ``.
    The sequences are packed into as few rows as the longest one allows (``pack_rows``) when that
    saves rows and ``pack`` allows it (``packing_works``), else right-padded (``pack_sequences``);
    the output head runs on the response tokens only (not on prompt or padding positions), the
    log-softmax never materializes (``log_softmax(z)[y] = z_y - logsumexp(z)``: one full-vocabulary
    fp32 tensor less in memory and in the backward pass) and the entropy is computed in chunks
    (``chunked_entropy``) from the same ``logsumexp``.

    Returns:
        ``log_prob (B, T)`` fp32 (differentiable if grad is enabled), ``mask (B, T)``, and
        ``entropy (B, T)`` when ``with_entropy`` (differentiable with ``entropy_grad``, for an
        entropy bonus in the loss; else no grad), else None; all on the model's device
        (the packed batch is moved there in one copy per tensor).
    """
    device = model_device(model)
    inputs, index, mask, real, at = model_inputs(prompts, responses, pad_id, pack, device)
    B, T = index.shape  # real (N,): the response tokens among the B·T slots; at (N,): their logits' positions
    with autocast(device, autocast_bf16):
        if _plain_lm_head(model):
            # the output head only on response tokens: prompt and padding logits are never needed
            hidden = model.get_decoder()(**inputs, use_cache=False).last_hidden_state
            logits = model.get_output_embeddings()(hidden.reshape(-1, hidden.shape[-1])[at])
        else:
            logits = model(**inputs, use_cache=False).logits
            logits = logits.reshape(-1, logits.shape[-1])[at]
    logits = logits.float()  # (N, V)
    if temperature != 1.0:  # a (N, V) copy, and its backward, only when it changes something
        logits = logits / temperature
    targets = inputs["input_ids"].reshape(-1)[at + 1]  # the token each logit predicts: the next position, same row

    def spread(x: torch.Tensor) -> torch.Tensor:  # (N,) -> (B, T), 0 off the response tokens
        return x.new_zeros(B * T).index_put((real,), x).view(B, T)

    lse = torch.logsumexp(logits, dim=-1)
    log_prob = spread(logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse)  # z_y - logsumexp(z)
    entropy = None
    if with_entropy:  # differentiable for an entropy bonus: then the softmax of every token is kept for backward
        entropy = spread(entropy_from_logits(logits) if entropy_grad else chunked_entropy(logits.detach(), lse.detach()))
    return log_prob, mask, entropy


PackedForward = Callable[[list[list[int]], list[list[int]], bool], torch.Tensor]
"""``(prompts, responses, pack) -> (B, T)`` per-response-token outputs of a model (log-probs, values)."""


@torch.no_grad()
def packing_works(model: torch.nn.Module, forward: PackedForward, what: str) -> bool:
    """Whether ``model`` keeps packed sequences apart (``pack_rows``): ``forward``'s outputs for two
    short sequences packed into one row (beside a longer one in a row of its own) equal those of
    each alone (1e-4), token ids 1-12. Architectures whose attention does not build its mask with
    transformers' ``masking_utils`` (some remote code) read a packed row as one sequence; their
    engine right-pads instead (a warning names ``what``), as on a device that computes no values
    (``meta``)."""
    if model_device(model).type == "meta":
        return False
    prompts, responses = [[1, 2], [3], [4]], [[5, 6, 7, 8], [9, 10], [11, 12]]
    packed = forward(prompts, responses, True)
    alone = [forward([p], [r], False)[0, : len(r)] for p, r in zip(prompts, responses)]
    works = all(torch.allclose(packed[i, : len(r)], a, atol=1e-4) for i, (r, a) in enumerate(zip(responses, alone)))
    if not works:
        logger.warning("%s does not keep packed sequences apart: %s are right-padded", type(model).__name__, what)
    return works


def to_host_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Micro-batch results ``(b_k, T_k)`` as one ``(Σ b_k, max T_k)`` host tensor (right-padded
    with 0), moved from the device in a single copy."""
    if not parts:
        return torch.zeros((0, 0))
    T = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, T - p.shape[1])) for p in parts]).cpu()


def micro_batches(lengths: Sequence[int], micro_batch: int, max_tokens: int = 0) -> list[list[int]]:
    """The rows of each micro-batch of a call.

    With ``max_tokens`` 0 (``trainer.micro_batch_tokens``' default): the caller's consecutive rows,
    ``micro_batch`` at a time, so a micro-batch mixes long and short sequences that ``pack_rows``
    packs into a few rows; its peak memory is what ``micro_batch`` consecutive rows take.
    With ``max_tokens`` > 0: the rows sorted by ``lengths`` (prompt + response tokens), longest
    first (ties in the caller's order), cut in runs of as many rows as keep
    ``rows × longest ≤ max_tokens`` (the tokens the micro-batch computes right-padded: a bound on
    its activations and on its peak memory; a row longer than ``max_tokens`` goes alone), so short
    sequences go in bigger micro-batches with little padding; ``micro_batch`` does not cap them.
    verl's ``use_dynamic_bsz`` / ``ppo_max_token_len_per_gpu`` does the same.

    Returns:
        The micro-batches' row indices into ``lengths``; every row in exactly one.

    Raises:
        ValueError: ``micro_batch < 1`` or ``max_tokens < 0``.
    """
    if micro_batch < 1:
        raise ValueError(f"micro_batch: got {micro_batch}; expected >= 1")
    if max_tokens < 0:
        raise ValueError(f"micro_batch_tokens: got {max_tokens}; expected >= 0 (0: micro_batch rows per micro-batch)")
    if max_tokens == 0:
        return [list(range(s, min(s + micro_batch, len(lengths)))) for s in range(0, len(lengths), micro_batch)]
    out: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if out and (len(out[-1]) + 1) * lengths[out[-1][0]] <= max_tokens:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def sequence_lengths(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> list[int]:
    """``len(prompt) + len(response)`` of each row.

    Raises:
        ValueError: different numbers of prompts and responses.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"prompts/responses: got {len(prompts)} prompts and {len(responses)} responses")
    return [len(p) + len(r) for p, r in zip(prompts, responses)]


def forward_per_micro_batch(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], micro_batch: int, max_tokens: int,
    forward: Callable[[list[Sequence[int]], list[Sequence[int]]], torch.Tensor],
) -> list[list[float]]:
    """A no-grad per-token output (log-probs, values) of every response: ``forward`` on each of
    ``micro_batches(...)``, back to host memory in one copy, returned in the caller's row order
    (row ``i`` has ``len(responses[i])`` floats)."""
    groups = micro_batches(sequence_lengths(prompts, responses), micro_batch, max_tokens)
    host = to_host_rows([forward([prompts[i] for i in g], [responses[i] for i in g]) for g in groups])
    at = {i: k for k, i in enumerate(i for g in groups for i in g)}  # row -> its row in host
    return [host[at[i], : len(r)].tolist() for i, r in enumerate(responses)]


def backward_per_micro_batch(
    prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], micro_batch: int,
    forward: Callable[[list[Sequence[int]], list[Sequence[int]]], tuple[torch.Tensor, ...]],
    loss_fn: Callable[..., tuple[torch.Tensor, Any]], max_tokens: int = 0,
) -> list[Any]:
    """The ``forward_backward`` of an engine on one device: for the rows of each micro-batch
    (``micro_batches``: ``micro_batch`` consecutive rows, or by length ``max_tokens`` tokens at most),
    ``loss, aux = loss_fn(rows, *forward(their prompts, their responses))``, then ``loss.backward()``.

    The gradients accumulate, so they are those of the sum of the micro-batches' losses whichever
    rows go together, as long as ``loss_fn`` normalizes by mini-batch totals (up to float rounding).
    Returns each micro-batch's ``aux``, in micro-batch order (``loss_fn`` knows its ``rows``)."""
    out = []
    for rows in micro_batches(sequence_lengths(prompts, responses), micro_batch, max_tokens):
        loss, aux = loss_fn(rows, *forward([prompts[i] for i in rows], [responses[i] for i in rows]))
        loss.backward()
        out.append(aux)
    return out


def adamw(model: torch.nn.Module, *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over ``model``'s parameters, with torch's fused kernel where its device has one (CPU,
    CUDA): one pass over each parameter and its two moments instead of a dozen elementwise ops
    (the same update up to float rounding; the for-loop default elsewhere)."""
    fused = model_device(model).type in ("cpu", "cuda")
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, fused=fused or None)


def clipped_step(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float, accumulate: Callable[[], dict[str, float]],
) -> tuple[dict[str, float], float]:
    """One optimizer step of an engine on one device: zero the gradients, ``accumulate`` them
    (forward/backward over micro-batches), clip their global norm to ``grad_clip`` (0: no clip),
    step — skipped, with a warning, when the norm is not finite. Returns ``accumulate``'s metrics
    and the gradient norm before clipping."""
    optimizer.zero_grad(set_to_none=True)
    metrics = accumulate()
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if not torch.isfinite(grad_norm):
        logger.warning("non-finite gradient norm %s: optimizer step skipped", grad_norm.item())
    else:
        optimizer.step()
    return metrics, float(grad_norm)


@dataclass(frozen=True)
class Sample:
    """One generated response: token ids (EOS included if emitted), per-token log-probs (nats)."""

    response_ids: list[int]
    log_probs: list[float]
    truncated: bool


class HFRolloutEngine:
    """Samples responses with ``transformers`` ``generate``: from a copy of the actor's weights, or
    from the actor's own module (``HFRolloutEngine.sharing``).

    Args:
        model_path: local HF model directory.
        dtype: weights of this copy (``bfloat16`` is ~3× faster on CPUs with bf16 units).
        device: where the model generates (the process's device).
    """

    def __init__(
        self, model_path: str | Path, *, dtype: str = "bfloat16", trust_remote_code: bool = False,
        device: torch.device | str = "cpu",
    ) -> None:
        model = load_model(model_path, dtype, trust_remote_code, torch.device(device)).eval()
        model.requires_grad_(False)
        self._setup(model, load_tokenizer(model_path, trust_remote_code), model_path, shared=False)

    @classmethod
    def sharing(cls, model: PreTrainedModel, tokenizer: Any, model_path: str | Path) -> HFRolloutEngine:
        """An engine that generates with ``model`` itself — the actor's module, trained in the same
        process — instead of a copy: no second set of weights in memory and nothing to copy after
        an update (``load_weights`` then copies nothing), as TRL's GRPOTrainer and verl's
        colocated hybrid engine do. ``generate`` runs under ``torch.no_grad`` with the model in
        eval mode and its own generation config swapped in for the call only; it leaves the
        module's mode, generation config, ``requires_grad`` and ``.grad`` as they were.

        Args:
            model: the module to generate with (its device and dtype are the engine's).
            tokenizer: ``model``'s tokenizer (``load_tokenizer``: a PAD token set).
            model_path: the directory ``model`` was loaded from (named in warnings).
        """
        engine = cls.__new__(cls)
        engine._setup(model, tokenizer, model_path, shared=True)
        return engine

    def _setup(self, model: PreTrainedModel, tokenizer: Any, model_path: str | Path, *, shared: bool) -> None:
        self.model, self.tokenizer, self.shared = model, tokenizer, shared
        self.device = model_device(model)
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id
        # generate() fills every field left unset from the model's generation config: generate with
        # one without processors, so that only what generate() passes applies (warn_foreign_sampling)
        self.ignored_sampling = warn_foreign_sampling(model_path, model.generation_config, "hf")
        self.generation_config = GenerationConfig(
            bos_token_id=model.generation_config.bos_token_id, eos_token_id=self.eos_id, pad_token_id=self.pad_id,
        )
        if not shared:  # its own copy: set once
            model.generation_config = self.generation_config

    @contextlib.contextmanager
    def _generating(self):
        """The model in eval mode with this engine's generation config, restored afterwards (a
        shared module goes back to the actor as it was: ``save_pretrained`` writes its own config)."""
        model = self.model
        modes, config = [(m, m.training) for m in model.modules()], model.generation_config  # each module's own
        model.eval()
        model.generation_config = self.generation_config
        try:
            yield model
        finally:
            model.generation_config = config
            for module, training in modes:  # not model.train(flag): that would give every submodule the root's mode
                module.training = training

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        greedy: bool = False,
        batch_size: int = 64,
    ) -> list[Sample]:
        """One response per prompt (repeat a prompt n times for a group).

        Samples from ``softmax(z / τ)`` restricted to the ``top_p`` nucleus and nothing else: the
        processors of the model's own generation config are not applied (``warn_foreign_sampling``).
        Log-probs are ``log_softmax(logits / τ)`` of the raw logits (``output_logits``, not
        the processed ``scores``) at the sampled token; prompts are left-padded and position
        ids follow the attention mask (docs/design.md §7: both matter to match a teacher-forced pass).
        A response that reaches ``max_new_tokens`` without EOS is ``truncated`` and gets no
        EOS appended.
        """
        out: list[Sample] = []
        for start in range(0, len(prompts), batch_size):
            out.extend(self._generate_batch(prompts[start : start + batch_size], max_new_tokens, temperature, top_p, greedy))
        return out

    def _generate_batch(self, prompts, max_new_tokens, temperature, top_p, greedy) -> list[Sample]:
        P = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), P), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for i, p in enumerate(prompts):
            input_ids[i, P - len(p) :] = torch.tensor(list(p), dtype=torch.long)
            attention_mask[i, P - len(p) :] = 1
        sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
        config = GenerationConfig(  # exactly the configured processors: temperature and top_p (none when greedy)
            max_new_tokens=max_new_tokens, eos_token_id=self.eos_id, pad_token_id=self.pad_id, output_logits=True,
            return_dict_in_generate=True, **sampling,
        )
        with self._generating() as model:
            gen = model.generate(
                input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device), generation_config=config,
            )
        tokens = gen.sequences[:, P:]
        step_lp = []
        for t, logits in enumerate(gen.logits):  # (B, V) per step; one step at a time keeps memory small
            lp = torch.log_softmax(logits.float() / (1.0 if greedy else temperature), dim=-1)
            step_lp.append(lp.gather(1, tokens[:, t : t + 1]).squeeze(1))
        lps = (torch.stack(step_lp, dim=1) if step_lp else torch.zeros((len(prompts), 0))).cpu()  # one copy per batch
        tokens = tokens.cpu()
        samples = []
        for i in range(len(prompts)):
            row = tokens[i].tolist()
            if self.eos_id in row:
                end, truncated = row.index(self.eos_id) + 1, False
            else:
                end, truncated = len(row), True
            samples.append(Sample(row[:end], lps[i, :end].tolist(), truncated))
        return samples

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy updated weights in place (cast to this engine's dtype); returns bytes copied. A
        tensor that already is the parameter (``sharing``: the actor's own weights; same device,
        start, dtype, shape and strides) is not copied and not counted; any other view of the
        parameter's storage (a transpose, say) is copied through a clone.

        Raises:
            KeyError: a name this model does not have.
        """
        params = dict(self.model.named_parameters(remove_duplicate=False))  # a tied head by its own name too
        copied = 0
        for name, tensor in named_tensors:
            if name not in params:
                raise KeyError(f"rollout engine: no parameter named {name!r}")
            param = params[name]
            if tensor.device == param.device and tensor.untyped_storage().data_ptr() == param.untyped_storage().data_ptr():
                if (tensor.storage_offset() == param.storage_offset() and tensor.dtype == param.dtype
                        and tensor.shape == param.shape and tensor.stride() == param.stride()):
                    continue  # the very same weights
                tensor = tensor.clone()  # another view of the parameter's memory: copy_ refuses overlapping operands
            param.copy_(tensor)
            copied += param.numel() * param.element_size()
        return copied


class HFTrainEngine:
    """The actor (or frozen reference) on torch: fp32 weights, optional bf16 autocast, AdamW.

    Implements ``dockrl.engines.train_engine.TrainEngine``.

    Args:
        model_path: local HF model directory.
        trainable: build an optimizer and allow updates (False for the reference).
        device: where the model computes (the process's device); weights stay fp32 there
            (the master weights of the update), bf16 only inside autocast.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        trainable: bool,
        lr: float = 1e-6,
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        autocast_bf16: bool = False,
        trust_remote_code: bool = False,
        device: torch.device | str = "cpu",
    ) -> None:
        self.device = torch.device(device)
        self.tokenizer = load_tokenizer(model_path, trust_remote_code)
        self.pad_id = self.tokenizer.pad_token_id
        self.model = load_model(model_path, "float32", trust_remote_code, self.device)
        self.autocast_bf16 = autocast_bf16
        self.grad_clip = grad_clip
        self.optimizer = None
        # Eval mode in every forward, also the trained ones: dropout would make the log-probs of
        # one policy differ between passes (the on-policy ratio ≠ 1, old vs new log-probs noisy).
        # Zeroing nn.Dropout modules is not enough: attention implementations read
        # config.attention_dropout and apply it when the module is in train mode (as verl and TRL,
        # RL runs without any dropout). A causal LM has no other train-mode behaviour.
        self.model.eval()
        self.pack = packing_works(self.model, lambda ps, rs, pack: response_log_probs(
            self.model, ps, rs, pad_id=self.pad_id, temperature=1.0, autocast_bf16=False, pack=pack)[0], "the actor's micro-batches")
        if trainable:
            self.optimizer = adamw(self.model, lr=lr, weight_decay=weight_decay)
        else:
            self.model.requires_grad_(False)

    @torch.no_grad()
    def log_probs(
        self, prompts, responses, *, temperature: float, micro_batch: int, micro_batch_tokens: int = 0,
    ) -> list[list[float]]:
        """Per-token log-probs (nats) of each response, in the caller's row order, computed over
        micro-batches (``micro_batches``: ``micro_batch`` consecutive rows, or rows sorted by length,
        at most ``micro_batch_tokens`` tokens each, when > 0); they come back to host memory in one copy for the
        whole call."""
        def forward(p: list[Sequence[int]], r: list[Sequence[int]]) -> torch.Tensor:
            return response_log_probs(self.model, p, r, pad_id=self.pad_id, temperature=temperature,
                                      autocast_bf16=self.autocast_bf16, pack=self.pack)[0]

        return forward_per_micro_batch(prompts, responses, micro_batch, micro_batch_tokens, forward)

    def forward_backward(
        self, prompts, responses, *, temperature: float, micro_batch: int, loss_fn: LossFn, entropy_grad: bool = False,
        micro_batch_tokens: int = 0,
    ) -> list[Any]:
        """For each micro-batch (``micro_batches``: ``micro_batch`` consecutive rows, or rows sorted by
        length, at most ``micro_batch_tokens`` tokens each, when > 0): ``response_log_probs`` (with entropy,
        differentiable with ``entropy_grad``), ``loss_fn(rows, ...)``, backward.

        Returns:
            The ``aux`` of each micro-batch, in micro-batch order.
        """
        def forward(p: list[Sequence[int]], r: list[Sequence[int]]) -> tuple[torch.Tensor, ...]:
            return response_log_probs(self.model, p, r, pad_id=self.pad_id, temperature=temperature, autocast_bf16=self.autocast_bf16,
                                      with_entropy=True, entropy_grad=entropy_grad, pack=self.pack)

        return backward_per_micro_batch(prompts, responses, micro_batch, forward, loss_fn, micro_batch_tokens)

    def sum_over_replicas(self, values: Sequence[float]) -> list[float]:
        """One process, one replica: ``values`` unchanged."""
        return [float(v) for v in values]

    def optimizer_step(self, accumulate: Callable[[], dict[str, float]]) -> dict[str, float]:
        """Zero grads, run ``accumulate`` (forward/backward over micro-batches), clip, step.

        Returns:
            The metrics of ``accumulate`` plus ``actor/grad_norm`` (before clipping).
        """
        if self.optimizer is None:
            raise RuntimeError("optimizer_step on a frozen engine (trainable=False)")
        metrics, grad_norm = clipped_step(self.model, self.optimizer, self.grad_clip, accumulate)
        metrics["actor/grad_norm"] = grad_norm
        return metrics

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        return ((n, p.detach()) for n, p in self.model.named_parameters())

    def save(self, path: str | Path) -> Path:
        """Write an HF checkpoint (safetensors + tokenizer) loadable with ``from_pretrained``."""
        path = Path(path)
        self.model.save_pretrained(path)
        self.tokenizer.save_pretrained(path)
        return path
