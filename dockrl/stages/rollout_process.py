"""The rollout stage as a process of its own (``dockrl worker --stage rollout``): ``run_rollout``.

Around a ``RolloutWorker`` (``dockrl.stages.rollout``, which generates) it evaluates before
and after training and loads the actor's weights from the weight channel after the updates it
waits for (``sync_target``: on-policy, or bounded staleness with ``dock.max_inflight`` > 1).
"""

from __future__ import annotations

from dockrl.checkpoint.resume import generated_through, held_open, resumed_at, weights_path
from dockrl.config import Config
from dockrl.dock import Dock
from dockrl.engines.factory import build_rollout_engine, receive_params
from dockrl.engines.layer_loader import WholeLayerLoader
from dockrl.engines.weight_sync import WeightChannel
from dockrl.envs.registry import build_environment
from dockrl.parallel.ranks import ProcessRanks
from dockrl.process.memory import GB
from dockrl.rewards.guard import build_scorer
from dockrl.run.setup import load_run_prompts, resolve_data, resolve_model
from dockrl.stages.dynamic_sampling import groups_per_round
from dockrl.stages.evaluate import evaluate
from dockrl.stages.gateway import build_gateway
from dockrl.stages.loop import Report, final_report, serve_iterations
from dockrl.stages.rollout import RolloutWorker

ROLLOUT_RANK = 1
"""The rollout's rank on the weight channel (the actor's is 0)."""


def sync_target(iteration: int, max_inflight: int, iterations: int) -> int:
    """The update whose weights the rollout takes once it generated ``iteration`` (it holds every
    one before it): ``iteration - max_inflight + 1``, so that iteration ``k`` is generated with the
    weights of update ``k - max_inflight`` (the initial ones, -1, before any), or all of them, the
    last update ``iterations - 1``, after the last iteration (the evaluation after training, and
    no update is left waiting for a receiver). ``max_inflight`` = 1 is on-policy: update ``k``
    right after generating ``k``."""
    return iterations - 1 if iteration == iterations - 1 else iteration - max_inflight + 1


def run_rollout(cfg: Config, dock: Dock, ranks: ProcessRanks, weight_sync: str, first_wait_s: float | None = None) -> None:
    """The ``rollout`` stage process: evaluate (a fresh run), generate every iteration, then for
    each update up to ``sync_target`` wait for the actor's ``ACTOR`` report, receive its weights
    on the channel at ``weight_sync`` and report ``WEIGHT_SYNC``; evaluate again after training.
    Before it waits for an update that carries every weight (not a LoRA adapter alone), a vLLM
    engine on the CPU releases its weights (``release_weights``; ``memory/rollout_weights_released_gb``
    in the first sync's report): they are not used until the update arrives.
    ``rollout/policy_version`` is the last update in the weights an iteration was generated with
    (-1: the initial ones) and ``rollout/staleness`` how many updates that lags behind on-policy.
    A resumed run starts after the iterations the checkpoint holds generated
    (``dockrl.checkpoint.resume.generated_through``). With partial rollout (``rollout.partial_tokens``) each
    iteration is a ``RolloutWorker.run_pass``, and ``rollout/oldest_policy_version`` is the oldest
    update in the weights of a response it finished (a continued one's first segment's). The driver opens the first iteration once
    ``EVAL_BEFORE`` is reported, so ``first_wait_s`` is not needed here."""
    model_path = resolve_model(cfg)
    train_file, test_file = resolve_data(cfg)
    engine = build_rollout_engine(cfg, weights_path(cfg, model_path), ranks)
    environment = build_environment(cfg)  # None: single-turn
    train_prompts, test_prompts = load_run_prompts(cfg, engine.tokenizer, train_file, test_file,
                                                   tools=environment.tools if environment else [])
    scorer = build_scorer(cfg.algorithm, cfg.env.sandbox.backend)
    params = receive_params(engine, cfg, model_path)
    gateway, tasks = build_gateway(cfg, engine, train_prompts)  # None: no agent (env.agent.command)
    worker = RolloutWorker(engine, cfg.rollout, round_groups=groups_per_round(cfg), environment=environment, gateway=gateway, tasks=tasks)
    channel: WeightChannel | None = None

    t, m = cfg.trainer, cfg.dock.max_inflight
    synced = resumed_at(cfg) - 1  # the last update in the engine's weights (-1: the initial ones)

    # vLLM-CPU's copy is released while the actor updates (the engine keeps it where updates carry adapters alone)
    release = getattr(engine, "release_weights", None)

    def sync(it: int) -> None:
        nonlocal synced
        assert channel is not None  # joined before the first iteration
        updates = range(synced + 1, sync_target(it, m, t.iterations) + 1)
        released = release() if release is not None and len(updates) else 0
        for update in updates:
            dock.wait_reports(update, [Report.ACTOR], cfg.dock.timeout_s)  # updated: its weights come next on the channel
            loader = WholeLayerLoader(engine.load_weights, getattr(engine, "layer_members", None))  # vLLM: whole layers
            metrics = channel.receive(params, loader) | ({"memory/rollout_weights_released_gb": released / GB} if released else {})
            released = 0
            loader.finish()
            metrics["timing_s/weight_sync"] = metrics["weight_sync/seconds"]
            synced = update
            dock.report(update, Report.WEIGHT_SYNC, metrics)

    done = generated_through(cfg)  # a resumed run: the checkpoint holds these generated
    if cfg.rollout.partial_tokens:  # their responses cut and not yet finished are in the restored dock
        worker.pending = {it: None for it in held_open(cfg) if it <= done}
    versions: dict[int, int] = {}  # by pass (iteration): the last update in the weights it generated with

    def generate(it: int) -> dict[str, float]:
        versions[it] = synced
        worker.weight_version = synced + 1  # the updates in the engine's weights: each token's weight_version
        if cfg.rollout.partial_tokens:
            metrics = worker.run_pass(dock, it, last=it == t.iterations - 1)
            first = it - int(metrics["rollout/response_passes_max"]) + 1  # the oldest pass of a response finished here
            metrics["rollout/oldest_policy_version"] = versions.get(first, max(first - m, -1))  # before a resume: k-m
        else:
            metrics = worker.run_iteration(dock)
        if m > 1:  # iterations in flight: which update generated it (on-policy runs report as the in-process rollout does)
            metrics |= {"rollout/policy_version": synced, "rollout/staleness": it - 1 - synced}
        return metrics

    try:
        # joined before the evaluation: the actor, started at the same time, waits for it meanwhile
        channel = WeightChannel(weight_sync, rank=ROLLOUT_RANK, timeout_s=cfg.dock.timeout_s, device=ranks.device)
        if t.eval_before and not cfg.run.resume:  # the driver opens the first iteration once this is reported
            dock.report(0, Report.EVAL_BEFORE, evaluate(engine, test_prompts, scorer, cfg, "before", environment))
        if done > synced:
            sync(done)
        serve_iterations(dock, Report.ROLLOUT, generate, timeout_s=cfg.dock.timeout_s, after_report=sync, seed=t.seed,
                         after=done)
        if t.eval_after:
            dock.report(t.iterations, Report.EVAL_AFTER, evaluate(engine, test_prompts, scorer, cfg, "after", environment))
        dock.report(t.iterations, final_report("rollout"), {})
    finally:
        scorer.close()
        if environment is not None:
            environment.close()
        if gateway is not None:
            gateway.close()
        if channel is not None:
            channel.close()
