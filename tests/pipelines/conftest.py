"""Fixtures for the pipeline tests: a fake KFP API server, every request and answer checked against the KFP API document."""

from __future__ import annotations

import json
import threading
import urllib.parse
import uuid
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from kfp_api_schema import KfpApiSchema, form_fields

API = "/apis/v2beta1"
NOT_FOUND, ALREADY_EXISTS, UNAUTHENTICATED, INVALID_ARGUMENT = 5, 6, 16, 3  # google.rpc.Code


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class FakeKfpApiServer:
    """A fake of the KFP API server (v2beta1) on 127.0.0.1: the endpoints ``kfp.Client`` uses to
    register pipelines and versions, find them, and start runs and recurring runs, with state kept
    in memory.

    Every request is checked against the KFP 2.17.0 API document (``kfp_api_schema``) before it is
    answered (one that fails gets 400 with the problems) and every answer before it is sent; the
    problems are collected in ``violations``, which the fixtures require empty at the end of a test.
    ``requests`` records ``(method, path, query, body)`` (a JSON body parsed, an upload as
    ``{"form": {field: text}}``), ``headers`` their headers (names in lower case). ``experiments``
    maps display names to ids, ``pipelines`` ids to pipelines, ``versions`` pipeline ids to their
    versions, oldest first (pre-fill them to test existing ones); ``refuse`` makes a POST path fail
    with the given status and google.rpc code, as the server refuses a request. The health answer is the API
    server's (``commit_sha``, ``tag_name`` = ``version`` or left out for None, ``multi_user``). With
    ``token`` set, a request without ``Authorization: Bearer <token>`` gets 401, as behind a
    multi-user install's authentication.
    """

    schema = KfpApiSchema()

    def __init__(self, version: str | None = "2.17.0", token: str = "") -> None:
        self.requests: list[tuple[str, str, dict, dict | None]] = []
        self.headers: list[dict[str, str]] = []
        self.violations: list[str] = []
        self.experiments: dict[str, str] = {}
        self.pipelines: dict[str, dict] = {}
        self.versions: dict[str, list[dict]] = {}
        self.runs: list[dict] = []
        self.recurring_runs: list[dict] = []
        self.refuse: dict[str, tuple[int, int, str]] = {}  # POST path -> (HTTP status, google.rpc code, message)
        self.version, self.token = version, token
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output clean
                pass

            def _reply(self, status: int, body: dict) -> None:
                server.violations += server.schema.check_answer(self.command, self._path, status, body)
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _error(self, status: int, code: int, message: str) -> None:
                self._reply(status, {"code": code, "message": message, "details": []})

            def _handle(self) -> None:
                url = urllib.parse.urlsplit(self.path)
                self._path = url.path
                query = urllib.parse.parse_qs(url.query, keep_blank_values=True)
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                content_type = self.headers.get("Content-Type", "")
                problems = server.schema.check_request(self.command, url.path, query, content_type, raw)
                if content_type.startswith("multipart/form-data") and not problems:
                    body: dict | None = {"form": {k: v.decode() for k, v in form_fields(content_type, raw).items()}}
                else:
                    body = json.loads(raw) if raw else None
                flat = {k: v[-1] for k, v in query.items()}
                server.requests.append((self.command, url.path, flat, body))
                server.headers.append({k.lower(): v for k, v in self.headers.items()})
                if server.token and self.headers.get("Authorization") != f"Bearer {server.token}":
                    return self._error(401, UNAUTHENTICATED, "Unauthorized")
                if problems:
                    server.violations += problems
                    return self._error(400, INVALID_ARGUMENT, "; ".join(problems))
                try:
                    status, answer = server.answer(self.command, url.path, flat, body)
                except ValueError as err:  # a request this fake cannot answer: the test must not pass on it
                    server.violations.append(f"{self.command} {url.path}: {err}")
                    return self._error(400, INVALID_ARGUMENT, str(err))
                if status == 200:
                    return self._reply(200, answer)
                return self._error(status, answer["code"], answer["message"])

            do_GET = do_POST = _handle

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    def answer(self, method: str, path: str, query: dict[str, str], body: dict | None) -> tuple[int, dict]:
        """``(status, answer)`` of a valid request, as the API server would give it."""
        parts = path.removeprefix(API).strip("/").split("/")
        if method == "POST" and path in self.refuse:
            status, code, message = self.refuse[path]
            return status, {"code": code, "message": message}
        if method == "GET" and parts == ["healthz"]:
            health = {"commit_sha": "fake", "multi_user": bool(self.token)}
            return 200, health | ({"tag_name": self.version} if self.version is not None else {})
        if parts == ["experiments"]:
            if method == "POST":
                self.experiments[body["display_name"]] = exp_id = f"exp-{len(self.experiments) + 1}"
                return 200, {"experiment_id": exp_id, "display_name": body["display_name"], "created_at": _now()}
            found = [{"experiment_id": i, "display_name": n} for n, i in self.experiments.items() if _matches({"display_name": n}, query)]
            return 200, {"experiments": found, "total_size": len(found)} if found else {}
        if method == "GET" and parts[:2] == ["pipelines", "names"]:
            name, namespace = urllib.parse.unquote(parts[2]), query.get("namespace", "")
            found = [p for p in self.pipelines.values() if p["name"] == name and p.get("namespace", "") == namespace]
            return (200, found[0]) if found else (404, {"code": NOT_FOUND, "message": f"pipeline {name!r} not found"})
        if method == "POST" and parts == ["pipelines"]:
            if any(p["name"] == body["name"] and p.get("namespace", "") == body.get("namespace", "") for p in self.pipelines.values()):
                return 409, {"code": ALREADY_EXISTS, "message": f"pipeline {body['name']!r} already exists"}
            pipeline = {**body, "pipeline_id": str(uuid.uuid4()), "created_at": _now()}
            self.pipelines[pipeline["pipeline_id"]] = pipeline
            return 200, pipeline
        if method == "POST" and parts == ["pipelines", "upload_version"]:
            pid, name = query.get("pipelineid", ""), query.get("name", "")
            if pid not in self.pipelines:
                return 404, {"code": NOT_FOUND, "message": f"pipeline {pid!r} not found"}
            if any(v["name"] == name for v in self.versions.get(pid, [])):
                return 409, {"code": ALREADY_EXISTS, "message": f"version {name!r} of pipeline {pid} already exists"}
            docs = list(yaml.safe_load_all(body["form"]["uploadfile"]))
            spec = {"pipeline_spec": docs[0], "platform_spec": docs[1]} if len(docs) > 1 else docs[0]
            version = {"pipeline_id": pid, "pipeline_version_id": str(uuid.uuid4()), "name": name,
                       "display_name": query.get("display_name") or name, "description": query.get("description", ""),
                       "created_at": _now(), "pipeline_spec": spec}
            self.versions.setdefault(pid, []).append(version)
            return 200, version
        if method == "GET" and parts[0] == "pipelines" and len(parts) >= 3 and parts[2] == "versions":
            versions = self.versions.get(parts[1], [])
            if len(parts) == 4:
                found = [v for v in versions if v["pipeline_version_id"] == parts[3]]
                return (200, found[0]) if found else (404, {"code": NOT_FOUND, "message": f"version {parts[3]!r} not found"})
            found = [v for v in versions if _matches(v, query)]
            if query.get("sort_by") == "created_at desc":  # else oldest first, as created
                found = found[::-1]
            found = found[: int(query.get("page_size") or len(found) or 1)]
            return 200, {"pipeline_versions": found, "total_size": len(found)} if found else {}
        if method == "POST" and parts in (["runs"], ["recurringruns"]):
            reference = body.get("pipeline_version_reference")
            if reference and not any(v["pipeline_version_id"] == reference.get("pipeline_version_id")
                                     for v in self.versions.get(reference["pipeline_id"], [])):
                return 404, {"code": NOT_FOUND, "message": f"pipeline version {reference} not found"}
            if parts == ["runs"]:
                self.runs.append(run := {**body, "run_id": f"run-{len(self.runs) + 1}", "state": "PENDING", "created_at": _now()})
                return 200, run
            rec = {**body, "recurring_run_id": f"rr-{len(self.recurring_runs) + 1}", "status": "ENABLED", "created_at": _now()}
            if "max_concurrency" in rec:
                rec["max_concurrency"] = str(rec["max_concurrency"])  # int64: a string in the server's JSON
            self.recurring_runs.append(rec)
            return 200, rec
        return 404, {"code": NOT_FOUND, "message": f"no route {method} {path} in this fake"}

    def posts(self, path: str) -> list[dict]:
        return [body for method, p, _, body in self.requests if method == "POST" and p == path]

    def __enter__(self) -> FakeKfpApiServer:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def _matches(item: dict, query: dict[str, str]) -> bool:
    """Whether ``item`` passes the ``filter`` of a list request (EQUALS predicates on string fields)."""
    predicates = json.loads(query.get("filter") or "{}").get("predicates", [])
    for p in predicates:
        if p.get("operation") not in ("EQUALS", 1) or ("string_value" not in p and "stringValue" not in p):
            raise ValueError(f"this fake reads EQUALS predicates on strings only, got {p}")
        if item.get(p["key"]) != p.get("string_value", p.get("stringValue")):
            return False
    return True


@pytest.fixture
def kfp_server():
    with FakeKfpApiServer() as server:
        yield server
    assert server.violations == [], "requests or answers outside the KFP API document"


@pytest.fixture
def make_kfp_server():
    """``make(version=..., token=...)`` starts one more ``FakeKfpApiServer``; all stop after the test."""
    servers: list[FakeKfpApiServer] = []

    def make(**kwargs) -> FakeKfpApiServer:
        servers.append(FakeKfpApiServer(**kwargs).__enter__())
        return servers[-1]

    yield make
    for server in servers:
        server.__exit__(None, None, None)
    assert [v for s in servers for v in s.violations] == [], "requests or answers outside the KFP API document"


@pytest.fixture(scope="session")
def compiled_npu(tmp_path_factory) -> Path:
    from dockrl.pipelines.grpo import compile_pipeline

    return compile_pipeline(tmp_path_factory.mktemp("ir") / "grpo-npu.yaml", platform="npu")
