"""The S3 warehouse of the transfer dock (``dock.warehouse=s3``): MinIO or any S3-compatible store.

``S3Warehouse`` keeps the objects of ``dockrl.dock.warehouse.base``'s layout in a bucket under a per-run
prefix, through the ``minio`` client, with short timeouts and bounded retries. Importing this
module needs the ``s3`` extra (``minio``); ``make_warehouse`` (``dockrl.dock.warehouse.stores``)
imports it only for a run that uses it.
"""

from __future__ import annotations

import io
import logging
import os
from typing import Callable, Sequence, TypeVar

import certifi
import urllib3
from minio import Minio
from minio.deleteobjects import DeleteObject
from minio.error import InvalidResponseError, S3Error, ServerError
from minio.helpers import check_bucket_name

from dockrl.dock.warehouse.base import MAX_PARALLEL, WarehouseError, check_key

logger = logging.getLogger(__name__)
T = TypeVar("T")

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
        check_key(key, self.url)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """Run one store operation; every failure becomes a ``WarehouseError`` naming the store."""
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
        names = [self._key(k) for k in keys]
        for start in range(0, len(names), 1000):  # S3 deletes at most 1000 keys per request
            batch = [DeleteObject(n) for n in names[start : start + 1000]]
            # called at once, so the lambda sees this batch
            errors = self._call("delete objects", lambda: list(self._client.remove_objects(self.bucket, batch)))  # noqa: B023
            if errors:
                raise WarehouseError(f"{self._where}: delete failed for {len(errors)} object(s), first: {errors[0]}")

    def list(self, prefix: str = "") -> list[str]:
        if prefix:
            check_key(prefix, self.url)
        base = f"{self.prefix}/" if self.prefix else ""
        objects = self._call(
            f"list {base + prefix!r}", lambda: list(self._client.list_objects(self.bucket, prefix=base + prefix, recursive=True))
        )
        return sorted(o.object_name[len(base) :] for o in objects)

    def __repr__(self) -> str:
        return f"S3Warehouse({self.url})"
