"""A test S3 server in a process of its own: moto's server mode with IAM authentication.

Run by the ``s3_server`` fixture (tests/dock/conftest.py). Prints one JSON line,
``{"endpoint": "127.0.0.1:PORT", "access_key": ..., "secret_key": ...}``, once the server
answers and a user with ``s3:*`` exists, then serves until its stdin closes.

Its own process because moto's server is a Flask app: Flask's module-level ``current_app``
proxy raises ``RuntimeError`` (not ``AttributeError``) on ``hasattr`` outside an app context,
and vLLM's kernel registration scans every module in ``sys.modules`` with ``hasattr`` — so a
test process that once imported Flask could no longer start a vLLM engine.
"""

from __future__ import annotations

import json
import logging
import sys
import urllib.request

import boto3
from moto.core.authorization import enable_iam_authentication
from moto.server import ThreadedMotoServer

REGION = "us-east-1"


def main() -> None:
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one access-log line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        url = f"http://{host}:{port}"
        urllib.request.urlopen(urllib.request.Request(f"{url}/moto-api/reset", method="POST"), timeout=10).close()
        iam = boto3.client("iam", endpoint_url=url, region_name=REGION, aws_access_key_id="setup", aws_secret_access_key="setup")
        iam.create_user(UserName="dock")
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
        arn = iam.create_policy(PolicyName="dock-s3", PolicyDocument=json.dumps(policy))["Policy"]["Arn"]
        iam.attach_user_policy(UserName="dock", PolicyArn=arn)
        key = iam.create_access_key(UserName="dock")["AccessKey"]
        with enable_iam_authentication():
            print(json.dumps({"endpoint": f"{host}:{port}", "access_key": key["AccessKeyId"],
                              "secret_key": key["SecretAccessKey"]}), flush=True)
            sys.stdin.read()  # until the fixture closes our stdin
    finally:
        server.stop()


if __name__ == "__main__":
    main()
