"""``dockrl rollouts distill``: a teacher's per-token reverse KL to the policy over a run's kept rollouts.

    dockrl rollouts distill runs/demo --teacher models/teacher [--iteration 3] [--out kl.parquet]

Each kept response is scored by the teacher (an HF causal LM with the run's tokenizer: refused otherwise,
``dockrl.run.setup.check_same_tokenizer``) at the run's ``rollout.temperature``, as the teacher stage scores a
live run's (``dockrl/stages/teacher.py``); beside the policy's own log-probs the run kept (``rollout_log_prob``),
each row's reverse KL ``KL(policy ‖ teacher) ≈ mean_t (log p_policy(y_t) - log p_teacher(y_t))`` (nats per token;
``dockrl.algorithms.distillation``) says how far the trained policy is from the teacher, iteration by iteration,
after the fact: a teacher chosen after the run, with no new rollouts.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from dockrl.algorithms import response_mask, right_pad
from dockrl.algorithms.distillation import reverse_kl_advantages
from dockrl.config import ConfigError
from dockrl.engines.hf.load import load_tokenizer
from dockrl.engines.hf.train import HFTrainEngine
from dockrl.rollouts.keep import KeptRollouts, load_rollouts_tokenizer, read_kept
from dockrl.run.setup import check_model_dir, check_same_tokenizer


def teacher_kl(kept: KeptRollouts, teacher: str | Path, *, iteration: int | None = None, batch_size: int = 32) -> pa.Table:
    """The reverse KL of each kept row's response to ``teacher``.

    Returns:
        The table ``iteration``, ``row``, ``tokens`` (the response's tokens the policy sampled: a multi-turn row's
        ``loss_mask``), ``reverse_kl`` (nats per token, their mean of ``log p_policy - log p_teacher``), in the
        dataset's order.

    Raises:
        ConfigError: ``teacher`` is no HF model folder, or its tokenizer is not the run's (both named).
        ValueError: ``iteration`` has no kept rows (``read_kept``), or the rows lack ``rollout_log_prob``.
    """
    path = Path(teacher)
    if not (path / "config.json").is_file():
        raise ConfigError(f"--teacher: got {str(teacher)!r}; expected a local HF folder with config.json of a causal LM")
    check_model_dir(path, field="--teacher")
    check_same_tokenizer(load_rollouts_tokenizer(kept), load_tokenizer(path), kept.tokenizer_dir(), path, field="--teacher")
    table = read_kept(kept, iteration, ["iteration", "row", "prompt_ids", "response_ids", "rollout_log_prob", "loss_mask"])
    engine = HFTrainEngine(path, trainable=False)
    cfg = kept.config
    kls: list[float] = []
    tokens: list[int] = []
    for batch in table.to_batches(max_chunksize=batch_size):
        responses = batch.column("response_ids").to_pylist()
        student = batch.column("rollout_log_prob").to_pylist()
        if any(s is None for s in student):
            raise ValueError("the kept rows lack rollout_log_prob, the policy's log-probs the reverse KL compares with")
        lps = engine.log_probs(batch.column("prompt_ids").to_pylist(), responses, temperature=cfg.rollout.temperature,
                               micro_batch=cfg.trainer.micro_batch, micro_batch_tokens=cfg.trainer.micro_batch_tokens)
        lengths = [len(r) for r in responses]
        T = max(max(lengths, default=1), 1)
        loss_mask = batch.column("loss_mask").to_pylist()
        mask = response_mask(lengths, T, loss_mask if any(m is not None for m in loss_mask) else None)
        per_token = -reverse_kl_advantages(right_pad(lps, T), right_pad(student, T), mask)  # log p_policy - log p_teacher
        n = mask.sum(dim=1)
        kls += (per_token.sum(dim=1) / n.clamp(min=1)).tolist()
        tokens += n.to(torch.int64).tolist()
    return pa.table({"iteration": table.column("iteration"), "row": table.column("row"),
                     "tokens": pa.array(tokens, pa.int64()), "reverse_kl": pa.array(kls, pa.float64())})


def teacher_kl_text(table: pa.Table) -> str:
    """What ``dockrl rollouts distill`` prints: each iteration's reverse KL, over its tokens, and its rows."""
    lines = [f"{'iteration':>9} {'rows':>6} {'tokens':>8} {'reverse_kl':>11}"]
    for it in sorted(set(table.column("iteration").to_pylist())):
        part = table.filter(pc.equal(table.column("iteration"), it)).to_pydict()
        n = sum(part["tokens"])
        kl = sum(k * t for k, t in zip(part["reverse_kl"], part["tokens"])) / max(n, 1)
        lines.append(f"{it:>9} {len(part['row']):>6} {n:>8} {kl:>11.4f}")
    return "\n".join(lines)


def teacher_kl_command(kept: KeptRollouts, teacher: str, iteration: int | None, out: str | None) -> str:
    """``dockrl rollouts distill``: the text to print (``teacher_kl_text``); with ``out`` the table written there too."""
    table = teacher_kl(kept, teacher, iteration=iteration)
    if out:
        pq.write_table(table, out)
    return teacher_kl_text(table)
