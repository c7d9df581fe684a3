"""Where the memory of a GRPO run goes: peak resident memory by stage and by object, for dockrl
(HF rollout, vLLM rollout) and TRL's GRPOTrainer, on the runs of ``benchmarks/vs_trl.py``.

    python benchmarks/memory.py --model .cache/dockrl/models/SmolLM2-135M-Instruct
    python benchmarks/memory.py --model ... --gradient-checkpointing off   # every activation kept
    python benchmarks/memory.py --quick          # the tiny random model, trl and dockrl-hf, ~1 min

Takes every flag of ``vs_trl.py`` (the same model, prompts, group shape, micro-batches, fp32 by
default, gradient checkpointing on both sides by default as TRL has it) and runs its sides, each
in a process of its own. Prints two tables (medians over the runs of a side):

* **by stage**: each stage's peak resident GiB in the run's process (``memory/peak_rss_gb/<stage>``:
  Linux's ``VmHWM`` reset at the stage's start, ``dockrl.process.memory``; the largest over the run's
  iterations). dockrl: rollout, reward, advantage, actor (the update); TRL: its generation
  (``_generate_and_score_completions``: sampling, reward, the log-probs) and its update (the rest
  of the step). Then the whole process tree's peak (``vs_trl.tree_peak_rss``: with the reward
  verifier's processes) and its ratio to TRL's.
* **by object**: what the state of the run holds, from the model's size (``vs_trl.model_sizes``):
  the actor's fp32 weights, its gradients and AdamW's two moments (of the trained parameters),
  the rollout engine's own copy of the weights and its KV cache (vLLM; the HF rollout generates
  with the actor's module, TRL too, and their KV cache lives in the rollout's peak); then what the
  peaks hold beyond that state: the rollout's transients (its KV cache, logits) and the update's
  activations, each with the process's libraries (~0.4–0.6 GB of torch, transformers and the rest). Dock cells are
  ``dock/*`` bytes in each run's metrics (tens of kB per iteration at this shape, not tabulated).

TRL and psutil are optional dependencies of this benchmark only (``pip install 'dockrl[bench]'``).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # vs_trl beside this file

import vs_trl  # noqa: E402  (after the path)

GB = 2**30
STAGES = {"trl": [("rollout", "rollout"), ("update", "update")],
          "dockrl": [("rollout", "rollout"), ("reward", "reward"), ("advantage", "advantage"), ("actor", "update")]}
"""Per kind of side, ``(stage, column)``: the stage's ``memory/peak_rss_gb/<stage>`` and the table's column for it."""


def _median(runs: list[dict[str, float]], key: str) -> float:
    return statistics.median(r.get(key, 0.0) for r in runs)


def state_gb(runs: list[dict[str, float]]) -> dict[str, float]:
    """The run's state by object (GiB): fp32 weights, gradients and AdamW moments of the trained
    parameters, the rollout's own weights and KV cache."""
    params, trainable = _median(runs, "params"), _median(runs, "trainable")
    return {"weights": params * 4 / GB, "gradients": trainable * 4 / GB, "optimizer": 2 * trainable * 4 / GB,
            "rollout copy": _median(runs, "rollout_copy_gb"), "KV cache": _median(runs, "kv_cache_gb")}


def tables(results: dict[str, list[dict[str, float]]]) -> str:
    """The by-stage and by-object tables (markdown) of ``vs_trl.collect``'s results."""
    columns = ["rollout", "reward", "advantage", "update"]
    head = ["side", "runs"] + [f"{c} peak GB" for c in columns] + ["tree peak GB", "vs TRL"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    base = _median(results["trl"], "peak_rss_gb") if "trl" in results else 0.0
    for side, runs in results.items():
        peaks = {column: _median(runs, f"memory/peak_rss_gb/{stage}") for stage, column in STAGES["trl" if side.startswith("trl") else "dockrl"]}
        tree = _median(runs, "peak_rss_gb")
        cells = [side, str(len(runs))] + [f"{peaks[c]:.2f}" if c in peaks else "" for c in columns]
        lines.append("| " + " | ".join(cells + [f"{tree:.2f}", f"{tree / base:.2f}x" if base else ""]) + " |")
    objects = ["weights", "gradients", "optimizer", "rollout copy", "KV cache"]
    head = ["side"] + [f"{o} GB" for o in objects] + ["state GB", "rollout peak − state GB", "update peak − state GB"]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for side, runs in results.items():
        state = state_gb(runs)
        total = sum(state.values())
        rollout = _median(runs, "memory/peak_rss_gb/rollout")
        update = _median(runs, "memory/peak_rss_gb/" + ("update" if side.startswith("trl") else "actor"))
        cells = [side] + [f"{state[o]:.2f}" for o in objects] + [f"{total:.2f}", f"{rollout - total:.2f}", f"{update - total:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    args = vs_trl.parse_args(argv)  # each side runs as a child process of vs_trl.py
    _, results = vs_trl.collect(args)
    out = f"{vs_trl.shape_line(args)}\n\n{tables(results)}"
    print(out)
    return out


if __name__ == "__main__":
    main()
