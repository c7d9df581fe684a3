"""The pipeline's artifact folders: a dataset folder, and a model folder that may only name its checkpoint.

A dataset folder holds ``train.<ext>``, ``test.<ext>`` and ``dataset.json`` (the file names and
row counts), as ``tasks.prepare_dataset`` writes it; ``dataset_files`` reads it back. A model
folder holds an HF checkpoint, or ``dockrl-checkpoint.json`` naming one on the shared volume
(``write_checkpoint_pointer``; ``resolve_checkpoint`` follows it).
"""

from __future__ import annotations

import json
from pathlib import Path

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
