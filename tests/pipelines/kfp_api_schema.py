"""Checks of KFP REST traffic against the KFP 2.17.0 API's OpenAPI 2 document (``reference/``).

The libraries here validate against OpenAPI 3 (openapi-core, openapi-schema-validator); the
document is Swagger 2, whose Schema Objects are a subset of JSON Schema draft 4. So a request is
matched to its operation (method and path template), its query, path, form and body parameters
are checked against the operation's declarations, and a JSON body or answer against the schema
the operation names, with ``jsonschema``'s draft 4 validator resolving ``#/definitions/...`` in
the document itself. Three readings make the check as strict as the server, not more:

* a field the schema does not list is refused (``additionalProperties: false`` on every object
  schema that lists properties and says nothing of others): a misspelt field fails here, where
  the server would drop it silently;
* a 64-bit integer (``type: string, format: int64``) may come as a JSON number or a string in a
  request (grpc-gateway reads both, the proto3 JSON mapping), and must be a string in an answer
  (which is what the server writes);
* the health answer carries ``commit_sha`` and ``tag_name`` besides ``multi_user``: the API
  server's health handler writes them (dockrl reads ``tag_name``, ``dockrl.pipelines.submit``),
  the document lists only ``multi_user`` and ``pipeline_store``.

Errors answered by the server (any status but 200) are ``googleRpcStatus`` objects.
"""

from __future__ import annotations

import copy
import email.parser
import email.policy
import json
import re
from pathlib import Path
from typing import Any

from jsonschema import Draft4Validator

DOCUMENT = Path(__file__).parent / "reference" / "kfp-2.17.0-api-v2beta1.swagger.json"
HEALTH_EXTRAS = {"commit_sha": {"type": "string"}, "tag_name": {"type": "string"}}


def _strict(schema: Any, *, request: bool) -> Any:
    """``schema`` with unknown fields refused and int64 read as the side (request, answer) reads it."""
    if isinstance(schema, list):
        return [_strict(s, request=request) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v, request=request) for k, v in schema.items() if k != "properties"}
    if "properties" in schema:
        out["properties"] = {k: _strict(v, request=request) for k, v in schema["properties"].items()}
        out.setdefault("additionalProperties", False)
    if request and schema.get("type") == "string" and schema.get("format") in ("int64", "uint64"):
        out["type"] = ["string", "integer"]
    return out


class KfpApiSchema:
    """The operations of the KFP API document, for checking one request or answer at a time.

    ``check_request`` and ``check_answer`` return the problems found as sentences (empty: valid).
    """

    def __init__(self, path: Path = DOCUMENT) -> None:
        self.document = json.loads(path.read_text())
        definitions = copy.deepcopy(self.document["definitions"])
        definitions["v2beta1GetHealthzResponse"]["properties"].update(HEALTH_EXTRAS)
        self._definitions = {side: _strict(definitions, request=side == "request") for side in ("request", "answer")}
        self._routes = []
        for template, item in self.document["paths"].items():
            pattern = re.escape(template)
            names = re.findall(r"\{([^}]+)\}", template)
            for name in names:
                pattern = pattern.replace(re.escape("{" + name + "}"), "([^/]+)")
            for method, operation in item.items():
                self._routes.append((method.upper(), re.compile(pattern + "$"), names, template, operation))
        self._routes.sort(key=lambda r: len(r[2]))  # /pipelines/upload before /pipelines/{pipeline_id}

    def operation(self, method: str, path: str) -> tuple[str, dict, dict[str, str]] | None:
        """``(template, operation, path parameters)`` of a request, or None when the document has no such operation."""
        for m, pattern, names, template, operation in self._routes:
            match = pattern.match(path)
            if m == method and match:
                return template, operation, dict(zip(names, match.groups()))
        return None

    def _validate(self, value: Any, schema: dict, side: str, where: str) -> list[str]:
        validator = Draft4Validator({"definitions": self._definitions[side], **_strict(schema, request=side == "request")})
        return [f"{where}: {'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in validator.iter_errors(value)]

    def check_request(self, method: str, path: str, query: dict[str, list[str]], content_type: str, body: bytes) -> list[str]:
        """Problems of one request: no such operation, an undeclared or mistyped parameter, a missing
        required one, a body not of the operation's content type or schema."""
        found = self.operation(method, path)
        if found is None:
            return [f"{method} {path}: no such operation in the KFP API"]
        template, op, path_params = found
        where = f"{method} {template} ({op['operationId']})"
        params = {(p["in"], p["name"]): p for p in op.get("parameters", [])}
        problems = [f"{where}: query parameter {k!r} is not declared" for k in query if ("query", k) not in params]
        for (kind, name), p in params.items():
            if kind == "query" and name in query:
                problems += [f"{where}: query {name}={v!r}: not a {p['type']}" for v in query[name] if not _scalar_ok(v, p)]
            if kind == "path" and not _scalar_ok(path_params.get(name, ""), p):
                problems.append(f"{where}: path parameter {name}={path_params.get(name)!r}: not a {p['type']}")
        consumes = op.get("consumes", self.document["consumes"])
        mime = content_type.split(";")[0].strip()
        body_param = next((p for (kind, _), p in params.items() if kind == "body"), None)
        form = [p for (kind, _), p in params.items() if kind == "formData"]
        if form:
            if mime != "multipart/form-data" or mime not in consumes:
                return problems + [f"{where}: content type {content_type!r}; the operation consumes {consumes}"]
            fields = form_fields(content_type, body)
            problems += [f"{where}: form field {k!r} is not declared" for k in fields if ("formData", k) not in params]
            problems += [f"{where}: required form field {p['name']!r} missing" for p in form if p.get("required") and p["name"] not in fields]
        elif body_param is not None:
            if mime not in consumes:
                return problems + [f"{where}: content type {content_type!r}; the operation consumes {consumes}"]
            try:
                value = json.loads(body or b"null")
            except ValueError as err:
                return problems + [f"{where}: the body is not JSON ({err})"]
            if value is None and body_param.get("required"):
                problems.append(f"{where}: required body missing")
            elif value is not None:
                problems += self._validate(value, body_param["schema"], "request", f"{where} body")
        elif body:
            problems.append(f"{where}: a body, but the operation takes none")
        return problems

    def check_answer(self, method: str, path: str, status: int, answer: Any) -> list[str]:
        """Problems of one answer: not of the schema the operation declares for ``status``
        (``200``, or ``default``: an error)."""
        found = self.operation(method, path)
        if found is None:
            return [f"{method} {path}: no such operation in the KFP API"]
        template, op, _ = found
        response = op["responses"].get(str(status)) or op["responses"]["default"]
        return self._validate(answer, response.get("schema", {}), "answer", f"answer {status} to {method} {template}")


def _scalar_ok(text: str, param: dict) -> bool:
    kind = param.get("type", "string")
    if "enum" in param and text not in param["enum"]:
        return False
    if kind == "integer":
        return re.fullmatch(r"-?\d+", text) is not None
    if kind == "boolean":
        return text in ("true", "false")
    return kind in ("string", "array")


def form_fields(content_type: str, body: bytes) -> dict[str, bytes]:
    """The fields of a ``multipart/form-data`` body, by name."""
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
        b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body)
    return {part.get_param("name", header="content-disposition"): part.get_payload(decode=True)
            for part in message.iter_parts()}
