"""The run configuration's sections of where the run keeps its data and how it runs: ``dock`` and
``run``; frozen, keyword-only dataclasses, one docstring per field.

The dock's rules (the warehouse's directory, the S3 endpoint, bucket, prefix and key variables) are beside them,
below; ``Config`` (``dockrl.config.config``) holds one of each.
"""

from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import dataclass
from typing import Annotated, Literal, Mapping

from dockrl.config.errors import fail, require_finite, require_positive
from dockrl.config.trackers import TRACKERS, TrackerName


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
    """Dock shards (in either mode, with ``placement: apart``); an iteration's rows are split over them by whole prompt
    groups, so at most ``trainer.global_batch``."""
    placement: Literal["apart", "beside"] = "apart"
    """Where the shards of ``mode: distributed`` run. ``apart``: ``shards`` shard processes of their own (pods of their
    own on Kubernetes). ``beside``: one shard beside the stage processes of every node, ``shards`` unused: on
    Kubernetes a sidecar container of every stage pod, on this machine one shard process per stage group; each stage
    process claims from its node's shard first (docs/dock.md "Shards beside the stages")."""
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
    lock_wait_s: float = 300.0
    """How long a run waits, seconds, for its run folder's lock when a process of another host
    holds it before it refuses (``dockrl.run.lock``): a lost node's lock on NFS or CephFS lasts
    until the file system's lease expires (NFSv4 90 s, CephFS ``mds_session_autoclose`` 300 s by
    default), and a retried pipeline task starts within that time. A live holder on this host is
    refused at once. 0: never wait."""
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
    trackers: tuple[Annotated[TrackerName, TRACKERS], ...] = ("tensorboard",)
    """Experiment trackers the driver logs to as each iteration ends (``dockrl/run/trackers/``, docs/kubeflow.md
    "Experiment trackers"): every iteration's metrics, the config and the run's lineage; ``tensorboard`` (event files in
    ``<output_dir>/tensorboard``), ``mlflow`` (a tracking server: ``$MLFLOW_TRACKING_URI``, credentials from MLflow's
    environment variables) and ``wandb`` (W&B, ``run.wandb_mode``). A tracker that fails mid-run never fails the run:
    it is counted (``tracker/<name>/failures``) and retried with backoff. A YAML list, or comma-separated; ``[]`` (in a config file): none."""
    tracker_project: str = "dockrl"
    """The MLflow experiment and the W&B project the run is logged under."""
    wandb_mode: Literal["online", "offline"] = "online"
    """W&B: ``online`` streams to the server (``$WANDB_BASE_URL``, key ``$WANDB_API_KEY``); ``offline`` writes the
    run under ``<output_dir>/wandb`` only, for ``wandb sync`` later (a cluster without a way out)."""

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


_HOST_PORT = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?)(:[0-9]{1,5})?")
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PREFIX = re.compile(r"([A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*)?")


def s3_endpoint(value: str, secure: bool, where: str) -> tuple[str, bool]:
    """``(host:port, secure)`` of an S3 endpoint given as ``host:port`` or ``http(s)://host:port``.

    Raises:
        ConfigError: empty, another scheme, a path, or not a host with an optional port.
    """
    endpoint = value
    scheme, sep, rest = value.partition("://")
    if sep:
        if scheme not in ("http", "https"):
            raise fail(where, value, "expected host:port or an http:// or https:// URL")
        endpoint, secure = rest.rstrip("/"), scheme == "https"
    if not _HOST_PORT.fullmatch(endpoint):
        raise fail(where, value, "expected host:port of the S3 endpoint, e.g. minio.kubeflow:9000 (no path)")
    return endpoint, secure


def pyarrow_s3_query(k: DockConfig, environ: Mapping[str, str] | None = None) -> str:
    """The query a ``pyarrow.fs.FileSystem.from_uri`` S3 URI needs to reach the ``dock`` section's store:
    ``endpoint_override=<host:port>&scheme=<http|https>`` and ``&region=`` when ``dock.region`` is set (pyarrow reads
    the keys from ``$AWS_ACCESS_KEY_ID`` and ``$AWS_SECRET_ACCESS_KEY``).

    Raises:
        ConfigError: naming ``dock.endpoint``: neither it nor ``$AWS_ENDPOINT_URL`` is a ``host:port``.
    """
    env = os.environ if environ is None else environ
    endpoint, secure = s3_endpoint(k.endpoint or env.get("AWS_ENDPOINT_URL", ""), k.secure, "dock.endpoint")
    return f"endpoint_override={endpoint}&scheme={'https' if secure else 'http'}" + (f"&region={k.region}" if k.region else "")


def check_rollouts_uri(uri: str, k: DockConfig) -> None:
    """``run.rollouts_uri``: empty (the run folder) or ``s3://<bucket>/<key>`` on the ``dock`` section's store.

    Raises:
        ConfigError: naming ``run.rollouts_uri`` (another scheme, a bad bucket or key, a query: the endpoint comes from
            ``dock.endpoint``), or ``dock.access_key_env``/``dock.secret_key_env`` when they name other variables than
            the ones pyarrow reads.
    """
    if not uri:
        return
    bucket, _, key = uri.removeprefix("s3://").partition("/")
    if not uri.startswith("s3://") or "?" in uri:
        raise fail("run.rollouts_uri", uri, "expected '' (the run folder) or s3://<bucket>/<key> (the endpoint, scheme and "
                                             "region come from the dock section)")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise fail("run.rollouts_uri", uri, f"bucket {bucket!r}: expected 3-63 of a-z 0-9 . -, starting and ending alphanumeric")
    if not _PREFIX.fullmatch(key.strip("/")) or any(p in (".", "..") for p in key.split("/")):
        raise fail("run.rollouts_uri", uri, f"key {key!r}: expected '/'-separated names of A-Za-z0-9 . _ - (no '.' or '..')")
    for where, name, default in (("dock.access_key_env", k.access_key_env, "AWS_ACCESS_KEY_ID"),
                                 ("dock.secret_key_env", k.secret_key_env, "AWS_SECRET_ACCESS_KEY")):
        if name != default:
            raise fail(where, name, f"expected {default} with run.rollouts_uri={uri!r}: the shards write the rollouts with "
                                     f"pyarrow, which reads the S3 keys from {default}")
    if k.endpoint:
        s3_endpoint(k.endpoint, k.secure, "dock.endpoint")


def check_dock(k: DockConfig) -> None:
    """The ``dock`` section's ranges, and its store's names (``dock.warehouse=s3``).

    Raises:
        ConfigError: names the field, its value and the rule.
    """
    require_finite({"dock.timeout_s": k.timeout_s, "dock.store_timeout_s": k.store_timeout_s, "dock.lease_s": k.lease_s}, zero=False)
    if not 0 <= k.store_retries <= 10:
        raise fail("dock.store_retries", k.store_retries, "expected an integer from 0 to 10")
    require_positive({"dock.shards": k.shards})
    if k.placement == "beside" and k.mode != "distributed":
        raise fail("dock.placement", k.placement, f"places shards beside stage processes, which dock.mode={k.mode!r} does not have: "
                   "use dock.mode=distributed, or dock.placement=apart")
    if not 1 <= k.max_inflight <= 8:
        raise fail("dock.max_inflight", k.max_inflight, "expected an integer from 1 (on-policy) to 8")
    if k.warehouse == "directory" and not k.directory.strip():
        raise fail("dock.directory", k.directory, "expected a directory for warehouse 'directory'")
    if k.warehouse != "s3":
        return
    if k.endpoint:
        s3_endpoint(k.endpoint, k.secure, "dock.endpoint")
    if not _BUCKET.fullmatch(k.bucket) or ".." in k.bucket:
        raise fail("dock.bucket", k.bucket, "expected an S3 bucket name: 3-63 of a-z 0-9 . -, starting and ending alphanumeric")
    if not _PREFIX.fullmatch(k.prefix.strip("/")) or any(p in (".", "..") for p in k.prefix.split("/")):
        raise fail("dock.prefix", k.prefix, "expected '/'-separated names of A-Za-z0-9 . _ - (no empty, '.' or '..' parts)")
    for where, name in (("dock.access_key_env", k.access_key_env), ("dock.secret_key_env", k.secret_key_env)):
        if not _ENV_NAME.fullmatch(name):
            raise fail(where, name, "expected the name of an environment variable, e.g. AWS_ACCESS_KEY_ID")


def check_run(run: RunConfig) -> None:
    """The ``run`` section's ranges (``run.keep_rollouts`` was parsed when the section was built), its trackers each at
    most once, and a project name for them.

    Raises:
        ConfigError: names the field, its value and the rule (``run.trackers``: a name twice; ``run.tracker_project``: empty).
    """
    if run.num_threads < 0:
        raise fail("run.num_threads", run.num_threads, "expected an integer >= 0 (0: torch's default)")
    require_finite({"run.driver_timeout_s": run.driver_timeout_s}, zero=False)
    require_finite({"run.lock_wait_s": run.lock_wait_s}, zero=True)
    if len(set(run.trackers)) != len(run.trackers):
        raise fail("run.trackers", list(run.trackers), "expected each tracker at most once")
    if not run.tracker_project.strip():
        raise fail("run.tracker_project", run.tracker_project, "expected the MLflow experiment / W&B project name, e.g. dockrl")


def check_keep_rollouts(warehouse: str, run: RunConfig) -> None:
    """``run.keep_rollouts`` needs the payload in the dock shards' memory (the shards write the kept rows).

    Raises:
        ConfigError: rollouts kept with a ``dock.warehouse`` other than ``memory``.
    """
    if run.keep_fraction > 0 and warehouse != "memory":
        raise fail("run.keep_rollouts", run.keep_rollouts, f"needs dock.warehouse=memory (got {warehouse!r}): the dock shards "
                    "write the kept rows from their memory; set run.keep_rollouts=off or dock.warehouse=memory")
