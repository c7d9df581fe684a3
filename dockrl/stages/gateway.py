"""The agent gateway: the rollout serves an OpenAI-compatible endpoint to a user's agent, a program of its own
(written against the ``openai`` client or any agent framework) that runs its own loop and tools, while the rollout
keeps every token the model was given and sampled.

Each **session** is one trajectory row of the dock. For each row the rollout starts the agent's command as a
process with ``OPENAI_BASE_URL`` (this server's ``/v1``) and ``OPENAI_API_KEY`` (the session's key) in its
environment and the session's task on its stdin, one JSON object: ``messages`` (the row's prompt as chat
messages), ``tools`` (the tools those messages were rendered with) and ``prompt`` (the prompt's text, for
``/v1/completions``). The routes (every one but ``/healthz`` with ``Authorization: Bearer <session key>``):

* ``POST /v1/chat/completions``: the request's ``messages`` must begin with the session's conversation so far (the
  task's messages, then each assistant message as returned and each message the agent sent after it); the
  messages after the last assistant turn (the agent's tool results, a user turn) are rendered by the chat template
  as ``ObservationTokens`` renders an observation and appended **as token ids**, and the model generates from the
  session's ids: the prompt is never re-tokenized text. The answer is a ``chat.completion`` whose message holds the
  turn's tool calls in the OpenAI format (``tool_calls``, ``finish_reason: "tool_calls"``) when the request gives
  ``tools`` (read with ``dockrl.envs.tool_calls``, the format of ``tool_parser``), and ``logprobs`` when asked.
* ``POST /v1/completions``: the same with text: ``prompt`` must begin with the session's text so far (its ids
  decoded, special tokens kept); what follows it is the agent's text, tokenized and appended.
* ``POST /v1/session/end``: the agent ends its session, optionally with ``{"reward": <number>}``, which then
  replaces the scorer's reward of the row. An agent that exits ends its session too.
* ``GET /healthz``: ``ok``.

The model's turns are sampled at the rollout's temperature and ``top_p`` (the trainer's log-probs are of those):
a request's sampling parameters are not used but ``max_tokens``, within the turn's budget. A turn ends at EOS, at
its budget, or where its tool calls end (``cut_at_calls``), as in the multi-turn rollout (``dockrl.stages.multi_turn``),
and the row's columns are the same: ``loss_mask`` is 1 exactly on the sampled tokens, 0 on what the agent inserted.
Requests of all sessions are batched: one ``RolloutEngine.generate`` call for the requests waiting together (when
every live session waits, or ``batch_wait_s`` after the first).

A session that misbehaves fails alone, scored ``failed_reward`` and counted (``SessionResult.failure``): an agent that
exits with an error or never sends a request, a request past ``max_turns`` model turns or ``max_total_tokens`` or after
a turn cut at its token budget (``finish_reason: "length"``), a session past ``session_timeout_s``, a generation not
done within ``request_timeout_s``. Its agent gets a JSON error
saying why (status 400; the OpenAI error format), its process is killed, and every other session goes on.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import secrets
import shlex
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Mapping, Sequence

from dockrl.config import Config, ConfigError
from dockrl.engines.rollout_engine import RolloutEngine, Sample
from dockrl.envs.tool_calls import ToolCall, ToolCallError, ToolParser, calls_end, parse_tool_calls
from dockrl.isolation.executor import send_reply
from dockrl.stages.multi_turn import ObservationTokens, Trajectory, TurnLimits, cut_at_calls

logger = logging.getLogger(__name__)

MAX_REQUEST_BYTES = 8 << 20
"""Largest request body, bytes."""
READ_TIMEOUT_S = 30.0
"""Longest a request's socket may wait for the next bytes, seconds."""
EXIT_GRACE_S = 5.0
"""How long an agent may take to exit once its session ended, seconds, before it is killed."""
STDERR_TAIL = 2000
"""Characters of a failed agent's stderr kept in its failure."""

AgentTasks = Callable[[Sequence[int]], Mapping[str, Any]]
"""The task of a row for its agent (``messages``, ``tools``), by the row's prompt ids."""


def session_metrics(sessions: int, failures: Sequence[str]) -> dict[str, float]:
    """``rollout/sessions`` and ``rollout/sessions_failed`` (each failure is in the log with why)."""
    return {"rollout/sessions": sessions, "rollout/sessions_failed": len(failures)}


@dataclass(frozen=True, kw_only=True)
class GatewayLimits:
    """The limits of a session: ``turns`` (its model turns, tokens per turn and after the prompt: the multi-turn
    rollout's ``rollout.max_turns``, ``rollout.max_response_length``, ``rollout.max_total_tokens``) and the gateway's."""

    turns: TurnLimits
    session_timeout_s: float = 300.0
    """Longest a session may last from its agent's start, seconds."""
    request_timeout_s: float = 120.0
    """Longest a request may wait for its generation, seconds."""
    max_sessions: int = 16
    """Agents running at once; the other sessions of the batch wait for a free slot."""
    batch_wait_s: float = 0.05
    """Longest the first waiting request waits for others to join its generation, seconds."""
    failed_reward: float = 0.0
    """The reward of a failed session (the scorer does not score it)."""


@dataclass
class SessionResult:
    """One finished session: its trajectory (the row's columns), its reward when the rollout decided it, why it failed."""

    trajectory: Trajectory
    reward: float | None = None
    """The agent's posted reward, ``failed_reward`` for a failed session; None: the scorer scores the last turn."""
    failure: str = ""
    """Why the session failed ("" when it did not)."""
    requests: int = 0
    """Requests the session answered with a generation."""


def build_gateway(cfg: Config, engine: RolloutEngine, prompts: Sequence[Any]) -> tuple[AgentGateway, AgentTasks] | tuple[None, None]:
    """The run's gateway (``env.agent.*``) and the tasks of its training ``prompts`` (``dockrl.run.data.Prompt``: each
    one's ``data.system_prompt`` and question as chat messages, the messages its ids render); none without an agent.

    Raises:
        ConfigError: ``data.chat_template=none`` (a prompt that is not a chat has no messages to give the agent).
    """
    a, r = cfg.env.agent, cfg.rollout
    if not a.command:
        return None, None
    if cfg.data.chat_template == "none":
        raise ConfigError("env.agent.command: the agent is given its prompt as chat messages, and data.chat_template=none "
                          "renders plain text: set data.chat_template=auto")
    system = [{"role": "system", "content": cfg.data.system_prompt}] if cfg.data.system_prompt else []
    tasks = {tuple(p.prompt_ids): {"messages": [*system, {"role": "user", "content": p.question}], "tools": []} for p in prompts}
    limits = GatewayLimits(turns=TurnLimits(max_turns=r.max_turns, max_turn_tokens=r.max_response_length, max_total_tokens=r.max_total_tokens),
                           session_timeout_s=a.session_timeout_s, request_timeout_s=a.request_timeout_s, max_sessions=a.max_sessions,
                           batch_wait_s=a.batch_wait_s, failed_reward=a.failed_reward)
    gateway = AgentGateway(engine, a.command, limits, tool_parser=cfg.env.tool_parser, temperature=r.temperature, top_p=r.top_p,
                           host=a.host)
    return gateway, lambda ids: tasks[tuple(ids)]


class SessionError(Exception):
    """A request the gateway refuses: the HTTP status, the OpenAI error's ``code``, the message."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


@dataclass
class _Job:
    """A request's generation, waiting for the engine's thread."""

    context: list[int]
    max_new_tokens: int
    since: float = field(default_factory=time.monotonic)
    done: threading.Event = field(default_factory=threading.Event)
    sample: Sample | None = None
    error: BaseException | None = None


@dataclass(eq=False)
class _Session:
    index: int
    key: str
    prompt_ids: list[int]
    task: dict
    observe: ObservationTokens
    trajectory: Trajectory = field(default_factory=Trajectory)
    messages: list[dict] = field(default_factory=list)
    """The conversation so far, as the agent must send it back (``_canonical`` form)."""
    end_of_turn: list[int] = field(default_factory=list)
    """The template's end-of-turn token when the last turn was cut at its tool calls (goes before the next observation)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    process: subprocess.Popen | None = None
    stderr: Any = None
    started: float = 0.0
    """When its agent was started (``time.monotonic``); 0: not yet."""
    ended_at: float | None = None
    reward: float | None = None
    failure: str = ""
    requests: int = 0
    waiting: bool = False

    @property
    def ended(self) -> bool:
        return self.ended_at is not None

    @property
    def finished(self) -> bool:
        """Ended, and its agent is gone (or never started)."""
        return self.ended and (self.process is None or self.process.poll() is not None)


def _canonical(message: Mapping[str, Any]) -> dict:
    """The parts of a chat message the session compares: role, content (text) and tool calls (name, arguments as
    objects), so that ``null`` and ``""`` content, key order and the client's extra fields do not differ."""
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise SessionError(400, "invalid_message", f"a message must be an object with a 'role'; got {str(message)[:200]!r}")
    content = message.get("content") or ""
    if isinstance(content, list):  # the content-parts form: its text parts
        content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function", {}) if isinstance(call, Mapping) else {}
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            pass
        calls.append({"name": function.get("name"), "arguments": arguments})
    out: dict[str, Any] = {"role": message["role"], "content": str(content)}
    if calls:
        out["tool_calls"] = calls
    return out


def _template_message(message: Mapping[str, Any]) -> dict:
    """A message the agent sent, as the chat template takes it (role and text content; a tool result's id and name)."""
    out = {"role": message["role"], "content": _canonical(message)["content"]}
    for key in ("tool_call_id", "name"):
        if isinstance(message.get(key), str):
            out[key] = message[key]
    return out


class AgentGateway:
    """Serves the sessions of a rollout to a user's agent (the module's docstring): ``run`` one batch of rows at a time.

    Args:
        engine: the rollout engine; ``run`` calls it from its own thread only.
        command: the agent's command line (``shlex`` syntax); each session runs it once.
        limits: the sessions' limits.
        tool_parser: how tool calls are read from a model turn (``dockrl.envs.tool_calls``); ``fenced`` calls a
            request's one tool with a fenced block's text as its one argument.
        temperature, top_p: the rollout's sampling.
        host: the address the server binds (the agents reach it at ``http://<host>:<port>/v1``).
        port: its port; 0: a free one.

    Raises:
        ValueError: an empty ``command``.
        OSError: the port cannot be bound.
    """

    def __init__(self, engine: RolloutEngine, command: str | Sequence[str], limits: GatewayLimits, *, tool_parser: ToolParser = "hermes",
                 temperature: float = 1.0, top_p: float = 1.0, host: str = "127.0.0.1", port: int = 0) -> None:
        self.command = shlex.split(command) if isinstance(command, str) else list(command)
        if not self.command:
            raise ValueError("agent gateway: an empty agent command")
        self.engine, self.limits, self.tool_parser, self.temperature, self.top_p = engine, limits, tool_parser, temperature, top_p
        self._observers: dict[str, ObservationTokens] = {}
        self._sessions: dict[str, _Session] = {}
        self._jobs: list[_Job] = []
        self._cond = threading.Condition()
        self._tokenizing = threading.Lock()  # the server's threads share the tokenizer: one at a time
        gateway = self

        class Handler(_Handler):
            owner = gateway

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="agent-gateway", daemon=True)
        self._thread.start()
        self.url = f"http://{host}:{self._server.server_address[1]}/v1"
        """The base URL the agents get (``OPENAI_BASE_URL``)."""

    def close(self) -> None:
        """Stop the server; idempotent."""
        self._server.shutdown()
        self._server.server_close()

    # the engine's thread ---------------------------------------------------------------------------------------

    def run(self, prompts: Sequence[Sequence[int]], tasks: Sequence[Mapping[str, Any]]) -> list[SessionResult]:
        """One session per prompt (a dock row), each served to its own agent process; returns when every session
        ended and its agent is gone.

        Args:
            prompts: each row's prompt ids ``(P,)``: the session starts from them.
            tasks: each row's task for its agent: ``messages`` (the chat messages the prompt renders), ``tools``
                (the tools it was rendered with, or none); ``prompt`` (its text) is added here.

        Returns:
            the sessions' results, in the order of ``prompts``.

        Raises:
            ValueError: ``prompts`` and ``tasks`` differ in number, or a task has no ``messages``.
            Exception: the engine's own, which fails the rollout (an agent's failure never does).
        """
        if len(prompts) != len(tasks):
            raise ValueError(f"agent gateway: {len(prompts)} prompts but {len(tasks)} tasks")
        sessions = []
        for i, (ids, task) in enumerate(zip(prompts, tasks)):
            if not isinstance(task.get("messages"), list) or not task["messages"]:
                raise ValueError(f"agent gateway: task {i} has no 'messages' (the chat messages of its prompt)")
            tools = list(task.get("tools") or [])
            full = {"messages": list(task["messages"]), "tools": tools,
                    "prompt": self.engine.tokenizer.decode(list(ids), skip_special_tokens=False)}
            s = _Session(i, secrets.token_urlsafe(24), list(ids), full, self._observer(tools),
                         messages=[_canonical(m) for m in full["messages"]])
            sessions.append(s)
        with self._cond:
            self._sessions = {s.key: s for s in sessions}
        waiting = list(sessions)
        try:
            while not all(s.finished for s in sessions):
                running = [s for s in sessions if s.started and not s.finished]
                while waiting and len(running) < self.limits.max_sessions:
                    s = waiting.pop(0)
                    self._start(s)
                    running.append(s)
                for s in running:
                    self._watch(s)
                self._serve_jobs([s for s in running if not s.ended])
        finally:
            for s in sessions:
                if s.process is not None and s.process.poll() is None:
                    s.process.kill()
                    s.process.wait(timeout=10)
                if s.stderr is not None:
                    s.stderr.close()
            with self._cond:
                self._sessions = {}
                for job in self._jobs:  # none is left but after an engine error
                    job.error = job.error or RuntimeError("the rollout stopped")
                    job.done.set()
                self._jobs = []
        return [self._result(s) for s in sessions]

    def _observer(self, tools: list[dict]) -> ObservationTokens:
        key = json.dumps(tools, sort_keys=True)
        if key not in self._observers:
            self._observers[key] = ObservationTokens(self.engine.tokenizer, tools=tools)
        return self._observers[key]

    def _start(self, s: _Session) -> None:
        env = {**os.environ, "OPENAI_BASE_URL": self.url, "OPENAI_API_KEY": s.key}
        s.stderr = tempfile.TemporaryFile()
        s.started = time.monotonic()
        try:
            s.process = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=s.stderr, env=env)
        except OSError as e:
            self._end(s, failure=f"the agent command {shlex.join(self.command)!r} did not start: {e}")
            return
        try:
            assert s.process.stdin is not None
            s.process.stdin.write(json.dumps(s.task).encode())
            s.process.stdin.close()
        except OSError:  # it exited before reading its task: its exit status says why
            pass

    def _watch(self, s: _Session) -> None:
        """End a session whose agent exited or whose time is up; kill an agent that outlived its session."""
        if s.process is None:  # it did not start
            return
        code, now = s.process.poll(), time.monotonic()
        if code is not None and not s.ended:
            if code != 0:
                self._end(s, failure=f"the agent exited with status {code}: {self._stderr_tail(s)}")
            elif not s.requests:
                self._end(s, failure="the agent exited without a request")
            else:
                self._end(s)
        elif code is None and not s.ended and now - s.started > self.limits.session_timeout_s:
            self._end(s, failure=f"the session lasted more than {self.limits.session_timeout_s:g} s (session_timeout_s); the agent's "
                      f"stderr: {self._stderr_tail(s)}")
        if code is None and s.ended and s.ended_at is not None and now - s.ended_at > EXIT_GRACE_S:
            s.process.kill()
            s.process.wait(timeout=10)

    @staticmethod
    def _stderr_tail(s: _Session) -> str:
        s.stderr.seek(0)
        text = s.stderr.read().decode(errors="replace").strip()
        return text[-STDERR_TAIL:] if text else "(no stderr)"

    def _end(self, s: _Session, *, failure: str = "", reward: float | None = None) -> None:
        with self._cond:
            if s.ended:
                return
            s.ended_at, s.failure, s.reward = time.monotonic(), failure, reward
            if failure:
                logger.warning("agent session %d failed: %s", s.index, failure)
            self._cond.notify_all()

    def _serve_jobs(self, live: list[_Session]) -> None:
        """Wait a little for requests, then generate for those waiting: at once when every live session waits, else
        once the first has waited ``batch_wait_s``."""
        with self._cond:
            if not self._jobs:
                self._cond.wait(timeout=0.02)
            if not self._jobs:
                return
            deadline = min(job.since for job in self._jobs) + self.limits.batch_wait_s
            while sum(s.waiting for s in live) < len(live) and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(timeout=left)
            jobs, self._jobs = self._jobs, []
        by_budget: dict[int, list[_Job]] = {}
        for job in jobs:
            by_budget.setdefault(job.max_new_tokens, []).append(job)
        for budget, group in by_budget.items():
            try:
                samples = self.engine.generate([job.context for job in group], max_new_tokens=budget, temperature=self.temperature,
                                               top_p=self.top_p, batch_size=len(group))
            except BaseException as e:
                for job in group:
                    job.error = e
                    job.done.set()
                raise
            for job, sample in zip(group, samples):
                job.sample = sample
                job.done.set()

    def _result(self, s: _Session) -> SessionResult:
        t = s.trajectory
        if s.failure:
            t.truncated = True
            if not t.response_ids:  # no turn: one template token, out of the loss, so that the row has a response
                t.add_observation([self.engine.eos_id])
        reward = self.limits.failed_reward if s.failure else s.reward
        return SessionResult(t, reward, s.failure, s.requests)

    # the server's threads --------------------------------------------------------------------------------------

    def session(self, authorization: str | None) -> _Session:
        """The session whose key the ``Authorization: Bearer`` header holds.

        Raises:
            SessionError: no or an unknown key (401).
        """
        key = (authorization or "").removeprefix("Bearer ").strip()
        with self._cond:
            found = next((s for k, s in self._sessions.items() if hmac.compare_digest(k, key)), None) if key else None
        if found is None:
            raise SessionError(401, "invalid_api_key", "no session has this key (OPENAI_API_KEY): it is not one the rollout gave, "
                               "or its session's batch is over")
        return found

    def end_session(self, s: _Session, body: Mapping[str, Any]) -> dict:
        """``POST /v1/session/end``: the agent ends its session, with its reward or without."""
        reward = body.get("reward")
        if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float)) or reward != reward
                                   or abs(reward) == float("inf")):
            raise SessionError(400, "invalid_reward", f"'reward' must be a finite number or absent; got {reward!r}")
        if s.ended:
            raise SessionError(400, "session_ended", f"the session has already ended ({s.failure or 'ended'})")
        self._end(s, reward=None if reward is None else float(reward))
        return {"ended": True, "turns": s.trajectory.turns}

    def chat(self, s: _Session, body: Mapping[str, Any]) -> dict:
        """``POST /v1/chat/completions`` for session ``s``."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise SessionError(400, "invalid_request", "'messages' must be a non-empty list")
        tools = body.get("tools") or []
        with self._turn(s, body):
            known = len(s.messages)
            got = [_canonical(m) for m in messages]
            for k, (have, want) in enumerate(zip(got, s.messages)):
                if have != want:
                    raise SessionError(400, "conversation_mismatch", f"message {k} differs from the session's: the conversation "
                                       f"so far is fixed (got {json.dumps(have)[:300]}, expected {json.dumps(want)[:300]})")
            if len(got) < known:
                raise SessionError(400, "conversation_mismatch", f"{len(got)} messages, fewer than the session's {known}")
            new = messages[known:]
            if s.trajectory.turns and not new:
                raise SessionError(400, "invalid_request", "no message after the assistant's last turn")
            if any(m["role"] == "assistant" for m in got[known:]):
                raise SessionError(400, "conversation_mismatch", "an assistant message the model did not write")
            with self._tokenizing:
                inserted = s.observe.messages([_template_message(m) for m in new]) if new else []
            sample = self._generate(s, inserted, body)
            s.messages += got[known:]
            with self._tokenizing:
                text, calls, finish = self._turn_text(s, sample, tools)
                logprobs = self._chat_logprobs(s) if body.get("logprobs") else None
            message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
            if calls:
                message["tool_calls"] = [{"id": f"call_{s.trajectory.turns}_{k}", "type": "function",
                                          "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for k, c in enumerate(calls)]
            s.messages.append(_canonical(message))
            choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}
            return self._answer(s, "chat.completion", choice, len(inserted))

    def complete(self, s: _Session, body: Mapping[str, Any]) -> dict:
        """``POST /v1/completions`` for session ``s``."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise SessionError(400, "invalid_request", "'prompt' must be one string")
        tok = self.engine.tokenizer
        with self._turn(s, body):
            with self._tokenizing:
                so_far = tok.decode(s.prompt_ids + s.trajectory.response_ids + s.end_of_turn, skip_special_tokens=False)
                if not prompt.startswith(so_far):
                    raise SessionError(400, "conversation_mismatch", "'prompt' must begin with the session's text so far (its token "
                                       f"ids decoded, special tokens kept); it differs at character {_differs_at(prompt, so_far)}")
                added = prompt[len(so_far):]
                if s.trajectory.turns and not added:
                    raise SessionError(400, "invalid_request", "no text after the model's last turn")
                inserted = list(tok.encode(added, add_special_tokens=False)) if added else []
            sample = self._generate(s, inserted, body, end_of_turn=False)
            with self._tokenizing:
                text, _, finish = self._turn_text(s, sample, [])
                logprobs = None
                if body.get("logprobs") is not None:
                    start, end = s.trajectory.turn_starts[-1], s.trajectory.turn_ends[-1]
                    ids = s.trajectory.response_ids[start:end]
                    logprobs = {"tokens": [tok.decode([i]) for i in ids], "token_logprobs": s.trajectory.log_probs[start:end],
                                "top_logprobs": None, "text_offset": None}
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs}
            return self._answer(s, "text_completion", choice, len(inserted))

    def _turn(self, s: _Session, body: Mapping[str, Any]) -> _SessionTurn:
        if body.get("stream"):
            raise SessionError(400, "unsupported", "'stream' is not supported: the gateway answers whole turns")
        if body.get("n", 1) != 1:
            raise SessionError(400, "unsupported", f"'n' must be 1 (each session is one trajectory); got {body.get('n')!r}")
        return _SessionTurn(s)

    def _generate(self, s: _Session, inserted: list[int], body: Mapping[str, Any], *, end_of_turn: bool = True) -> Sample:
        """Append the agent's ``inserted`` ids (after the end-of-turn token of a turn cut at its calls, when
        ``end_of_turn``), check the session's budget, and sample the next turn from the session's ids."""
        if s.ended:
            raise SessionError(400, "session_ended", f"the session has ended ({s.failure or 'ended'})")
        t, turns = s.trajectory, self.limits.turns
        if t.truncated:
            self._end(s, failure="a request after a turn cut at its token budget (rollout.max_response_length or max_total_tokens): "
                      "the session was over")
            raise SessionError(400, "session_budget", s.failure)
        if t.turns >= turns.max_turns:
            self._end(s, failure=f"a request past the session's {turns.max_turns} model turns (rollout.max_turns)")
            raise SessionError(400, "session_budget", s.failure)
        if t.turns:
            inserted = (s.end_of_turn if end_of_turn else []) + inserted
        if turns.max_total_tokens and len(t.response_ids) + len(inserted) >= turns.max_total_tokens:
            self._end(s, failure=f"the session's tokens would reach rollout.max_total_tokens={turns.max_total_tokens}")
            raise SessionError(400, "session_budget", s.failure)
        if t.turns:
            t.add_observation(inserted)
        elif inserted:
            raise SessionError(400, "conversation_mismatch", "the first request must hold the task's messages only")
        s.end_of_turn = []
        budget = turns.budget(len(t.response_ids))
        asked = body.get("max_completion_tokens", body.get("max_tokens"))
        if asked is not None:
            if isinstance(asked, bool) or not isinstance(asked, int) or asked < 1:
                raise SessionError(400, "invalid_request", f"'max_tokens' must be a positive integer; got {asked!r}")
            budget = min(budget, asked)
        job = _Job(s.prompt_ids + t.response_ids, budget)
        with self._cond:
            s.waiting = True
            self._jobs.append(job)
            self._cond.notify_all()
        try:
            if not job.done.wait(self.limits.request_timeout_s):
                self._end(s, failure=f"a generation was not done within {self.limits.request_timeout_s:g} s (request_timeout_s)")
                raise SessionError(504, "timeout", s.failure)
        finally:
            s.waiting = False
        if job.error is not None or job.sample is None:
            self._end(s, failure=f"the rollout's engine failed: {job.error}")
            raise SessionError(500, "engine_failed", s.failure)
        s.requests += 1
        return job.sample

    def _turn_text(self, s: _Session, sample: Sample, tools: list) -> tuple[str, list[ToolCall], str]:
        """Add the sampled turn to the trajectory (cut where its tool calls end, when ``tools`` are given); its text, its
        readable tool calls and the finish reason."""
        tok = self.engine.tokenizer
        ids, log_probs, truncated = sample.response_ids, sample.log_probs, sample.truncated
        text = tok.decode(ids, skip_special_tokens=True)
        fenced = _fenced_tool(tools)
        if tools and (self.tool_parser != "fenced" or fenced):
            cut = cut_at_calls(tok, lambda turn: calls_end(turn, self.tool_parser), ids, text, truncated)
            if cut is not None:
                ids, log_probs, truncated, s.end_of_turn = ids[:cut], log_probs[:cut], False, [self.engine.eos_id]
                text = tok.decode(ids, skip_special_tokens=True)
            parsed = parse_tool_calls(text, self.tool_parser, fenced_tool=fenced or ("", ""))
        else:
            parsed = []
        s.trajectory.add_turn(ids, log_probs)
        s.trajectory.truncated = truncated
        calls = [c for c in parsed if isinstance(c, ToolCall)]
        s.trajectory.tool_calls += len(parsed)
        s.trajectory.tool_errors += sum(isinstance(c, ToolCallError) for c in parsed)
        content = text
        if calls and self.tool_parser == "hermes":
            content = text[:text.find("<tool_call>")].strip()
        finish = "length" if truncated else "tool_calls" if calls else "stop"
        return content, calls, finish

    def _chat_logprobs(self, s: _Session) -> dict:
        t, tok = s.trajectory, self.engine.tokenizer
        start, end = t.turn_starts[-1], t.turn_ends[-1]
        content = []
        for i, lp in zip(t.response_ids[start:end], t.log_probs[start:end]):
            token = tok.decode([i])
            content.append({"token": token, "logprob": lp, "bytes": list(token.encode()), "top_logprobs": []})
        return {"content": content}

    def _answer(self, s: _Session, kind: str, choice: dict, inserted: int) -> dict:
        t = s.trajectory
        sampled = t.turn_ends[-1] - t.turn_starts[-1]
        prompt_tokens = len(s.prompt_ids) + t.turn_starts[-1]
        return {"id": f"dockrl-{s.index}-{t.turns}", "object": kind, "created": int(time.time()), "model": "dockrl",
                "choices": [choice], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": sampled,
                                               "total_tokens": prompt_tokens + sampled},
                "dockrl": {"inserted_tokens": inserted, "turn": t.turns}}


class _SessionTurn:
    """One request of a session at a time: a second while one is in flight is refused."""

    def __init__(self, s: _Session) -> None:
        self.s = s

    def __enter__(self) -> None:
        if not self.s.lock.acquire(blocking=False):
            raise SessionError(400, "request_in_flight", "a request of this session is already in flight: send one at a time")

    def __exit__(self, *_: object) -> None:
        self.s.lock.release()


def _fenced_tool(tools: Sequence[Mapping[str, Any]]) -> tuple[str, str] | None:
    """``(name, argument)`` a fenced block calls: the request's one tool, with one required argument; else None."""
    if len(tools) != 1:
        return None
    function = tools[0].get("function", {})
    required = function.get("parameters", {}).get("required", [])
    return (function.get("name", ""), required[0]) if len(required) == 1 else None


def _differs_at(a: str, b: str) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class _Handler(BaseHTTPRequestHandler):
    owner: AgentGateway
    timeout = READ_TIMEOUT_S
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        logger.debug("agent gateway: " + format, *args)

    def _send(self, status: int, body: dict | str) -> None:
        send_reply(self, status, body)

    def _error(self, e: SessionError) -> None:
        self._send(e.status, {"error": {"message": str(e), "type": "invalid_request_error" if e.status < 500 else "server_error",
                                        "param": None, "code": e.code}})

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/healthz":
            self._send(200, "ok")
        else:
            self._error(SessionError(404, "not_found", f"no route GET {self.path}"))

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        routes = {"/v1/chat/completions": AgentGateway.chat, "/v1/completions": AgentGateway.complete,
                  "/v1/session/end": AgentGateway.end_session}
        try:
            route = routes.get(self.path.split("?")[0])
            if route is None:
                raise SessionError(404, "not_found", f"no route POST {self.path}; the gateway serves {', '.join(routes)}")
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                raise SessionError(411, "invalid_request", "a request body needs a Content-Length")
            if int(length) > MAX_REQUEST_BYTES:
                self.close_connection = True
                raise SessionError(413, "invalid_request", f"a body of more than {MAX_REQUEST_BYTES} bytes")
            session = self.owner.session(self.headers.get("Authorization"))
            try:
                body = json.loads(self.rfile.read(int(length)) or b"{}")
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise SessionError(400, "invalid_json", f"the body is not JSON ({e})") from None
            if not isinstance(body, dict):
                raise SessionError(400, "invalid_json", "the body must be a JSON object")
            self._send(200, route(self.owner, session, body))
        except SessionError as e:
            self._error(e)
