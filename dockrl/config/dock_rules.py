"""The ``dock`` section's rules: the warehouse's directory, and the S3 endpoint, bucket, prefix and key
variables of ``dock.warehouse=s3`` (``s3_endpoint`` also reads an endpoint for the checkpoint's snapshot);
``run.rollouts_uri``, which writes to the same store (``pyarrow_s3_query``).
"""

from __future__ import annotations

import os
import re
from typing import Mapping

from dockrl.config.errors import fail
from dockrl.config.run_sections import DockConfig, RunConfig

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


def check_keep_rollouts(warehouse: str, run: RunConfig) -> None:
    """``run.keep_rollouts`` needs the payload in the dock shards' memory (the shards write the kept rows).

    Raises:
        ConfigError: rollouts kept with a ``dock.warehouse`` other than ``memory``.
    """
    if run.keep_fraction > 0 and warehouse != "memory":
        raise fail("run.keep_rollouts", run.keep_rollouts, f"needs dock.warehouse=memory (got {warehouse!r}): the dock shards "
                    "write the kept rows from their memory; set run.keep_rollouts=off or dock.warehouse=memory")
