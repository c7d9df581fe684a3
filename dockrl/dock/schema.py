"""The experience table's column schema: declared once, versioned, checked on every put.

Each column has an Arrow type, the stage that produces it and the stages that consume it
(docs/design.md §1). Token columns are variable-length lists: no padding is stored.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pyarrow as pa


@dataclass(frozen=True, kw_only=True)
class Column:
    """One column of the experience table."""

    name: str
    """Column name, e.g. ``response_ids``."""
    type: pa.DataType
    """Arrow type of one cell."""
    producer: str
    """Stage that writes the column (``driver`` for inputs)."""
    doc: str
    """What a cell holds, with its unit or shape."""
    rewritable: bool = False
    """A later put may overwrite a cell (a stage's own carry-over between its passes); no stage
    claims on such a column. Every other cell is written once."""


@dataclass(frozen=True)
class Schema:
    """A versioned set of columns and the consumers (stages) that claim rows."""

    version: int
    columns: tuple[Column, ...]
    consumers: tuple[str, ...]

    def __post_init__(self) -> None:
        names = [c.name for c in self.columns]
        if len(set(names)) != len(names):
            raise ValueError(f"schema v{self.version}: duplicate column names in {names}")

    @functools.cached_property  # a put and a read ask for it per column
    def _by_name(self) -> dict[str, Column]:
        return {c.name: c for c in self.columns}

    def column(self, name: str) -> Column:
        """The column called ``name``.

        Raises:
            KeyError: unknown column; the message lists the known ones.
        """
        found = self._by_name.get(name)
        if found is not None:
            return found
        raise KeyError(f"unknown column {name!r}; schema v{self.version} has {[c.name for c in self.columns]}")

    def arrow_schema(self, names: list[str] | tuple[str, ...]) -> pa.Schema:
        return pa.schema([pa.field(n, self.column(n).type) for n in names])


_TOKENS = pa.list_(pa.int32())
_FLOATS = pa.list_(pa.float32())

GRPO_SCHEMA = Schema(
    version=5,  # v2: advantages per token; v3: partial rollout's carry-over columns; v4: multi-turn trajectories, weight versions;
    # v5: the teacher's log-probs (on-policy distillation), the gateway's session_reward
    columns=(
        Column(name="prompt_ids", type=_TOKENS, producer="driver", doc="chat-formatted prompt token ids (P,)"),
        Column(name="ground_truth", type=pa.string(), producer="driver", doc="reference final answer"),
        Column(name="released", type=pa.bool_(), producer="driver",
               doc="the rollout may sample the row (dynamic sampling: the driver writes it for the first round, the "
                   "advantage stage for each later round it releases)"),
        Column(name="response_ids", type=_TOKENS, producer="rollout", doc="sampled response token ids (R,), EOS included when emitted"),
        Column(name="truncated", type=pa.bool_(), producer="rollout", doc="response hit the length limit before EOS"),
        Column(name="rollout_log_prob", type=_FLOATS, producer="rollout", doc="per-token log-prob under the rollout engine (R,), nats"),
        Column(name="weight_version", type=_TOKENS, producer="rollout",
               doc="per token (R,): the actor updates in the weights that sampled it (0: the initial ones); partial "
                   "rollout's segments differ"),
        # partial rollout (rollout.partial_tokens): the rollout's own carry-over between its passes, read by no other
        # stage; their producer is no consumer, so they never count toward finishing a rollout row
        Column(name="rollout_cut", type=pa.bool_(), producer="rollout_partial", rewritable=True,
               doc="partial rollout: the response was cut at rollout.partial_tokens and waits for the rollout's next pass "
                   "(written for every row in the pass for its iteration, false again once it is finished)"),
        Column(name="partial_ids", type=_TOKENS, producer="rollout_partial", rewritable=True,
               doc="partial rollout: the tokens of a cut response so far (rollout.partial_tokens per pass,)"),
        Column(name="partial_log_prob", type=_FLOATS, producer="rollout_partial", rewritable=True,
               doc="partial rollout: their per-token log-probs, each under the weights of the pass that sampled it, nats"),
        Column(name="partial_weight_version", type=_TOKENS, producer="rollout_partial", rewritable=True,
               doc="partial rollout: their per-token weight versions (as weight_version)"),
        # multi-turn rollout (an environment): one trajectory per row; response_ids holds the model's turns and the
        # observations between them, rollout_log_prob is 0.0 on observation tokens (docs/agents.md). Written in the
        # rollout's put of the row, but their producer is no consumer: a single-turn row, which lacks them, still
        # counts as finished by the rollout once its response columns are written
        Column(name="loss_mask", type=pa.list_(pa.int8()), producer="rollout_turns",
               doc="multi-turn: 1 exactly on the tokens the model sampled, 0 on observation and template tokens (R,)"),
        Column(name="turn_starts", type=_TOKENS, producer="rollout_turns",
               doc="multi-turn: offset in response_ids of each model turn's first token (turns,)"),
        Column(name="turn_ends", type=_TOKENS, producer="rollout_turns",
               doc="multi-turn: offset in response_ids just after each model turn's last token (turns,)"),
        Column(name="turn_rewards", type=_FLOATS, producer="rollout_turns", doc="multi-turn: the environment's reward of each model turn (turns,)"),
        Column(name="tool_calls", type=pa.int32(), producer="rollout_turns", doc="multi-turn: tool calls in the trajectory's model turns"),
        Column(name="tool_errors", type=pa.int32(), producer="rollout_turns",
               doc="multi-turn: of those, the calls that failed (unparsable, unknown tool, error, sandbox limit)"),
        Column(name="session_reward", type=pa.float32(), producer="rollout_turns",
               doc="gateway (env.agent.command): the session's reward when the rollout decided it (the agent posted one, or "
                   "the session failed: env.agent.failed_reward); null: the scorer scores the last turn"),
        Column(name="rm_model_score", type=pa.float32(), producer="reward_model",
               doc="reward model's score of prompt + response (reward_model.enable only)"),
        Column(name="rm_score", type=pa.float32(), producer="reward",
               doc="reward of the response: the rule reward, or rule_weight · rule + model_weight · rm_model_score; "
                   "multi-turn: of the last model turn, plus the sum of turn_rewards"),
        Column(name="correct", type=pa.bool_(), producer="reward", doc="final answer matches the ground truth"),
        Column(name="advantages", type=_FLOATS, producer="advantage",
               doc="per-token advantage (R,) of algorithm.adv_estimator; outcome estimators repeat the response's value"),
        Column(name="ref_log_prob", type=_FLOATS, producer="reference", doc="per-token log-prob under the frozen reference (R,), nats"),
        Column(name="teacher_log_prob", type=_FLOATS, producer="teacher",
               doc="per-token log-prob under the distillation teacher (R,), nats (teacher.enable only)"),
        Column(name="old_log_prob", type=_FLOATS, producer="actor", doc="per-token log-prob under the actor before the update (R,), nats"),
        Column(name="values", type=_FLOATS, producer="critic", doc="per-token value V(s_t) under the critic before its update (R,)"),
        Column(name="returns", type=_FLOATS, producer="advantage", doc="per-token return (R,): GAE's A_t + V(s_t), else the advantages"),
    ),
    # the critic consumes twice per iteration: responses (→ values), then returns (its update)
    consumers=("rollout", "reward_model", "reward", "advantage", "reference", "teacher", "actor", "critic", "critic_update"),
)
