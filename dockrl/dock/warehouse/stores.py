"""The warehouse backends that need no extra, and the choice of a run's warehouse from its config.

``DirectoryWarehouse`` keeps the objects as files under a local directory (the embedded store
of a laptop run); ``make_warehouse`` builds the backend ``dock.warehouse`` names: none for
``memory``, a ``DirectoryWarehouse``, or an ``S3Warehouse`` (``dockrl.dock.warehouse.s3``, which
needs the ``s3`` extra). The ``Warehouse`` protocol, object layout and helpers are in
``dockrl.dock.warehouse.base``.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

from dockrl.dock.warehouse.base import Warehouse, WarehouseError, check_key

if TYPE_CHECKING:
    from dockrl.config import DockConfig

_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


class DirectoryWarehouse:
    """Objects as files under ``root`` (created if missing): the embedded store of a laptop run.

    A write goes to a hidden temp file in the target's directory, then ``os.replace`` renames it:
    readers see the whole object or none, also when the writer dies midway (not synced to disk,
    so a power loss may lose recent objects).
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).absolute()
        self.url = self.root.as_uri()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise WarehouseError(f"object store {self.url}: cannot create the directory ({e})") from None

    def _path(self, key: str) -> Path:
        return self.root / check_key(key, self.url)

    def write(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        for _attempt in range(3):  # a concurrent delete may prune the directory between mkdir and rename
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp.write_bytes(data)
                os.replace(tmp, path)
                return
            except FileNotFoundError as e:
                error: OSError = e
            except OSError as e:
                error = e
                break
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise WarehouseError(f"object store {self.url}: write {key!r} failed ({error})") from None

    def read(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise WarehouseError(f"object store {self.url}: object {key!r} does not exist") from None
        except OSError as e:
            raise WarehouseError(f"object store {self.url}: read {key!r} failed ({e})") from None

    def delete(self, keys: Sequence[str]) -> None:
        for key in keys:
            try:
                self._path(key).unlink(missing_ok=True)
            except OSError as e:
                raise WarehouseError(f"object store {self.url}: delete {key!r} failed ({e})") from None
        for parent in sorted({self._path(k).parent for k in keys}, key=lambda p: -len(p.parts)):
            while parent != self.root and parent.is_dir() and not any(parent.iterdir()):
                parent.rmdir()  # drop emptied iteration/column directories
                parent = parent.parent

    def list(self, prefix: str = "") -> list[str]:
        if prefix:
            check_key(prefix, self.url)
        base = self.root / prefix.rstrip("/") if prefix.endswith("/") else self.root
        if not base.is_dir():
            return []
        keys = (p.relative_to(self.root).as_posix() for p in base.rglob("*") if p.is_file() and not p.name.startswith("."))
        return sorted(k for k in keys if k.startswith(prefix))

    def __repr__(self) -> str:
        return f"DirectoryWarehouse({self.url})"


def make_warehouse(dock: DockConfig, run: str, environ: Mapping[str, str] | None = None) -> Warehouse | None:
    """The warehouse ``dock.warehouse`` names, for the run called ``run``; None for ``memory``.

    Each run gets its own root: ``<dock.directory>/<run>`` or ``s3://<endpoint>/<dock.bucket>/<dock.prefix>/<run>``.
    S3 credentials come from the environment variables ``dock.access_key_env`` and
    ``dock.secret_key_env`` (never from the config file); an empty ``dock.endpoint`` is taken
    from ``AWS_ENDPOINT_URL`` (set by the object-store Secret of the manifests). An S3 store is
    checked at once (``S3Warehouse.ensure_bucket``).

    Raises:
        ConfigError: ``run`` is not a plain name, a credential variable is unset, or no endpoint.
        WarehouseError: the store is unreachable, refuses the credentials, or the directory
            cannot be created.
    """
    from dockrl.config import ConfigError, s3_endpoint  # lazy: the dock loads the config package (yaml) only here

    env = os.environ if environ is None else environ
    if not _RUN_NAME.fullmatch(run) or run in (".", ".."):
        raise ConfigError(f"run name {run!r}: expected one path component of [A-Za-z0-9._-] (it names the run's objects)")
    if dock.warehouse == "memory":
        return None
    if dock.warehouse == "directory":
        return DirectoryWarehouse(Path(dock.directory) / run)
    if dock.warehouse != "s3":
        raise ConfigError(f"dock.warehouse: got {dock.warehouse!r}; expected one of 'memory', 's3', 'directory'")
    keys = {}
    for field, var in (("dock.access_key_env", dock.access_key_env), ("dock.secret_key_env", dock.secret_key_env)):
        keys[field] = env.get(var, "")
        if not keys[field]:
            raise ConfigError(f"{field}: environment variable {var!r} is unset or empty; export the S3 credentials there")
    endpoint, secure = s3_endpoint(dock.endpoint or env.get("AWS_ENDPOINT_URL", ""), dock.secure, "dock.endpoint")
    from dockrl.dock.warehouse.s3 import S3Warehouse  # lazy: minio is an optional extra (s3)

    warehouse = S3Warehouse(
        endpoint, dock.bucket, "/".join(p for p in (dock.prefix.strip("/"), run) if p),
        access_key=keys["dock.access_key_env"], secret_key=keys["dock.secret_key_env"], secure=secure,
        region=dock.region or None, timeout_s=dock.store_timeout_s, retries=dock.store_retries,
        credentials_from=f"${dock.access_key_env} and ${dock.secret_key_env}",
    )
    return warehouse.ensure_bucket()
