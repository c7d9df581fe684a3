"""The agent gateway against the direct multi-turn rollout, on the same task, engine and limits, side by side.

The task is the bundled tool task (``dockrl/envs/data/tool_arithmetic_train.jsonl``) with the calculator tool: the
**direct** path is the rollout stage's own loop (``dockrl.stages.multi_turn.roll_out`` with the ``calculator``
environment); the **gateway** path serves the same prompts as sessions (``dockrl.stages.gateway.AgentGateway``), each
driven by an agent process written against the ``openai`` client (``benchmarks/calculator_agent.py``) that runs the
same loop on its side. The two paths alternate (direct, gateway, direct, ...) after one warm-up run of each.

    python benchmarks/gateway.py --model MODEL_DIR [--engine vllm] [--prompts 8 --n 4]

Prints one row per path (medians over ``--repeats``): sessions, model turns (requests), sampled tokens, seconds, of
which in the engine's ``generate``, sessions per second, seconds per model turn outside ``generate``, and the
gateway's ratio to the direct path; then the gateway's overhead per request (seconds outside ``generate`` per model
turn, gateway minus direct: the agents' processes, HTTP, JSON, tokenizing their messages) and what starting one
agent process costs alone.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from agents import SYSTEM_PROMPTS  # noqa: E402 - the learning benchmark's prompt of the same task

from dockrl.envs.calculator import CalculatorEnvironment  # noqa: E402
from dockrl.envs.prompting import describe_tools  # noqa: E402
from dockrl.envs.tasks import TOOL_TRAIN  # noqa: E402
from dockrl.run.data import load_prompts  # noqa: E402
from dockrl.stages.gateway import AgentGateway, GatewayLimits  # noqa: E402
from dockrl.stages.multi_turn import ObservationTokens, TurnLimits, roll_out  # noqa: E402

AGENT = [sys.executable, str(HERE / "calculator_agent.py")]


class TimedEngine:
    """The engine, with the seconds spent in its ``generate`` summed."""

    def __init__(self, engine) -> None:
        self.engine, self.seconds = engine, 0.0
        self.tokenizer, self.eos_id, self.pad_id = engine.tokenizer, engine.eos_id, engine.pad_id

    def generate(self, prompts, **kw):
        start = time.perf_counter()
        try:
            return self.engine.generate(prompts, **kw)
        finally:
            self.seconds += time.perf_counter() - start


def build_engine(kind: str, model: str, dtype: str):
    if kind == "hf":
        from dockrl.engines.hf.rollout import HFRolloutEngine

        return HFRolloutEngine(model, dtype=dtype)
    from dockrl.engines.vllm.engine import VLLMRolloutEngine  # lazy: only where asked for

    return VLLMRolloutEngine(model, dtype=dtype, seed=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF model directory, or 'tiny' for the test model")
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--parser", default="fenced", choices=["fenced", "hermes"], help="env.tool_parser")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4, help="sessions per prompt (rollout.n)")
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-total-tokens", type=int, default=224)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    if args.model == "tiny":
        from dockrl.run.models import build_tiny_model

        args.model = str(build_tiny_model(tempfile.mkdtemp(prefix="tiny-model-")))
    engine = TimedEngine(build_engine(args.engine, args.model, args.dtype))
    tok = engine.tokenizer
    env = CalculatorEnvironment(args.parser)
    system = SYSTEM_PROMPTS["calculator"] + "\n\n" + describe_tools(env.tools, args.parser)
    prompts, _ = load_prompts(TOOL_TRAIN, tok, system_prompt=system, max_prompt_length=1024)
    rows = [p for p in prompts[:args.prompts] for _ in range(args.n)]
    ids = [p.prompt_ids for p in rows]
    tasks = [{"messages": [{"role": "system", "content": system}, {"role": "user", "content": p.question}], "tools": []} for p in rows]
    limits = TurnLimits(max_turns=args.max_turns, max_turn_tokens=args.max_new_tokens, max_total_tokens=args.max_total_tokens)
    observe = ObservationTokens(tok)
    gateway = AgentGateway(engine, AGENT, GatewayLimits(turns=limits, max_sessions=len(rows)), tool_parser=args.parser,
                           temperature=args.temperature)

    def direct() -> tuple[int, int]:
        out = roll_out(engine, ids, [env.open(p.ground_truth) for p in rows], observe, limits, temperature=args.temperature,
                       batch_size=len(rows))
        return sum(t.turns for t in out), sum(sum(t.loss_mask) for t in out)

    def served() -> tuple[int, int]:
        out = gateway.run(ids, tasks)
        failed = [r.failure for r in out if r.failure]
        if failed:
            raise RuntimeError(f"{len(failed)} sessions failed, e.g. {failed[0]}")
        return sum(r.trajectory.turns for r in out), sum(sum(r.trajectory.loss_mask) for r in out)

    paths = {"direct multi-turn rollout": direct, "gateway (openai agents)": served}
    results: dict[str, list[tuple[float, int, int, float]]] = {name: [] for name in paths}
    try:
        for run in paths.values():  # warm-up
            run()
        for _ in range(args.repeats):
            for name, run in paths.items():
                torch.manual_seed(0)
                engine.seconds, start = 0.0, time.perf_counter()
                turns, tokens = run()
                results[name].append((time.perf_counter() - start, turns, tokens, engine.seconds))
    finally:
        gateway.close()
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import openai, dockrl.envs.calculator"], check=True)
    agent_start = time.perf_counter() - start

    print(f"{args.engine} engine, {args.dtype}, {len(rows)} sessions ({args.prompts} prompts × {args.n}), ≤ {args.max_turns} turns of "
          f"≤ {args.max_new_tokens} tokens, temperature {args.temperature:g}, medians of {args.repeats}\n")
    print("| path | sessions | model turns | sampled tokens | seconds | in generate | sessions/s | s outside generate per model turn | "
          "sessions/s ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    outside, rates = {}, {}
    for name, runs in results.items():
        seconds, turns, tokens, generating = (statistics.median(r[k] for r in runs) for k in range(4))
        rates[name], outside[name] = len(rows) / seconds, (seconds - generating) / turns
        base = rates["direct multi-turn rollout"]
        print(f"| {name} | {len(rows)} | {turns:g} | {tokens:g} | {seconds:.2f} | {generating:.2f} | {rates[name]:.3f} | "
              f"{outside[name]:.3f} | {rates[name] / base:.2f} |")
    overhead = outside["gateway (openai agents)"] - outside["direct multi-turn rollout"]
    print(f"\ngateway overhead per request: {overhead * 1000:.0f} ms (seconds outside generate per model turn, gateway minus "
          f"direct); starting one agent process (python, import openai): {agent_start:.2f} s")


if __name__ == "__main__":
    main()
