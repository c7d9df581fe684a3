"""``dockrl rollouts rescore``: a new reward over a run's kept rollouts, beside the reward the run trained with.

    dockrl rollouts rescore runs/demo --scorer mypkg.rewards:StrictScorer [--iteration 3] [--out rescored.parquet]
    dockrl rollouts rescore runs/demo --judge reward_model.model.path=models/judge \
        --judge 'reward_model.generative.template=Is this right? {response} Answer yes or no.' \
        --judge reward_model.generative.parser=label --judge reward_model.generative.labels=yes=1,no=0

The kept rows are read with ``pyarrow.dataset`` (``dockrl.rollouts.keep.read_rollouts``); each response is decoded
with the run's tokenizer (as the reward stage decodes it: special tokens skipped) and scored by ``--scorer``
(``module:Class``, built and run as ``algorithm.scorer`` is: in a process of its own under the run's
``algorithm.reward_timeout_s``, its values checked; ``dockrl.rewards.guard``). ``old`` is the row's ``rm_score``
as trained (with a reward model's weight and DAPO's overlong penalty where the run had them), ``new`` the
scorer's reward alone. With ``--judge`` the new reward is a generative judge's instead (``reward_model.*`` settings of
a ``reward_model.kind=generative`` model, ``dockrl.engines.judge``), on this machine's CPU: each row's verdict parsed
(an unreadable one scores ``unparsed_score`` and is flagged bad, reason ``unparsed``). The pipeline
``dockrl.pipelines.rescore`` runs the same on a train task's ``rollouts`` Dataset (``rescore_artifact``).
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dockrl.config import Config, ConfigError, load_config
from dockrl.rewards.guard import build_scorer, check_rewards
from dockrl.rollouts.keep import KeptRollouts, kept_rollouts, load_rollouts_tokenizer, read_kept

RESCORED_FILE = "rescored.parquet"
"""The rescored table in a ``rescore_artifact`` folder."""


def judge_config(kept: KeptRollouts, judge: Sequence[str]) -> Config:
    """The kept run's config with the generative judge ``judge`` names (``reward_model.*`` override lines; ``enable`` and
    ``kind=generative`` are implied) as its reward model.

    Raises:
        ConfigError: a line that is no ``reward_model.*`` override, or settings the judge's rules refuse (named).
    """
    others = [line for line in judge if not line.strip().startswith("reward_model.")]
    if others:
        raise ConfigError(f"judge: got {others}; expected reward_model.* settings of the judge, e.g. reward_model.model.path=...")
    section = load_config(None, ["reward_model.enable=true", "reward_model.kind=generative", *judge]).reward_model
    return dataclasses.replace(kept.config, reward_model=section)


def rescore(kept: KeptRollouts, scorer: str = "", *, iteration: int | None = None, batch_size: int = 64,
            judge: Sequence[str] = ()) -> tuple[pa.Table, Counter]:
    """Score every kept row (of ``iteration``, or all) with ``scorer``, or with the generative judge ``judge`` names
    (``judge_config``; exactly one of the two).

    Returns:
        The table ``iteration``, ``row``, ``old`` (``rm_score``, null where the run scored none), ``new`` (the
        scorer's reward; 0.0 where its value was bad), ``new_bad`` (the value was not a finite number, or the
        batch timed out), in the dataset's order (iteration, row); and the bad values by reason
        (``check_rewards``).

    Raises:
        ConfigError: ``scorer`` does not import (``algorithm.scorer: ...``); the judge's settings or model do not fit.
        ValueError: ``iteration`` has no kept rows (``read_kept``); neither or both of ``scorer`` and ``judge``.
        ScorerError: the scorer raised or its process died.
        TimeoutError: the judge took longer than ``reward_model.generative.timeout_s`` over a batch.
    """
    if bool(scorer) == bool(judge):
        raise ValueError("rescore: give a scorer (module:Class) or a judge (reward_model.* settings), exactly one")
    table = read_kept(kept, iteration, ["iteration", "row", "prompt_ids", "response_ids", "ground_truth", "rm_score"])
    tokenizer = load_rollouts_tokenizer(kept)
    if judge:
        new, flags, bad = judge_rows(judge_config(kept, judge), table, tokenizer, batch_size)
    else:
        new, flags, bad = scorer_rows(kept.config, scorer, table, tokenizer, batch_size)
    return rescored_table(table, new, flags), bad


def scorer_rows(cfg: Config, scorer: str, table: pa.Table, tokenizer: Any, batch_size: int) -> tuple[list[float], list[bool], Counter]:
    """``scorer``'s rewards of ``table``'s rows (run as ``cfg``'s ``algorithm.scorer`` would be), whether each value
    was bad, and the bad values by reason (``check_rewards``)."""
    built = build_scorer(dataclasses.replace(cfg.algorithm, scorer=scorer))
    new: list[float] = []
    flags: list[bool] = []
    bad = Counter[str]()
    try:
        for batch in table.to_batches(max_chunksize=batch_size):
            texts = tokenizer.batch_decode(batch.column("response_ids").to_pylist(), skip_special_tokens=True)
            before = built.counters()["timeouts"]
            result = built.score(texts, batch.column("ground_truth").to_pylist())
            rewards, reasons = check_rewards(result, len(texts))
            timed_out = built.counters()["timeouts"] > before
            bad += reasons + (Counter({"timed out": len(texts)}) if timed_out else Counter())
            new += rewards
            if timed_out or sum(reasons.values()) == len(texts):
                flags += [True] * len(texts)
            else:  # which values were bad: each checked alone
                flags += [bool(check_rewards([v], 1)[1]) for v in result]
    finally:
        built.close()
    return new, flags, bad


def judge_rows(cfg: Config, table: pa.Table, tokenizer: Any, batch_size: int) -> tuple[list[float], list[bool], Counter]:
    """The judge's scores of ``table``'s rows on the CPU, whether each verdict was unparsed, and their count."""
    import torch

    from dockrl.engines.judge import build_judge  # lazy: transformers' models, only with a judge
    from dockrl.run.setup import resolve_reward_model

    judge = build_judge(cfg, resolve_reward_model(cfg), tokenizer, torch.device("cpu"))
    new: list[float] = []
    flags: list[bool] = []
    for batch in table.to_batches(max_chunksize=batch_size):
        verdicts = judge.verdicts(batch.column("prompt_ids").to_pylist(), batch.column("response_ids").to_pylist(),
                                  batch.column("ground_truth").to_pylist(), micro_batch=cfg.reward_model.micro_batch_size)
        new += [v.score for v in verdicts]
        flags += [not v.parsed for v in verdicts]
    return new, flags, Counter({"unparsed": sum(flags)} if any(flags) else {})


def rescored_table(table: pa.Table, new: list[float], flags: list[bool]) -> pa.Table:
    """``iteration``, ``row``, ``old`` (the kept ``rm_score``), ``new``, ``new_bad``."""
    return pa.table({"iteration": table.column("iteration"), "row": table.column("row"), "old": table.column("rm_score"),
                     "new": pa.array(new, pa.float64()), "new_bad": pa.array(flags, pa.bool_())})


def per_iteration(table: pa.Table) -> dict[str, float]:
    """``rescore/old_mean/iter_<NNNN>`` and ``rescore/new_mean/iter_<NNNN>`` of a ``rescore`` table, plus the
    totals ``rescore/rows``, ``rescore/bad`` and ``rescore/changed`` (rows whose reward differs)."""
    grouped = table.group_by("iteration").aggregate([("old", "mean"), ("new", "mean")]).sort_by("iteration").to_pylist()
    out: dict[str, float] = {}
    for g in grouped:
        out[f"rescore/old_mean/iter_{g['iteration']:04d}"] = g["old_mean"]
        out[f"rescore/new_mean/iter_{g['iteration']:04d}"] = g["new_mean"]
    # the kept rm_score is float32 (the dock's type): the new reward is compared at that precision
    new32 = pc.cast(table.column("new"), pa.float32())
    changed = pc.sum(pc.fill_null(pc.not_equal(pc.cast(table.column("old"), pa.float32()), new32), True)).as_py() or 0
    bad = pc.sum(table.column("new_bad")).as_py() or 0
    return out | {"rescore/rows": float(table.num_rows), "rescore/bad": float(bad), "rescore/changed": float(changed)}


def rescore_text(table: pa.Table, bad: Counter) -> str:
    """What ``dockrl rollouts rescore`` prints: one line per row (iteration, row, old, new), then each iteration's means."""
    lines = [f"{'iteration':>9} {'row':>5} {'old':>9} {'new':>9}"]
    for r in table.to_pylist():
        old = "-" if r["old"] is None else f"{r['old']:.4f}"
        lines.append(f"{r['iteration']:>9} {r['row']:>5} {old:>9} {r['new']:>9.4f}{'  (bad)' if r['new_bad'] else ''}")
    stats = per_iteration(table)
    for key in sorted(k for k in stats if k.startswith("rescore/old_mean/")):
        it = key.rsplit("_", 1)[1]
        lines.append(f"iteration {int(it)}: mean old {stats[key]:.4f}, mean new {stats[f'rescore/new_mean/iter_{it}']:.4f}")
    lines.append(f"({table.num_rows} rows rescored, {int(stats['rescore/changed'])} changed"
                 + (f"; bad values: {dict(bad)}" if bad else "") + ")")
    return "\n".join(lines)


def rescore_artifact(rollouts_dir: str | Path, scorer: str, out_dir: str | Path, judge: Sequence[str] = ()) -> tuple[dict[str, Any],
                                                                                                          dict[str, float]]:
    """The pipeline's rescore step: ``rescore`` every row of a kept-rollouts folder (a ``rollouts`` Dataset or a run
    folder) with ``scorer`` or ``judge`` into ``out_dir/rescored.parquet``, with ``rescore.json`` (the scorer or the
    judge's settings, the source, the bad values).

    Returns:
        The output Dataset's metadata (scorer or judge, rows, source) and the metrics (``per_iteration``).
    """
    kept = kept_rollouts(rollouts_dir)
    table, bad = rescore(kept, scorer, judge=judge)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, out / RESCORED_FILE)
    by = {"scorer": scorer} if scorer else {"judge": list(judge)}
    meta = {**by, "rows": table.num_rows, "source": str(rollouts_dir), "format": "parquet", "bad": dict(bad)}
    (out / "rescore.json").write_text(json.dumps(meta, indent=2) + "\n")
    return meta, per_iteration(table)


def rescore_command(kept: KeptRollouts, scorer: str, iteration: int | None, out: str | None, judge: Sequence[str] = ()) -> str:
    """``dockrl rollouts rescore``: the text to print (``rescore_text``); with ``out`` the table written there too."""
    table, bad = rescore(kept, scorer, iteration=iteration, judge=judge)
    if out:
        pq.write_table(table, out)
    return rescore_text(table, bad)
