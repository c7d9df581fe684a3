"""Fixtures for the pipeline tests: a fake KFP API server."""

from __future__ import annotations

import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest


class FakeKfpServer:
    """The KFP v2beta1 endpoints ``kfp.Client`` uses to submit and schedule, on 127.0.0.1.

    Records every request as ``(method, path, query, body)`` in ``requests`` and its headers in
    ``headers`` (names in lower case); ``experiments`` maps display names to ids (pre-fill it to test an existing
    experiment). Its health answer is the API server's (``commit_sha``, ``tag_name``,
    ``multi_user``) with ``tag_name`` = ``version`` (None: left out). With ``token`` set, a
    request without ``Authorization: Bearer <token>`` gets 401, as behind a multi-user
    install's authentication.
    """

    def __init__(self, version: str | None = "2.17.0", token: str = "") -> None:
        self.requests: list[tuple[str, str, dict, dict | None]] = []
        self.headers: list[dict[str, str]] = []
        self.experiments: dict[str, str] = {}
        self.version, self.token = version, token
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def _reply(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _record(self) -> tuple[str, dict, dict | None]:
                url = urllib.parse.urlsplit(self.path)
                query = dict(urllib.parse.parse_qsl(url.query))
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length)) if length else None
                server.requests.append((self.command, url.path, query, body))
                server.headers.append({k.lower(): v for k, v in self.headers.items()})
                return url.path, query, body

            def _refused(self) -> bool:
                if server.token and self.headers.get("Authorization") != f"Bearer {server.token}":
                    self._reply(401, {"error": "Unauthorized"})
                    return True
                return False

            def do_GET(self):
                path, query, _ = self._record()
                if self._refused():
                    return None
                if path == "/apis/v2beta1/healthz":
                    health = {"commit_sha": "fake", "multi_user": bool(server.token)}
                    return self._reply(200, health | ({"tag_name": server.version} if server.version is not None else {}))
                if path == "/apis/v2beta1/experiments":
                    wanted = json.loads(query.get("filter", "{}")).get("predicates", [{}])[0].get("stringValue")
                    found = [{"experiment_id": i, "display_name": n} for n, i in server.experiments.items() if n == wanted]
                    return self._reply(200, {"experiments": found, "total_size": len(found)} if found else {})
                self._reply(404, {"error": f"no route {path}"})

            def do_POST(self):
                path, _, body = self._record()
                if self._refused():
                    return None
                if path == "/apis/v2beta1/experiments":
                    exp_id = f"exp-{len(server.experiments) + 1}"
                    server.experiments[body["display_name"]] = exp_id
                    return self._reply(200, {"experiment_id": exp_id, "display_name": body["display_name"]})
                if path == "/apis/v2beta1/runs":
                    return self._reply(200, {"run_id": "run-1", "display_name": body["display_name"], "state": "PENDING"})
                if path == "/apis/v2beta1/recurringruns":
                    return self._reply(200, {"recurring_run_id": "rr-1", "display_name": body["display_name"], "status": "ENABLED"})
                self._reply(404, {"error": f"no route {path}"})

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def posts(self, path: str) -> list[dict]:
        return [body for method, p, _, body in self.requests if method == "POST" and p == path]

    def __enter__(self) -> FakeKfpServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


@pytest.fixture
def kfp_server():
    with FakeKfpServer() as server:
        yield server


@pytest.fixture
def make_kfp_server():
    """``make(version=..., token=...)`` starts one more ``FakeKfpServer``; all stop after the test."""
    servers: list[FakeKfpServer] = []

    def make(**kwargs) -> FakeKfpServer:
        servers.append(FakeKfpServer(**kwargs).__enter__())
        return servers[-1]

    yield make
    for server in servers:
        server.__exit__(None, None, None)


@pytest.fixture(scope="session")
def compiled_npu(tmp_path_factory) -> Path:
    from dockrl.pipelines.grpo import compile_pipeline

    return compile_pipeline(tmp_path_factory.mktemp("ir") / "grpo-npu.yaml", platform="npu")
