"""Start of a local distributed run: stage processes forked from the fork server against one interpreter each.

A local run (``dock.mode=distributed``, the local worker backend) starts its dock shards and one
process per stage; ``run.fork_server=true`` (the default) forks the stage processes from one process
that has imported their code (``dockrl/launch/fork_server.py``), ``false`` starts each with an
interpreter of its own (``subprocess.Popen``), which imports torch and transformers itself.

Both sides run the same short job, alternating, ``--repeats`` times each, in this process (the driver):
the tiny random model (or ``--model``), ``--iterations`` iterations of 4 prompts × 4 samples × 12 tokens,
two dock shards, the default reward, ``--engine`` for the rollout (hf by default). Reported per side (medians): seconds from ``driver.train`` to the
end of iteration 0 (the start: processes up, models loaded, one iteration), seconds of the whole run, and
the memory of the run's processes at the end of iteration 0: the sum of their PSS (proportional set
size: a page shared by n processes counts 1/n in each, ``/proc/<pid>/smaps_rollup``) and of their RSS
(which counts a shared page in every process). Ratios are fork / popen.

    python benchmarks/local_start.py                  # tiny model, 3 repeats per side
    python benchmarks/local_start.py --model benchmarks/.cache/dockrl/models/SmolLM2-135M-Instruct --repeats 2
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from dockrl import driver
from dockrl.config import load_config
from dockrl.launch.procfs import live_processes, process_environ
from dockrl.run.models import build_tiny_model

SIDES = ("popen", "fork")
MARK_ENV = "DOCKRL_BENCH_LOCAL_START"
"""Set to this process's pid: the run's processes inherit it, and only they are measured."""


def _rollup_kb(pid: int, field: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def run_memory_gb() -> tuple[float, float, int]:
    """Summed PSS and RSS (GB) and the number of this benchmark's run processes (``MARK_ENV``, ``DOCKRL_RUN_ID``)."""
    mark = str(os.getpid()).encode()
    pids = [pid for pid in live_processes() if pid != os.getpid() and (env := process_environ(pid)).get(MARK_ENV.encode()) == mark
            and b"DOCKRL_RUN_ID" in env]
    return (sum(_rollup_kb(p, "Pss") for p in pids) / 1e6, sum(_rollup_kb(p, "Rss") for p in pids) / 1e6, len(pids))


def one_run(side: str, model: str, folder: Path, iterations: int, engine: str = "hf") -> dict[str, float]:
    """One run of the job with ``run.fork_server`` as ``side`` says; its seconds and memory."""
    shutil.rmtree(folder / side, ignore_errors=True)
    cfg = load_config(None, [
        f"model.path={model}", f"run.output_dir={folder / side}", f"run.cache_dir={folder / 'cache'}", "run.progress=false",
        f"run.fork_server={side == 'fork'}", "dock.mode=distributed", "dock.shards=2", f"rollout.engine={engine}", f"trainer.iterations={iterations}",
        "trainer.global_batch=4", "trainer.mini_batch=4", "trainer.micro_batch=4", "rollout.n=4", "rollout.max_response_length=12",
        "trainer.eval_before=false", "trainer.eval_after=false", "trainer.save_every=0", "data.generate_train=40",
        "data.generate_test=8", "data.eval_size=8",
    ])
    out: dict[str, float] = {}
    start = time.monotonic()

    def on_iteration(it: int, _metrics: dict) -> None:
        if it == 0:
            out["first_s"] = time.monotonic() - start
            out["pss_gb"], out["rss_gb"], out["processes"] = run_memory_gb()

    driver.train(cfg, on_iteration=on_iteration)
    out["total_s"] = time.monotonic() - start
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="HF model folder (default: the tiny random model, built here)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per side, alternating")
    parser.add_argument("--iterations", type=int, default=2, help="iterations per run")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf",
                        help="rollout.engine (vllm: the rollout process imports vLLM and starts its engine after the fork)")
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.iterations < 1:
        parser.error("--repeats and --iterations must be at least 1")
    logging.basicConfig(level=logging.WARNING)
    os.environ[MARK_ENV] = str(os.getpid())
    with tempfile.TemporaryDirectory(prefix="dockrl-local-start-") as tmp:
        folder = Path(tmp)
        model = args.model or str(build_tiny_model(folder / "tiny-model"))
        results: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
        for r in range(args.repeats):
            for side in SIDES:
                results[side].append(one_run(side, model, folder, args.iterations, args.engine))
                print(f"# repeat {r + 1} {side}: " + ", ".join(f"{k} {v:.2f}" for k, v in results[side][-1].items()), file=sys.stderr)
    med = {side: {k: statistics.median(x[k] for x in rows) for k in rows[0]} for side, rows in results.items()}
    print(f"# local run start: {Path(model).name if args.model else 'tiny random model'}, rollout.engine={args.engine}, "
          f"{args.iterations} iterations of 4 prompts × 4 samples × 12 tokens, 2 dock shards; medians of {args.repeats} runs per side, alternating; "
          f"{os.cpu_count()} CPUs")
    print("| side | processes | s to iteration 0 done | vs popen | s per run | vs popen | PSS GB (sum) | vs popen | RSS GB (sum) |")
    print("|---|---|---|---|---|---|---|---|---|")
    base = med["popen"]
    for side in SIDES:
        m = med[side]
        print(f"| {side} | {m['processes']:.0f} | {m['first_s']:.2f} | {m['first_s'] / base['first_s']:.2f}x | {m['total_s']:.2f} | "
              f"{m['total_s'] / base['total_s']:.2f}x | {m['pss_gb']:.2f} | {m['pss_gb'] / base['pss_gb']:.2f}x | {m['rss_gb']:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
