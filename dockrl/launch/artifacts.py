"""The pipeline's artifact folders: a dataset folder, and a model folder that may only name its checkpoint.

A dataset folder holds ``train.<ext>``, ``test.<ext>`` and ``dataset.json`` (the file names and
row counts), as ``tasks.prepare_dataset`` writes it; ``dataset_files`` reads it back. A model
folder holds an HF checkpoint, or ``dockrl-checkpoint.json`` naming one on the shared volume
(``write_checkpoint_pointer``; ``resolve_checkpoint`` follows it). A kept-rollouts folder (the train task's
``rollouts`` Dataset, ``place_rollouts``) is the run's ``rollouts/`` dataset (docs/rollouts.md) with the run's
``_config.yaml`` and the tokenizer that decodes its token ids (``_tokenizer/``) beside it: it is read without the
run folder. ``pyarrow.dataset`` skips names that start with ``_``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from dockrl.dock.shard.kept_rollouts import SCHEMA_VERSION
from dockrl.rollouts.keep import ROLLOUTS_CONFIG, ROLLOUTS_TOKENIZER, has_rows, kept_rollouts, rollouts_dataset

DATASET_MANIFEST = "dataset.json"
CHECKPOINT_POINTER = "dockrl-checkpoint.json"
"""In a model folder: the checkpoint is elsewhere (on the shared volume), at the path it names."""


def dataset_files(dataset_dir: str | Path) -> tuple[Path, Path]:
    """Train and test files of a folder written by ``prepare_dataset``.

    Raises:
        FileNotFoundError: the folder lacks ``dataset.json`` or a file it names.
    """
    folder = Path(dataset_dir)
    manifest = folder / DATASET_MANIFEST
    if not manifest.is_file():
        raise FileNotFoundError(f"{manifest} does not exist: {folder} is not a folder written by prepare_dataset")
    info = json.loads(manifest.read_text())
    train, test = folder / info["train"], folder / info["test"]
    for path in (train, test):
        if not path.is_file():
            raise FileNotFoundError(f"{path} (named in {manifest}) does not exist")
    return train, test


def write_checkpoint_pointer(folder: str | Path, checkpoint: str | Path) -> Path:
    """Make ``folder`` (a model artifact) name ``checkpoint`` instead of holding its files: a
    checkpoint on the shared volume is not copied into a pod's local disk."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    pointer = out / CHECKPOINT_POINTER
    pointer.write_text(json.dumps({"path": str(checkpoint)}) + "\n")
    return pointer


def resolve_checkpoint(folder: str | Path) -> Path:
    """The checkpoint folder a model artifact holds or names (``write_checkpoint_pointer``).

    Raises:
        FileNotFoundError: the pointer names a folder this pod cannot see (the shared volume
            not mounted at the same path).
    """
    src = Path(folder)
    pointer = src / CHECKPOINT_POINTER
    if not pointer.is_file():
        return src
    target = Path(json.loads(pointer.read_text())["path"])
    if not (target / "config.json").is_file():
        raise FileNotFoundError(f"{pointer} names the checkpoint {target}, which has no config.json here: "
                                "is the shared volume mounted at the same path in this pod?")
    return target


def place_rollouts(kept: str | Path, dest: str | Path, *, checkpoint: str | Path, config: str | Path, move: bool) -> Path:
    """Make ``dest`` (the train task's ``rollouts`` Dataset folder) hold the run's kept rollouts ``kept``
    (``<run>/rollouts``; moved with ``move``, else copied), the run's ``config`` as ``_config.yaml`` and the
    tokenizer of ``checkpoint`` (a model folder, ``resolve_checkpoint``) as ``_tokenizer/``. A run that kept
    nothing gets an empty folder. Returns ``dest``."""
    out = Path(dest)
    src = Path(kept)
    if src.is_dir():
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        if move:
            shutil.move(src, out)
        else:
            shutil.copytree(src, out, dirs_exist_ok=True)
        shutil.copy2(config, out / ROLLOUTS_CONFIG)
        from transformers import AutoTokenizer  # lazy: transformers takes seconds to import

        tokenizer = AutoTokenizer.from_pretrained(str(resolve_checkpoint(checkpoint)), local_files_only=True)
        tokenizer.save_pretrained(str(out / ROLLOUTS_TOKENIZER))
    out.mkdir(parents=True, exist_ok=True)
    return out


def rollouts_metadata(folder: str | Path, run_id: str) -> dict[str, Any]:
    """The ``rollouts`` Dataset's metadata, shown in the Kubeflow UI beside its lineage: ``run_id``,
    ``schema_version``, ``rows``, ``iterations`` (how many), ``first_iteration``/``last_iteration``, ``bytes`` (of
    the Parquet files), ``keep_rollouts``, ``config_sha256`` and ``uri`` (from ``_meta.json``; ``off`` and no hash for a
    run that kept nothing; ``uri``: ``run.rollouts_uri``, where the rows are when not in the folder)."""
    import pyarrow.compute as pc  # lazy: pyarrow.dataset only where an artifact is described

    root = Path(folder)
    meta_path = root / "_meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    out: dict[str, Any] = {"run_id": run_id, "schema_version": meta.get("schema_version", SCHEMA_VERSION), "format": "parquet",
                           "partitioning": "hive: iteration=<N>/shard-<S>.parquet", "keep_rollouts": str(meta.get("keep_rollouts", "off")),
                           "config_sha256": meta.get("config_sha256", ""), "uri": meta.get("uri", ""), "rows": 0, "iterations": 0,
                           "bytes": 0}
    location = kept_rollouts(root).rows if meta.get("uri") else root  # run.rollouts_uri: in the object store (its config's)
    if not has_rows(location):
        return out
    dataset = rollouts_dataset(location)
    iterations = dataset.to_table(columns=["iteration"]).column("iteration")
    unique = pc.unique(iterations).to_pylist()
    sizes = dataset.filesystem.get_file_info(dataset.files)
    return out | {"rows": len(iterations), "iterations": len(unique), "first_iteration": min(unique), "last_iteration": max(unique),
                  "bytes": sum(f.size for f in sizes)}
