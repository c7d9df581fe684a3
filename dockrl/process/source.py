"""Which source dockrl runs from: the commit recorded in a run's lineage and in a registered pipeline's version."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import dockrl

COMMIT_ENV = "DOCKRL_COMMIT"
"""Set in the images (scripts/build_images.sh passes it as a build argument): ``<commit>`` or ``<commit>-dirty``."""


def checkout_commit(folder: str | Path | None = None) -> tuple[str, bool] | None:
    """``(commit, dirty)`` of the git checkout the ``dockrl`` package is imported from (or ``folder``):
    its abbreviated commit (12 hex digits), and whether tracked files have changes not committed. None for
    an installed package (no checkout around it, or one that does not track dockrl's files), or where git
    is missing."""
    where = Path(folder) if folder is not None else Path(dockrl.__file__).parent

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True, timeout=10, check=False)

    try:
        if git("ls-files", "--error-unmatch", "__init__.py").returncode != 0:
            return None
        commit, status = git("rev-parse", "--short=12", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.TimeoutExpired):
        return None
    if commit.returncode != 0 or status.returncode != 0:
        return None
    return commit.stdout.strip(), bool(status.stdout.strip())


def source_commit(folder: str | Path | None = None) -> tuple[str, bool] | None:
    """``(commit, dirty)`` dockrl runs from: ``$DOCKRL_COMMIT`` where set (an image), else ``checkout_commit``."""
    label = os.environ.get(COMMIT_ENV, "").strip()
    if label:
        return label.removesuffix("-dirty"), label.endswith("-dirty")
    return checkout_commit(folder)


def commit_label() -> str:
    """``<commit>``, ``<commit>-dirty`` or '' (unknown): ``source_commit`` as one string, for a run's lineage."""
    source = source_commit()
    return f"{source[0]}-dirty" if source and source[1] else source[0] if source else ""
