"""Where a model-written program runs (``env.sandbox.backend``): the one seam the ``python`` environment and the
code scorer call, and the sandbox executor's client.

* ``require_layers(limits)``: fail closed before the first program. ``local``: the layers of ``limits.require`` in
  force on this machine (``dockrl.isolation.sandbox.require_layers``); ``pod``: in force at the executor
  (``GET /info``; a pod started with ``--pod`` meets them all), whose largest limits must hold ``limits``.
* ``run_program(code, limits, stdin=)``: the program's ``SandboxResult``. ``local``: ``run_python`` here; ``pod``:
  ``POST /run`` to the executor, whose answer is the fields of the ``SandboxResult`` its ``run_python`` returned, so
  the callers read one result type either way and a program scores the same wherever it ran.

The executor is the one at ``DOCKRL_SANDBOX_URL``, reached with the secret ``DOCKRL_SANDBOX_SECRET`` (the launcher
sets both on the stages that run programs; ``dockrl.launch.distributed``). HTTP goes straight to it, never through a
proxy of the environment. Every call has a timeout: the first answer ``DOCKRL_SANDBOX_WAIT_S`` (its pod may start
after the stage's), a program its ``wall_s`` plus the executor's wait for a free slot plus ``ANSWER_MARGIN_S``.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import threading
import time
import urllib.parse
from typing import Any

from dockrl.config import ConfigError
from dockrl.config.env_sections import SandboxConfig
from dockrl.isolation import sandbox
from dockrl.isolation.executor import MAX_REQUEST_BYTES, RUN_LIMITS
from dockrl.isolation.sandbox import SandboxResult, SandboxUnavailable, run_python
from dockrl.process.env import SANDBOX_SECRET_ENV, SANDBOX_URL_ENV, SANDBOX_WAIT_ENV

logger = logging.getLogger(__name__)

ANSWER_MARGIN_S = 10.0
"""Time an executor's answer may take beyond its program's wall limit and slot wait, seconds."""
START_WAIT_S = 60.0
"""How long the first call waits for the executor to answer when ``DOCKRL_SANDBOX_WAIT_S`` is unset, seconds."""
MAX_ANSWER_BYTES = 8 << 20
"""Largest answer read: two outputs of at most ``env.sandbox.output_bytes`` (1 MiB), JSON-escaped."""


class ExecutorError(RuntimeError):
    """The sandbox executor did not answer, refused, or answered what is no result; the message names its URL.
    ``status``: the HTTP status of a refusal, None when it did not answer."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ExecutorClient:
    """The client of one sandbox executor (``dockrl.isolation.executor``); thread-safe.

    Args:
        url: ``http://host:port`` of the executor.
        secret: the run's secret of its executors.
        start_wait_s: how long the first ``info`` retries an executor that does not answer yet, seconds.

    Raises:
        ConfigError: ``url`` is not ``http://host:port``, or ``secret`` is empty (names the variables).
    """

    def __init__(self, url: str, secret: str, *, start_wait_s: float = START_WAIT_S) -> None:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        if parts.scheme != "http" or not host or parts.path not in ("", "/"):
            raise ConfigError(f"{SANDBOX_URL_ENV}: got {url!r}; expected the sandbox executor's http://host:port "
                              "(env.sandbox.backend=pod: the launcher sets it, or start `dockrl sandbox serve` and set it)")
        try:
            port = parts.port or 80
        except ValueError:
            raise ConfigError(f"{SANDBOX_URL_ENV}: got {url!r}; its port is not a number") from None
        if not secret:
            raise ConfigError(f"{SANDBOX_SECRET_ENV} is empty: env.sandbox.backend=pod needs the secret its executor was started with")
        self.url, self.host, self.port, self.start_wait_s = url.rstrip("/"), host, port, start_wait_s
        self._auth = f"Bearer {secret}"
        self._info: dict[str, Any] | None = None
        self._lock = threading.Lock()

    def _call(self, method: str, path: str, body: dict[str, Any] | None, timeout_s: float) -> dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else None
        if data is not None and len(data) > MAX_REQUEST_BYTES:
            raise ExecutorError(f"a program of {len(data)} bytes for the sandbox executor at {self.url}: at most {MAX_REQUEST_BYTES}")
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)
        try:
            conn.request(method, path, body=data, headers={"Authorization": self._auth, "Content-Type": "application/json"})
            response = conn.getresponse()
            raw = response.read(MAX_ANSWER_BYTES + 1)
        except OSError as e:  # refused, no such host, timed out, reset
            raise ExecutorError(f"the sandbox executor at {self.url} ({SANDBOX_URL_ENV}) did not answer {method} {path} within "
                                f"{timeout_s:.0f} s: {type(e).__name__}: {e}") from None
        except http.client.HTTPException as e:
            raise ExecutorError(f"the sandbox executor at {self.url} answered {method} {path} with no HTTP: {e!r}") from None
        finally:
            conn.close()
        try:
            answer = json.loads(raw) if len(raw) <= MAX_ANSWER_BYTES else None
        except ValueError:
            answer = None
        if response.status != 200 or not isinstance(answer, dict):
            said = answer.get("error") if isinstance(answer, dict) else raw[:200].decode("utf-8", "replace")
            raise ExecutorError(f"the sandbox executor at {self.url} refused {method} {path}: HTTP {response.status}: {said}",
                                response.status)
        return answer

    def info(self) -> dict[str, Any]:
        """The executor's ``GET /info`` (module docstring of ``dockrl.isolation.executor``), asked once: the first call
        retries for ``start_wait_s`` while the executor does not answer (refused, not yet in the DNS).

        Raises:
            ExecutorError: no answer within ``start_wait_s``, or a refusal (a wrong secret)."""
        with self._lock:
            if self._info is None:
                deadline = time.monotonic() + self.start_wait_s
                while True:
                    try:
                        self._info = self._call("GET", "/info", None, timeout_s=max(1.0, min(10.0, self.start_wait_s)))
                        break
                    except ExecutorError as e:
                        if e.status is not None or time.monotonic() + 1.0 > deadline:
                            waited = f" (waited {self.start_wait_s:.0f} s, {SANDBOX_WAIT_ENV})" if e.status is None else ""
                            raise ExecutorError(f"{e}{waited}", e.status) from None
                        time.sleep(1.0)
            return self._info

    def run(self, code: str, limits: SandboxConfig, *, stdin: str = "") -> SandboxResult:
        """``run_python(code, limits, stdin=stdin)`` at the executor.

        Raises:
            ExecutorError: no answer within ``limits.wall_s`` + the executor's slot wait + ``ANSWER_MARGIN_S``, a refusal
                (limits above the executor's), or an answer that is no ``SandboxResult``.
        """
        timeout_s = limits.wall_s + float(self.info()["slot_wait_s"]) + ANSWER_MARGIN_S
        answer = self._call("POST", "/run", {"code": code, "stdin": stdin, "limits": {k: getattr(limits, k) for k in RUN_LIMITS}},
                            timeout_s)
        try:
            return SandboxResult(**{**answer, "isolation": tuple(answer.get("isolation", ()))})
        except TypeError as e:
            raise ExecutorError(f"the sandbox executor at {self.url} answered no SandboxResult ({e}); is it this dockrl's?") from None


_clients: dict[tuple[str, str], ExecutorClient] = {}
_clients_lock = threading.Lock()


def executor_from_env() -> ExecutorClient:
    """The client of the executor of ``DOCKRL_SANDBOX_URL`` with ``DOCKRL_SANDBOX_SECRET`` (and ``DOCKRL_SANDBOX_WAIT_S``),
    one per process.

    Raises:
        ConfigError: a variable is unset or malformed (names it)."""
    url, secret, wait = (os.environ.get(k, "") for k in (SANDBOX_URL_ENV, SANDBOX_SECRET_ENV, SANDBOX_WAIT_ENV))
    if not url:
        raise ConfigError(f"env.sandbox.backend=pod: {SANDBOX_URL_ENV} is unset; a distributed run's launcher sets it on the stages "
                          f"that run programs; in-process, start `dockrl sandbox serve` and set it and {SANDBOX_SECRET_ENV}")
    try:
        start_wait_s = float(wait) if wait else START_WAIT_S
    except ValueError:
        raise ConfigError(f"{SANDBOX_WAIT_ENV}: got {wait!r}; expected seconds") from None
    with _clients_lock:
        if (url, secret) not in _clients:
            _clients[(url, secret)] = ExecutorClient(url, secret, start_wait_s=start_wait_s)
        return _clients[(url, secret)]


def require_layers(limits: SandboxConfig) -> tuple[str, ...]:
    """Check that the layers ``limits.require`` are in force where programs run (module docstring); returns the
    sandbox's layers in force there. An empty ``require`` is only warned about.

    Raises:
        SandboxUnavailable: a required layer is missing; with ``pod``, also the executor does not answer, or its
            largest limits are below ``limits`` (each message names the executor and what to do).
        ConfigError: with ``pod``, ``DOCKRL_SANDBOX_URL`` or its secret is unset or malformed.
    """
    if limits.backend == "local":
        return sandbox.require_layers(limits)
    client = executor_from_env()
    try:
        info = client.info()
    except ExecutorError as e:
        raise SandboxUnavailable(f"env.sandbox.backend=pod: {e}") from None
    for name in RUN_LIMITS:
        if getattr(limits, name) > info["limits"][name]:
            raise SandboxUnavailable(f"env.sandbox.{name}: got {getattr(limits, name)}; the sandbox executor at {client.url} runs "
                                     f"programs of at most {info['limits'][name]}: start it with the run's env.sandbox")
    missing = [name for name in limits.require if name not in info["layers"]]
    if missing:
        raise SandboxUnavailable(
            f"env.sandbox.require: {', '.join(missing)} not in force in the sandbox executor at {client.url} (it gives "
            f"{info['layers'] or 'none'}; its sandbox's layers: {info['isolation'] or 'none'}), so no model-written program may run "
            "there. Start it as a pod of its own (`dockrl sandbox serve --pod`, as the launcher renders it for "
            "env.sandbox.backend=pod), or on a machine that gives them, or set env.sandbox.require=[] for trusted code only")
    if not limits.require:
        logger.warning("sandbox: env.sandbox.require=[]: model-written programs run in the sandbox executor at %s with whatever it "
                       "gives (%s); for trusted code only", client.url, info["isolation"] or "no layer")
    return tuple(info["isolation"])


def run_program(code: str, limits: SandboxConfig, *, stdin: str = "") -> SandboxResult:
    """Run the Python program ``code`` in the sandbox ``limits.backend`` names (module docstring).

    Raises:
        OSError: ``local``: the sandbox itself could not start.
        ExecutorError: ``pod``: the executor did not answer in time or refused (names it).
        ConfigError: ``pod``: ``DOCKRL_SANDBOX_URL`` or its secret is unset or malformed.
    """
    if limits.backend == "pod":
        return executor_from_env().run(code, limits, stdin=stdin)
    return run_python(code, limits, stdin=stdin)

