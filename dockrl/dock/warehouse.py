"""Warehouse backends of the transfer dock: where the payload of the columns lives (docs/design.md §2).

Chosen per run by ``dock.warehouse`` (``make_warehouse``):

* ``memory`` — the payload stays in the dock shards' memory (``DockShardServer(payload="memory")``,
  Arrow Flight ``do_put``/``do_get``); there is no warehouse object (``make_warehouse`` → None).
* ``s3`` — ``S3Warehouse``: a bucket and a per-run prefix of an S3 store (MinIO in a cluster, any
  S3), through the ``minio`` client, with short timeouts and bounded retries.
* ``directory`` — ``DirectoryWarehouse``: the same objects as files under a local directory
  (the embedded object store of a laptop run), each written atomically (temp file + rename).

**Object layout.** One Arrow IPC file per (iteration, column, chunk), under the run's root:
``iter-<iteration:08d>/<column>/<first row:08d>-<uuid>.arrow``, holding one record batch with
one field named after the column, of the schema's Arrow type. A chunk is the cells of one put
that one shard owns, in the put's row order. Objects are immutable: written once, read any
number of times, deleted with their iteration (``delete_iteration``).

**Who does what.** With a store backend the shards hold only metadata
(``DockShardServer(payload="store")``): a client's put writes its objects here, then tells each
owning shard with the ``commit`` action which rows of which column live in which object at which
offsets; a get or claim asks the shards to ``locate`` the cells (``Located``) and reads each
object it needs once (``read_cells``). No payload byte passes through a shard, and controller
bytes grow with the number of rows, not with the size of the cells.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence, TypeVar

import numpy as np
import pyarrow as pa

from dockrl.dock.errors import DockError
from dockrl.dock.schema import Schema

if TYPE_CHECKING:
    from dockrl.config import DockConfig

logger = logging.getLogger(__name__)
T = TypeVar("T")

MAX_PARALLEL = 8
"""Objects read or written concurrently by one call."""
_RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_KEY = re.compile(r"[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*/?")


class WarehouseError(DockError):
    """The object store failed: unreachable, credentials refused, object missing or not readable.

    The message names the store (endpoint and bucket, or directory), the operation and the key.
    """


class Warehouse(Protocol):
    """An object store holding immutable objects under ``/``-separated keys relative to the run's root.

    Every method raises ``WarehouseError`` naming the store and the key when the store fails.
    """

    url: str
    """Where the objects live, for messages: ``s3://endpoint/bucket/prefix`` or ``file:///dir``."""

    def write(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``, atomically: readers see the whole object or none."""

    def read(self, key: str) -> bytes:
        """The bytes stored under ``key``."""

    def delete(self, keys: Sequence[str]) -> None:
        """Remove objects; keys that do not exist are ignored."""

    def list(self, prefix: str = "") -> list[str]:
        """Keys of the objects under ``prefix`` (``""``: all of the run's), sorted."""


# --- keys and Arrow IPC encoding -----------------------------------------------------------------


def iteration_prefix(iteration: int) -> str:
    """Key prefix of every object of ``iteration``."""
    return f"iter-{iteration:08d}/"


def new_key(iteration: int, column: str, first_row: int) -> str:
    """A fresh object key for a chunk of ``column`` whose first row is ``first_row``."""
    return f"{iteration_prefix(iteration)}{column}/{first_row:08d}-{uuid.uuid4().hex}.arrow"


def _check_key(key: str, url: str) -> str:
    if not _KEY.fullmatch(key) or any(part in (".", "..") for part in key.split("/")):
        raise WarehouseError(f"object store {url}: invalid key {key!r}; expected relative '/'-separated names of [A-Za-z0-9._-]")
    return key


def encode_array(column: str, array: pa.Array) -> bytes:
    """An Arrow IPC file with one record batch of one field ``column`` holding ``array``."""
    batch = pa.RecordBatch.from_arrays([array], names=[column])
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return sink.getvalue().to_pybytes()


def decode_array(data: bytes, column: str, type: pa.DataType, where: str) -> pa.Array:
    """The array of an object written by ``encode_array``.

    Raises:
        WarehouseError: ``data`` is not an Arrow IPC file, or its field is not ``column`` of ``type``.
    """
    try:
        table = pa.ipc.open_file(pa.py_buffer(data)).read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise WarehouseError(f"{where}: not a readable Arrow IPC file ({e})") from None
    if table.schema.names != [column] or table.schema.field(0).type != type:
        raise WarehouseError(f"{where}: holds {table.schema}; expected one field {column!r} of type {type}")
    return table.column(0).combine_chunks()


# --- locations of cells --------------------------------------------------------------------------


@dataclass(frozen=True)
class Located:
    """Where the cells of one column live, in the order they were asked for.

    Cell ``k`` is row ``offsets[k]`` of object ``keys[index[k]]``; ``index`` and ``offsets`` are
    int64 arrays of shape ``(cells,)``.
    """

    keys: tuple[str, ...]
    index: np.ndarray
    offsets: np.ndarray

    def to_json(self) -> dict[str, Any]:
        return {"keys": list(self.keys), "index": self.index.tolist(), "offsets": self.offsets.tolist()}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Located:
        return cls(tuple(data["keys"]), np.asarray(data["index"], np.int64), np.asarray(data["offsets"], np.int64))

    @staticmethod
    def concat(parts: Sequence[Located]) -> Located:
        """The cells of ``parts`` one after the other."""
        keys: list[str] = []
        index = []
        for part in parts:
            index.append(part.index + len(keys))
            keys += part.keys
        empty = np.zeros(0, np.int64)
        return Located(tuple(keys), np.concatenate([empty, *index]), np.concatenate([empty, *(p.offsets for p in parts)]))


def _parallel(fn: Callable[[Any], T], items: Sequence[Any]) -> list[T]:
    if len(items) <= 1:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL, len(items)), thread_name_prefix="dock-warehouse") as pool:
        return list(pool.map(fn, items))


def write_arrays(warehouse: Warehouse, objects: Sequence[tuple[str, str, pa.Array]]) -> int:
    """Write each ``(key, column, array)`` as one object, concurrently; all or none.

    Returns the bytes written. On any failure the objects already written are deleted (best
    effort, logged) before the error is raised, so no half-written put stays behind.

    Raises:
        WarehouseError: the store failed.
    """
    encoded = [(key, encode_array(column, array)) for key, column, array in objects]
    done: list[str] = []

    def write(item: tuple[str, bytes]) -> None:
        warehouse.write(*item)
        done.append(item[0])  # list.append is atomic under the GIL

    try:
        _parallel(write, encoded)
    except BaseException:
        delete_quietly(warehouse, done)
        raise
    return sum(len(data) for _, data in encoded)


def delete_quietly(warehouse: Warehouse, keys: Sequence[str]) -> None:
    """Delete ``keys``; a failure is logged, not raised (cleanup after another error)."""
    if not keys:
        return
    try:
        warehouse.delete(keys)
    except WarehouseError as e:
        logger.warning("could not delete %d unreferenced objects from %s: %s", len(keys), warehouse.url, e)


def read_cells(
    warehouse: Warehouse, schema: Schema, columns: Sequence[str], located: Mapping[str, Located]
) -> tuple[pa.RecordBatch, int, int]:
    """The located cells as one record batch (columns in order, cells in ``located`` order).

    Each distinct object is read once, concurrently. Returns the batch, the number of objects
    read and their bytes.

    Raises:
        WarehouseError: the store failed, an object is missing, or it is shorter than an offset.
    """
    column_of = {key: name for name in columns for key in located[name].keys}
    keys = list(column_of)
    blobs = dict(zip(keys, _parallel(warehouse.read, keys)))
    arrays = {
        key: decode_array(blobs[key], name, schema.column(name).type, f"object {key!r} in {warehouse.url}")
        for key, name in column_of.items()
    }
    out = []
    for name in columns:
        loc = located[name]
        chunks = [arrays[key] for key in loc.keys]
        lengths = np.array([len(c) for c in chunks], dtype=np.int64)
        bad = loc.offsets >= lengths[loc.index] if len(chunks) else loc.offsets >= 0
        if bad.any() or (loc.offsets < 0).any():
            k = int(np.flatnonzero(bad | (loc.offsets < 0))[0])
            raise WarehouseError(
                f"object {loc.keys[loc.index[k]]!r} in {warehouse.url} has no row {int(loc.offsets[k])} for column {name!r}"
            )
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        flat = pa.chunked_array(chunks, type=schema.column(name).type)
        out.append(flat.take(pa.array(starts[loc.index] + loc.offsets, type=pa.int64())).combine_chunks())
    batch = pa.RecordBatch.from_arrays(out, schema=schema.arrow_schema(list(columns)))
    return batch, len(keys), sum(len(b) for b in blobs.values())


def delete_iteration(warehouse: Warehouse, iteration: int) -> int:
    """Delete every object of ``iteration``; returns how many there were.

    Raises:
        WarehouseError: the store failed.
    """
    keys = warehouse.list(iteration_prefix(iteration))
    warehouse.delete(keys)
    return len(keys)


# --- a local directory ---------------------------------------------------------------------------


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
        return self.root / _check_key(key, self.url)

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
            _check_key(prefix, self.url)
        base = self.root / prefix.rstrip("/") if prefix.endswith("/") else self.root
        if not base.is_dir():
            return []
        keys = (p.relative_to(self.root).as_posix() for p in base.rglob("*") if p.is_file() and not p.name.startswith("."))
        return sorted(k for k in keys if k.startswith(prefix))

    def __repr__(self) -> str:
        return f"DirectoryWarehouse({self.url})"


# --- S3 (MinIO or any S3-compatible store) --------------------------------------------------------

_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken", "ExpiredToken", "AllAccessDisabled"}
_PART_SIZE = 64 * 1024 * 1024  # objects up to this size go in one PUT: atomic, one request


class S3Warehouse:
    """Objects in ``bucket`` under ``prefix`` of an S3-compatible store, through the ``minio`` client.

    Args:
        endpoint: ``host:port`` of the store (no scheme).
        bucket: bucket name (S3 naming rules).
        prefix: key prefix of the run's objects (``""``: the bucket root).
        access_key, secret_key: credentials (from the environment: see ``make_warehouse``).
        secure: HTTPS instead of HTTP.
        region: the bucket's region; None asks the store once.
        timeout_s: connect and read timeout of each request attempt, seconds.
        retries: retries of a request after a connection error, timeout or 5xx answer
            (backoff 0.1 s doubling, at most 1 s). A request gives up after about
            ``(retries + 1) × timeout_s`` plus backoff.
        credentials_from: where the keys came from, named in errors about refused credentials.

    ``ensure_bucket`` checks the store once (call it before the run starts: a wrong endpoint or
    key fails there, not in a stage). Thread-safe.
    """

    def __init__(
        self, endpoint: str, bucket: str, prefix: str = "", *, access_key: str, secret_key: str, secure: bool = True,
        region: str | None = None, timeout_s: float = 10.0, retries: int = 2,
        credentials_from: str = "the access and secret key given",
    ) -> None:
        import certifi
        import urllib3
        from minio import Minio
        from minio.helpers import check_bucket_name

        self.endpoint, self.bucket, self.prefix = endpoint, bucket, prefix.strip("/")
        self.timeout_s, self.retries, self.credentials_from = timeout_s, retries, credentials_from
        scheme = "https" if secure else "http"
        self.url = f"s3://{endpoint}/{bucket}" + (f"/{self.prefix}" if self.prefix else "")
        self._where = f"object store {scheme}://{endpoint} bucket {bucket!r}" + (f" prefix {self.prefix!r}" if self.prefix else "")
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=timeout_s, read=timeout_s),
            maxsize=2 * MAX_PARALLEL,
            cert_reqs="CERT_REQUIRED",
            ca_certs=os.environ.get("SSL_CERT_FILE") or certifi.where(),
            retries=urllib3.Retry(
                total=retries, connect=retries, read=retries, status=retries, backoff_factor=0.1, backoff_max=1.0,
                status_forcelist=(500, 502, 503, 504), respect_retry_after_header=False,
            ),
        )
        try:
            check_bucket_name(bucket, strict=True)
            self._client = Minio(
                endpoint, access_key=access_key, secret_key=secret_key, secure=secure, region=region or None, http_client=http
            )
        except ValueError as e:  # the client refuses a malformed endpoint or bucket name
            raise WarehouseError(f"{self._where}: {e}") from None

    def _key(self, key: str) -> str:
        _check_key(key, self.url)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """Run one store operation; every failure becomes a ``WarehouseError`` naming the store."""
        import urllib3
        from minio.error import InvalidResponseError, S3Error, ServerError

        try:
            return fn()
        except S3Error as e:
            if e.code in _DENIED:
                reason = f"access denied ({e.code}: {e.message}); check the credentials in {self.credentials_from}"
            elif e.code == "NoSuchBucket":
                reason = f"the bucket does not exist ({e.code})"
            elif e.code in ("NoSuchKey", "NoSuchObject"):
                reason = "the object does not exist"
            else:
                reason = f"{e.code}: {e.message}"
            raise WarehouseError(f"{self._where}: {what} failed: {reason}") from None
        except urllib3.exceptions.HTTPError as e:
            cause = getattr(e, "reason", None) or e
            raise WarehouseError(
                f"{self._where}: {what} failed: store unreachable after {self.retries + 1} attempt(s) "
                f"with a {self.timeout_s:g} s timeout each ({type(cause).__name__}: {cause})"
            ) from None
        except (InvalidResponseError, ServerError) as e:
            raise WarehouseError(f"{self._where}: {what} failed: unexpected answer ({e})") from None

    def ensure_bucket(self, create: bool = True) -> S3Warehouse:
        """Check that the store answers and the bucket exists (creating it if ``create``); returns self.

        Raises:
            WarehouseError: unreachable store, refused credentials, or a missing bucket with
                ``create=False``.
        """
        if self._call("check bucket", lambda: self._client.bucket_exists(self.bucket)):
            return self
        if not create:
            raise WarehouseError(f"{self._where}: the bucket does not exist; create it or pick an existing one")
        self._call("create bucket", lambda: self._client.make_bucket(self.bucket))
        logger.info("created bucket %r at %s", self.bucket, self.endpoint)
        return self

    def write(self, key: str, data: bytes) -> None:
        name = self._key(key)
        self._call(
            f"write {name!r}",
            lambda: self._client.put_object(
                self.bucket, name, io.BytesIO(data), len(data), content_type="application/vnd.apache.arrow.file",
                part_size=_PART_SIZE,
            ),
        )

    def read(self, key: str) -> bytes:
        name = self._key(key)

        def get() -> bytes:
            response = self._client.get_object(self.bucket, name)
            try:
                return response.read()
            finally:
                response.close()
                response.release_conn()

        return self._call(f"read {name!r}", get)

    def delete(self, keys: Sequence[str]) -> None:
        from minio.deleteobjects import DeleteObject

        names = [self._key(k) for k in keys]
        for start in range(0, len(names), 1000):  # S3 deletes at most 1000 keys per request
            batch = [DeleteObject(n) for n in names[start : start + 1000]]
            # called at once, so the lambda sees this batch
            errors = self._call("delete objects", lambda: list(self._client.remove_objects(self.bucket, batch)))  # noqa: B023
            if errors:
                raise WarehouseError(f"{self._where}: delete failed for {len(errors)} object(s), first: {errors[0]}")

    def list(self, prefix: str = "") -> list[str]:
        if prefix:
            _check_key(prefix, self.url)
        base = f"{self.prefix}/" if self.prefix else ""
        objects = self._call(
            f"list {base + prefix!r}", lambda: list(self._client.list_objects(self.bucket, prefix=base + prefix, recursive=True))
        )
        return sorted(o.object_name[len(base) :] for o in objects)

    def __repr__(self) -> str:
        return f"S3Warehouse({self.url})"


# --- from the run's config --------------------------------------------------------------------------


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
    from dockrl.config import ConfigError, s3_endpoint

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
    warehouse = S3Warehouse(
        endpoint, dock.bucket, "/".join(p for p in (dock.prefix.strip("/"), run) if p),
        access_key=keys["dock.access_key_env"], secret_key=keys["dock.secret_key_env"], secure=secure,
        region=dock.region or None, timeout_s=dock.store_timeout_s, retries=dock.store_retries,
        credentials_from=f"${dock.access_key_env} and ${dock.secret_key_env}",
    )
    return warehouse.ensure_bucket()
