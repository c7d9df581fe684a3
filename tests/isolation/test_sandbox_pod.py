"""The sandbox fails closed where a pod cannot give it its layers, and counts the program's processes only.

A worker pod is simulated as dockrl's pods run: uid 10001, no capabilities, and a seccomp filter like the
container runtime's default profile, which refuses ``unshare`` without CAP_SYS_ADMIN (so no user, network or
mount namespace), or an older profile that also refuses Landlock's system calls. The filter comes from
libseccomp (``pyseccomp``); each case runs in a process of its own, as the pod's worker would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

BECOME_A_POD = textwrap.dedent("""
    import ctypes, errno, os, sys
    import pyseccomp as seccomp

    def become_a_pod(refused):
        \"\"\"This process as dockrl's pods run: uid 10001, no capabilities, the system calls ``refused`` (comma-separated)
        refused as a seccomp profile refuses them.\"\"\"
        # the interpreter may live under a folder only root may enter (pyenv's under /root): in a mount namespace
        # of this process's own, such a folder becomes a searchable tmpfs with the one entry on the way bound back
        libc = ctypes.CDLL(None, use_errno=True)
        assert libc.unshare(0x00020000) == 0 and libc.mount(b"none", b"/", None, (1 << 14) | (1 << 18), None) == 0
        parts = [p for p in os.path.realpath(sys.base_prefix).split("/") if p]
        for depth in range(len(parts) - 1):
            folder, entry = "/" + "/".join(parts[:depth + 1]), parts[depth + 1]
            if not os.stat(folder).st_mode & 0o001:
                keep = os.open(folder, os.O_PATH)
                assert libc.mount(b"tmpfs", folder.encode(), b"tmpfs", 0, b"mode=0755") == 0
                os.mkdir(f"{folder}/{entry}")
                assert libc.mount(f"/proc/self/fd/{keep}/{entry}".encode(), f"{folder}/{entry}".encode(), None, 4096 | (1 << 14), None) == 0
        if refused:
            rules = seccomp.SyscallFilter(seccomp.ALLOW)
            for name in refused.split(","):
                rules.add_rule(seccomp.ERRNO(errno.EPERM), name)
            rules.load()
        os.setgroups([])
        os.setgid(10001)
        os.setuid(10001)  # dockrl's worker images run as 10001, with no capabilities
""")
"""Defines ``become_a_pod(refused)``; a script that starts with it calls it first."""

POD = BECOME_A_POD + textwrap.dedent("""
    import json, threading, time

    refused, threads, program, require = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    become_a_pod(refused)
    stop = threading.Event()
    for _ in range(threads):  # a worker's threads (torch, pyarrow, the dock client): the uid's tasks
        threading.Thread(target=stop.wait, daemon=True).start()
    from dockrl.config.env_sections import SandboxConfig
    from dockrl.envs.python_tool import PythonEnvironment
    from dockrl.isolation.sandbox import SandboxUnavailable, run_python

    limits = SandboxConfig(require=tuple(require.split(",")) if require else (), max_processes=8, wall_s=10.0)
    try:
        PythonEnvironment(limits)
        refusal = None
    except SandboxUnavailable as e:
        refusal = str(e)
    r = run_python(program, limits)
    print(json.dumps({"refusal": refusal, "ok": r.ok, "limit": r.limit, "stdout": r.stdout, "stderr": r.stderr[-500:],
                      "isolation": r.isolation}))
""")

USES_A_THREAD_AND_A_PROCESS = (
    "import subprocess, sys, threading\n"
    "t = threading.Thread(target=print, args=('thread',))\n"
    "t.start()\n"
    "t.join()\n"
    "print(subprocess.run([sys.executable, '-c', 'print(6 * 7)'], capture_output=True, text=True).stdout.strip())\n"
)
FORK_BOMB = "import os, time\nwhile True:\n    os.fork()\n"
ALL = "network,mounts,writes,processes"


def pod(refused: str, program: str = "pass", *, threads: int = 0, require: str = ALL) -> dict:
    if os.geteuid() != 0:
        pytest.skip("simulating a pod's uid 10001 needs root (CI runs as root)")
    env = {**os.environ, "TMPDIR": "/tmp", "PYTHONPATH": os.getcwd()}  # the pod's user reads the repository, writes /tmp
    done = subprocess.run([sys.executable, "-c", POD, refused, str(threads), program, require], capture_output=True, text=True,
                          timeout=120, env=env, cwd="/")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_without_namespaces_the_environment_refuses_to_start_naming_what_is_missing():
    """The runtime's default seccomp profile: no unshare. Landlock still gives the network and writes layers;
    the mount namespace and the process count are missing, and the refusal says so and how to get them."""
    out = pod("unshare")
    refusal = out["refusal"]
    assert refusal and refusal.startswith("env.sandbox.require: mounts, processes not in force on this machine"), refusal
    assert "seccompProfile" in refusal and "Operation not permitted" in refusal and "env.sandbox.require=[]" in refusal


def test_without_landlock_either_every_layer_is_named():
    out = pod("unshare,landlock_create_ruleset")
    assert out["refusal"].startswith("env.sandbox.require: network, mounts, writes, processes not in force"), out["refusal"]


def test_the_opt_out_runs_trusted_code_with_what_the_machine_gives():
    out = pod("unshare", USES_A_THREAD_AND_A_PROCESS, require="")
    assert out["refusal"] is None and out["ok"], out
    assert "mountns" not in out["isolation"] and "landlock-fs" in out["isolation"]


def test_the_workers_threads_do_not_count_against_the_programs_processes_without_a_user_namespace():
    """40 threads of the worker's uid: RLIMIT_NPROC would count them (the program's thread failing with EAGAIN,
    scored as the model's failure); without a user namespace of its own the limit is not set at all."""
    out = pod("unshare", USES_A_THREAD_AND_A_PROCESS, threads=40, require="writes")
    assert out["refusal"] is None and out["ok"] and out["stdout"] == "thread\n42\n", out


def test_in_its_own_user_namespace_the_program_counts_its_own_processes_only():
    out = pod("", USES_A_THREAD_AND_A_PROCESS, threads=40)
    assert out["refusal"] is None and out["ok"] and out["stdout"] == "thread\n42\n", out
    assert "userns-nproc" in out["isolation"] and "mountns" in out["isolation"]
    bomb = pod("", FORK_BOMB, threads=40)
    assert not bomb["ok"] and bomb["limit"] == "processes", bomb  # a limit, reported as one
