"""Upload, submit and schedule through the real ``kfp.Client`` against a fake KFP API server on 127.0.0.1, every
request and answer checked against the KFP 2.17.0 API document (conftest.py); cron validation; clear errors."""

from __future__ import annotations

import hashlib
import json
import re
import socket
import subprocess
import time
from datetime import UTC, datetime

import pytest
import yaml
from kfp_api_schema import KfpApiSchema

import dockrl
from dockrl.kubeflow import pipeline_cli
from dockrl.pipelines.submit import (
    PipelineError,
    check_host,
    default_run_name,
    schedule,
    submit,
    upload,
    validate_cron,
    version_name,
)
from dockrl.process.source import checkout_commit, commit_label, source_commit

OVERRIDES = ["trainer.iterations=3", "trainer.lr=5e-6"]
API = "/apis/v2beta1"
RUN_NAME = re.compile(r"^grpo-smollm2-135m-\d{8}-\d{4}$")  # algorithm, model, UTC date and time


def _cli(capsys, *argv) -> tuple[int, str, str]:
    rc = pipeline_cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _json(out: str) -> dict:
    return json.loads(out[out.index("{\n"):])


def _version_of(compiled) -> str:
    return version_name(compiled, source_commit())[0]


def test_upload_creates_the_pipeline_and_a_version_named_from_the_release_commit_and_package(kfp_server, compiled_npu, capsys):
    rc, out, err = _cli(capsys, "upload", "--host", kfp_server.url, "--package", str(compiled_npu))
    assert rc == 0, err
    [pipeline] = kfp_server.posts(f"{API}/pipelines")
    assert pipeline["name"] == pipeline["display_name"] == "dockrl-grpo"  # the package's own name
    assert "npu, local workers" in pipeline["description"]
    [(query, body)] = [(q, b) for m, p, q, b in kfp_server.requests if p == f"{API}/pipelines/upload_version"]
    name = _version_of(compiled_npu)
    assert query["name"] == name and name.startswith(f"{dockrl.__version__}-")
    assert query["pipelineid"] == _json(out)["pipeline_id"] and "package sha256:" in query["description"]
    assert list(yaml.safe_load_all(body["form"]["uploadfile"])) == list(yaml.safe_load_all(compiled_npu.read_text()))  # as compiled
    assert _json(out) == {"pipeline_id": pipeline_id(kfp_server), "pipeline_name": "dockrl-grpo",
                          "pipeline_version_id": kfp_server.versions[pipeline_id(kfp_server)][0]["pipeline_version_id"],
                          "version_name": name}

    # the same package again: the pipeline and its version are found, nothing is created
    assert upload(kfp_server.url, compiled_npu) == _json(out)
    assert len(kfp_server.posts(f"{API}/pipelines")) == 1 and len(kfp_server.posts(f"{API}/pipelines/upload_version")) == 1


def pipeline_id(server, name: str = "dockrl-grpo") -> str:
    [found] = [i for i, p in server.pipelines.items() if p["name"] == name]
    return found


def test_another_package_is_a_new_version_of_the_pipeline(kfp_server, compiled_npu, tmp_path):
    from dockrl.pipelines.grpo import compile_pipeline

    first = upload(kfp_server.url, compiled_npu)
    gpu = compile_pipeline(tmp_path / "grpo-gpu.yaml", platform="gpu")
    second = upload(kfp_server.url, gpu)
    assert second["pipeline_id"] == first["pipeline_id"] and second["version_name"] != first["version_name"]
    assert [v["name"] for v in kfp_server.versions[first["pipeline_id"]]] == [first["version_name"], second["version_name"]]
    assert len(kfp_server.posts(f"{API}/pipelines")) == 1
    named = upload(kfp_server.url, gpu, pipeline_name="grpo-gpu")  # a pipeline of its own
    assert named["pipeline_id"] != first["pipeline_id"] and named["version_name"] == second["version_name"]


def test_version_names_state_the_release_the_commit_and_a_dirty_checkout(compiled_npu):
    digest = hashlib.sha256(compiled_npu.read_bytes()).hexdigest()
    clean, about = version_name(compiled_npu, ("3737ee0c1234", False))
    assert clean == f"{dockrl.__version__}-3737ee0c1234-{digest[:8]}"
    assert f"git commit 3737ee0c1234, clean; package sha256:{digest}" in about and "npu, local workers" in about
    dirty, about = version_name(compiled_npu, ("3737ee0c1234", True))
    assert dirty == f"{dockrl.__version__}-3737ee0c1234-dirty-{digest[:8]}" and "dirty: with uncommitted changes" in about
    installed, about = version_name(compiled_npu, None)
    assert installed == f"{dockrl.__version__}-{digest[:8]}" and "an installed package (no git checkout)" in about


def test_the_source_commit_is_that_of_the_checkout_holding_dockrl(tmp_path):
    repo = tmp_path / "repo"
    (repo / "dockrl").mkdir(parents=True)
    (repo / "dockrl" / "__init__.py").write_text("")

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    assert checkout_commit(repo / "dockrl") is None  # not tracked: a checkout around an installed package
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "c")
    commit = git("rev-parse", "--short=12", "HEAD")
    assert checkout_commit(repo / "dockrl") == (commit, False)
    (repo / "notes.txt").write_text("untracked files do not change the package")
    assert checkout_commit(repo / "dockrl") == (commit, False)
    (repo / "dockrl" / "__init__.py").write_text("x = 1\n")
    assert checkout_commit(repo / "dockrl") == (commit, True)
    assert checkout_commit(tmp_path) is None  # no checkout at all


def test_an_images_commit_comes_from_its_build_argument(monkeypatch):
    monkeypatch.setenv("DOCKRL_COMMIT", "0123456789ab-dirty")  # what scripts/build_images.sh bakes into an image
    assert source_commit() == ("0123456789ab", True) and commit_label() == "0123456789ab-dirty"
    monkeypatch.setenv("DOCKRL_COMMIT", "0123456789ab")
    assert source_commit() == ("0123456789ab", False)
    monkeypatch.delenv("DOCKRL_COMMIT")
    assert source_commit() == checkout_commit()


def test_submit_uploads_the_package_and_runs_that_version_named_from_its_parameters(kfp_server, compiled_npu, capsys):
    rc, out, err = _cli(capsys, "submit", "--host", kfp_server.url, "--experiment", "grpo-exp", "--package", str(compiled_npu),
                        "--service-account", "dockrl-launcher", *OVERRIDES)
    assert rc == 0, err
    result = _json(out)
    [exp] = kfp_server.posts(f"{API}/experiments")
    assert exp["display_name"] == "grpo-exp"
    [run] = kfp_server.posts(f"{API}/runs")
    assert run["experiment_id"] == result["experiment_id"] == "exp-1" and run["service_account"] == "dockrl-launcher"
    # the registered version, not the spec: the run belongs to "dockrl-grpo", version <name>, in the UI
    assert "pipeline_spec" not in run
    assert run["pipeline_version_reference"] == {"pipeline_id": result["pipeline_id"], "pipeline_version_id": result["pipeline_version_id"]}
    assert result["version_name"] == _version_of(compiled_npu)
    assert RUN_NAME.match(run["display_name"]) and result["run_name"] == run["display_name"] and result["run_id"] == "run-1"
    # only run-time parameters: the worker backend and the platform are compiled into the version
    assert run["runtime_config"]["parameters"] == {"config_overrides": "\n".join(OVERRIDES), "export_dtype": "bfloat16"}


def test_submit_runs_a_registered_version_by_name_or_the_newest(kfp_server, compiled_npu, tmp_path, capsys):
    from dockrl.pipelines.grpo import compile_pipeline

    old = upload(kfp_server.url, compiled_npu)
    new = upload(kfp_server.url, compile_pipeline(tmp_path / "grpo-gpu.yaml", platform="gpu"))
    uploads = len(kfp_server.posts(f"{API}/pipelines/upload_version"))
    rc, out, err = _cli(capsys, "submit", "--host", kfp_server.url, "--pipeline", "dockrl-grpo", "--run-name", "nightly",
                        "algorithm.adv_estimator=rloo")
    assert rc == 0, err
    newest = kfp_server.posts(f"{API}/runs")[-1]
    assert newest["pipeline_version_reference"]["pipeline_version_id"] == new["pipeline_version_id"]
    assert newest["display_name"] == "nightly" and _json(out)["version_name"] == new["version_name"]
    run = submit(kfp_server.url, pipeline="dockrl-grpo", version=old["version_name"], params={"config_overrides": "algorithm.adv_estimator=rloo"})
    named = kfp_server.posts(f"{API}/runs")[-1]
    assert named["pipeline_version_reference"]["pipeline_version_id"] == old["pipeline_version_id"] == run["pipeline_version_id"]
    assert re.match(r"^rloo-smollm2-135m-\d{8}-\d{4}$", named["display_name"])  # the algorithm the run trains with
    assert len(kfp_server.posts(f"{API}/pipelines/upload_version")) == uploads  # nothing uploaded to run a registered version


def test_a_missing_pipeline_or_version_and_a_version_with_a_package_are_refused(kfp_server, compiled_npu, capsys):
    rc, _, err = _cli(capsys, "submit", "--host", kfp_server.url, "--pipeline", "nope")
    assert rc == 1 and "has no pipeline 'nope': register one with `dockrl pipeline upload`" in err
    upload(kfp_server.url, compiled_npu)
    with pytest.raises(PipelineError, match="pipeline 'dockrl-grpo' at .* has no version '9.9.9'"):
        submit(kfp_server.url, pipeline="dockrl-grpo", version="9.9.9")
    with pytest.raises(PipelineError, match="'worker_backend' is not a run-time parameter"):
        schedule(kfp_server.url, pipeline="dockrl-grpo", cron="0 0 3 * * *", params={"worker_backend": "kubernetes"})
    assert kfp_server.posts(f"{API}/runs") == [] and kfp_server.posts(f"{API}/recurringruns") == []
    rc, _, err = _cli(capsys, "submit", "--host", kfp_server.url, "--package", str(compiled_npu), "--version", "1")
    assert rc == 2 and "give the package or the version of a registered pipeline, not both" in err


def test_run_names_come_from_the_algorithm_the_model_and_the_date():
    when = datetime(2026, 12, 7, 23, 5, tzinfo=UTC)
    defaults = {"adv_estimator": "grpo", "model_path": "smollm2-135m", "config_overrides": ""}
    assert default_run_name("dockrl-grpo", defaults, when) == "grpo-smollm2-135m-20261207-2305"
    given = defaults | {"model_path": "/shared/models/Qwen2.5-7B/", "config_overrides": "# ppo\nalgorithm.adv_estimator=gae\n"}
    assert default_run_name("dockrl-grpo", given, when, recurring=True) == "gae-qwen2.5-7b-recurring-20261207-2305"
    assert default_run_name("dockrl-grpo", defaults | {"config_overrides": "model.path=s3://b/m/llama"}, when).startswith("grpo-llama-")
    assert default_run_name("dockrl-rescore", {"rollouts_uri": "x", "scorer": "y"}, when) == "dockrl-rescore-20261207-2305"


def test_submit_reuses_an_existing_experiment(kfp_server, compiled_npu):
    kfp_server.experiments["dockrl"] = "exp-42"
    out = submit(kfp_server.url, compiled_npu, params={"config_overrides": ""})
    assert out["experiment_id"] == "exp-42" and out["run_id"] == "run-1"
    assert kfp_server.posts(f"{API}/experiments") == []


def test_cli_submit_without_package_compiles_for_the_platform(kfp_server, capsys):
    rc, _, _ = _cli(capsys, "submit", "--host", kfp_server.url, "--platform", "gpu")
    assert rc == 0
    [version] = kfp_server.versions[pipeline_id(kfp_server)]
    executors = version["pipeline_spec"]["pipeline_spec"]["deploymentSpec"]["executors"]
    assert executors["exec-train"]["container"]["resources"]["accelerator"]["resourceType"] == "nvidia.com/gpu"


def test_cli_submit_for_stage_pods_compiles_a_launcher_without_accelerators(kfp_server, capsys):
    rc, _, _ = _cli(capsys, "submit", "--host", kfp_server.url, "--platform", "gpu", "--worker-backend", "kubernetes",
                    "--service-account", "dockrl-launcher")
    assert rc == 0
    [run] = kfp_server.posts(f"{API}/runs")
    assert "worker_backend" not in run["runtime_config"]["parameters"]  # no run-time override of the compiled backend
    assert run["service_account"] == "dockrl-launcher"
    [version] = kfp_server.versions[pipeline_id(kfp_server)]
    spec = version["pipeline_spec"]["pipeline_spec"]
    train = spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]["train"]
    assert train["inputs"]["parameters"]["worker_backend"]["runtimeValue"]["constant"] == "kubernetes"
    executors = spec["deploymentSpec"]["executors"]
    assert "accelerator" not in executors["exec-train"]["container"].get("resources", {})


def test_the_checks_of_the_api_document_refuse_what_the_server_would_not_read():
    """The fake server's checks can fail: a misspelt field, a wrong type, an undeclared parameter, a missing upload."""
    schema = KfpApiSchema()
    run = {"display_name": "r", "pipeline_version_reference": {"pipeline_id": "p", "pipeline_version_id": "v"}}
    assert schema.check_request("POST", f"{API}/runs", {}, "application/json", json.dumps(run).encode()) == []
    bad = schema.check_request("POST", f"{API}/runs", {}, "application/json", json.dumps(run | {"displayname": "r"}).encode())
    assert bad and "'displayname' was unexpected" in bad[0]
    rec = {"display_name": "r", "max_concurrency": 2, "trigger": {"cron_schedule": {"cron": "0 0 3 * * *"}}}
    assert schema.check_request("POST", f"{API}/recurringruns", {}, "application/json", json.dumps(rec).encode()) == []
    assert schema.check_answer("POST", f"{API}/recurringruns", 200, rec | {"recurring_run_id": "rr"})  # int64: a string in an answer
    assert schema.check_answer("POST", f"{API}/recurringruns", 200, rec | {"max_concurrency": "2"}) == []
    assert "not a integer" in schema.check_request("GET", f"{API}/experiments", {"page_size": ["ten"]}, "", b"")[0]
    assert "'pagesize' is not declared" in schema.check_request("GET", f"{API}/experiments", {"pagesize": ["1"]}, "", b"")[0]
    form = "multipart/form-data; boundary=b"
    part = b'--b\r\nContent-Disposition: form-data; name="file"; filename="p.yaml"\r\n\r\nx\r\n--b--\r\n'
    missing = schema.check_request("POST", f"{API}/pipelines/upload_version", {"name": ["v"]}, form, part)
    assert "form field 'file' is not declared" in missing[0] and "required form field 'uploadfile' missing" in missing[1]
    assert schema.check_request("DELETE", f"{API}/healthz", {}, "", b"") == [f"DELETE {API}/healthz: no such operation in the KFP API"]
    assert schema.check_answer("GET", f"{API}/healthz", 200, {"multi_user": False, "tag_name": "2.17.0", "commit_sha": "abc"}) == []
    assert schema.check_answer("GET", f"{API}/runs/r", 404, {"code": 5, "message": "not found"}) == []
    assert schema.check_answer("GET", f"{API}/runs/r", 404, {"error": "not found"})  # not a googleRpcStatus


@pytest.fixture(scope="module")
def compiled_kubernetes(tmp_path_factory):
    from dockrl.pipelines.grpo import compile_pipeline

    return compile_pipeline(tmp_path_factory.mktemp("ir") / "k8s.yaml", platform="npu", worker_backend="kubernetes")


def test_a_package_compiled_for_one_backend_cannot_run_with_the_other(kfp_server, compiled_kubernetes, capsys):
    rc, _, err = _cli(capsys, "submit", "--host", kfp_server.url, "--package", str(compiled_kubernetes),
                      "--worker-backend", "local")
    assert rc == 2 and "compiled for the 'kubernetes' worker backend, which a run cannot change" in err
    with pytest.raises(PipelineError, match="'worker_backend' is not a run-time parameter"):
        submit(kfp_server.url, compiled_kubernetes, params={"worker_backend": "local"})
    with pytest.raises(PipelineError, match="'namespace' is not a run-time parameter"):
        schedule(kfp_server.url, compiled_kubernetes, cron="0 0 3 * * *", params={"namespace": "other"})
    assert kfp_server.requests == []  # refused before connecting
    # the same backend as compiled is fine, and sends no backend of its own
    rc, _, _ = _cli(capsys, "submit", "--host", kfp_server.url, "--package", str(compiled_kubernetes),
                    "--worker-backend", "kubernetes")
    assert rc == 0
    [run] = kfp_server.posts(f"{API}/runs")
    assert set(run["runtime_config"]["parameters"]) == {"config_overrides", "export_dtype"}


def test_compile_options_with_a_compiled_package_are_refused(kfp_server, compiled_npu, capsys):
    rc, _, err = _cli(capsys, "submit", "--host", kfp_server.url, "--package", str(compiled_npu), "--registry", "r.example.com")
    assert rc == 2 and "--registry: compile options, but --package" in err
    assert kfp_server.requests == []


def test_a_server_older_than_the_minimum_is_refused_before_anything_is_created(compiled_npu, make_kfp_server, capsys):
    old = make_kfp_server(version="2.16.1")
    with pytest.raises(PipelineError, match=r"KFP at .* is version 2.16.1; dockrl needs KFP >= 2.17.0: ") as err:
        submit(old.url, compiled_npu)
    # why 2.17 (the launcher's metadata publish retry), and the documented way around it
    for said in ("retry publishing a task's outputs to the metadata store", "#13179", "#11660", "EnvoyFilter in docs/kubernetes.md",
                 "--metadata-keepalive", "amd64"):
        assert said in str(err.value), said
    assert [path for _, path, _, _ in old.requests] == [f"{API}/healthz"]
    with pytest.raises(PipelineError, match="dockrl needs KFP >= 2.17.0"):
        schedule(make_kfp_server(version="v2.16.0").url, compiled_npu, cron="0 0 3 * * *")
    rc, _, err_text = _cli(capsys, "submit", "--host", make_kfp_server(version="2.14.3").url, "--package", str(compiled_npu),
                           "--metadata-keepalive")
    assert rc == 1 and "is version 2.14.3; dockrl needs KFP >= 2.17.0 (at the very least 2.15.0" in err_text  # no way around


@pytest.mark.parametrize("tag", ["2.17.0", "v2.17.1", "2.18.0-rc.1", "3.0.0"])
def test_a_server_at_or_above_the_minimum_gets_the_run(compiled_npu, make_kfp_server, tag):
    assert submit(make_kfp_server(version=tag).url, compiled_npu)["run_id"] == "run-1"


def test_with_the_metadata_keepalive_a_2_15_server_gets_the_run(compiled_npu, make_kfp_server, capsys):
    server = make_kfp_server(version="2.15.0")
    rc, out, err = _cli(capsys, "submit", "--host", server.url, "--package", str(compiled_npu), "--metadata-keepalive")
    assert rc == 0, err
    assert json.loads(out[out.index("{"):])["run_id"] == "run-1"
    assert schedule(server.url, compiled_npu, cron="0 0 3 * * *", metadata_keepalive=True)["recurring_run_id"] == "rr-1"


@pytest.mark.parametrize("tag", [None, "unknown"])
def test_a_server_that_does_not_tell_its_version_gets_a_warning(compiled_npu, make_kfp_server, caplog, tag):
    """KFP's API server reports its build's TAG_NAME ("unknown" in a development build), or nothing (older ones)."""
    server = make_kfp_server(version=tag)
    with caplog.at_level("WARNING"):
        assert submit(server.url, compiled_npu)["run_id"] == "run-1"
    assert "does not tell its version" in caplog.text and ">= 2.17.0" in caplog.text


def test_multi_user_token_and_profile_namespace(compiled_npu, capsys, monkeypatch, make_kfp_server):
    server = make_kfp_server(token="s3cret")
    with pytest.raises(PipelineError, match=r"HTTP 401 .*needs --token \(or \$DOCKRL_KFP_TOKEN\)"):
        submit(server.url, compiled_npu)
    monkeypatch.setenv("DOCKRL_KFP_TOKEN", "s3cret")
    rc, out, err = _cli(capsys, "submit", "--host", server.url, "--package", str(compiled_npu), "--namespace", "team-a",
                        "--cookies", "authservice_session=abc", "--experiment", "grpo-team")
    assert rc == 0, err
    ok = [h for h in server.headers if h.get("authorization") == "Bearer s3cret"]
    assert len(ok) == len(server.headers) - 1 >= 3  # every request but the refused probe carried the token
    assert all(h.get("cookie") == "authservice_session=abc" for h in ok)
    [exp] = server.posts(f"{API}/experiments")
    assert exp == {"display_name": "grpo-team", "namespace": "team-a"}  # the experiment lives in the profile
    [pipeline] = server.posts(f"{API}/pipelines")
    assert pipeline["namespace"] == "team-a"  # and the pipeline
    [run] = server.posts(f"{API}/runs")
    assert run["experiment_id"] == "exp-1"
    lists = [q for m, p, q, _ in server.requests if m == "GET" and p in (f"{API}/experiments", f"{API}/pipelines/names/dockrl-grpo")]
    assert len(lists) >= 2 and all(q.get("namespace") == "team-a" for q in lists)


def test_schedule_creates_a_recurring_run_of_a_registered_version_without_catchup(kfp_server, compiled_npu, capsys):
    registered = upload(kfp_server.url, compiled_npu)
    rc, out, err = _cli(capsys, "schedule", "--host", kfp_server.url, "--cron", "0 0 3 * * *", "--pipeline", "dockrl-grpo",
                        "--version", registered["version_name"], "--max-concurrency", "2", *OVERRIDES)
    assert rc == 0, err
    result = _json(out)
    assert result["recurring_run_id"] == "rr-1" and result["version_name"] == registered["version_name"]
    [rec] = kfp_server.posts(f"{API}/recurringruns")
    assert rec["pipeline_version_reference"] == {"pipeline_id": registered["pipeline_id"],
                                                 "pipeline_version_id": registered["pipeline_version_id"]}
    assert "pipeline_spec" not in rec
    assert rec["trigger"] == {"cron_schedule": {"cron": "0 0 3 * * *"}}
    assert rec["max_concurrency"] == 2
    assert rec["no_catchup"] is True
    assert rec["mode"] == "ENABLE"
    assert re.match(r"^grpo-smollm2-135m-recurring-\d{8}-\d{4}$", rec["display_name"]) and rec["experiment_id"] == "exp-1"
    assert result["recurring_run_name"] == rec["display_name"]
    assert "service_account" not in rec  # KFP's default account unless one is given
    assert rec["runtime_config"]["parameters"]["config_overrides"] == "\n".join(OVERRIDES)


def test_bad_cron_is_rejected_before_any_request(kfp_server, compiled_npu, capsys):
    rc, _, err = _cli(capsys, "schedule", "--host", kfp_server.url, "--cron", "0 3 * * *", "--package", str(compiled_npu))
    assert rc != 0
    assert "has 5 field(s)" in err and "'0 0 3 * * *'" in err
    assert kfp_server.requests == []


def test_unreachable_host_is_a_clear_error_within_the_timeout(compiled_npu):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(PipelineError, match=rf"cannot reach KFP at http://127.0.0.1:{port} within 2 s"):
        submit(f"http://127.0.0.1:{port}", compiled_npu, timeout_s=2)
    assert time.monotonic() - start < 5


def test_silent_host_times_out(compiled_npu):
    with socket.socket() as s:  # accepts connections (backlog) but never answers
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        start = time.monotonic()
        with pytest.raises(PipelineError, match="cannot reach KFP .* within 1 s"):
            check_host(f"http://127.0.0.1:{s.getsockname()[1]}", timeout_s=1)
        assert time.monotonic() - start < 4


def test_host_that_is_not_kfp(kfp_server):
    with pytest.raises(PipelineError, match="--host 'localhost:8080': expected the KFP API URL"):
        check_host("localhost:8080")


def test_missing_package_is_a_clear_error(kfp_server, tmp_path, capsys):
    missing = tmp_path / "nope.yaml"
    rc, _, err = _cli(capsys, "submit", "--host", kfp_server.url, "--package", str(missing))
    assert rc != 0
    assert f"pipeline package {missing} does not exist" in err and "dockrl pipeline compile" in err
    with pytest.raises(PipelineError, match="does not exist"):
        schedule(kfp_server.url, missing, cron="0 0 3 * * *")


def test_bad_override_is_rejected_before_connecting(kfp_server, capsys):
    rc, _, err = _cli(capsys, "submit", "--host", kfp_server.url, "trainer.lr=fast")
    assert rc == 2 and "trainer.lr: got 'fast'" in err
    assert kfp_server.requests == []


def test_api_refusal_names_the_status(kfp_server, compiled_npu):
    kfp_server.refuse[f"{API}/runs"] = (400, 3, "runtime_config: invalid parameter")
    with pytest.raises(PipelineError, match="refused to create the run: HTTP 400 Bad Request .*runtime_config: invalid parameter"):
        submit(kfp_server.url, compiled_npu)
    kfp_server.refuse[f"{API}/pipelines/upload_version"] = (409, 6, "version exists")
    with pytest.raises(PipelineError, match=r"refused to upload version '.*' of pipeline 'other': HTTP 409 Conflict .*version exists"):
        upload(kfp_server.url, compiled_npu, pipeline_name="other")


@pytest.mark.parametrize("cron", [
    "0 0 3 * * *", "*/30 * * * * *", "0 0 9 ? * 2-6", "0 0 9 ? * MON-FRI", "0 15,45 8-18/2 1 JAN-jun *",
    "0 0 0 1 */3 ?", "5/10 * * * * *", "@daily", "@every 1h30m", "  0  0 3 * * *  ",
])
def test_valid_crons(cron):
    assert validate_cron(cron) == " ".join(cron.split())


@pytest.mark.parametrize("cron, message", [
    ("0 3 * * *", "has 5 field(s)"),
    ("", "has 0 field(s)"),
    ("0 0 3 * * * *", "has 7 field(s)"),
    ("60 0 3 * * *", "seconds field '60': 60 is outside 0-59"),
    ("0 0 24 * * *", "hours field '24': 24 is outside 0-23"),
    ("0 0 3 0 * *", "day of month field '0': 0 is outside 1-31"),
    ("0 0 3 * 13 *", "month field '13'"),
    ("0 0 3 * * 7", "day of week field '7': 7 is outside 0-6"),
    ("0 0 3 * FOO *", "'FOO' is not a number"),
    ("0 0 3 * * */0", "step '0' must be a positive integer"),
    ("? 0 3 * * *", "'?' is only allowed"),
    ("0 0 5-3 * * *", "runs backwards"),
    ("@sometimes", "unknown descriptor"),
    ("@every soon", "unknown descriptor"),
])
def test_invalid_crons_name_the_field_and_the_format(cron, message):
    with pytest.raises(PipelineError) as err:
        validate_cron(cron)
    assert message in str(err.value)
    if not cron.startswith("@"):
        assert "seconds first" in str(err.value)


def test_max_concurrency_is_checked(kfp_server, compiled_npu):
    with pytest.raises(PipelineError, match="--max-concurrency 0"):
        schedule(kfp_server.url, compiled_npu, cron="0 0 3 * * *", max_concurrency=0)
    assert kfp_server.requests == []


def test_cli_schedule_compiles_and_schedules_the_alignment_pipeline(kfp_server, capsys):
    """A recurring alignment run (SFT → GRPO), compiled now with ``--kind alignment``, as a GRPO one is."""
    rc, out, err = _cli(capsys, "schedule", "--host", kfp_server.url, "--kind", "alignment", "--platform", "gpu", "--cron", "0 0 3 * * *",
                        *OVERRIDES)
    assert rc == 0, err
    assert _json(out)["recurring_run_id"] == "rr-1"
    [version] = kfp_server.versions[pipeline_id(kfp_server, "dockrl-alignment")]
    tasks = version["pipeline_spec"]["pipeline_spec"]["components"]["comp-exit-handler-1"]["dag"]["tasks"]
    assert {"sft", "start-from", "train"} <= set(tasks)
    [rec] = kfp_server.posts(f"{API}/recurringruns")
    assert rec["runtime_config"]["parameters"]["config_overrides"] == "\n".join(OVERRIDES)
    assert rec["trigger"] == {"cron_schedule": {"cron": "0 0 3 * * *"}} and rec["no_catchup"] is True
