"""This tree's dockrl against another commit's (``--ref``, e.g. main before a change), on
``benchmarks/vs_trl.py``'s run: its dockrl sides, tokens/s and peak RSS, both trees in one run.

The commit is checked out in a temporary git worktree (removed at the end) and each tree's own
``vs_trl.py`` runs with that tree first on ``PYTHONPATH``, in this environment (the same packages).
Runs alternate (the commit's, this tree's, the commit's, ...) so that machine noise hits both alike;
each ``vs_trl.py`` run counts its iterations after a warm-up (its docstring).

    python benchmarks/vs_ref.py --ref 1b966dd --model .cache/dockrl/models/SmolLM2-135M-Instruct
    python benchmarks/vs_ref.py --ref main --quick        # the tiny random model, seconds
    python benchmarks/vs_ref.py --ref 1b966dd --model ... --this-args="--gradient-checkpointing off"

``--this-args`` go to this tree's ``vs_trl.py`` only (a flag the commit's does not have, such as
``--gradient-checkpointing off`` for a commit that did not checkpoint). Prints one table: per side
and tree the median tokens/s and peak RSS (the process tree's, GB) of its runs, and this tree's
ratio to the commit's.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _vs_trl(tree: Path, args: argparse.Namespace, extra: list[str]) -> dict[str, dict[str, float]]:
    """One run of ``tree``'s vs_trl.py over ``args.sides``: each side's result (vs_trl's ``run 1/1 side: {...}`` lines)."""
    common = ["--sides", args.sides, "--repeats", "1", "--iterations", str(args.iterations)]
    common += ["--quick"] if args.quick else ["--model", str(Path(args.model).resolve())]
    cmd = [sys.executable, str(tree / "benchmarks" / "vs_trl.py"), *common, *extra]
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH", "")])])}
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    if proc.returncode:
        raise RuntimeError(f"vs_ref: {shlex.join(cmd)} (in {tree}) failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    results = {}
    for line in proc.stderr.splitlines():
        if line.startswith("run 1/1 "):
            side, _, payload = line.removeprefix("run 1/1 ").partition(": ")
            results[side] = json.loads(payload)
    missing = set(args.sides.split(",")) - set(results)
    if missing:
        raise RuntimeError(f"vs_ref: {tree}'s vs_trl.py printed no result for {sorted(missing)}:\n{proc.stderr[-3000:]}")
    return results


def table(ref: str, runs: dict[str, list[dict[str, dict[str, float]]]]) -> str:
    """Per side, each tree's median tokens/s and peak RSS over its runs, and this tree / the commit."""
    head = ["side", "runs", f"tokens/s {ref}", "tokens/s this", "tokens/s this / ref", f"peak RSS GB {ref}", "peak RSS GB this", "RSS this / ref"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for side in runs["this"][0]:
        m = {tree: {k: statistics.median(r[side].get(k, float("nan")) for r in runs[tree]) for k in ("tokens_per_s", "peak_rss_gb")}
             for tree in ("ref", "this")}
        lines.append(f"| {side} | {len(runs['this'])} | {m['ref']['tokens_per_s']:.1f} | {m['this']['tokens_per_s']:.1f} | "
                     f"{m['this']['tokens_per_s'] / m['ref']['tokens_per_s']:.2f}x | {m['ref']['peak_rss_gb']:.2f} | "
                     f"{m['this']['peak_rss_gb']:.2f} | {m['this']['peak_rss_gb'] / m['ref']['peak_rss_gb']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ref", required=True, help="the commit to compare with (anything git rev-parse takes)")
    parser.add_argument("--model", default="", help="HF model directory (vs_trl.py's --model)")
    parser.add_argument("--quick", action="store_true", help="vs_trl.py's --quick: the tiny random model")
    parser.add_argument("--sides", default="dockrl-hf,dockrl-vllm", help="vs_trl.py's --sides (dockrl's)")
    parser.add_argument("--iterations", type=int, default=3, help="per run, the first a warm-up")
    parser.add_argument("--repeats", type=int, default=1, help="runs per tree, alternating")
    parser.add_argument("--this-args", default="", help="more vs_trl.py arguments for this tree only (shell words)")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="per vs_trl.py run")
    args = parser.parse_args(argv)
    if not args.model and not args.quick:
        parser.error("--model is required (or --quick)")
    if args.iterations < 1 or args.repeats < 1:
        parser.error(f"--iterations and --repeats: got {args.iterations}, {args.repeats}; expected integers >= 1")
    rev = subprocess.run(["git", "rev-parse", "--short", args.ref], cwd=REPO, capture_output=True, text=True)
    if rev.returncode:
        parser.error(f"--ref: {args.ref!r} is not a commit of {REPO.name}: {rev.stderr.strip()}")
    with tempfile.TemporaryDirectory(prefix="vs-ref-") as tmp:
        worktree = Path(tmp) / "ref"
        subprocess.run(["git", "worktree", "add", "--detach", str(worktree), args.ref], cwd=REPO, check=True, capture_output=True)
        try:
            runs: dict[str, list] = {"ref": [], "this": []}
            for r in range(args.repeats):
                runs["ref"].append(_vs_trl(worktree, args, []))
                runs["this"].append(_vs_trl(REPO, args, shlex.split(args.this_args)))
                print(f"repeat {r + 1}/{args.repeats}: {json.dumps({k: v[-1] for k, v in runs.items()})}", file=sys.stderr, flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(worktree)], cwd=REPO, capture_output=True)
    out = f"{rev.stdout.strip()} ({args.ref}) against this tree, vs_trl.py --iterations {args.iterations}\n\n" + table(args.ref, runs)
    print(out)
    return out


if __name__ == "__main__":
    main()
