"""The sandbox executor (dockrl.isolation.executor) and its client (dockrl.isolation.runner), as real processes:
a program gives the same result, and the same reward, run here or through the executor; a wrong secret, an
oversize request and limits above the executor's are refused; an executor that does not answer is an error naming
it within its timeout; ``--pod`` refuses to start where the process is no sandbox pod."""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import socket
import subprocess
import sys
import time

import pytest
from test_sandbox_pod import BECOME_A_POD

from dockrl.config import ConfigError
from dockrl.config.env_sections import SANDBOX_LAYERS, SandboxConfig
from dockrl.envs.python_tool import PythonEnvironment
from dockrl.isolation import runner
from dockrl.isolation.executor import MAX_REQUEST_BYTES, pod_problems
from dockrl.isolation.runner import ExecutorClient, ExecutorError, require_layers, run_program
from dockrl.isolation.sandbox import SandboxUnavailable, run_python
from dockrl.process.env import SANDBOX_SECRET_ENV, SANDBOX_URL_ENV, SANDBOX_WAIT_ENV
from dockrl.rewards.code import CodeScorer, reference_solutions

LIMITS = SandboxConfig(cpu_s=1, wall_s=3.0, memory_mb=256, output_bytes=1000, max_processes=12)
POD = dataclasses.replace(LIMITS, backend="pod")


def same(result):
    return dataclasses.replace(result, seconds=0.0)


PROGRAMS = [
    ("print(6 * 7)", ""),
    ("import sys\nprint(sys.stdin.read()[::-1])", "olleh"),
    ("raise ValueError('no')", ""),
    ("import time\ntime.sleep(60)", ""),
    ("x = bytearray(10 * 1024**3)", ""),
    ("print('y' * 5000)", ""),
    ("import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)", ""),
]


@pytest.mark.parametrize(("code", "stdin"), PROGRAMS)
def test_a_program_gives_the_same_result_here_and_through_the_executor(code, stdin, sandbox_pod_env):
    here = run_python(code, LIMITS, stdin=stdin)
    there = run_program(code, POD, stdin=stdin)
    assert same(there) == same(here)
    assert there.isolation  # the executor's own sandbox's layers, as it ran the program


def test_the_code_scorers_rewards_are_the_same_through_the_executor(sandbox_pod_env):
    references = reference_solutions()
    wrong = {task: answer.replace("return", "return 1 + ", 1) for task, answer in references.items()}
    responses = [*references.values(), *wrong.values(), "no program"]
    tasks = [*references, *wrong, next(iter(references))]
    local, pod = CodeScorer(timeout_s=3.0), CodeScorer(timeout_s=3.0, sandbox_backend="pod")
    rewards = local.score(responses, tasks)
    assert pod.score(responses, tasks) == rewards
    assert rewards[:10] == [1.0] * 10 and min(rewards[10:]) < 1.0
    assert pod.counters() == local.counters()


def test_the_python_environments_observations_are_the_same_through_the_executor(sandbox_pod_env):
    local, pod = PythonEnvironment(LIMITS).open(""), PythonEnvironment(POD).open("")
    for code, _ in PROGRAMS:
        turn = f"<tool_call>{json.dumps({'name': 'python', 'arguments': {'code': code}})}</tool_call>"
        there, here = pod.step(turn), local.step(turn)
        assert (there.observation, there.tool_errors) == (here.observation, here.tool_errors)


def test_the_executor_meets_what_this_machine_gives_and_names_itself_when_it_does_not(sandbox_pod_env):
    assert require_layers(POD) == require_layers(LIMITS)  # a process of this machine: its layers, no more
    with pytest.raises(SandboxUnavailable, match=rf"env.sandbox.memory_mb: got 4096; the sandbox executor at {sandbox_pod_env.url} runs "
                                                 "programs of at most 512"):
        require_layers(dataclasses.replace(POD, memory_mb=4096))


def test_a_layer_the_executor_does_not_give_is_refused_naming_it(sandbox_pod_env, monkeypatch):
    client = runner.executor_from_env()
    info = client.info()
    monkeypatch.setitem(info, "layers", [name for name in SANDBOX_LAYERS if name != "network"])  # as a pod without them says
    with pytest.raises(SandboxUnavailable, match=rf"env.sandbox.require: network not in force in the sandbox executor at {sandbox_pod_env.url}"):
        require_layers(POD)


def test_a_wrong_or_missing_secret_is_refused(sandbox_executor):
    with pytest.raises(ExecutorError, match="refused GET /info: HTTP 401: wrong or missing secret") as refused:
        ExecutorClient(sandbox_executor.url, "not-the-secret-of-this-run").run("print(1)", LIMITS)
    assert refused.value.status == 401
    host, port = sandbox_executor.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("POST", "/run", body=json.dumps({"code": "print(1)", "limits": {}}))  # no Authorization at all
    assert conn.getresponse().status == 401
    conn.close()


def test_an_oversize_request_is_refused_unread(sandbox_executor):
    host, port = sandbox_executor.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.putrequest("POST", "/run")
    conn.putheader("Authorization", f"Bearer {sandbox_executor.secret}")
    conn.putheader("Content-Length", str(MAX_REQUEST_BYTES + 1))
    conn.endheaders()  # and not one byte of the body: the executor answers without reading it
    response = conn.getresponse()
    assert response.status == 413 and "at most" in json.loads(response.read())["error"]
    conn.close()
    with pytest.raises(ExecutorError, match=f"at most {MAX_REQUEST_BYTES}"):  # the client does not send one
        ExecutorClient(sandbox_executor.url, sandbox_executor.secret).run("#" * MAX_REQUEST_BYTES, LIMITS)


def test_limits_above_the_executors_or_out_of_bounds_are_refused_naming_the_field(sandbox_executor):
    client = ExecutorClient(sandbox_executor.url, sandbox_executor.secret)
    with pytest.raises(ExecutorError, match="HTTP 400: env.sandbox.disk_mb: got 4096; this executor runs programs of at most 64"):
        client.run("print(1)", dataclasses.replace(LIMITS, disk_mb=4096))
    with pytest.raises(ExecutorError, match="HTTP 400: env.sandbox.wall_s: got -1.0; expected seconds > 0"):
        client.run("print(1)", dataclasses.replace(LIMITS, wall_s=-1.0))


def test_an_executor_that_does_not_answer_is_an_error_naming_it_within_its_wait():
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{closed.getsockname()[1]}"
    closed.close()  # nothing listens there
    started = time.monotonic()
    with pytest.raises(ExecutorError, match=rf"the sandbox executor at {url} \({SANDBOX_URL_ENV}\) did not answer GET /info .*"
                                            rf"ConnectionRefusedError.*waited 2 s, {SANDBOX_WAIT_ENV}"):
        ExecutorClient(url, "any-secret-at-all-of-16", start_wait_s=2.0).run("print(1)", POD)
    assert time.monotonic() - started < 5.0
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(ExecutorError, match=rf"the sandbox executor at {url} .*did not answer GET /info within 2 s: TimeoutError"):
            ExecutorClient(url, "any-secret-at-all-of-16", start_wait_s=2.0).info()
        assert time.monotonic() - started < 6.0


def test_a_stage_with_backend_pod_and_no_executor_configured_fails_at_start_naming_the_variable(monkeypatch):
    monkeypatch.delenv(SANDBOX_URL_ENV, raising=False)
    with pytest.raises(ConfigError, match=f"env.sandbox.backend=pod: {SANDBOX_URL_ENV} is unset"):
        PythonEnvironment(POD)


def test_the_executor_refuses_a_short_secret_and_pod_mode_outside_a_sandbox_pod():
    env = {**os.environ, SANDBOX_SECRET_ENV: "short"}
    proc = subprocess.run([sys.executable, "-m", "dockrl", "sandbox", "serve", "--port", "0"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and f"{SANDBOX_SECRET_ENV}: 5 characters" in proc.stderr and "Traceback" not in proc.stderr
    env[SANDBOX_SECRET_ENV] = "a-secret-long-enough-for-it"
    proc = subprocess.run([sys.executable, "-m", "dockrl", "sandbox", "serve", "--port", "0", "--pod"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "--pod: this pod is no sandbox pod" in proc.stderr and "Traceback" not in proc.stderr


def test_pod_problems_name_each_way_a_pod_is_no_sandbox_pod(tmp_path):
    with socket.socket() as api_server:  # a reachable API server: egress is open
        api_server.bind(("127.0.0.1", 0))
        api_server.listen()
        environ = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(api_server.getsockname()[1]),
                   "DOCKRL_DOCK_TOKEN": "x", "AWS_SECRET_ACCESS_KEY": "y"}
        token = tmp_path / "token"
        token.write_text("a service-account token")
        said = "\n".join(pod_problems(environ=environ, root=str(tmp_path), token=token))
    assert f"its root file system {tmp_path} is writable" in said
    assert "a service-account token is mounted" in said
    assert "credentials ['AWS_SECRET_ACCESS_KEY', 'DOCKRL_DOCK_TOKEN']" in said
    assert "egress is open" in said
    closed = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": environ["KUBERNETES_SERVICE_PORT"]}  # as no egress
    said = "\n".join(pod_problems(environ=closed, root=str(tmp_path), token=tmp_path / "none"))
    assert "egress" not in said and "token" not in said and "credentials" not in said
    assert "not in a Kubernetes pod" in "\n".join(pod_problems(environ={}, root=str(tmp_path), token=tmp_path / "none"))


READ_THE_SERVERS_ENVIRONMENT = ("import os\ntry:\n    print(open(f'/proc/{os.getppid()}/environ', 'rb').read())\n"
                                "except OSError as e:\n    print('refused', e.errno)")
"""A program that reads its parent's environment: the executor's server, whose environment holds the secret."""


def test_a_program_cannot_read_the_executors_secret_from_its_server(sandbox_pod_env):
    """Here Landlock's domain and the server's capabilities refuse it (below: a pod without them)."""
    result = run_program(READ_THE_SERVERS_ENVIRONMENT, POD)
    assert result.stdout == "refused 13\n" and sandbox_pod_env.secret not in result.stdout + result.stderr


def test_in_a_pod_without_layers_a_program_cannot_read_the_secret_either():
    """The executor as a pod whose runtime gives no layer inside (uid 10001, no capabilities, seccomp refusing ``unshare``
    and Landlock): its programs share its uid, user namespace and (no) capabilities; the server's not being dumpable is
    what keeps its ``/proc/<pid>/environ`` from them."""
    if os.geteuid() != 0:
        pytest.skip("simulating a pod's uid 10001 needs root (CI runs as root)")
    secret = "executor-secret-of-a-pod-without-layers"
    script = BECOME_A_POD + ("become_a_pod(sys.argv[1])\n"
                             "os.execv(sys.executable, [sys.executable, '-m', 'dockrl', 'sandbox', 'serve', '--port', '0'])\n")
    env = {**os.environ, SANDBOX_SECRET_ENV: secret, "TMPDIR": "/tmp",  # the pod's user reads the repository, writes /tmp
           "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), os.getcwd()) if p)}
    proc = subprocess.Popen([sys.executable, "-c", script, "unshare,landlock_create_ruleset"], env=env, cwd="/", text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        if not line:
            proc.wait(timeout=30)
            pytest.fail(f"the executor did not start: {proc.stderr.read()}")
        result = ExecutorClient(json.loads(line)["url"], secret).run(READ_THE_SERVERS_ENVIRONMENT, dataclasses.replace(LIMITS, require=()))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert not {"landlock-fs", "userns+netns", "netns"} & set(result.isolation), result.isolation  # no layer inside: the pod's case
    assert result.stdout == "refused 13\n" and secret not in result.stdout + result.stderr, result
