"""The run configuration's sections of where the run keeps its data and how it runs: ``dock`` and
``run``; frozen, keyword-only dataclasses, one docstring per field.

The dock's rules are in ``dockrl.config.dock_rules``; ``Config`` (``dockrl.config.rules``) holds one of each.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

from dockrl.config.errors import fail


@dataclass(frozen=True, kw_only=True)
class DockConfig:
    timeout_s: float = 600.0
    """Longest a stage waits for rows before failing with the missing columns."""
    lease_s: float = 300.0
    """Lease term of a claim, seconds: rows a worker claimed and did not ack return to the
    ready pool this long after its last renewal (a live client renews every lease_s/3)."""
    warehouse: Literal["memory", "s3", "directory"] = "memory"
    """Where column payload lives: the dock shards' memory, an S3 bucket, or a local directory."""
    directory: str = ".cache/dockrl/warehouse"
    """Root of the local object store (``warehouse: directory``); each run writes under ``<directory>/<run>``."""
    endpoint: str = ""
    """S3 endpoint ``host:port`` or ``http(s)://host:port`` (the scheme overrides ``secure``); empty: ``$AWS_ENDPOINT_URL``."""
    bucket: str = "dockrl"
    """S3 bucket of the run's objects (created if missing)."""
    prefix: str = "dock"
    """Key prefix inside the bucket; each run writes under ``<prefix>/<run>``."""
    secure: bool = True
    """HTTPS to an endpoint given without a scheme."""
    region: str = ""
    """Region of the bucket; empty: asked from the store once."""
    access_key_env: str = "AWS_ACCESS_KEY_ID"
    """Environment variable holding the S3 access key (keys never go in the config file)."""
    secret_key_env: str = "AWS_SECRET_ACCESS_KEY"
    """Environment variable holding the S3 secret key."""
    store_timeout_s: float = 10.0
    """Connect and read timeout of each S3 request attempt, seconds."""
    store_retries: int = 2
    """Retries of an S3 request after a connection error, timeout or 5xx answer."""
    mode: Literal["inprocess", "distributed"] = "inprocess"
    """``inprocess``: every stage runs in the driver's process, over dock shards of that process;
    ``distributed``: each stage is its own process and they share only ``shards`` Arrow Flight
    dock shard processes (and the actor → rollout weight channel). A checkpoint resumes in either."""
    shards: int = 1
    """Dock shards (in either mode); an iteration's rows are split over them by whole prompt
    groups, so at most ``trainer.global_batch``."""
    prefetch: bool = True
    """A stage's put that acks its claim carries its next claim of the same shape (one round trip per claim
    cycle instead of two; docs/dock.md "Claims ride on puts"); those rows stay leased to the stage until it
    claims again. False: every claim is its own call. Without effect with a ``warehouse`` other than ``memory``."""
    max_inflight: int = 1
    """Iterations open at once (``distributed`` mode): with m > 1 the rollout generates the next
    m-1 iterations while the actor trains on this one, iteration k with the weights of update
    k-m (bounded staleness, one-step off-policy at m = 2). 1 is on-policy."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    output_dir: str = "runs/demo"
    """Run directory: metrics, plot, config, checkpoints."""
    cache_dir: str = ".cache/dockrl"
    """Prepared models and generated data."""
    progress: bool = True
    """Show a progress bar with ETA."""
    num_threads: int = 0
    """torch intra-op threads (0: torch's default)."""
    resume: str = ""
    """Resume from a checkpoint: '' (a fresh run), 'latest' (the newest complete one under
    output_dir/checkpoints) or a checkpoint folder (``dockrl.checkpoint.resume``)."""
    fork_server: bool = True
    """A local distributed run (``dock.mode=distributed`` on this machine) forks its stage processes from one
    process that has imported their code, torch and transformers (``dockrl/launch/fork_server.py``): a run
    imports them once, not once per process, and the processes share those pages. false: each stage process
    starts an interpreter of its own. The pipeline's stage pods (its ``worker_backend=kubernetes``) always start their own."""
    driver_timeout_s: float = 60.0
    """Workers and dock shards of a distributed run stop when the driver has not renewed its
    lease on the dock for this long, seconds (``dockrl.process.lifeline``; a local worker also stops at
    once when the driver process dies)."""
    keep_rollouts: str | float | bool = "off"
    """Keep each iteration's rows as a Parquet dataset ``<output_dir>/rollouts/iteration=<N>/shard-<S>.parquet``,
    written by the dock shards in the background when the iteration closes (docs/rollouts.md): ``off``, ``all``, or a
    fraction in (0, 1) of the rows, a deterministic sample: row ``r`` of iteration ``i`` is kept when the first 8 bytes
    of ``blake2b(f"{trainer.seed}:{i}:{r}")``, as an unsigned integer over 2**64, are below the fraction. Needs
    ``dock.warehouse=memory``. YAML reads an unquoted ``off`` as false: false is ``off``, true ``all``."""
    rollouts_uri: str = ""
    """Where ``run.keep_rollouts`` writes the rows: empty, ``<output_dir>/rollouts``; or ``s3://<bucket>/<key>``, the
    object store of the ``dock`` section's S3 settings (``dock.endpoint`` or ``$AWS_ENDPOINT_URL``, ``dock.secure``,
    ``dock.region``; keys from ``$AWS_ACCESS_KEY_ID`` and ``$AWS_SECRET_ACCESS_KEY``), the bucket created if missing.
    The run folder's ``rollouts/_meta.json`` names it either way (docs/rollouts.md)."""

    def __post_init__(self) -> None:
        self.keep_fraction  # noqa: B018 - parsed once, here: a bad value fails when the config is built

    @functools.cached_property
    def keep_fraction(self) -> float:
        """The fraction of rows ``keep_rollouts`` keeps: 0.0 (``off``), 1.0 (``all``) or the fraction in (0, 1)."""
        return keep_fraction(self.keep_rollouts)


def keep_fraction(value: str | float | bool) -> float:
    """The fraction of rows ``run.keep_rollouts`` keeps: 0.0 (``off``), 1.0 (``all``) or the fraction in (0, 1).

    Raises:
        ConfigError: naming ``run.keep_rollouts``: not ``off``, ``all`` or a number in (0, 1).
    """
    if isinstance(value, bool) or value in ("off", "all"):
        return 1.0 if value is True or value == "all" else 0.0
    try:
        fraction = float(value)
    except ValueError:
        fraction = math.nan
    if not 0 < fraction < 1:
        raise fail("run.keep_rollouts", value, "expected 'off', 'all' or a fraction of the rows in (0, 1), e.g. 0.25")
    return fraction
