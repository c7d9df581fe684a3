"""Rollout stage: claim prompts, sample one response per row, put responses and log-probs.

Rows of a group carry the same prompt, so a whole-group claim yields the n samples of GRPO.
As a process of its own (``run_rollout``, in ``dockrl.stages.rollout_process``) it also
evaluates before and after training and loads the actor's weights from the weight channel after
every update: right after generating the iteration it updates on (on-policy), or with ``dock.max_inflight`` = m > 1 once it
generated the iterations in flight after it (``sync_target``; bounded staleness as in verl's
one-step-off-policy recipe and MindSpeed RL's dataflow, arXiv 2507.19017). With partial rollout
(``rollout.partial_tokens``, Kimi k1.5's partial rollouts, arXiv 2501.12599 §2.6.2) a response
without EOS within the budget in a pass is put back into the dock as carry-over (``rollout_cut``,
``partial_ids``, ``partial_log_prob``, read by no other stage) and continued in the next pass, after
the weight sync, from prompt + tokens so far, until it ends or spans ``rollout.partial_max_age``
passes: only then are its response columns written, so every other stage sees each row once,
complete (``RolloutWorker.run_pass``).
"""

from __future__ import annotations

import time
from typing import Sequence

from dockrl.config import RolloutConfig
from dockrl.dock import Dock, StageDock
from dockrl.engines.rollout_engine import RolloutEngine, Sample
from dockrl.envs.base import Environment
from dockrl.stages.dynamic_sampling import GATE, divisor_at_most
from dockrl.stages.gateway import AgentGateway, AgentTasks, session_metrics
from dockrl.stages.multi_turn import ObservationTokens, Trajectory, TurnLimits, multi_turn_metrics, roll_out, trajectory_columns


def rollout_metrics(lengths: Sequence[int], truncated: int, seconds: float) -> dict[str, float]:
    """``rollout/*`` metrics of responses of ``lengths`` tokens, ``truncated`` of them cut at the
    length limit, generated in ``seconds`` (of wall clock).

    Raises:
        ValueError: no response.
    """
    if not lengths:
        raise ValueError("rollout metrics: no response was generated")
    return {
        "rollout/response_length_mean": sum(lengths) / len(lengths),
        "rollout/response_length_max": max(lengths),
        "rollout/truncated_ratio": truncated / len(lengths),
        "rollout/responses": len(lengths),
        "perf/rollout_tokens_per_s": sum(lengths) / seconds,
        "timing_s/rollout": seconds,
    }


def response_columns(samples: Sequence[Sample], versions: Sequence[Sequence[int]]) -> dict[str, list]:
    """The rollout's response columns of ``samples``, one row each, with ``versions`` the
    ``weight_version`` of each one's tokens (``weight_versions``)."""
    return {"response_ids": [s.response_ids for s in samples], "rollout_log_prob": [s.log_probs for s in samples],
            "truncated": [s.truncated for s in samples], "weight_version": [list(v) for v in versions]}


def weight_versions(responses: Sequence[Sequence[int]], version: int) -> list[list[int]]:
    """The ``weight_version`` cells of ``responses`` whose every token the weights of ``version`` sampled."""
    return [[version] * len(r) for r in responses]


class RolloutWorker:
    """Generates for the rows of an iteration, ``rollout.batch_size`` rows (whole groups) per claim.

    Args:
        shares: rollout replicas claiming from the same iteration; each claim takes at most
            ``1/shares`` of the iteration's groups (of a round's), so that every replica gets work
            (the hybrid actor's ranks, each with a full inference copy, generate side by side).
        round_groups: with dynamic sampling (``algorithm.filter_groups.enable``), the groups of a
            round (``trainer.global_batch``): rows are claimed once their ``released`` gate is
            written, in claims of a number of groups dividing a round, so that no claim waits for
            a round not yet released (``dockrl.stages.dynamic_sampling``). 0: no rounds.
        environment: the run's environment (``env.name``): each row is a multi-turn trajectory
            (``dockrl.stages.multi_turn``) with an episode of its own, opened with the row's
            ``ground_truth``; the rows get the turn columns too (``loss_mask``, ``turn_*``, ``tool_*``).
        gateway: the run's agent gateway (``env.agent.command``, ``dockrl.stages.gateway``): each row is a session of
            the user's agent, whose task ``tasks`` gives by the row's prompt ids; the rows get the turn columns and
            ``session_reward``.
    """

    def __init__(self, engine: RolloutEngine, cfg: RolloutConfig, *, shares: int = 1, round_groups: int = 0,
                 environment: Environment | None = None, gateway: AgentGateway | None = None, tasks: AgentTasks | None = None) -> None:
        if (gateway is None) != (tasks is None):
            raise ValueError("rollout: an agent gateway needs the tasks of its prompts, and tasks need a gateway")
        self.engine, self.cfg, self.shares, self.round_groups = engine, cfg, shares, round_groups
        self.environment, self.gateway, self.tasks = environment, gateway, tasks
        self.failures: list[str] = []
        """Gateway: why each failed session of the last ``generate_iteration`` failed."""
        self.observe = ObservationTokens(engine.tokenizer, tools=environment.tools) if environment is not None else None
        self.trajectories: list[Trajectory] = []
        """Multi-turn: the trajectories of the last ``generate_iteration``."""
        self.cut: list[int] = []
        """Rows of the last iteration generated with a budget that were cut there (``generate_iteration``)."""
        self.pending: dict[int, list[int] | None] = {}
        """Partial rollout: by iteration, the rows whose cut responses the next pass continues
        (``run_pass``); ``None``: read them from the dock (a resumed run's checkpoint holds them)."""
        self.generated = 0
        """Response tokens sampled since ``run_pass`` began (every segment, finished or cut)."""
        self.weight_version: int | None = None
        """The actor updates in the engine's weights, written per token as ``weight_version``; set by
        the rollout process at each weight sync (``run_rollout``). None: on-policy, the weights hold
        every update before the claimed iteration (in-process and hybrid runs sync after each update)."""

    def generate_iteration(self, dock: StageDock, *, budget: int = 0) -> tuple[list[int], int, float]:
        """Generate for rows of the open iteration until none is left to claim.

        ``budget`` (partial rollout, ``rollout.partial_tokens``; 0: none): tokens per response in
        this pass; a response without EOS within it is cut: it gets no response columns but its
        carry-over (``partial_ids``, ``partial_log_prob``, ``partial_weight_version``; every row of the pass gets ``rollout_cut``)
        and its row goes to ``self.cut`` (``continue_cut`` continues it in the next pass).

        Returns:
            lengths (tokens) of the responses finished in this pass, how many were truncated, seconds taken.
        """
        start, lengths, truncated = time.perf_counter(), [], 0
        self.cut, self.trajectories, self.failures = [], [], []
        groups, columns = max(self.cfg.batch_size // dock.group_size, 1), ["prompt_ids"]
        if self.environment is not None:  # each trajectory's episode opens with its prompt's reference answer
            columns.append("ground_truth")
        total = self.round_groups or dock.num_rows // dock.group_size  # groups claimable at once
        if self.shares > 1:
            groups = min(groups, -(-total // self.shares))
        if self.round_groups:
            groups, columns = divisor_at_most(self.round_groups, groups), ["prompt_ids", GATE]
        while claim := dock.claim("rollout", columns, groups * dock.group_size, whole_groups=True):
            prompts = claim.batch.column("prompt_ids").to_pylist()
            if self.environment is not None or self.gateway is not None:  # the config refuses partial rollout with either
                extra: dict[str, list] = {}
                if self.gateway is not None:
                    assert self.tasks is not None
                    results = self.gateway.run(prompts, [self.tasks(p) for p in prompts])
                    trajectories = [r.trajectory for r in results]
                    extra["session_reward"] = [r.reward for r in results]
                    self.failures += [r.failure for r in results if r.failure]
                    self.generated += sum(sum(t.loss_mask) for t in trajectories)
                else:
                    trajectories = self._roll_out(prompts, claim.batch.column("ground_truth").to_pylist())
                versions = weight_versions([t.response_ids for t in trajectories], self._version(claim.iteration))
                dock.put(claim.rows, trajectory_columns(trajectories) | {"weight_version": versions} | extra, ack=claim)
                self.trajectories += trajectories
                lengths += [len(t.response_ids) for t in trajectories]
                truncated += sum(t.truncated for t in trajectories)
                continue
            samples = self._sample(prompts, budget or self.cfg.max_response_length)
            versions = weight_versions([s.response_ids for s in samples], self._version(claim.iteration))
            if budget:
                cut = [s.truncated for s in samples]  # no EOS within the budget: continued in the next pass
                self.cut += self._put_cut(dock, claim.rows, cut, samples, versions, claim.iteration)
                dock.put(claim.rows, {"rollout_cut": cut}, ack=claim)
                samples = [s for s, c in zip(samples, cut) if not c]
            else:
                # partial rollout's pass without a budget (the run's last) still says "not cut" for every
                # row: a resumed rollout reads rollout_cut of every open iteration it generated
                flags = {"rollout_cut": [False] * len(samples)} if self.cfg.partial_tokens else {}
                dock.put(
                    claim.rows,
                    response_columns(samples, versions) | flags,
                    ack=claim,  # acked with the put: a worker that dies before it leaves its rows to another
                )
            lengths += [len(s.response_ids) for s in samples]
            truncated += sum(s.truncated for s in samples)
        return lengths, truncated, time.perf_counter() - start

    def _roll_out(self, prompts: Sequence[Sequence[int]], truths: Sequence[str]) -> list[Trajectory]:
        """One multi-turn trajectory per prompt, each in an episode of its own, closed afterwards."""
        assert self.environment is not None and self.observe is not None
        c, episodes = self.cfg, []
        try:
            episodes = [self.environment.open(truth) for truth in truths]
            limits = TurnLimits(max_turns=c.max_turns, max_turn_tokens=c.max_response_length, max_total_tokens=c.max_total_tokens)
            trajectories = roll_out(self.engine, prompts, episodes, self.observe, limits, temperature=c.temperature, top_p=c.top_p,
                                    batch_size=c.batch_size)
        finally:
            for episode in episodes:
                episode.close()
        self.generated += sum(sum(t.loss_mask) for t in trajectories)
        return trajectories

    def _version(self, iteration: int) -> int:
        """The weight version of the tokens sampled now for ``iteration`` (``self.weight_version``)."""
        return iteration if self.weight_version is None else self.weight_version

    def _sample(self, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[Sample]:
        c = self.cfg
        samples = self.engine.generate(prompts, max_new_tokens=max_new_tokens, temperature=c.temperature, top_p=c.top_p,
                                       batch_size=c.batch_size)
        self.generated += sum(len(s.response_ids) for s in samples)
        return samples

    @staticmethod
    def _put_cut(dock: Dock | StageDock, rows: Sequence[int], cut: Sequence[bool], samples: Sequence[Sample],
                 versions: Sequence[Sequence[int]], iteration: int | None = None) -> list[int]:
        """Write the response columns of the rows not ``cut`` and the carry-over of those cut (with
        ``versions``, each sample's per-token weight versions); returns the cut rows."""
        done = [k for k, c in enumerate(cut) if not c]
        held = [k for k, c in enumerate(cut) if c]
        if held:
            dock.put([rows[k] for k in held], {"partial_ids": [samples[k].response_ids for k in held],
                                               "partial_log_prob": [samples[k].log_probs for k in held],
                                               "partial_weight_version": [list(versions[k]) for k in held]}, iteration=iteration)
        if done:
            dock.put([rows[k] for k in done], response_columns([samples[k] for k in done], [versions[k] for k in done]),
                     iteration=iteration)
        return [rows[k] for k in held]

    def continue_cut(self, dock: Dock, iteration: int, rows: Sequence[int], *, version: int, budget: int = 0
                     ) -> tuple[list[int], int, list[int]]:
        """Continue the cut responses of ``rows`` of ``iteration`` (``generate_iteration``) with the
        engine's current weights: generate from prompt + the tokens so far, at most ``budget`` more
        (0: none) within ``rollout.max_response_length``. A response that ends here gets its
        response columns (the carry-over's tokens, log-probs and weight versions, then the new ones) and
        ``rollout_cut`` false; one cut again gets the longer carry-over. ``version``: the weight
        version of the engine's weights (``weight_version`` of the tokens sampled here).

        Returns:
            the finished responses' lengths (tokens, every segment), how many were truncated, the rows cut again.

        Raises:
            DockError: ``iteration`` is not open, or a row has no carry-over.
        """
        batch = dock.get(["prompt_ids", "partial_ids", "partial_log_prob", "partial_weight_version"], rows, iteration=iteration)
        prompts, so_far, log_probs, versions_so_far = (batch.column(k).to_pylist() for k in range(4))
        by_length: dict[int, list[int]] = {}  # a budget's multiple each: grouped, each group has one limit
        for k, tokens in enumerate(so_far):
            by_length.setdefault(len(tokens), []).append(k)
        longer: list[Sample | None] = [None] * len(rows)
        versions: list[list[int]] = [[] for _ in rows]
        for length, ks in by_length.items():
            room = self.cfg.max_response_length - length
            samples = self._sample([prompts[k] + so_far[k] for k in ks], min(budget, room) if budget else room)
            for k, s in zip(ks, samples):
                longer[k] = Sample(so_far[k] + s.response_ids, log_probs[k] + s.log_probs, s.truncated)
                versions[k] = versions_so_far[k] + [version] * len(s.response_ids)
        samples_ = [s for s in longer if s is not None]
        assert len(samples_) == len(rows), "a cut response was not continued"
        # no EOS within the budget: cut again, unless it reached max_response_length (then it ends, truncated)
        cut = [bool(budget) and s.truncated and len(s.response_ids) < self.cfg.max_response_length for s in samples_]
        again = self._put_cut(dock, rows, cut, samples_, versions, iteration)
        if len(again) < len(rows):
            dock.put([r for r, c in zip(rows, cut) if not c], {"rollout_cut": [False] * (len(rows) - len(again))}, iteration=iteration)
        done = [s for s, c in zip(samples_, cut) if not c]
        return [len(s.response_ids) for s in done], sum(s.truncated for s in done), again

    def run_pass(self, dock: Dock, iteration: int, *, last: bool) -> dict[str, float]:
        """One pass of partial rollout (``rollout.partial_tokens``) for the open ``iteration``: first
        continue the cut responses of the iterations before, oldest first (``self.pending``; a
        resumed run reads them from the dock), then generate ``iteration``'s rows. Each response gets
        at most ``rollout.partial_tokens`` tokens in a pass but in its ``rollout.partial_max_age``-th
        pass and in the ``last`` (no pass follows), which finish it: no response spans more passes.

        Returns:
            ``rollout/*`` metrics of the responses finished in this pass (``rollout_metrics``; lengths
            0 when every one was cut), with ``rollout/partial_cut`` (responses of ``iteration`` cut),
            ``rollout/partial_continued`` (those of earlier iterations finished), ``rollout/partial_held``
            (responses cut and waiting after this pass), ``rollout/response_passes_max`` (the most
            passes a finished response spanned), and ``rollout/tokens_generated``: the tokens this
            pass sampled, whichever response they belong to, which ``perf/rollout_tokens_per_s`` divides
            by the pass's seconds.
        """
        start, self.generated = time.perf_counter(), 0
        lengths: list[int] = []
        truncated = continued = 0
        passes = 1
        for it in sorted(self.pending):
            rows = self.pending.pop(it)
            if rows is None:  # resumed: the checkpoint's dock holds the iteration open, with its cut rows
                everything = range(dock.num_rows)  # as this iteration's: partial rollout has no dynamic sampling's rounds
                rows = [r for r, c in zip(everything, dock.get(["rollout_cut"], everything, iteration=it).column(0).to_pylist()) if c]
            if not rows:
                continue
            age = iteration - it + 1  # passes the responses span once this one is done
            budget = 0 if last or age >= self.cfg.partial_max_age else self.cfg.partial_tokens
            done, done_truncated, again = self.continue_cut(dock, it, rows, version=self._version(iteration), budget=budget)
            lengths, truncated, continued = lengths + done, truncated + done_truncated, continued + len(done)
            passes = max(passes, age) if done else passes
            if again:
                self.pending[it] = again
        new, new_truncated, _ = self.generate_iteration(dock, budget=0 if last else self.cfg.partial_tokens)
        if self.cut:  # in row order, as a resumed run reads them: the same batches sample the same continuations
            self.pending[iteration] = sorted(self.cut)
        lengths, truncated = lengths + new, truncated + new_truncated
        seconds = time.perf_counter() - start
        metrics = rollout_metrics(lengths, truncated, seconds) if lengths else {
            "rollout/response_length_mean": 0.0, "rollout/response_length_max": 0, "rollout/truncated_ratio": 0.0,
            "rollout/responses": 0, "perf/rollout_tokens_per_s": 0.0, "timing_s/rollout": seconds}
        held = sum(len(rows or []) for rows in self.pending.values())
        # the tokens this pass generated (segments of responses it cut or continued included), not the finished lengths
        metrics |= {"perf/rollout_tokens_per_s": self.generated / seconds, "rollout/tokens_generated": self.generated}
        return metrics | {"rollout/partial_cut": len(self.cut), "rollout/partial_continued": continued,
                          "rollout/partial_held": held, "rollout/response_passes_max": passes}

    def run_iteration(self, dock: StageDock) -> dict[str, float]:
        """Generate for every row of the open iteration; returns ``rollout/*`` metrics (``rollout_metrics``;
        multi-turn: lengths count observation tokens too, ``perf/rollout_tokens_per_s`` the sampled
        tokens alone, with ``multi_turn_metrics``)."""
        self.generated = 0
        lengths, truncated, seconds = self.generate_iteration(dock)
        metrics = rollout_metrics(lengths, truncated, seconds)
        if self.environment is not None or self.gateway is not None:
            metrics |= multi_turn_metrics(self.trajectories) | {"perf/rollout_tokens_per_s": self.generated / seconds}
        if self.gateway is not None:
            metrics |= session_metrics(len(self.trajectories), self.failures)
        return metrics
