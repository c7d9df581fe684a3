"""A run's kept rollouts (``run.keep_rollouts``, docs/rollouts.md): what the driver sends with each close, the
dataset's ``_meta.json``, where a run's or a pipeline artifact's kept rollouts are (``kept_rollouts``), reading them (``read_rollouts``) and
``dockrl rollouts show`` (``show_table``; the command line is ``dockrl.rollouts.cli``).

The dock shards write the rows (``dockrl.dock.shard.kept_rollouts``); the driver only names where, with the lineage
(``keep_spec``), and writes the dataset-level ``<run>/rollouts/_meta.json`` (``write_dataset_meta``) once per
run start: no payload passes through it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from dockrl.config import Config, dump_config, load_config, pyarrow_s3_query
from dockrl.dock.shard.kept_rollouts import SCHEMA_VERSION, KeepSpec

if TYPE_CHECKING:
    import pyarrow as pa

ROLLOUTS_DIR = "rollouts"
"""The dataset's folder in the run folder."""
ROLLOUTS_CONFIG = "_config.yaml"
"""In a kept-rollouts artifact folder (the pipeline's ``rollouts`` Dataset): the config of the run that kept them."""
ROLLOUTS_TOKENIZER = "_tokenizer"
"""In a kept-rollouts artifact folder: the run's tokenizer (``save_pretrained``), which decodes the token ids."""


@dataclass(frozen=True)
class KeptRollouts:
    """Where a run's kept rollouts are, and what reads them."""

    root: Path
    """The dataset's local folder: ``<run>/rollouts`` or the artifact folder (``_meta.json``; the rows too unless
    ``run.rollouts_uri`` put them in the object store)."""
    config: Config
    """The config of the run that kept them."""
    run_dir: Path | None
    """The run folder (checkpoints, ``metrics.jsonl``); None for an artifact folder."""

    @property
    def rows(self) -> str:
        """Where the Parquet files (``iteration=<N>/shard-<S>.parquet``) are: ``root``, or the run's
        ``run.rollouts_uri`` with the query that reaches its store (``rows_uri``)."""
        return rows_uri(self.config, self.root)

    def tokenizer_dir(self) -> Path:
        """The folder of the tokenizer that decodes the token ids: the artifact's ``_tokenizer/``, else the model
        ``config.yaml`` names (from its local folder; nothing is fetched)."""
        if self.run_dir is None:
            return self.root / ROLLOUTS_TOKENIZER
        if self.config.model.path and (Path(self.config.model.path) / "config.json").is_file():
            return Path(self.config.model.path)
        from dockrl.run.setup import resolve_model  # lazy: the packaged model's export

        return resolve_model(self.config)


def kept_rollouts(path: Path | str) -> KeptRollouts:
    """The kept rollouts of ``path``: a run folder (``config.yaml`` and ``rollouts/``) or a kept-rollouts artifact
    folder (``_config.yaml``, ``_tokenizer/``: the pipeline train task's ``rollouts`` Dataset).

    Raises:
        FileNotFoundError: ``path`` is neither (it names what is missing).
    """
    folder = Path(path)
    if (folder / ROLLOUTS_CONFIG).is_file() and (folder / ROLLOUTS_TOKENIZER).is_dir():
        return KeptRollouts(root=folder, config=load_config(folder / ROLLOUTS_CONFIG), run_dir=None)
    if (folder / ROLLOUTS_DIR).is_dir() and (folder / "config.yaml").is_file():
        return KeptRollouts(root=folder / ROLLOUTS_DIR, config=load_config(folder / "config.yaml"), run_dir=folder)
    raise FileNotFoundError(f"{folder} holds no kept rollouts: expected a run folder with config.yaml and {ROLLOUTS_DIR}/ (a run "
                            f"with run.keep_rollouts=all or a fraction) or a pipeline's rollouts artifact ({ROLLOUTS_CONFIG}, "
                            f"{ROLLOUTS_TOKENIZER}/)")


def load_rollouts_tokenizer(kept: KeptRollouts):
    """The tokenizer of ``kept`` (``KeptRollouts.tokenizer_dir``), loaded offline."""
    from transformers import AutoTokenizer  # lazy: transformers takes seconds to import

    return AutoTokenizer.from_pretrained(str(kept.tokenizer_dir()), local_files_only=True)


def rollouts_root(cfg: Config) -> Path:
    """The kept rollouts' local folder: ``<run.output_dir>/rollouts``, absolute (shard processes write there)."""
    return (Path(cfg.run.output_dir) / ROLLOUTS_DIR).absolute()


def rows_uri(cfg: Config, local: Path | str) -> str:
    """Where the kept rows are written and read: ``local`` (a folder), or ``run.rollouts_uri`` with the query
    ``pyarrow.fs.FileSystem.from_uri`` needs to reach the ``dock`` section's S3 store (``pyarrow_s3_query``; the bucket
    created if missing)."""
    if not cfg.run.rollouts_uri:
        return str(local)
    return f"{cfg.run.rollouts_uri.rstrip('/')}?{pyarrow_s3_query(cfg.dock)}&allow_bucket_creation=true"


def _filesystem(location: Path | str) -> tuple[Any, str]:
    """``(pyarrow filesystem or None for the local one, path)`` of a folder or a ``pyarrow.fs`` URI."""
    if "://" not in str(location):
        return None, str(location)
    import pyarrow.fs as pafs  # lazy: `dockrl --help` stays fast

    return pafs.FileSystem.from_uri(str(location))


def config_hash(cfg: Config) -> str:
    """sha256 of the run's config as ``config.yaml`` holds it (``dump_config``)."""
    return hashlib.sha256(dump_config(cfg).encode()).hexdigest()


def lineage(cfg: Config, resumed_from: Path | str | None) -> dict[str, Any]:
    """What every kept file and ``_meta.json`` say of the run: its config hash and the checkpoint it resumed from."""
    return {"config_sha256": config_hash(cfg), "resumed_from": None if resumed_from is None else str(resumed_from)}


def write_dataset_meta(cfg: Config, resumed_from: Path | str | None) -> dict[str, Any]:
    """Write ``<run>/rollouts/_meta.json`` (``pyarrow.dataset`` skips names starting with ``_``): the schema version,
    the run's lineage, the sampling and ``uri`` (``run.rollouts_uri``: where the rows are; empty, beside it); a
    resumed run writes it again with its own. With ``run.rollouts_uri`` the same file goes there too (the bucket
    created if missing). Returns the lineage (``lineage``), which every kept file carries too (``keep_spec``).

    Raises:
        OSError: naming ``run.rollouts_uri``: its object store is unreachable or refuses the keys.
    """
    root = rollouts_root(cfg)
    root.mkdir(parents=True, exist_ok=True)
    run = lineage(cfg, resumed_from)
    meta = {"schema_version": SCHEMA_VERSION, "keep_rollouts": cfg.run.keep_rollouts, "fraction": cfg.run.keep_fraction,
            "seed": cfg.trainer.seed, "partitioning": "hive: iteration=<N>/shard-<S>.parquet", "uri": cfg.run.rollouts_uri} | run
    text = json.dumps(meta, indent=2) + "\n"
    path = root / "_meta.json"
    tmp = path.with_name("._meta.json.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    if cfg.run.rollouts_uri:  # checked here, at the run's start: a wrong endpoint or key fails now, not in a shard's writer
        try:
            fs, where = _filesystem(rows_uri(cfg, root))
            fs.create_dir(where, recursive=True)
            with fs.open_output_stream(f"{where}/_meta.json") as out:
                out.write(text.encode())
        except OSError as e:
            raise OSError(f"run.rollouts_uri={cfg.run.rollouts_uri!r}: could not write its _meta.json (the store of dock.endpoint, "
                          f"keys from $AWS_ACCESS_KEY_ID and $AWS_SECRET_ACCESS_KEY): {e}") from e
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
    return KeepSpec(uri=rows_uri(cfg, rollouts_root(cfg)), fraction=cfg.run.keep_fraction, seed=cfg.trainer.seed,
                    weight_version=iteration if version is None else int(version) + 1, meta=meta)


def rollouts_dataset(location: Path | str):
    """The kept rows at ``location`` (a folder or a ``pyarrow.fs`` URI: ``KeptRollouts.rows``) as a
    ``pyarrow.dataset.Dataset`` (hive partitioning; ``_meta.json`` and hidden temporary files skipped)."""
    import pyarrow.dataset as ds  # lazy: `dockrl --help` stays fast

    fs, path = _filesystem(location)
    return ds.dataset(path, filesystem=fs, format="parquet", partitioning="hive")


def has_rows(location: Path | str) -> bool:
    """Whether ``location`` holds kept rows (a Parquet file); False where it does not exist."""
    try:
        return bool(rollouts_dataset(location).files)
    except FileNotFoundError:
        return False


def read_rollouts(location: Path | str, iteration: int | None = None, columns: list[str] | None = None) -> pa.Table:
    """The kept rows at ``location`` (a folder or a ``pyarrow.fs`` URI; of one ``iteration``, or all), sorted by
    iteration and row (``pyarrow.dataset``, hive)."""
    import pyarrow.dataset as ds  # lazy: `dockrl --help` stays fast

    dataset = rollouts_dataset(location)
    table = dataset.to_table(columns=columns, filter=None if iteration is None else ds.field("iteration") == iteration)
    return table.sort_by([("iteration", "ascending"), ("row", "ascending")])


def read_kept(kept: KeptRollouts, iteration: int | None = None, columns: list[str] | None = None) -> pa.Table:
    """``read_rollouts`` of ``kept``; an ``iteration`` asked for must have kept rows.

    Raises:
        ValueError: the run kept no row of ``iteration`` (names the iterations it kept).
    """
    table = read_rollouts(kept.rows, iteration, columns)
    if iteration is not None and table.num_rows == 0:
        import pyarrow.compute as pc  # lazy: as pyarrow.dataset

        found = sorted(pc.unique(rollouts_dataset(kept.rows).to_table(columns=["iteration"]).column("iteration")).to_pylist())
        where = kept.config.run.rollouts_uri or kept.root  # never kept.rows: its query may carry the store's settings
        raise ValueError(f"iteration {iteration} has no kept rows in {where}; "
                         + (f"the kept iterations are {', '.join(map(str, found))}" if found else "it holds no kept rows yet"))
    return table


def show_table(kept: KeptRollouts, iteration: int, limit: int, width: int = 60) -> str:
    """The text of ``dockrl rollouts show``: one line per kept row of ``iteration`` (at most ``limit``), its response
    decoded with the run's tokenizer (``load_rollouts_tokenizer``).

    Raises:
        ValueError: the run kept no row of ``iteration`` (``read_kept``).
    """
    table = read_kept(kept, iteration, ["iteration", "row", "weight_version", "rm_score", "correct", "response_length", "response_ids"])
    tokenizer = load_rollouts_tokenizer(kept)
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
