"""Fixtures of the dock tests: a real S3-compatible server on 127.0.0.1 (moto's server mode).

The server checks request signatures against its IAM users (as MinIO does), so a wrong key
is refused instead of silently accepted. One server per test module.
"""

from __future__ import annotations

import json
import logging
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from dockrl.dock.warehouse import S3Warehouse

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
    boto3 = pytest.importorskip("boto3")
    from moto.core.authorization import enable_iam_authentication
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one access-log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        # moto's state is per process: start from an empty account, then make a user with an S3 key
        urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST"), timeout=10).close()
        iam = boto3.client("iam", endpoint_url=url, region_name=REGION, aws_access_key_id="setup", aws_secret_access_key="setup")
        iam.create_user(UserName="dock")
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        arn = iam.create_policy(PolicyName="dock-s3", PolicyDocument=json.dumps(policy))["Policy"]["Arn"]
        iam.attach_user_policy(UserName="dock", PolicyArn=arn)
        key = iam.create_access_key(UserName="dock")["AccessKey"]
        with enable_iam_authentication():
            yield S3Server(f"{host}:{port}", key["AccessKeyId"], key["SecretAccessKey"])
    finally:
        server.stop()
