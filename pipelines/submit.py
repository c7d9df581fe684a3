"""Submit the compiled pipeline to Kubeflow Pipelines, or schedule it as a recurring run.

    dockrl pipeline submit --host http://localhost:8080 --experiment grpo trainer.iterations=50
    dockrl pipeline schedule --host http://localhost:8080 --cron "0 0 3 * * *"

Both talk to the KFP API (v2beta1) through ``kfp.Client``. The host is probed first with a
short timeout, so an unreachable host is a clear error in seconds (the client itself retries
its health check for about half a minute), and its version is checked against
``MIN_KFP_VERSION`` where its health answer tells it. On a multi-user install both take a
bearer token or session cookies and the profile namespace the run belongs to. Only the
package's run-time parameters can be sent: what is compiled in (worker backend, platform,
images) stays as compiled. KFP's cron has six fields, seconds first, and the SDK passes it
unchecked: ``validate_cron`` checks it here.
"""

import json
import logging
import re
import urllib.error
import urllib.request
import warnings
from pathlib import Path
from typing import Any

import kfp
import yaml
from kfp_server_api import ApiException

HEALTHZ = "/apis/v2beta1/healthz"

logger = logging.getLogger(__name__)


class PipelineError(RuntimeError):
    """A pipeline package, host or schedule is unusable; the message says what to change."""


class PipelineInputError(PipelineError, ValueError):
    """A cron expression or pipeline package KFP would not take: the user's input (``dockrl pipeline`` exits 2)."""


# ---- cron (robfig/cron with seconds, as KFP's scheduled workflows read it) ----

_MONTHS = {m: i for i, m in enumerate("JAN FEB MAR APR MAY JUN JUL AUG SEP OCT NOV DEC".split(), start=1)}
_DAYS = {d: i for i, d in enumerate("SUN MON TUE WED THU FRI SAT".split())}
_FIELDS: tuple[tuple[str, int, int, dict[str, int], bool], ...] = (  # name, lowest, highest, names, '?' allowed
    ("seconds", 0, 59, {}, False),
    ("minutes", 0, 59, {}, False),
    ("hours", 0, 23, {}, False),
    ("day of month", 1, 31, {}, True),
    ("month", 1, 12, _MONTHS, False),
    ("day of week", 0, 6, _DAYS, True),
)
_DESCRIPTORS = {"@yearly", "@annually", "@monthly", "@weekly", "@daily", "@midnight", "@hourly"}
_DURATION = re.compile(r"^(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+$")
CRON_HELP = "6 fields, seconds first: 'sec min hour day-of-month month day-of-week', e.g. '0 0 3 * * *' (03:00 every day)"


def _cron_value(text: str, lo: int, hi: int, names: dict[str, int], where: str) -> int:
    value = names.get(text.upper()) if not text.isdigit() else int(text)
    if value is None:
        allowed = f"{lo}-{hi}" + (f" or {', '.join(names)}" if names else "")
        raise ValueError(f"{where}: {text!r} is not a number; expected {allowed}")
    if not lo <= value <= hi:
        raise ValueError(f"{where}: {value} is outside {lo}-{hi}")
    return value


def validate_cron(expr: str) -> str:
    """Check a KFP cron expression; returns it stripped.

    Accepts six fields (``*``, ``?`` in the day fields, ``a``, ``a-b``, ``*/n``, ``a-b/n``,
    ``a/n``, comma lists, JAN-DEC and SUN-SAT), the descriptors ``@daily`` etc., and
    ``@every <duration>`` (``@every 1h30m``).

    Raises:
        PipelineInputError: naming the expression, the field and the rule; a 5-field (Unix)
            expression gets the 6-field version to use.
    """
    e = " ".join(expr.split())
    if e.startswith("@"):
        if e in _DESCRIPTORS or (e.startswith("@every ") and _DURATION.match(e[len("@every "):])):
            return e
        raise PipelineInputError(f"cron {expr!r}: unknown descriptor; expected one of {', '.join(sorted(_DESCRIPTORS))} "
                            "or '@every <duration>' (e.g. '@every 6h')")
    fields = e.split(" ") if e else []
    if len(fields) != 6:
        hint = f"; as a 5-field Unix cron this is '0 {e}' in KFP" if len(fields) == 5 else ""
        raise PipelineInputError(f"cron {expr!r}: has {len(fields)} field(s); KFP cron needs {CRON_HELP}{hint}")
    for text, (name, lo, hi, names, question) in zip(fields, _FIELDS):
        where = f"cron {expr!r}, {name} field {text!r}"
        try:
            for part in text.split(","):
                base, _, step = part.partition("/")
                if step and not (step.isdigit() and int(step) >= 1):
                    raise ValueError(f"{where}: step {step!r} must be a positive integer")
                if base == "*" or (base == "?" and question):
                    continue
                if base == "?":
                    raise ValueError(f"{where}: '?' is only allowed in the day-of-month and day-of-week fields")
                first, dash, last = base.partition("-")
                a = _cron_value(first, lo, hi, names, where)
                if dash and a > _cron_value(last, lo, hi, names, where):
                    raise ValueError(f"{where}: range {base!r} runs backwards")
        except ValueError as err:
            raise PipelineInputError(f"{err}; KFP cron needs {CRON_HELP}") from None
    return e


# ---- host and client ----

MIN_KFP_VERSION = (2, 17, 0)
"""Oldest KFP backend a run is submitted to: from 2.17.0 the launcher retries publishing a task's
outputs to the metadata store when the connection was dropped (kubeflow/pipelines #13179).
Before, a long task that talks to nobody for an hour (train) can fail at its very end with
"connection reset by peer" (#11660, #13484); and KFP's launcher and driver images are multi-arch
only from 2.17.0 (#12705, #12804), which arm64 (Kunpeng) nodes need."""
MIN_KFP_VERSION_WITH_KEEPALIVE = (2, 15, 0)
"""Oldest KFP backend that runs the compiled package at all (an optional Secret as environment,
kubeflow/pipelines #12216; resources from a task's output, #11501; node affinity): accepted with
``metadata_keepalive`` where the cluster keeps the metadata gRPC connections alive itself (the
EnvoyFilter in docs/kubernetes.md) and its nodes are amd64."""
TOKEN_ENV = "DOCKRL_KFP_TOKEN"
"""Environment variable with the bearer token for a multi-user KFP (instead of ``--token``)."""
COOKIES_ENV = "DOCKRL_KFP_COOKIES"
"""Environment variable with the session cookie(s) for a multi-user KFP (instead of ``--cookies``)."""


def _headers(token: str = "", cookies: str = "") -> dict[str, str]:
    out = {"Accept": "application/json"}
    if token:
        out["Authorization"] = f"Bearer {token}"
    if cookies:
        out["Cookie"] = cookies
    return out


def _version(tag: str) -> tuple | None:
    """``(major, minor, patch)`` of a KFP release tag (``2.5.0``, ``v2.14.3``, ``2.15.0-rc.1``); None if none."""
    m = re.match(r"^v?(\d+)\.(\d+)(?:\.(\d+))?", tag or "")
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)) if m else None


def check_version(host: str, healthz: dict[str, Any], *, metadata_keepalive: bool = False) -> tuple | None:
    """Check the server's KFP version against ``MIN_KFP_VERSION``.

    The version is the ``tag_name`` of the health answer: the API server reports its image's
    ``TAG_NAME`` build argument there, which KFP's release builds set to the release
    (``2.17.0``); a development build says ``unknown`` and ``commit_sha`` is a git hash, not a
    version (``backend/src/apiserver/main.go``, ``newHealthzResponse``). ``metadata_keepalive``:
    the cluster keeps KFP's metadata gRPC connections alive (docs/kubernetes.md), so a backend
    from ``MIN_KFP_VERSION_WITH_KEEPALIVE`` is accepted.

    Returns the version, or None where the server does not tell it (then a warning: the run may
    fail if the backend is older than the minimum).

    Raises:
        PipelineError: the server is older than the minimum (the message says what breaks and
            what to do).
    """
    found = _version(str(healthz.get("tag_name", "")))
    floor = MIN_KFP_VERSION_WITH_KEEPALIVE if metadata_keepalive else MIN_KFP_VERSION
    wanted = ".".join(map(str, floor))
    if found is None:
        logger.warning("KFP at %s does not tell its version (healthz tag_name=%r); dockrl needs KFP >= %s",
                       host, healthz.get("tag_name"), wanted)
        return None
    if found < MIN_KFP_VERSION_WITH_KEEPALIVE:
        raise PipelineError(f"KFP at {host} is version {healthz['tag_name']}; dockrl needs KFP >= "
                            f"{'.'.join(map(str, MIN_KFP_VERSION))} (at the very least "
                            f"{'.'.join(map(str, MIN_KFP_VERSION_WITH_KEEPALIVE))}: older backends do not read the "
                            "package's optional Secret, node affinity and resources from a task's output); "
                            "upgrade Kubeflow Pipelines")
    if found < floor:
        raise PipelineError(
            f"KFP at {host} is version {healthz['tag_name']}; dockrl needs KFP >= {wanted}: before 2.17.0 the launcher does "
            "not retry publishing a task's outputs to the metadata store, so a long, quiet task (train) can fail at its end "
            "with 'connection reset by peer' (kubeflow/pipelines #11660, #13484; fixed by #13179), and KFP's launcher "
            "images are amd64 only (arm64 nodes cannot run any task). Upgrade Kubeflow Pipelines to 2.17.0 or later; or, "
            "on amd64 nodes, keep the metadata gRPC connection alive with the EnvoyFilter in docs/kubernetes.md (KFP "
            "version) and pass --metadata-keepalive")
    return found


def server_info(host: str, timeout_s: float = 10.0, *, token: str = "", cookies: str = "") -> dict[str, Any]:
    """The KFP API's health answer (``commit_sha``, ``tag_name``, ``multi_user``), probed with
    ``timeout_s``; ``token``/``cookies`` authenticate the request on a multi-user install.

    Raises:
        PipelineError: not an http(s) URL, unreachable within ``timeout_s``, refused (401/403:
            the message says to pass a token), or not answering like a KFP API.
    """
    if not re.match(r"^https?://[^/\s]+", host or ""):
        raise PipelineError(f"--host {host!r}: expected the KFP API URL, e.g. http://localhost:8080")
    host = host.rstrip("/")
    fix = ("check --host; from outside the cluster, e.g. "
           "`kubectl port-forward -n kubeflow svc/ml-pipeline-ui 8080:80` and --host http://localhost:8080")
    request = urllib.request.Request(host + HEALTHZ, headers=_headers(token, cookies))
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            info = json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as err:
        if err.code in (401, 403):
            raise PipelineError(f"KFP at {host} answered {HEALTHZ} with HTTP {err.code} {err.reason}: a multi-user "
                                f"install needs --token (or ${TOKEN_ENV}) or --cookies (or ${COOKIES_ENV})") from None
        raise PipelineError(f"KFP at {host} answered {HEALTHZ} with HTTP {err.code} {err.reason}; {fix}") from None
    except (urllib.error.URLError, TimeoutError, ConnectionError) as err:
        reason = getattr(err, "reason", err)
        raise PipelineError(f"cannot reach KFP at {host} within {timeout_s:.0f} s ({reason}); {fix}") from None
    except ValueError:
        raise PipelineError(f"{host}{HEALTHZ} did not answer JSON: is {host} the KFP API? {fix}") from None
    if not isinstance(info, dict):
        raise PipelineError(f"{host}{HEALTHZ} did not answer a JSON object: is {host} the KFP API? {fix}")
    return info


def check_host(host: str, timeout_s: float = 10.0, *, token: str = "", cookies: str = "",
               metadata_keepalive: bool = False) -> str:
    """Probe the KFP API's health endpoint and check its version (``check_version``); returns the
    host without a trailing slash.

    Raises:
        PipelineError: as ``server_info`` and ``check_version``.
    """
    info = server_info(host, timeout_s, token=token, cookies=cookies)
    host = host.rstrip("/")
    check_version(host, info, metadata_keepalive=metadata_keepalive)
    return host


def _client(host: str, timeout_s: float, *, token: str = "", cookies: str = "", namespace: str = "",
            metadata_keepalive: bool = False):
    host = check_host(host, timeout_s, token=token, cookies=cookies, metadata_keepalive=metadata_keepalive)
    with warnings.catch_warnings():  # "only works with KFP v2.0.0-beta.2 and later": v2beta1 is what we use
        warnings.filterwarnings("ignore", category=FutureWarning, module="kfp")
        return kfp.Client(host=host, existing_token=token or None, cookies=cookies or None,
                          namespace=namespace or "kubeflow")


def package_parameters(package: str | Path) -> dict[str, Any]:
    """The run-time parameters of a compiled package: name -> default (None where it has none)."""
    spec = next(yaml.safe_load_all(Path(package).read_text()), None) or {}
    params = ((spec.get("root") or {}).get("inputDefinitions") or {}).get("parameters") or {}
    return {name: p.get("defaultValue") for name, p in params.items()}


def check_params(package: str | Path, params: dict[str, Any]) -> None:
    """Check that ``params`` are run-time parameters of ``package``.

    Raises:
        PipelineError: a name is not one of them (a compile-time setting such as the worker
            backend cannot be changed by a run: recompile).
    """
    if Path(package).suffix not in (".yaml", ".yml", ".json"):
        return  # an archive: the server checks it
    known = package_parameters(package)
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise PipelineError(f"pipeline package {package}: {', '.join(map(repr, unknown))} is not a run-time parameter "
                            f"(it has {', '.join(sorted(known))}); the worker backend, platform, images and sizes are "
                            "compiled in: recompile with `dockrl pipeline compile` to change them")


def _package(package: str | Path) -> str:
    path = Path(package)
    if not path.is_file():
        raise PipelineInputError(f"pipeline package {path} does not exist; create it with `dockrl pipeline compile {path}`")
    if path.suffix not in (".yaml", ".yml", ".json", ".zip", ".gz", ".tgz"):
        raise PipelineInputError(f"pipeline package {path}: expected a compiled .yaml (from `dockrl pipeline compile`)")
    return str(path)


def _api_call(host: str, what: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except ApiException as err:
        body = (err.body or "")[:500] if isinstance(err.body, str) else str(err.body)[:500]
        raise PipelineError(f"KFP at {host} refused to {what}: HTTP {err.status} {err.reason} {body}".rstrip()) from None


def submit(host: str, package: str | Path, *, params: dict[str, Any] | None = None,
           experiment: str = "dockrl", run_name: str = "dockrl-grpo", service_account: str = "",
           namespace: str = "", token: str = "", cookies: str = "", timeout_s: float = 10.0,
           metadata_keepalive: bool = False) -> dict[str, str]:
    """Start one run of ``package`` in ``experiment`` (created if missing).

    ``params``: run-time parameters of the package (``package_parameters``); compile-time
    settings (worker backend, platform, images) cannot be changed here.
    ``service_account``: the run's pods' account ("" for KFP's default, ``pipeline-runner``).
    ``namespace``: the profile namespace of a multi-user KFP (the experiment and the run live
    there; "" for single-user KFP). ``token``/``cookies``: authentication for a multi-user KFP
    (a bearer token, e.g. ``kubectl create token``, or the session cookie of the central dashboard).
    ``metadata_keepalive``: accept a backend older than ``MIN_KFP_VERSION`` (``check_version``).

    Returns:
        ``{"experiment_id": ..., "run_id": ...}``.

    Raises:
        PipelineError: missing package, a parameter the package does not have, unreachable or
            too old host, or the API refused a request.
    """
    package = _package(package)
    check_params(package, params or {})
    client = _client(host, timeout_s, token=token, cookies=cookies, namespace=namespace,
                     metadata_keepalive=metadata_keepalive)
    exp = _api_call(host, f"create experiment {experiment!r}", client.create_experiment, name=experiment,
                    namespace=namespace or None)
    run = _api_call(host, "create the run", client.run_pipeline, experiment_id=exp.experiment_id, job_name=run_name,
                    pipeline_package_path=package, params=params or {}, service_account=service_account or None)
    return {"experiment_id": exp.experiment_id, "run_id": run.run_id}


def schedule(host: str, package: str | Path, *, cron: str, params: dict[str, Any] | None = None,
             experiment: str = "dockrl", name: str = "dockrl-grpo-recurring", max_concurrency: int = 1,
             service_account: str = "", namespace: str = "", token: str = "", cookies: str = "",
             timeout_s: float = 10.0, metadata_keepalive: bool = False) -> dict[str, str]:
    """Create a recurring run of ``package`` on a 6-field ``cron`` schedule, without catch-up.

    ``no_catchup``: runs missed while the schedule was paused are not started afterwards.
    ``max_concurrency``: runs of this schedule allowed at once (a GRPO run holds accelerators).
    ``params``, ``service_account``, ``namespace``, ``token``, ``cookies``, ``metadata_keepalive``: as for ``submit``.

    Returns:
        ``{"experiment_id": ..., "recurring_run_id": ...}``.

    Raises:
        PipelineError: bad cron or max_concurrency (checked before connecting), missing
            package, unreachable host, or the API refused a request.
    """
    cron = validate_cron(cron)
    if not 1 <= max_concurrency <= 10:
        raise PipelineError(f"--max-concurrency {max_concurrency}: expected 1-10 (KFP's limit)")
    package = _package(package)
    check_params(package, params or {})
    client = _client(host, timeout_s, token=token, cookies=cookies, namespace=namespace,
                     metadata_keepalive=metadata_keepalive)
    exp = _api_call(host, f"create experiment {experiment!r}", client.create_experiment, name=experiment,
                    namespace=namespace or None)
    rec = _api_call(host, "create the recurring run", client.create_recurring_run, experiment_id=exp.experiment_id,
                    job_name=name, cron_expression=cron, max_concurrency=max_concurrency, no_catchup=True,
                    pipeline_package_path=package, params=params or {}, service_account=service_account or None)
    return {"experiment_id": exp.experiment_id, "recurring_run_id": rec.recurring_run_id}
