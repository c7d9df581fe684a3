"""The sandbox executor: an HTTP server that runs model-written programs in the sandbox of its own machine for
stages elsewhere (``env.sandbox.backend=pod``), so that where a worker pod cannot give the sandbox its layers, the
programs run in a pod that holds nothing worth reaching.

    DOCKRL_SANDBOX_SECRET=... dockrl sandbox serve --port 8790 [--host 0.0.0.0] [--pod] [env.sandbox.FIELD=VALUE ...]

The ``env.sandbox`` overrides are the largest memory, disk, file and process limits a program may ask for
(``POD_SIZED``: the pod's resources are sized for ``pod_slots`` such programs). The protocol is JSON over HTTP; every request but ``/healthz`` carries
``Authorization: Bearer <secret>``, the run's secret of its executors (``DOCKRL_SANDBOX_SECRET``; never the dock's token):

* ``GET /info``: ``{"layers": [...], "isolation": [...], "limits": {...}, "slots": n, "slot_wait_s": s, "pod": bool}``,
  the names of ``env.sandbox.require`` this executor meets, the sandbox's layers in force here, the largest limits
  a program may ask for;
* ``POST /run`` ``{"code": str, "stdin": str, "limits": {cpu_s, wall_s, memory_mb, output_bytes, file_mb, disk_mb,
  max_processes}}``: the program run by ``dockrl.isolation.sandbox.run_python``, answered with the fields of its
  ``SandboxResult`` (``dockrl.isolation.runner`` turns them back into one: the same result as a local run);
* ``GET /healthz``: ``ok``, unauthenticated and saying nothing else (the pod's readiness probe).

Refused: a missing or wrong secret (401), a body over ``MAX_REQUEST_BYTES`` or without a length (413, 411, unread),
limits above this executor's or outside ``env.sandbox``'s bounds (400, naming the field), and a program that found no
free slot within ``SLOT_WAIT_S`` (503). Every wait is bounded: a request's reads and writes by ``READ_TIMEOUT_S``, a
program by its ``wall_s``.

With ``--pod`` (how the launcher starts it, ``dockrl.launch.sandbox_pod``) the executor is a pod of its own, and
the pod stands in for the sandbox's layers where it cannot give them inside (``pod_problems`` checks at start what a
pod can see of itself, and the executor refuses to start when one is wrong): ``network``, no egress (its
NetworkPolicy; a connect to the API server must fail); ``mounts``, no other process, file or socket beside its own,
and no service-account token; ``writes``, a read-only root file system and one ``emptyDir`` of bounded size;
``processes``, the pod's own cgroup and limits, which no worker's threads count against. It holds no credential but
its secret (checked: no dock token, no object-store keys).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import hmac
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Mapping

from dockrl.config import ConfigError, load_config
from dockrl.config.env_sections import SANDBOX_LAYERS, SANDBOX_MAX, EnvConfig, SandboxConfig, check_env
from dockrl.isolation.sandbox import LAYERS, run_python
from dockrl.process.env import SANDBOX_SECRET_ENV

logger = logging.getLogger(__name__)

EXECUTOR_PORT = 8790
"""Port of an executor in its pod."""
MAX_REQUEST_BYTES = 4 << 20
"""Largest request body, bytes: a program and its stdin (``run_python`` keeps 1 MiB of stdin)."""
READ_TIMEOUT_S = 30.0
"""Longest a request's socket may wait for the next bytes, seconds."""
SLOT_WAIT_S = 300.0
"""Longest a program waits for a free slot before it is refused (503), seconds."""
RUN_LIMITS = ("cpu_s", "wall_s", "memory_mb", "output_bytes", "file_mb", "disk_mb", "max_processes")
"""The fields of ``env.sandbox`` a request's ``limits`` carries (all of them)."""
POD_SIZED = ("memory_mb", "disk_mb", "file_mb", "max_processes")
"""The limits an executor's pod is sized for (its own ``env.sandbox``): a program may ask for no more. Its time and
output (``wall_s``, ``cpu_s``, ``output_bytes``) size nothing and go up to ``env.sandbox``'s bounds (``SANDBOX_MAX``):
the code scorer asks for its own (``algorithm.reward_timeout_s``, 64 KiB of test reports)."""
MIN_SECRET_CHARS = 16
CREDENTIAL_PREFIXES = ("DOCKRL_DOCK_", "AWS_")
"""Names of the variables that hold a credential of the run: the dock's (its tokens, ``DOCKRL_DOCK_TOKEN``,
``DOCKRL_DOCK_DRIVER_TOKEN``, and its TLS keys) and the object store's keys: none may be in an executor pod."""
SERVICE_ACCOUNT_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
_PR_SET_DUMPABLE = 4


def layers_met(isolation: tuple[str, ...]) -> list[str]:
    """The names of ``env.sandbox.require`` that the sandbox layers ``isolation`` give (``sandbox.LAYERS``)."""
    return [name for name, gives in LAYERS.items() if set(gives) & set(isolation)]


def pod_problems(*, environ: Mapping[str, str], root: str = "/", token: Path = SERVICE_ACCOUNT_TOKEN,
                 connect_timeout_s: float = 2.0) -> list[str]:
    """What makes this pod no sandbox pod, as one phrase each (empty: none): run as root, a writable root file system,
    a service-account token, a credential of the run in ``environ``, or egress (a TCP connect to the API server at
    ``KUBERNETES_SERVICE_HOST``:``KUBERNETES_SERVICE_PORT`` that succeeds within ``connect_timeout_s``)."""
    problems: list[str] = []
    if os.geteuid() == 0:
        problems.append("it runs as root (runAsNonRoot, runAsUser)")
    if not os.statvfs(root).f_flag & os.ST_RDONLY:
        problems.append(f"its root file system {root} is writable (readOnlyRootFilesystem: true)")
    if token.exists():
        problems.append(f"a service-account token is mounted at {token.parent} (automountServiceAccountToken: false)")
    held = sorted(name for name in environ if name.startswith(CREDENTIAL_PREFIXES))
    if held:
        problems.append(f"it holds the run's credentials {held} in its environment")
    host, port = environ.get("KUBERNETES_SERVICE_HOST", ""), environ.get("KUBERNETES_SERVICE_PORT", "")
    if not host or not port.isdigit():
        problems.append("it is not in a Kubernetes pod (no KUBERNETES_SERVICE_HOST/PORT)")
    else:
        try:
            socket.create_connection((host, int(port)), timeout=connect_timeout_s).close()
            problems.append(f"it reached the API server at {host}:{port}: egress is open (its NetworkPolicy is missing, or "
                            "the cluster's network plugin does not enforce NetworkPolicies)")
        except OSError:
            pass
    return problems



def send_reply(handler: BaseHTTPRequestHandler, status: int, body: dict[str, Any] | str) -> None:
    """Answer ``handler``'s request: ``body`` as JSON (a dict) or plain text, with its length (the sandbox executor's
    and the agent gateway's replies)."""
    data = (json.dumps(body) if isinstance(body, dict) else body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json" if isinstance(body, dict) else "text/plain")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)

class ExecutorServer(ThreadingHTTPServer):
    """The executor's HTTP server (module docstring): ``serve_forever`` answers each request in a thread of its own.

    Args:
        address: (host, port) to bind; port 0 picks a free one (``server_address`` has it).
        secret: the run's secret (``MIN_SECRET_CHARS`` or more).
        ceiling: its ``env.sandbox``: the largest ``POD_SIZED`` limits a program may ask for, and how many programs run
            at once (``pod_slots``).
        pod: it runs as a pod of its own that passed ``pod_problems``: every layer is met by the pod.
        slot_wait_s: longest a program waits for a slot.

    Raises:
        ValueError: the secret is too short.
    """

    daemon_threads = False  # server_close() waits for the programs in flight: each ends, killed, within its wall limit

    def __init__(self, address: tuple[str, int], *, secret: str, ceiling: SandboxConfig, pod: bool = False,
                 slot_wait_s: float = SLOT_WAIT_S) -> None:
        if len(secret) < MIN_SECRET_CHARS:
            raise ValueError(f"{SANDBOX_SECRET_ENV}: {len(secret)} characters; expected a random secret of at least {MIN_SECRET_CHARS}")
        self.secret, self.ceiling, self.slot_wait_s = secret.encode(), ceiling, slot_wait_s
        self.slots = threading.BoundedSemaphore(ceiling.pod_slots)
        self.closing = threading.Event()
        isolation = run_python("pass", ceiling).isolation
        self.largest: dict[str, float] = {k: getattr(ceiling, k) if k in POD_SIZED else SANDBOX_MAX[k] for k in RUN_LIMITS}
        self.info = {"layers": list(SANDBOX_LAYERS) if pod else layers_met(isolation), "isolation": list(isolation),
                     "limits": self.largest, "slots": ceiling.pod_slots, "slot_wait_s": slot_wait_s, "pod": pod}
        super().__init__(address, _Handler)

    def take_slot(self) -> bool:
        """Wait for a free slot, at most ``slot_wait_s`` and not once the executor is stopping; False when none came."""
        deadline = time.monotonic() + self.slot_wait_s
        while not self.closing.is_set():
            if self.slots.acquire(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
                return True
            if time.monotonic() >= deadline:
                return False
        return False

    def stop(self) -> None:
        """Stop serving: no new program starts; ``serve_forever`` returns (call it from another thread)."""
        self.closing.set()
        self.shutdown()

    def limits_of(self, asked: Any) -> SandboxConfig:
        """The limits of a request's ``limits``, checked against ``env.sandbox``'s bounds and this executor's ceiling.

        Raises:
            ValueError: not an object of exactly ``RUN_LIMITS`` numbers, out of bounds, or above the ceiling (names the field).
        """
        if not isinstance(asked, dict) or set(asked) != set(RUN_LIMITS):
            raise ValueError(f"limits: expected an object with exactly {', '.join(RUN_LIMITS)}")
        for name, value in asked.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (name != "wall_s" and not isinstance(value, int)):
                raise ValueError(f"limits.{name}: got {value!r}; expected {'a number' if name == 'wall_s' else 'an integer'}")
            if name in POD_SIZED and value > self.largest[name]:
                raise ValueError(f"env.sandbox.{name}: got {value}; this executor runs programs of at most "
                                 f"{self.largest[name]} (its pod is sized for them)")
        changes: dict[str, Any] = {k: float(v) if k == "wall_s" else v for k, v in asked.items()}
        limits = dataclasses.replace(self.ceiling, **changes)
        check_env(EnvConfig(sandbox=limits))  # ConfigError is a ValueError
        return limits


class _Handler(BaseHTTPRequestHandler):
    server: ExecutorServer
    timeout = READ_TIMEOUT_S  # the socket's: no request holds a thread by sending slowly

    def log_message(self, format: str, *args: Any) -> None:  # the base class writes every request to stderr
        logger.debug("%s %s", self.address_string(), format % args)

    def _answer(self, status: int, body: dict[str, Any] | str) -> None:
        send_reply(self, status, body)

    def _authorized(self) -> bool:
        given = self.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode(), b"Bearer " + self.server.secret):
            return True
        logger.warning("sandbox executor: refused a request from %s to %s: %s", self.address_string(), self.path,
                       "a wrong secret" if given else "no secret")
        self._answer(401, {"error": f"wrong or missing secret: send 'Authorization: Bearer' with {SANDBOX_SECRET_ENV}"})
        return False

    def do_GET(self) -> None:
        if self.path == "/healthz":
            self._answer(200, "ok")
        elif not self._authorized():
            return
        elif self.path == "/info":
            self._answer(200, self.server.info)
        else:
            self._answer(404, {"error": f"no such path {self.path!r}: GET /info, POST /run"})

    def do_POST(self) -> None:
        if not self._authorized():
            return
        if self.path != "/run":
            self._answer(404, {"error": f"no such path {self.path!r}: GET /info, POST /run"})
            return
        length = self.headers.get("Content-Length", "")
        if not length.isdigit():
            self._answer(411, {"error": "a request body needs its Content-Length"})
            return
        if int(length) > MAX_REQUEST_BYTES:
            self.close_connection = True  # the body is never read
            self._answer(413, {"error": f"request of {length} bytes; at most {MAX_REQUEST_BYTES} (a program and its stdin)"})
            return
        try:
            request = json.loads(self.rfile.read(int(length)))
            code, stdin = request.get("code"), request.get("stdin", "")
            if not isinstance(code, str) or not isinstance(stdin, str):
                raise ValueError("code and stdin: expected strings")
            limits = self.server.limits_of(request.get("limits"))
        except (ValueError, AttributeError) as e:  # json.JSONDecodeError and ConfigError are ValueErrors
            self._answer(400, {"error": str(e)})
            return
        if not self.server.take_slot():
            self._answer(503, {"error": f"no free slot within {self.server.slot_wait_s:.0f} s (or the executor is stopping): every "
                                        "one of env.sandbox.pod_slots runs a program; raise it, or score with fewer workers"})
            return
        try:
            result = run_python(code, limits, stdin=stdin)
        except OSError as e:
            self._answer(500, {"error": f"the sandbox did not start here: {e}"})
            return
        finally:
            self.server.slots.release()
        self._answer(200, dataclasses.asdict(result))


def serve_main(argv: list[str]) -> int:
    """``dockrl sandbox serve``: the executor (module docstring) until stopped; prints one JSON line once it listens
    (``url``, ``layers``, ``isolation``). Exit 2 with one line when the secret, the limits or (``--pod``) the pod are wrong."""
    parser = argparse.ArgumentParser(prog="dockrl sandbox serve", description=serve_main.__doc__)
    parser.add_argument("--host", default="127.0.0.1", help="interface to bind (0.0.0.0 in a pod)")
    parser.add_argument("--port", type=int, default=EXECUTOR_PORT, help="0: a free one (printed)")
    parser.add_argument("--pod", action="store_true", help="a pod of its own: check it is one (no credential, no egress, "
                        "read-only root) and stand in for the layers it cannot give inside")
    parser.add_argument("overrides", nargs="*", help="env.sandbox.FIELD=VALUE: the largest limits and pod_slots")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        limits = load_config(None, args.overrides).env.sandbox
        problems = pod_problems(environ=os.environ) if args.pod else []
        if problems:
            raise ConfigError(f"--pod: this pod is no sandbox pod: {'; '.join(problems)} (render it with env.sandbox.backend=pod, "
                              "dockrl.launch.sandbox_pod)")
        server = ExecutorServer((args.host, args.port), secret=os.environ.get(SANDBOX_SECRET_ENV, ""), ceiling=limits, pod=args.pod)
    except (ValueError, OSError) as e:  # ConfigError among them; OSError: the port is taken
        print(f"dockrl sandbox serve: {e}", file=sys.stderr)
        return 2
    # a program runs as this process's user: without this it could read the secret in /proc/<pid>/environ
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    # SIGTERM (a pod deleted, a run torn down): the programs in flight end within their wall limit and are killed with
    # everything they started, instead of dying with their server and leaving their sessions behind
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.stop, daemon=True).start())
    said = {"url": f"http://{args.host}:{server.server_port}", "layers": server.info["layers"], "isolation": server.info["isolation"]}
    print(json.dumps(said), flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()  # joins the requests' threads
    return 0
