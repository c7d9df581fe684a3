"""Fixtures of the dock tests: a real S3-compatible server on 127.0.0.1 (moto's server mode).

The server checks request signatures against its IAM users (as MinIO does), so a wrong key
is refused instead of silently accepted. One server per test module, each in a process of its own.
"""

from __future__ import annotations

import json
import select
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dockrl.dock.warehouse.s3 import S3Warehouse

REGION = "us-east-1"


@dataclass(frozen=True)
class S3Server:
    """Where the test S3 server listens and the key of its one user (allowed ``s3:*``)."""

    endpoint: str
    access_key: str
    secret_key: str

    def warehouse(self, bucket: str = "dockrl-test", prefix: str | None = None, **kw) -> S3Warehouse:
        """A warehouse on a fresh prefix of ``bucket`` (created if missing)."""
        args = {"access_key": self.access_key, "secret_key": self.secret_key, "secure": False, "region": REGION,
                "timeout_s": 2.0, "retries": 1} | kw
        prefix = f"run-{uuid.uuid4().hex[:12]}" if prefix is None else prefix
        return S3Warehouse(self.endpoint, bucket, prefix, **args).ensure_bucket()


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Server]:
    """moto's S3 server in a child process (``s3_server_process.py`` says why not in this one)."""
    pytest.importorskip("boto3")
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("s3_server_process.py"))],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ready = select.select([proc.stdout], [], [], 60.0)[0]
        line = proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"the test S3 server did not start within 60 s (exit code {proc.poll()})")
        info = json.loads(line)
        yield S3Server(info["endpoint"], info["access_key"], info["secret_key"])
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
