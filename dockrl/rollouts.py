"""A run's kept rollouts (``run.keep_rollouts``, docs/rollouts.md): what the driver sends with each close, the
dataset's ``_meta.json``, and ``dockrl rollouts show``.

The dock shards write the rows (``dockrl.dock.rollouts``); the driver only names where, with the lineage
(``keep_spec``), and writes the dataset-level ``<run>/rollouts/_meta.json`` (``write_dataset_meta``) once per
run start: no payload passes through it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from dockrl.config import Config, dump_config, load_config
from dockrl.config.run_sections import keep_fraction
from dockrl.dock.rollouts import SCHEMA_VERSION, KeepSpec

if TYPE_CHECKING:
    import pyarrow as pa

ROLLOUTS_DIR = "rollouts"
"""The dataset's folder in the run folder."""


def rollouts_root(cfg: Config) -> Path:
    """The kept rollouts' dataset root: ``<run.output_dir>/rollouts``, absolute (shard processes write there)."""
    return (Path(cfg.run.output_dir) / ROLLOUTS_DIR).absolute()


def config_hash(cfg: Config) -> str:
    """sha256 of the run's config as ``config.yaml`` holds it (``dump_config``)."""
    return hashlib.sha256(dump_config(cfg).encode()).hexdigest()


def lineage(cfg: Config, resumed_from: Path | str | None) -> dict[str, Any]:
    """What every kept file and ``_meta.json`` say of the run: its config hash and the checkpoint it resumed from."""
    return {"config_sha256": config_hash(cfg), "resumed_from": None if resumed_from is None else str(resumed_from)}


def write_dataset_meta(cfg: Config, resumed_from: Path | str | None) -> dict[str, Any]:
    """Write ``<run>/rollouts/_meta.json`` (``pyarrow.dataset`` skips names starting with ``_``): the schema version,
    the run's lineage and the sampling; a resumed run writes it again with its own. Returns the lineage
    (``lineage``), which every kept file carries too (``keep_spec``)."""
    root = rollouts_root(cfg)
    root.mkdir(parents=True, exist_ok=True)
    run = lineage(cfg, resumed_from)
    meta = {"schema_version": SCHEMA_VERSION, "keep_rollouts": cfg.run.keep_rollouts, "fraction": keep_fraction(cfg.run.keep_rollouts),
            "seed": cfg.trainer.seed, "partitioning": "hive: iteration=<N>/shard-<S>.parquet"} | run
    path = root / "_meta.json"
    tmp = path.with_name("._meta.json.tmp")
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    tmp.replace(path)
    return run


def keep_spec(cfg: Config, iteration: int, metrics: Mapping[str, float], meta: dict[str, Any]) -> KeepSpec:
    """What the driver's close of ``iteration`` asks the shards to keep, in a run with ``run.keep_rollouts`` on
    (``meta``: the lineage ``write_dataset_meta`` returned).

    The weight version is the number of actor updates in the weights that sampled the iteration: the iteration's
    index on-policy, ``rollout/policy_version + 1`` when the rollout reports one (``dock.max_inflight`` > 1). With
    partial rollout a response's earlier segments may come from older weights (``rollout/oldest_policy_version``);
    the version kept is the one of the pass that finished it.
    """
    version = metrics.get("rollout/policy_version")
    return KeepSpec(uri=str(rollouts_root(cfg)), fraction=keep_fraction(cfg.run.keep_rollouts), seed=cfg.trainer.seed,
                    weight_version=iteration if version is None else int(version) + 1, meta=meta)


def read_rollouts(root: Path | str, iteration: int | None = None, columns: list[str] | None = None) -> pa.Table:
    """The kept rows under ``root`` (of one ``iteration``, or all), sorted by iteration and row (``pyarrow.dataset``, hive)."""
    import pyarrow.dataset as ds  # lazy: `dockrl --help` stays fast

    dataset = ds.dataset(str(root), format="parquet", partitioning="hive")
    table = dataset.to_table(columns=columns, filter=None if iteration is None else ds.field("iteration") == iteration)
    return table.sort_by([("iteration", "ascending"), ("row", "ascending")])


def show_table(run_dir: Path, iteration: int, limit: int, width: int = 60) -> str:
    """The text of ``dockrl rollouts show``: one line per kept row of ``iteration`` (at most ``limit``), its response
    decoded with the run's tokenizer (the model ``config.yaml`` names, loaded from its local folder)."""
    from transformers import AutoTokenizer  # lazy: transformers takes seconds to import

    cfg = load_config(run_dir / "config.yaml")
    if cfg.model.path and (Path(cfg.model.path) / "config.json").is_file():
        model_dir = Path(cfg.model.path)
    else:
        from dockrl.run_setup import resolve_model  # lazy: the packaged model's export

        model_dir = resolve_model(cfg)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    table = read_rollouts(run_dir / ROLLOUTS_DIR, iteration,
                          ["iteration", "row", "weight_version", "rm_score", "correct", "response_length", "response_ids"])
    rows = table.slice(0, limit).to_pylist()
    lines = [f"{'iteration':>9} {'row':>5} {'weights':>7} {'reward':>7} {'correct':>7} {'length':>6}  response"]
    for r in rows:
        text = str(tokenizer.decode(r["response_ids"] or [], skip_special_tokens=True)).replace("\n", "\\n")
        text = text if len(text) <= width else text[: width - 1] + "…"
        reward = "-" if r["rm_score"] is None else f"{r['rm_score']:.3f}"
        correct = "-" if r["correct"] is None else str(r["correct"]).lower()
        lines.append(f"{r['iteration']:>9} {r['row']:>5} {r['weight_version']:>7} {reward:>7} {correct:>7} "
                     f"{r['response_length'] or 0:>6}  {text}")
    lines.append(f"({len(rows)} of {table.num_rows} kept rows of iteration {iteration})")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """``dockrl rollouts show RUN --iteration N [--limit K]``: exit 0, or 2 for a run without kept rollouts."""
    parser = argparse.ArgumentParser(prog="dockrl rollouts", description="A run's kept rollouts (run.keep_rollouts; docs/rollouts.md).")
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="a table of one iteration's kept rows: reward, length, the response's first characters")
    show.add_argument("run", help="run folder (run.output_dir)")
    show.add_argument("--iteration", type=int, required=True, help="the iteration to show")
    show.add_argument("--limit", type=int, default=20, help="rows shown at most (default 20)")
    show.add_argument("--width", type=int, default=60, help="characters of each response shown (default 60)")
    args = parser.parse_args(argv)
    run_dir = Path(args.run)
    if not (run_dir / ROLLOUTS_DIR).is_dir() or not (run_dir / "config.yaml").is_file():
        print(f"dockrl rollouts: {run_dir} holds no kept rollouts (a run with run.keep_rollouts=all or a fraction writes "
              f"{run_dir / ROLLOUTS_DIR})", file=sys.stderr)
        return 2
    print(show_table(run_dir, args.iteration, args.limit, args.width))
    return 0
