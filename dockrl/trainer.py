"""The GRPO driver: insert prompts into the dock, let each stage run, log, checkpoint.

The driver never moves payload between stages: it writes the prompt rows of an iteration and
each stage claims what it needs from the dock and writes its columns back. Run it with
``dockrl train [--config FILE] [section.field=value ...]``. Here every stage runs in this
process; with ``dock.mode=distributed`` each runs as its own process
(``dockrl/launch/distributed.py``), sharing the set-up functions of this module.
"""

from __future__ import annotations

import logging
import random
import secrets
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

from dockrl.config import AlgorithmConfig, Config, ConfigError, TrainerConfig, save_config
from dockrl.data import Prompt, check_chat_template, export_champ, generate_problems, load_prompts, write_jsonl
from dockrl.dock import GRPO_SCHEMA, open_dock
from dockrl.engines.factory import build_reference_engine, build_rollout_engine, build_train_engine
from dockrl.engines.hf import load_tokenizer
from dockrl.evaluate import greedy_accuracy
from dockrl.metrics import MetricsWriter, Progress, plot_metrics
from dockrl.models import prepare_smollm2
from dockrl.resume import (
    checkpoint_dir, checkpoint_due, dock_snapshot_uri, final_dir, find_resume, load_optimizer, prepare_checkpoint,
    prompts_fingerprint, save_optimizer, seed_iteration, write_driver_state, write_final_state,
)
from dockrl.lifeline import sigterm_as_exit
from dockrl.rewards import RewardScorer
from dockrl.rewards.guard import ScorerProcess, import_scorer
from dockrl.run_lock import RunLock
from dockrl.workers.actor import ActorWorker
from dockrl.workers.advantage import AdvantageWorker
from dockrl.workers.reference import ReferenceWorker
from dockrl.workers.reward import RewardWorker
from dockrl.workers.rollout import RolloutWorker

logger = logging.getLogger(__name__)

PACKAGED_MODEL = "smollm2-135m"


def resolve_model(cfg: Config) -> Path:
    """The model directory: the packaged SmolLM2 export (prepared once) or ``model.path``.

    Raises:
        ConfigError: ``model.path`` is not a local HF model folder (no ``config.json``):
            nothing is fetched from a hub.
    """
    if cfg.model.path == PACKAGED_MODEL:
        return prepare_smollm2(Path(cfg.run.cache_dir) / "models" / "SmolLM2-135M-Instruct")
    path = Path(cfg.model.path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"model.path: got {cfg.model.path!r}; expected a local HF model folder with config.json "
                          f"(or {PACKAGED_MODEL!r} for the packaged SmolLM2-135M-Instruct)")
    check_model_dir(path, cfg.model.trust_remote_code)
    return path


def check_model_dir(path: Path, trust_remote_code: bool = False) -> None:
    """Check an HF model folder before any engine loads it: a readable ``config.json`` of an
    architecture this transformers knows, weights, and safetensors files whose header and size
    agree (a truncated download fails here, naming the file).

    Raises:
        ConfigError: naming ``model.path``, the file and what is wrong with it.
    """
    import json

    try:
        doc = json.loads((path / "config.json").read_text())
        model_type = doc.get("model_type") if isinstance(doc, dict) else None
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path: {path / 'config.json'} is not readable JSON ({e})") from None
    if not trust_remote_code:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        if model_type not in CONFIG_MAPPING:
            raise ConfigError(f"model.path: {path / 'config.json'} has model_type={model_type!r}, an architecture this "
                              "transformers does not know; use a Llama/Qwen2-architecture model (or model.trust_remote_code=true "
                              "for a folder that ships its own code)")
    shards = sorted(path.glob("*.safetensors"))
    if not shards and not any(path.glob("*.bin")) and not any(path.glob("*.pt")):
        raise ConfigError(f"model.path: {path} has config.json but no weights (*.safetensors or *.bin); "
                          "copy the whole model folder (save_pretrained writes both)")
    from safetensors import safe_open

    for shard in shards:
        try:
            with safe_open(str(shard), framework="pt") as f:
                f.keys()
        except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError
            raise ConfigError(f"model.path: {shard} is not a readable safetensors file ({e}); "
                              "it may be truncated: copy or download it again") from None


def resolve_data(cfg: Config) -> tuple[Path, Path]:
    """Train and test files: the configured ones, or seeded generated problems (held-out test)."""
    d = cfg.data
    key = f"arith-s{cfg.trainer.seed}-steps{d.min_steps}-{d.max_steps}-max{d.max_number}"
    folder = Path(cfg.run.cache_dir) / "data" / key
    train, test = Path(d.train_path) if d.train_path else None, Path(d.test_path) if d.test_path else None
    gen = dict(min_steps=d.min_steps, max_steps=d.max_steps, max_number=d.max_number)
    if d.test_path == "champ":
        test = Path(cfg.run.cache_dir) / "data" / "champ.jsonl"
        if not test.is_file():
            export_champ(test)
    if test is None:
        test = folder / f"test-{d.generate_test}.jsonl"
        if not test.is_file():
            write_jsonl(generate_problems(d.generate_test, seed=1_000_003 + cfg.trainer.seed, **gen), test)
    if train is None:
        train = folder / f"train-{d.generate_train}.jsonl"
        if not train.is_file():
            held_out = {row["question"] for row in generate_problems(d.generate_test, seed=1_000_003 + cfg.trainer.seed, **gen)}
            rows = [r for r in generate_problems(d.generate_train, seed=cfg.trainer.seed, **gen) if r["question"] not in held_out]
            write_jsonl(rows, train)
    return train, test


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def build_scorer(a: AlgorithmConfig):
    """The reward scorer: ``algorithm.scorer`` (``module:Class``) if set, else the GSM8K rule verifier.

    A custom scorer runs in a process of its own under ``algorithm.reward_timeout_s`` per
    sample (``dockrl.rewards.guard.ScorerProcess``); the built-in verifier times each sample itself.

    Raises:
        ConfigError: ``algorithm.scorer`` names no importable class (the import's error appended).
    """
    kwargs = dict(timeout_s=a.reward_timeout_s, correct_reward=a.correct_reward, format_reward=a.format_reward)
    if not a.scorer:
        return RewardScorer(**kwargs)
    try:
        import_scorer(a.scorer)  # here, so a typo fails before any process starts
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"algorithm.scorer: got {a.scorer!r}, which does not import ({type(e).__name__}: {e}); "
                          "expected 'package.module:Class' importable here (and in every worker: PYTHONPATH)") from e
    return ScorerProcess(a.scorer, kwargs, timeout_s=a.reward_timeout_s)


def load_run_prompts(cfg: Config, tokenizer, train_file: Path, test_file: Path) -> tuple[list[Prompt], list[Prompt]]:
    """Training prompts and the evaluation prompts (the first ``data.eval_size`` of the test file)."""
    check_chat_template(tokenizer, cfg.data.chat_template, cfg.model.path)  # names model.path, not a data file
    load = dict(system_prompt=cfg.data.system_prompt, max_prompt_length=cfg.data.max_prompt_length,
                chat_template=cfg.data.chat_template, model=cfg.model.path)
    out = []
    for field, path in (("data.train_path", train_file), ("data.test_path", test_file)):
        try:
            prompts, report = load_prompts(path, tokenizer, **load)
        except (FileNotFoundError, ValueError) as e:  # a user's file: name the setting it came from
            raise ConfigError(f"{field}: {e}") from None
        logger.info("data %s: %d prompts (%d lines dropped, %d repeat a question)", field, report.kept, len(report.bad),
                    report.duplicates)
        out.append(prompts)
    train_prompts, test_prompts = out
    if cfg.data.eval_size:
        test_prompts = test_prompts[: cfg.data.eval_size]
    return train_prompts, test_prompts


def evaluate(engine: RolloutEngine, prompts: list[Prompt], scorer, cfg: Config, tag: str) -> dict[str, float]:
    """Greedy test accuracy as ``eval/accuracy_<tag>`` and ``eval/format_rate_<tag>``."""
    res = greedy_accuracy(
        engine, prompts, scorer, correct_reward=cfg.algorithm.correct_reward,
        max_new_tokens=cfg.rollout.max_response_length, batch_size=cfg.trainer.eval_batch_size,
    )
    logger.info("greedy test accuracy %s training: %.3f (format %.3f, %d prompts)", tag, res["accuracy"], res["format_rate"], res["count"])
    return {f"eval/accuracy_{tag}": res["accuracy"], f"eval/format_rate_{tag}": res["format_rate"]}


def prompt_batches(prompts: list[Prompt], t: TrainerConfig) -> Iterator[list[Prompt]]:
    """The ``trainer.global_batch`` prompts of each iteration, seeded by ``trainer.seed``.

    Epochs follow each other as fresh seeded permutations of all prompts, so every prompt is
    used once per epoch; a batch that crosses the end of an epoch continues into the next.
    Deterministic: a resumed run regenerates the same batches (its position is the iteration).
    """
    rng = random.Random(t.seed)
    epoch: list[int] = []
    pos = 0
    for _ in range(t.iterations):
        picked: list[int] = []
        while len(picked) < t.global_batch:
            if pos == len(epoch):  # next epoch over the prompts
                epoch = list(range(len(prompts)))
                rng.shuffle(epoch)
                pos = 0
            take = min(t.global_batch - len(picked), len(epoch) - pos)
            picked += epoch[pos:pos + take]
            pos += take
        yield [prompts[i] for i in picked]


def open_with_prompts(dock, iteration: int, picked: list[Prompt], n: int, *, announce: bool = True) -> None:
    """Open ``iteration`` with ``len(picked)·n`` rows; prompt ``i`` fills rows ``[i·n, (i+1)·n)``.

    ``announce=False`` leaves it unannounced to the stages (a checkpoint snapshots it first).
    """
    dock.open_iteration(iteration, len(picked) * n, n, announce=announce)
    dock.put(range(len(picked) * n), {
        "prompt_ids": [p.prompt_ids for p in picked for _ in range(n)],
        "ground_truth": [p.ground_truth for p in picked for _ in range(n)],
    })


def snapshot_for_checkpoint(
    dock, cfg: Config, checkpoint: Path, *, next_iteration: int, picked: list[Prompt], summary: dict[str, float],
    prompts: str, run: str,
) -> None:
    """The driver's part of a checkpoint, after the actor wrote weights and optimizer there:
    open ``next_iteration`` with its prompts (unannounced), snapshot the dock, write the driver state last."""
    open_with_prompts(dock, next_iteration, picked, cfg.rollout.n, announce=False)
    uri = dock_snapshot_uri(cfg, checkpoint, run)
    dock.snapshot(uri)
    write_driver_state(checkpoint, cfg, next_iteration=next_iteration, dock_uri=uri, open_iteration=next_iteration,
                       summary=summary, prompts=prompts)
    logger.info("checkpoint %s written; iteration %d resumes from it", checkpoint, next_iteration)


def add_iteration_metrics(metrics: dict[str, float], seconds: float, rows: int) -> dict[str, float]:
    """Add ``timing_s/iteration`` and ``perf/response_tokens_per_s`` (response tokens of all rows per second)."""
    metrics["timing_s/iteration"] = seconds
    metrics["perf/response_tokens_per_s"] = metrics["rollout/response_length_mean"] * rows / seconds
    return metrics


def train(cfg: Config, *, on_iteration: Callable[[int, dict[str, float]], None] | None = None) -> dict[str, float]:
    """Run GRPO as configured; returns the run summary (accuracies, seconds).

    ``on_iteration(i, metrics)`` is called once each iteration's metrics are written.
    ``run.resume`` continues from a checkpoint (``dockrl.resume``): weights, optimizer, dock
    and the next iteration come from it; ``metrics.jsonl`` keeps the iterations before it.

    ``dock.mode=distributed`` runs every stage as its own process
    (``dockrl.launch.distributed.train_distributed``); the default runs them all here.
    Writes to ``run.output_dir``: ``config.yaml``, ``metrics.jsonl``, ``tensorboard/``,
    ``metrics.png``, ``summary.json`` and ``checkpoints/`` (HF format).
    Nothing of the run folder is written before the run is accepted (a fresh run into a used
    folder, or a resume that does not fit its checkpoint, leaves the folder as it was), and the
    folder is locked for the run's lifetime (``dockrl.run_lock``).

    Raises:
        RunLockedError: another live run holds ``run.output_dir``.
        ConfigError: what only the run can check (``model.path``, ``run.resume``, the data).
    """
    with RunLock(cfg.run.output_dir), sigterm_as_exit():  # `kill` runs the clean-up below (verifier pool, workers, lock)
        if cfg.dock.mode == "distributed":
            from dockrl.launch.distributed import train_distributed

            return train_distributed(cfg, on_iteration=on_iteration)
        return _train_inprocess(cfg, on_iteration=on_iteration)


def _train_inprocess(cfg: Config, *, on_iteration: Callable[[int, dict[str, float]], None] | None) -> dict[str, float]:
    """``train`` with every stage in this process (the run folder is locked by the caller)."""
    t0 = time.perf_counter()
    run_dir = Path(cfg.run.output_dir)
    if cfg.run.num_threads:
        torch.set_num_threads(cfg.run.num_threads)
    seed_everything(cfg.trainer.seed)
    model_path = resolve_model(cfg)
    train_file, test_file = resolve_data(cfg)
    t, r, a = cfg.trainer, cfg.rollout, cfg.algorithm
    tokenizer = load_tokenizer(model_path, cfg.model.trust_remote_code)
    train_prompts, test_prompts = load_run_prompts(cfg, tokenizer, train_file, test_file)
    fingerprint = prompts_fingerprint([p.prompt_ids for p in train_prompts])
    point = find_resume(cfg, fingerprint)
    save_config(cfg, run_dir / "config.yaml")  # only now: a refused run leaves the folder's config as it was
    weights = point.checkpoint if point else model_path  # the actor and the rollout start from the same weights

    hybrid = None
    if t.hybrid:  # one actor generates (vLLM) and trains (megatron); it syncs inside its update stage
        from dockrl.workers.hybrid import build_hybrid_worker

        hybrid = build_hybrid_worker(cfg, weights, optimizer_from=point.checkpoint if point else None)
        rollout_engine, actor = hybrid.actor.rollout_engine, hybrid.actor
        rollout_stage, actor_stage = hybrid.generation, hybrid.update
    else:
        rollout_engine, actor = build_rollout_engine(cfg, weights), build_train_engine(cfg, weights)
        rollout_stage, actor_stage = RolloutWorker(rollout_engine, r), ActorWorker(actor, trainer=t, algo=a, rollout=r)
    if point and hybrid is None:  # the hybrid loaded it before its first sync
        load_optimizer(actor, point.checkpoint)
    scorer = build_scorer(a)
    workers = [rollout_stage, RewardWorker.from_config(scorer, tokenizer, a), AdvantageWorker(a)]
    if a.kl_coef > 0:
        reference = build_reference_engine(cfg, model_path)
        workers.append(ReferenceWorker(reference, temperature=r.temperature, micro_batch=t.micro_batch))
    workers.append(actor_stage)
    dock = open_dock(cfg.dock, GRPO_SCHEMA, run=f"dockrl-{secrets.token_hex(6)}")  # dock.shards shards in this process
    first, open_now = 0, None
    if point:
        if point.dock_uri:  # checkpoints/final has no open iteration to restore
            dock.restore(point.dock_uri)
        first, open_now = point.next_iteration, point.open_iteration
        logger.info("resuming at iteration %d from %s", first, point.checkpoint)
    batches = list(prompt_batches(train_prompts, t))

    summary: dict[str, float] = {"eval/test_prompts": len(test_prompts), "data/train_prompts": len(train_prompts)}
    summary |= point.summary if point else {}
    try:
        with MetricsWriter(run_dir, on_log=on_iteration, resume_from=first if point else None) as writer, \
                Progress(t.iterations - first, "GRPO", enable=cfg.run.progress) as progress:
            if t.eval_before and not point:
                summary |= evaluate(rollout_engine, test_prompts, scorer, cfg, "before")
            for it in range(first, t.iterations):
                picked, start = batches[it], time.perf_counter()
                seed_iteration(t.seed, it)
                if open_now != it:  # else restored from the checkpoint with its prompts
                    open_with_prompts(dock, it, picked, r.n)
                metrics: dict[str, float] = {}
                for worker in workers:
                    metrics |= worker.run_iteration(dock)
                if hybrid is None:
                    sync_start = time.perf_counter()
                    metrics["weight_sync/bytes"] = rollout_engine.load_weights(actor.named_weights())
                    metrics["timing_s/weight_sync"] = time.perf_counter() - sync_start
                metrics |= dock.stats()
                dock.close_iteration()
                add_iteration_metrics(metrics, time.perf_counter() - start, len(picked) * r.n)
                writer.log(it, metrics)
                progress.update(metrics)
                if checkpoint_due(t, it):
                    ckpt = actor.save(prepare_checkpoint(checkpoint_dir(run_dir, it + 1)))
                    save_optimizer(actor, ckpt)
                    snapshot_for_checkpoint(dock, cfg, ckpt, next_iteration=it + 1, picked=batches[it + 1], summary=summary,
                                            prompts=fingerprint, run="inprocess")
                    open_now = it + 1
            final = actor.save(prepare_checkpoint(final_dir(run_dir)))  # a finished run continues from here
            save_optimizer(actor, final)
            write_final_state(final, cfg, summary=summary, prompts=fingerprint)
            if t.eval_after:
                summary |= evaluate(rollout_engine, test_prompts, scorer, cfg, "after")
            summary["run/seconds"] = time.perf_counter() - t0
            writer.log_summary(summary)
        plot_metrics(run_dir / "metrics.jsonl", run_dir / "metrics.png")
    finally:
        dock.close()
        scorer.close()
        if hybrid is not None:
            hybrid.actor.close()
    return summary
