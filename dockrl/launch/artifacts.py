"""The pipeline's artifact folders: a dataset folder, and a model folder that may only name its checkpoint.

A dataset folder holds ``train.<ext>``, ``test.<ext>`` and ``dataset.json`` (the file names and
row counts), as ``tasks.prepare_dataset`` writes it; ``dataset_files`` reads it back. A model
folder holds an HF checkpoint, or ``dockrl-checkpoint.json`` naming one on the shared volume or in the
object store (``write_checkpoint_pointer``; ``resolve_checkpoint`` and ``resolve_model`` follow it). A kept-rollouts folder (the train task's
``rollouts`` Dataset, ``place_rollouts``) is the run's ``rollouts/`` dataset (docs/rollouts.md) with the run's
``_config.yaml`` and the tokenizer that decodes its token ids (``_tokenizer/``) beside it: it is read without the
run folder. ``pyarrow.dataset`` skips names that start with ``_``.

A run's model and data may also be ``s3://`` URIs: ``fetch_s3`` copies them into the task's pod, with the
``dock`` section's S3 settings (the same store, endpoint and keys as the S3 warehouse).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dockrl.config import pyarrow_s3_query
from dockrl.dock.shard.kept_rollouts import SCHEMA_VERSION
from dockrl.rollouts.keep import ROLLOUTS_CONFIG, ROLLOUTS_TOKENIZER, has_rows, kept_rollouts, rollouts_dataset

if TYPE_CHECKING:
    from dockrl.config.run_sections import DockConfig

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


def is_s3(location: str | Path) -> bool:
    """Whether a model or data setting names an object in the object store (``s3://bucket/key``)."""
    return str(location).startswith("s3://")


def fetch_s3(uri: str, dest: str | Path, dock: DockConfig) -> Path:
    """Copy the object or the folder (every object under the key, recursively) at ``uri`` into ``dest``.

    ``uri`` is ``s3://<bucket>/<key>``; the store is the ``dock`` section's (``dock.endpoint`` or
    ``$AWS_ENDPOINT_URL``, ``dock.secure``, ``dock.region``; the keys from ``$AWS_ACCESS_KEY_ID`` and
    ``$AWS_SECRET_ACCESS_KEY``, the object-store Secret's). Returns the local copy: ``dest/<name>`` for an
    object, ``dest`` for a folder.

    Raises:
        ConfigError: naming ``dock.endpoint``: no endpoint is set.
        FileNotFoundError: nothing is at ``uri`` (the message names the endpoint).
    """
    import pyarrow.fs as pafs  # lazy: only a run with s3:// inputs needs the S3 filesystem

    query = pyarrow_s3_query(dock)
    fs, key = pafs.FileSystem.from_uri(f"{uri.rstrip('/')}?{query}")
    info = fs.get_file_info(key)
    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    if info.type == pafs.FileType.File:
        target = out / Path(key).name
        pafs.copy_files(key, str(target), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
        return target
    if info.type != pafs.FileType.Directory:
        raise FileNotFoundError(f"{uri} does not exist in the object store ({query})")
    pafs.copy_files(key, str(out), source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
    return out


def upload_s3(folder: str | Path, uri: str, dock: DockConfig) -> str:
    """Copy the files of ``folder`` to ``uri`` (``s3://<bucket>/<key>``, the bucket created if missing) in the
    ``dock`` section's store (as ``fetch_s3``). Returns ``uri``.

    Raises:
        ConfigError: naming ``dock.endpoint``: no endpoint is set.
        ValueError: ``uri`` is not an ``s3://`` URI.
    """
    import pyarrow.fs as pafs  # lazy: as fetch_s3

    if not is_s3(uri) or "?" in uri:
        raise ValueError(f"{uri!r}: expected s3://<bucket>/<key> (the endpoint comes from the dock section)")
    fs, key = pafs.FileSystem.from_uri(f"{uri.rstrip('/')}?{pyarrow_s3_query(dock)}&allow_bucket_creation=true")
    fs.create_dir(key)
    pafs.copy_files(str(folder), key, source_filesystem=pafs.LocalFileSystem(), destination_filesystem=fs)
    return uri


def write_checkpoint_pointer(folder: str | Path, checkpoint: str | Path) -> Path:
    """Make ``folder`` (a model artifact) name ``checkpoint`` (a folder on the shared volume, or an ``s3://``
    URI) instead of holding its files: a model is not copied into a pod's local disk or KFP's artifact store."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    pointer = out / CHECKPOINT_POINTER
    pointer.write_text(json.dumps({"path": str(checkpoint)}) + "\n")
    return pointer


def pointer_target(folder: str | Path) -> str:
    """What a model artifact names (a folder or an ``s3://`` URI); "" where it holds the model itself."""
    pointer = Path(folder) / CHECKPOINT_POINTER
    return str(json.loads(pointer.read_text())["path"]) if pointer.is_file() else ""


def resolve_model(folder: str | Path, dock: DockConfig, scratch: str | Path) -> Path:
    """The model folder a model artifact holds or names; one in the object store is fetched into ``scratch``.

    Raises:
        FileNotFoundError: as ``resolve_checkpoint`` and ``fetch_s3``.
    """
    named = pointer_target(folder)
    return fetch_s3(named, scratch, dock) if is_s3(named) else resolve_checkpoint(folder)


def model_location(folder: str | Path) -> dict[str, Any]:
    """Metadata of a model artifact (``folder``): ``path`` (the model's folder: on the shared volume where the
    artifact names it, else the artifact's own), ``pointer`` (whether it names one) and ``bytes`` (the model's files).

    Raises:
        FileNotFoundError: as ``resolve_checkpoint``.
    """
    target = resolve_checkpoint(folder)
    return {"path": str(target), "pointer": target != Path(folder),
            "bytes": sum(p.stat().st_size for p in target.rglob("*") if p.is_file())}


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
    named = json.loads(pointer.read_text())["path"]
    if is_s3(named):
        raise FileNotFoundError(f"{pointer} names {named}, in the object store: fetch it (resolve_model)")
    target = Path(named)
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
