"""What sending programs to a sandbox executor costs (``env.sandbox.backend=pod``) against running them here.

The same ``--programs`` programs (``print(sum(range(1000)))``), from ``--threads`` threads as the code scorer sends
them, run once in this machine's sandbox (``run_python``) and once through a sandbox executor process on loopback
(``dockrl sandbox serve``, ``--threads`` slots), side by side in one run. Loopback hides the network's round trip
(a pod network adds about a millisecond per program); what it shows is the HTTP and JSON around each program.

    python benchmarks/sandbox_executor.py                  # 64 programs from 4 threads
    python benchmarks/sandbox_executor.py --programs 256 --threads 8

Prints a markdown table (route, programs, seconds, programs/s, ms per program) and the ratio of the executor's
time to the local one.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from dockrl.config.env_sections import SandboxConfig
from dockrl.isolation.runner import ExecutorClient
from dockrl.isolation.sandbox import SandboxResult, run_python
from dockrl.process.env import SANDBOX_SECRET_ENV

PROGRAM = "print(sum(range(1000)))"


def timed(run, programs: int, threads: int) -> float:
    """Seconds to run ``programs`` programs through ``run`` from ``threads`` threads; every one must print 499500."""
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        results: list[SandboxResult] = list(pool.map(lambda _: run(PROGRAM), range(programs)))
    seconds = time.perf_counter() - started
    wrong = [r for r in results if r.stdout != "499500\n"]
    if wrong:
        raise RuntimeError(f"{len(wrong)} programs printed something else: {wrong[0]}")
    return seconds


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--programs", type=int, default=64)
    parser.add_argument("--threads", type=int, default=4)
    args = parser.parse_args(argv)
    limits = SandboxConfig(pod_slots=args.threads)
    secret = secrets.token_urlsafe(32)
    server = subprocess.Popen([sys.executable, "-m", "dockrl", "sandbox", "serve", "--port", "0", f"env.sandbox.pod_slots={args.threads}"],
                              env={**os.environ, SANDBOX_SECRET_ENV: secret}, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        if not line:
            raise RuntimeError("the sandbox executor did not start (run `dockrl sandbox serve` to see why)")
        client = ExecutorClient(json.loads(line)["url"], secret)
        client.info()
        seconds = {"local (run_python)": timed(lambda code: run_python(code, limits), args.programs, args.threads),
                   "executor on loopback": timed(lambda code: client.run(code, limits), args.programs, args.threads)}
    finally:
        server.terminate()
        server.wait(timeout=60)
    rows = ["| route | programs | seconds | programs/s | ms per program |", "|---|---|---|---|---|"]
    rows += [f"| {route} | {args.programs} | {s:.2f} | {args.programs / s:.1f} | {1000 * s / args.programs:.1f} |"
             for route, s in seconds.items()]
    ratio = seconds["executor on loopback"] / seconds["local (run_python)"]
    out = "\n".join(rows) + f"\n\nexecutor / local: {ratio:.2f}× the time ({args.threads} threads)\n"
    print(out)
    return out


if __name__ == "__main__":
    main()
