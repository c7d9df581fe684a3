"""Multi-turn rollout over an environment: the model's turns and the environment's observations
as one token sequence per trajectory, exactly the tokens the model was given and sampled.

Each turn, every active trajectory is generated together (``RolloutEngine.generate`` on prompt +
response so far, so it runs on every engine); a turn ends at the EOS token (the chat model's
end-of-turn), at its budget, or where its tool calls end when the episode says where
(``Episode.calls_end``): what the model sampled after its calls is cut, as a stop sequence would
cut it, and the assistant's end-of-turn token follows as a template token (loss mask 0). The
turn's text (decoded for the environment only) goes to the trajectory's ``Episode.step``; its
observation is appended **as token ids**: the chat template renders the observation turn alone
(``ObservationTokens``: what the template puts after the assistant's end-of-turn token, the tool
turn, then the generation prompt of the next assistant turn) and the ids are concatenated. The
conversation is never re-tokenized, so the trained ids are the sampled ids (up to where a turn's
calls end) plus the observation ids, token for token (the re-tokenization drift of trl #5224 and
verl #6501 cannot happen). A trajectory ends when the environment says done or gives no
observation, after ``rollout.max_turns`` model turns, when a turn is cut at its budget, or when
the next observation would not fit in ``rollout.max_total_tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from dockrl.engines.rollout_engine import RolloutEngine
from dockrl.envs.base import Episode

_PROBE = [{"role": "user", "content": "1"}, {"role": "assistant", "content": "2"}]
"""A conversation that ends with an assistant turn: the observation turn is rendered after it."""


class ObservationTokens:
    """The token ids that follow a model turn ending with EOS when the environment answers with ``text``.

    The ids are those the chat template puts after the assistant's end-of-turn token (e.g. ``"\\n"``),
    then the observation turn (role ``role``), then the generation prompt of the next assistant turn,
    tokenized alone (no special tokens added): ``template(probe + [observation], generation prompt)``
    minus ``template(probe)`` up to the end-of-turn token.

    Args:
        tokenizer: the policy's HF tokenizer, with a chat template; its ``eos_token`` must end an
            assistant turn in that template (the rollout stops there).
        role: the observation turn's role (``tool``; templates without one render it as they do).
        tools: the tools' JSON schemas given to the template (``Environment.tools``), or none.

    Raises:
        ValueError: the template does not end an assistant turn with the EOS token, or it renders
            the earlier turns differently once an observation follows (then no suffix exists).
    """

    def __init__(self, tokenizer: Any, *, role: str = "tool", tools: Sequence[dict] = ()) -> None:
        self.tokenizer, self.role, self.tools = tokenizer, role, list(tools) or None
        self.base = self._render(_PROBE, generation_prompt=False)
        eos = tokenizer.eos_token
        end = self.base.rfind(eos) if eos else -1
        if end < 0:
            raise ValueError(f"multi-turn rollout: the chat template does not end an assistant turn with the EOS token {eos!r} "
                             f"(it renders {self.base[-40:]!r}): the rollout stops at EOS, so the observation cannot follow it")
        self.after_eos = self.base[end + len(eos):]

    def _render(self, messages: list[dict], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, add_generation_prompt=generation_prompt, tokenize=False)

    def __call__(self, text: str) -> list[int]:
        """The ids of the observation ``text`` (tokens, in the policy's vocabulary)."""
        return self.messages([{"role": self.role, "content": text}])

    def messages(self, messages: Sequence[dict]) -> list[int]:
        """The ids of the turns ``messages`` (chat messages: a tool's results, a user's turn), each rendered by the
        template as it renders them after an assistant turn, then the generation prompt of the next assistant turn.

        Raises:
            ValueError: as the constructor's, when the template renders the turns before them differently.
        """
        full = self._render([*_PROBE, *messages], generation_prompt=True)
        if not full.startswith(self.base):
            raise ValueError("multi-turn rollout: the chat template renders the conversation before an observation differently "
                             f"once one follows ({self.base[-40:]!r} vs {full[len(self.base) - 40:len(self.base)]!r}); the "
                             "observation turn cannot be appended as tokens: use a template that renders earlier turns unchanged")
        return list(self.tokenizer.encode(self.after_eos + full[len(self.base):], add_special_tokens=False))


@dataclass
class Trajectory:
    """One trajectory: everything after the prompt, as the dock row holds it (``R`` tokens)."""

    response_ids: list[int] = field(default_factory=list)
    """Model turns and observations in order ``(R,)``."""
    log_probs: list[float] = field(default_factory=list)
    """``(R,)`` the rollout engine's log-prob of each sampled token (nats); 0.0 on observation tokens."""
    loss_mask: list[int] = field(default_factory=list)
    """``(R,)`` 1 exactly on tokens the model sampled, 0 on observation and template tokens."""
    turn_starts: list[int] = field(default_factory=list)
    """Offset in ``response_ids`` of each model turn's first token."""
    turn_ends: list[int] = field(default_factory=list)
    """Offset just after each model turn's last token (its EOS when it has one)."""
    turn_rewards: list[float] = field(default_factory=list)
    """The environment's reward of each model turn (0 for a turn it did not see)."""
    tool_calls: int = 0
    tool_errors: int = 0
    tool_calls_right: int = 0
    """Calls that ran and returned the reference answer (``Step.tool_calls_right``): a metric, not a dock column."""
    truncated: bool = False
    """The last model turn was cut at its budget (no EOS), or the token budget ended the trajectory before the environment did."""

    def add_turn(self, ids: Sequence[int], log_probs: Sequence[float]) -> None:
        self.turn_starts.append(len(self.response_ids))
        self.response_ids += ids
        self.log_probs += log_probs
        self.loss_mask += [1] * len(ids)
        self.turn_ends.append(len(self.response_ids))
        self.turn_rewards.append(0.0)

    def add_observation(self, ids: Sequence[int]) -> None:
        self.response_ids += ids
        self.log_probs += [0.0] * len(ids)
        self.loss_mask += [0] * len(ids)

    @property
    def turns(self) -> int:
        """Model turns."""
        return len(self.turn_ends)


@dataclass(frozen=True, kw_only=True)
class TurnLimits:
    """The limits of a trajectory: ``rollout.max_turns``, ``rollout.max_response_length`` (tokens
    per model turn), ``rollout.max_total_tokens`` (tokens after the prompt; 0: no limit but the turns')."""

    max_turns: int
    max_turn_tokens: int
    max_total_tokens: int = 0

    def budget(self, used: int) -> int:
        """Tokens the next model turn may sample after ``used`` tokens of the trajectory."""
        if self.max_total_tokens:
            return min(self.max_turn_tokens, self.max_total_tokens - used)
        return self.max_turn_tokens


def roll_out(
    engine: RolloutEngine, prompts: Sequence[Sequence[int]], episodes: Sequence[Episode], observe: ObservationTokens,
    limits: TurnLimits, *, temperature: float = 1.0, top_p: float = 1.0, greedy: bool = False, batch_size: int = 64,
) -> list[Trajectory]:
    """One trajectory per prompt, each with its own episode (``Environment.open``), turn by turn.

    Every turn generates the active trajectories together, grouped by their token budget
    (``limits.budget``), with ``engine.generate(prompt + response so far)``, sampled at ``temperature``
    and ``top_p`` or ``greedy`` (the evaluation's). The episodes are not closed here (their owner closes them).

    Returns:
        the trajectories, in the order of ``prompts``.

    Raises:
        ValueError: ``prompts`` and ``episodes`` differ in number.
        EnvironmentFailure: an episode's environment broke (``Episode.step``).
    """
    if len(prompts) != len(episodes):
        raise ValueError(f"multi-turn rollout: {len(prompts)} prompts but {len(episodes)} episodes")
    out = [Trajectory() for _ in prompts]
    active = list(range(len(prompts)))
    for turn in range(limits.max_turns):
        if not active:
            break
        by_budget: dict[int, list[int]] = {}  # one generate call per budget: each call has one max_new_tokens
        for i in active:
            by_budget.setdefault(limits.budget(len(out[i].response_ids)), []).append(i)
        still: list[int] = []
        for budget, rows in by_budget.items():
            samples = engine.generate([list(prompts[i]) + out[i].response_ids for i in rows], max_new_tokens=budget,
                                      temperature=temperature, top_p=top_p, greedy=greedy, batch_size=batch_size)
            texts = engine.tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
            for i, sample, text in zip(rows, samples, texts):
                trajectory = out[i]
                ids, log_probs, truncated, end_of_turn = sample.response_ids, sample.log_probs, sample.truncated, []
                cut = cut_at_calls(engine.tokenizer, getattr(episodes[i], "calls_end", None), ids, text, truncated)
                if cut is not None:  # ends at its calls: the assistant's end-of-turn token is the template's, not sampled
                    ids, log_probs, truncated, end_of_turn = ids[:cut], log_probs[:cut], False, [engine.eos_id]
                    text = engine.tokenizer.decode(ids, skip_special_tokens=True)
                trajectory.add_turn(ids, log_probs)
                if truncated:  # cut at its budget: no end of turn for an observation to follow
                    trajectory.truncated = True
                    continue
                step = episodes[i].step(text)
                trajectory.turn_rewards[-1] = step.reward
                trajectory.tool_calls += step.tool_calls
                trajectory.tool_errors += step.tool_errors
                trajectory.tool_calls_right += step.tool_calls_right
                if step.done or step.observation is None or turn == limits.max_turns - 1:
                    continue
                observation = end_of_turn + observe(step.observation)
                if limits.max_total_tokens and len(trajectory.response_ids) + len(observation) >= limits.max_total_tokens:
                    trajectory.truncated = True  # no room for the observation and a token of the next turn
                    continue
                trajectory.add_observation(observation)
                still.append(i)
        active = sorted(still)
    return out


def cut_at_calls(tokenizer: Any, calls_end: Callable[[str], int | None] | None, ids: Sequence[int], text: str,
                 truncated: bool) -> int | None:
    """How many of a turn's sampled ``ids`` to keep when it went on past its tool calls (``calls_end``: where they end in
    a turn's text, as ``Episode.calls_end``; None: the turn is kept whole): the fewest whose text holds the calls whole.
    None: no complete call, or nothing but whitespace and the end of turn after it."""
    if calls_end is None:
        return None
    find, end = calls_end, calls_end(text)
    if end is None or (not text[end:].strip() and not truncated):
        return None

    def holds_calls(k: int) -> bool:  # grows with k: a prefix holding the calls whole keeps holding them
        got = find(tokenizer.decode(ids[:k], skip_special_tokens=True))
        return got is not None and got >= end

    lo, hi = 1, len(ids)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if holds_calls(mid) else (mid + 1, hi)
    return lo


def trajectory_columns(trajectories: Sequence[Trajectory]) -> dict[str, list]:
    """The rollout's columns of ``trajectories``, one row each: the response columns (``response_ids``,
    ``rollout_log_prob``, ``truncated``) and the turn columns (``dockrl.dock.schema``)."""
    t = trajectories
    return {"response_ids": [x.response_ids for x in t], "rollout_log_prob": [x.log_probs for x in t],
            "truncated": [x.truncated for x in t], "loss_mask": [x.loss_mask for x in t], "turn_starts": [x.turn_starts for x in t],
            "turn_ends": [x.turn_ends for x in t], "turn_rewards": [x.turn_rewards for x in t],
            "tool_calls": [x.tool_calls for x in t], "tool_errors": [x.tool_errors for x in t]}


def multi_turn_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """``rollout/*`` metrics of the trajectories: turns per trajectory (mean, max), tool calls and
    tool errors per trajectory, the share of tool calls that failed, the calls per trajectory that returned the
    reference answer (``Step.tool_calls_right``), the environment's reward per trajectory (sum over its turns) and
    the tokens the model sampled per trajectory.

    Raises:
        ValueError: no trajectory.
    """
    if not trajectories:
        raise ValueError("multi-turn metrics: no trajectory was generated")
    n = len(trajectories)
    calls, errors = sum(t.tool_calls for t in trajectories), sum(t.tool_errors for t in trajectories)
    return {
        "rollout/turns_mean": sum(t.turns for t in trajectories) / n,
        "rollout/turns_max": max(t.turns for t in trajectories),
        "rollout/tool_calls_mean": calls / n,
        "rollout/tool_errors_mean": errors / n,
        "rollout/tool_error_ratio": errors / calls if calls else 0.0,
        "rollout/tool_calls_right_mean": sum(t.tool_calls_right for t in trajectories) / n,
        "rollout/env_reward_mean": sum(sum(t.turn_rewards) for t in trajectories) / n,
        "rollout/sampled_tokens_mean": sum(sum(t.loss_mask) for t in trajectories) / n,
    }
