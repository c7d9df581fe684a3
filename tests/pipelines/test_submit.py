"""Submit and schedule against a fake KFP API on 127.0.0.1; cron validation; clear errors."""

from __future__ import annotations

import json
import socket
import time

import pytest
import yaml

from dockrl.kubeflow import pipeline_cli
from dockrl.pipelines.submit import PipelineError, check_host, schedule, submit, validate_cron

OVERRIDES = ["trainer.iterations=3", "trainer.lr=5e-6"]


def _cli(capsys, *argv) -> tuple[int, str, str]:
    rc = pipeline_cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_submit_creates_the_experiment_and_a_run_from_the_package(kfp_server, compiled_npu, capsys):
    rc, out, _ = _cli(capsys, "submit", "--host", kfp_server.url, "--experiment", "grpo-exp", "--package", str(compiled_npu),
                      "--run-name", "nightly", "--service-account", "dockrl-launcher", *OVERRIDES)
    assert rc == 0
    assert json.loads(out[out.index("{"):]) == {"experiment_id": "exp-1", "run_id": "run-1"}
    [exp] = kfp_server.posts("/apis/v2beta1/experiments")
    assert exp["display_name"] == "grpo-exp"
    [run] = kfp_server.posts("/apis/v2beta1/runs")
    assert run["experiment_id"] == "exp-1" and run["display_name"] == "nightly"
    assert run["service_account"] == "dockrl-launcher"
    # only run-time parameters: the worker backend and the platform are compiled into the package
    assert run["runtime_config"]["parameters"] == {"config_overrides": OVERRIDES, "export_dtype": "bfloat16"}
    # the run carries the pipeline spec exactly as compiled, with its platform section
    assert run["pipeline_spec"] == {
        "pipeline_spec": next(yaml.safe_load_all(compiled_npu.read_text())),
        "platform_spec": list(yaml.safe_load_all(compiled_npu.read_text()))[1],
    }


def test_submit_reuses_an_existing_experiment(kfp_server, compiled_npu):
    kfp_server.experiments["dockrl"] = "exp-42"
    out = submit(kfp_server.url, compiled_npu, params={"config_overrides": []})
    assert out == {"experiment_id": "exp-42", "run_id": "run-1"}
    assert kfp_server.posts("/apis/v2beta1/experiments") == []


def test_cli_submit_without_package_compiles_for_the_platform(kfp_server, capsys):
    rc, _, _ = _cli(capsys, "submit", "--host", kfp_server.url, "--platform", "gpu")
    assert rc == 0
    [run] = kfp_server.posts("/apis/v2beta1/runs")
    executors = run["pipeline_spec"]["pipeline_spec"]["deploymentSpec"]["executors"]
    assert executors["exec-train"]["container"]["resources"]["accelerator"]["resourceType"] == "nvidia.com/gpu"


def test_cli_submit_for_stage_pods_compiles_a_launcher_without_accelerators(kfp_server, capsys):
    rc, _, _ = _cli(capsys, "submit", "--host", kfp_server.url, "--platform", "gpu", "--worker-backend", "kubernetes",
                    "--service-account", "dockrl-launcher")
    assert rc == 0
    [run] = kfp_server.posts("/apis/v2beta1/runs")
    assert "worker_backend" not in run["runtime_config"]["parameters"]  # no run-time override of the compiled backend
    assert run["service_account"] == "dockrl-launcher"
    spec = run["pipeline_spec"]["pipeline_spec"]
    train = spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]["train"]
    assert train["inputs"]["parameters"]["worker_backend"]["runtimeValue"]["constant"] == "kubernetes"
    executors = spec["deploymentSpec"]["executors"]
    assert "accelerator" not in executors["exec-train"]["container"].get("resources", {})


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
    [run] = kfp_server.posts("/apis/v2beta1/runs")
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
    assert [path for _, path, _, _ in old.requests] == ["/apis/v2beta1/healthz"]
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
    [exp] = server.posts("/apis/v2beta1/experiments")
    assert exp == {"display_name": "grpo-team", "namespace": "team-a"}  # the experiment lives in the profile
    [run] = server.posts("/apis/v2beta1/runs")
    assert run["experiment_id"] == "exp-1"
    lists = [q for m, p, q, _ in server.requests if m == "GET" and p == "/apis/v2beta1/experiments"]
    assert lists and all(q.get("namespace") == "team-a" for q in lists)


def test_schedule_creates_a_recurring_run_without_catchup(kfp_server, compiled_npu, capsys):
    rc, out, _ = _cli(capsys, "schedule", "--host", kfp_server.url, "--cron", "0 0 3 * * *", "--package", str(compiled_npu),
                      "--max-concurrency", "2", "--name", "nightly-grpo", *OVERRIDES)
    assert rc == 0
    assert json.loads(out[out.index("{"):]) == {"experiment_id": "exp-1", "recurring_run_id": "rr-1"}
    [rec] = kfp_server.posts("/apis/v2beta1/recurringruns")
    assert rec["trigger"] == {"cron_schedule": {"cron": "0 0 3 * * *"}}
    assert rec["max_concurrency"] == 2
    assert rec["no_catchup"] is True
    assert rec["mode"] == "ENABLE"
    assert rec["display_name"] == "nightly-grpo" and rec["experiment_id"] == "exp-1"
    assert "service_account" not in rec  # KFP's default account unless one is given
    assert rec["runtime_config"]["parameters"]["config_overrides"] == OVERRIDES


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


def test_api_refusal_names_the_status(kfp_server, compiled_npu, monkeypatch):
    kfp_server.experiments["dockrl"] = "exp-1"
    monkeypatch.setattr("dockrl.pipelines.submit._package", lambda p: str(p))
    import kfp

    def refuse(self, **kwargs):
        from kfp_server_api import ApiException

        raise ApiException(status=400, reason="Bad Request")

    monkeypatch.setattr(kfp.Client, "run_pipeline", refuse)
    with pytest.raises(PipelineError, match="refused to create the run: HTTP 400 Bad Request"):
        submit(kfp_server.url, compiled_npu)


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
