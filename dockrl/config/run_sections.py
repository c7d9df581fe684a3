"""The run configuration's sections of where the run keeps its data and how it runs: ``dock`` and
``run``; frozen, keyword-only dataclasses, one docstring per field.

The dock's rules are in ``dockrl.config.dock_rules``; ``Config`` (``dockrl.config.rules``) holds one of each.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


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
    output_dir/checkpoints) or a checkpoint folder (``dockrl.resume``)."""
    driver_timeout_s: float = 60.0
    """Workers and dock shards of a distributed run stop when the driver has not renewed its
    lease on the dock for this long, seconds (``dockrl.lifeline``; a local worker also stops at
    once when the driver process dies)."""
