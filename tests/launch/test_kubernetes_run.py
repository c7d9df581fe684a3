"""A distributed run set up on the Kubernetes worker backend, against the fake API (FakeCluster in
conftest.py): the groups it renders, the launcher's shared run folder, a failing pod, teardown.

No cluster here: nothing in these tests reaches a stage that talks to a real pod (see docs/kubernetes.md,
"Not run on a real cluster", for what needs one).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml

from dockrl.config import load_config, load_config_text
from dockrl.dock.tls import RunCertificates
from dockrl.kubeflow import train_task
from dockrl.kubeflow.steps import prepare_dataset
from dockrl.launch.artifacts import resolve_checkpoint
from dockrl.launch.backend import WorkerFailed
from dockrl.launch.distributed import shard_locations, worker_groups
from dockrl.launch.jobset import jobset_name
from dockrl.launch.kubernetes import ENTRY_POINT, SHARD_PORT, KubernetesBackend
from dockrl.launch.launcher_pod import OwnerPod
from dockrl.launch.platform import PLATFORMS, Platform
from dockrl.process.env import CONFIG_ENV, DRIVER_TOKEN_ENV, stage_token_env

RUN = "3f2b1c9e-7a44-4c1e-9d0b-5e6f7a8b9c0d"  # a KFP run id
NS = "team-rl"
OWNER = OwnerPod(name="dockrl-grpo-abcde-train-123", uid="8c7e6d5f-0000-4000-8000-123456789abc")
LAUNCHER_IP = "10.44.3.17"
DATA = ["data.generate_train=12", "data.generate_test=4", "data.max_steps=2"]


def npu_platform(tmp_path: Path) -> Platform:
    """The npu preset with the shared volume mounted under tmp_path (as in the pods, on this machine)."""
    fields = json.loads(PLATFORMS["npu"].to_json()) | {"shared_mount_path": str(tmp_path / "shared")}
    return Platform.from_json(json.dumps(fields))


def small_config(tiny_model_dir, out: Path, *extra: str):
    return load_config(None, [
        f"model.path={tiny_model_dir}", f"run.output_dir={out}", "dock.mode=distributed", "dock.shards=2",
        "algorithm.kl_loss_coef=0.05", "trainer.iterations=1", "trainer.global_batch=2", "trainer.mini_batch=2",
        "trainer.micro_batch=2", "rollout.n=2", *extra,
    ])


def env_of(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_a_distributed_run_renders_one_valid_jobset_with_cluster_addresses(cluster, tiny_model_dir, tmp_path, validate_jobset):
    platform = npu_platform(tmp_path)
    backend = KubernetesBackend(RUN, namespace=NS, platform=platform, core_api=cluster.core(), custom_api=cluster.custom(),
                                owner=OWNER, launcher_ip=LAUNCHER_IP)
    cfg = small_config(tiny_model_dir, backend.shared_dir / "runs" / RUN)
    ports = backend.serve_ports(2)
    name = jobset_name(RUN)
    hosts = [f"{name}-dock-shard-0-{s}.{name}.{NS}.svc" for s in (0, 1)]  # pod s of the shards' one Job
    certs = RunCertificates.generate(hosts)  # as the launcher makes them: for the shards' pod DNS names
    groups = worker_groups(cfg, backend, ports, f"{backend.launcher_host}:29500", "driver-token", RUN, first_wait=1234.0, tls=certs)
    secret, _, jobset = backend.render(groups)
    validate_jobset(jobset)
    stages = ("rollout", "reward", "reference", "actor")
    tokens = {stage_token_env(stage): secret["stringData"][stage_token_env(stage)] for stage in stages}  # one key per stage
    assert secret["stringData"] == {DRIVER_TOKEN_ENV: "driver-token", **tokens, **certs.server.env("server"), **certs.client.env("client")}
    assert len(set(tokens.values())) == len(stages)
    rjobs = {r["name"]: r for r in jobset["spec"]["replicatedJobs"]}
    assert list(rjobs) == ["dock-shard", "rollout", "reward", "reference", "actor"]  # the shards: one replicated job
    assert rjobs["dock-shard"]["template"]["spec"] | {"template": None} == {
        "completionMode": "Indexed", "completions": 2, "parallelism": 2, "backoffLimit": 0,
        "activeDeadlineSeconds": PLATFORMS["npu"].worker_deadline_s, "template": None}

    def pod(group: str) -> dict:
        return rjobs[group]["template"]["spec"]["template"]["spec"]

    locations = [f"grpc+tls://{host}:{SHARD_PORT}" for host in hosts]
    assert shard_locations(backend, ports, "grpc+tls") == locations  # where the launcher connects, too

    def secret_ref(key: str) -> dict:
        return {"secretKeyRef": {"name": secret["metadata"]["name"], "key": key}}

    [c] = pod("dock-shard")["containers"]
    # arguments only: the image's entry point is dockrl (on the NPU image after CANN's set_env.sh)
    assert "command" not in c
    assert c["args"][:7] == ["dock-shard", "--host", "0.0.0.0", "--port", str(SHARD_PORT), "--token-env", DRIVER_TOKEN_ENV]
    assert [json.loads(c["args"][i + 1])["stage"] for i, arg in enumerate(c["args"]) if arg == "--stage-rights"] == list(stages)
    args = " ".join(c["args"])
    assert f"--driver-timeout-s {cfg.run.driver_timeout_s}" in args  # the liveness tie (dockrl.process.lifeline)
    assert f"--snapshot-place {backend.shared_dir / 'runs' / RUN}" in args and c["args"][-1] == "--tls"
    assert c["ports"] == [{"name": "rpc", "containerPort": SHARD_PORT, "protocol": "TCP"}]
    assert all(env_of(c)[key] == secret_ref(key) for key in tokens) and CONFIG_ENV not in env_of(c)
    assert set(env_of(c)) >= {DRIVER_TOKEN_ENV, *certs.server.env("server")}  # by secretKeyRef
    # each shard's index is its pod's completion index
    assert env_of(c)["DOCKRL_REPLICA"] == {"fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    text = json.dumps(jobset)
    assert not [v for v in ("driver-token", *tokens.values(), "PRIVATE KEY", "CERTIFICATE") if v in text]

    for stage in stages:
        spec = pod(stage)
        [c] = spec["containers"]
        cmd = c["args"]
        assert ENTRY_POINT == () and cmd[:5] == ["worker", "--stage", stage, "--config-env", CONFIG_ENV]
        assert cmd[cmd.index("--dock") + 1] == ",".join(locations)
        assert cmd[cmd.index("--weight-sync") + 1] == f"{LAUNCHER_IP}:29500"  # the launcher pod's IP
        assert cmd[cmd.index("--run") + 1] == RUN
        # every stage starts at once: the others wait through the rollout's evaluation (and all for the shards)
        assert cmd[-2:] == ["--first-wait-s", "1234"]
        env = env_of(c)
        # its own token only: the driver's is the shards', another stage's its own
        assert {k: v for k, v in env.items() if k.startswith("DOCKRL_DOCK_TOKEN") or k == DRIVER_TOKEN_ENV} == {
            stage_token_env(stage): secret_ref(stage_token_env(stage))}
        assert set(certs.client.env("client")) <= set(env) and not set(env) & {"DOCKRL_DOCK_TLS_SERVER_KEY"}
        assert load_config_text(env[CONFIG_ENV], "env") == cfg  # the whole config, no file of the launcher
        # the shared volume, where the run folder (data, checkpoints) is, at the same path as in the launcher
        assert {"name": "shared", "mountPath": str(backend.shared_dir)} in c["volumeMounts"]
        assert {"name": "shared", "persistentVolumeClaim": {"claimName": "dockrl-shared"}} in spec["volumes"]
        requests = c["resources"]["requests"]
        if stage == "reward":
            assert set(requests) == {"cpu", "memory", "ephemeral-storage"} and "nodeSelector" not in spec and "tolerations" not in spec
            assert c["image"] == "ghcr.io/dockrl/dockrl-cpu:0.1.0"
        else:  # one process, one rank of the layout, one device: a device's share of a node
            assert c["image"] == "ghcr.io/dockrl/dockrl-npu:0.1.0"
            assert c["resources"] == {"requests": {"cpu": "16", "memory": "96Gi", "ephemeral-storage": "20Gi", "huawei.com/Ascend910": 1},
                                      "limits": {"huawei.com/Ascend910": 1}}
            assert spec["nodeSelector"] == {"accelerator": "huawei-Ascend910"}
            assert spec["securityContext"]["supplementalGroups"] == [1000]
    assert "limits" not in pod("dock-shard")["containers"][0]["resources"]
    assert "nodeSelector" not in pod("dock-shard")
    assert pod("dock-shard")["containers"][0]["image"] == PLATFORMS["cpu"].image


def test_the_hybrid_actor_asks_for_one_device_per_rank_of_the_layout(cluster, tiny_model_dir, tmp_path):
    backend = KubernetesBackend(RUN, namespace=NS, platform=npu_platform(tmp_path), core_api=None, custom_api=None,
                                launcher_ip=LAUNCHER_IP)
    cfg = small_config(tiny_model_dir, backend.shared_dir / "r", "trainer.hybrid=true", "trainer.engine=megatron", "rollout.engine=vllm",
                       "parallel.tp=2", "parallel.dp=2", "trainer.global_batch=4", "trainer.mini_batch=4")
    groups = {g.name: g for g in worker_groups(cfg, backend, backend.serve_ports(2), f"{LAUNCHER_IP}:29500", "t", RUN)}
    assert (groups["hybrid"].replicas, groups["hybrid"].devices) == (4, 1)  # tp × pp × dp = 4 rank processes
    assert (groups["reference"].devices, groups["reward"].devices, groups["dock-shard"].devices) == (1, 0, 0)
    [_, _, jobset] = backend.render(list(groups.values()))
    hybrid = {r["name"]: r for r in jobset["spec"]["replicatedJobs"]}["hybrid"]["template"]["spec"]
    # one pod shaped like a node holds the 4 ranks as local ranks (dockrl node), both TP groups inside it
    [c] = hybrid["template"]["spec"]["containers"]
    assert hybrid["parallelism"] == 1 and c["resources"]["limits"] == {"huawei.com/Ascend910": 4}
    assert c["args"][:6] == ["node", "--nproc-per-node", "4", "--rdzv-timeout-s", "2400", "--"] and c["args"][6:8] == ["worker", "--stage"]


def use_fake_cluster(cluster, monkeypatch, *, pod_ip: str | None = LAUNCHER_IP) -> None:
    """What ``KubernetesBackend.from_cluster`` reads in the launcher pod, served by the fake."""
    import kubernetes

    monkeypatch.setattr(kubernetes.config, "load_incluster_config", lambda: None)
    monkeypatch.setattr(kubernetes.client, "CoreV1Api", lambda: cluster.core())
    monkeypatch.setattr(kubernetes.client, "CustomObjectsApi", lambda: cluster.custom())
    for name, value in {"POD_NAMESPACE": NS, "POD_NAME": OWNER.name, "POD_UID": OWNER.uid, "POD_IP": pod_ip}.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)


def test_a_failing_shard_pod_fails_the_run_with_its_log_and_teardown_removes_everything(
    cluster, tiny_model_dir, tmp_path, monkeypatch,
):
    use_fake_cluster(cluster, monkeypatch)
    monkeypatch.setattr(KubernetesBackend, "__init__", _fast_polls(KubernetesBackend.__init__))
    cluster.pods_on_create["dock-shard"] = ({"phase": "Failed", "containerStatuses": [{
        "name": "worker", "ready": False, "restartCount": 0, "image": "x", "imageID": "",
        "state": {"terminated": {"exitCode": 2, "reason": "Error"}}}]},
        "dockrl dock-shard: error: --token-env DOCKRL_DOCK_TOKEN: the environment variable is unset or empty\n")
    prepare_dataset(DATA, tmp_path / "ds")
    platform = npu_platform(tmp_path)
    with pytest.raises(WorkerFailed) as err:
        train_task.run_training([f"model.path={tiny_model_dir}", "dock.shards=2"], tmp_path / "ds", tmp_path / "model",
                              tmp_path / "run", log_metric=lambda k, v: None, worker_backend="kubernetes",
                              run_id=RUN, platform=platform)
    e = err.value
    assert e.group == "dock-shard" and e.member.startswith(f"{jobset_name(RUN)}-dock-shard-0-")
    assert "exited with code 2 (Error)" in e.reason and "environment variable is unset" in e.log_tail
    assert [o["kind"] for o in cluster.created] == ["Secret", "NetworkPolicy", "JobSet"]  # every group in one JobSet, at once
    rjobs = {r["name"]: r["template"]["spec"]["template"]["spec"] for r in cluster.created[2]["spec"]["replicatedJobs"]}
    reward = rjobs["reward"]["containers"][0]["args"]
    # its wait for the first iteration: the rollout's loading and evaluation (dock.timeout_s 600 s each, one evaluation
    # batch of 4 test prompts), plus how far apart pods may start (the scheduling and image pull timeouts)
    assert float(reward[reward.index("--first-wait-s") + 1]) == 600 * 3 + platform.schedule_timeout_s + platform.image_pull_timeout_s
    # torn down: the JobSet and its pods; the Secret goes with the launcher pod that owns it (the Role: create only)
    [(kind, secret)] = [(k[0], o) for k, o in cluster.objects.items()]
    assert kind == "Secret" and secret["metadata"]["ownerReferences"] == [OWNER.reference()]
    shared_run = tmp_path / "shared" / "runs" / RUN
    assert sorted(p.name for p in (shared_run / "data").iterdir()) == ["test.jsonl", "train.jsonl"]
    config = yaml.safe_load((shared_run / "config.yaml").read_text())
    assert config["data"]["train_path"] == str(shared_run / "data" / "train.jsonl")
    assert config["run"]["output_dir"] == str(shared_run)


def _fast_polls(init):
    def fast(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.poll_s = 0.05

    return fast


def test_the_launcher_needs_its_pod_ip_before_anything_starts(cluster, tiny_model_dir, tmp_path, monkeypatch):
    use_fake_cluster(cluster, monkeypatch, pod_ip=None)
    prepare_dataset(DATA, tmp_path / "ds")
    with pytest.raises(ValueError, match=r"launcher pod's IP is unknown; set POD_IP .*status\.podIP"):
        train_task.run_training([f"model.path={tiny_model_dir}"], tmp_path / "ds", tmp_path / "model", tmp_path / "run",
                              log_metric=lambda k, v: None, worker_backend="kubernetes", run_id=RUN, platform=npu_platform(tmp_path))
    assert cluster.calls == []


def test_run_training_on_kubernetes_keeps_the_run_on_the_shared_volume_then_hands_it_over(cluster, tmp_path, monkeypatch):
    """The launcher's part, with the driver's train replaced by one that writes a one-iteration run."""
    from dockrl import driver

    use_fake_cluster(cluster, monkeypatch)
    seen = {}

    def fake_train(cfg, *, backend):
        seen["cfg"], seen["backend"] = cfg, backend
        out = Path(cfg.run.output_dir)
        assert Path(cfg.data.train_path).read_text() == (tmp_path / "ds" / "train.jsonl").read_text()
        (out / "checkpoints" / "final").mkdir(parents=True)
        (out / "checkpoints" / "final" / "config.json").write_text("{}")
        (out / "metrics.jsonl").write_text('{"iteration": 0, "reward/mean": 0.5}\n')
        (out / "summary.json").write_text('{"run/seconds": 1.0, "eval/accuracy_after": null}')  # NaN is written as null
        return {"run/seconds": 1.0, "eval/accuracy_after": math.nan}

    monkeypatch.setattr(driver, "train", fake_train)
    prepare_dataset(DATA, tmp_path / "ds")
    logged: dict[str, float] = {}
    summary = train_task.run_training([], tmp_path / "ds", tmp_path / "model", tmp_path / "run", log_metric=logged.__setitem__,
                                    worker_backend="kubernetes", run_id=RUN, platform=npu_platform(tmp_path))
    backend, cfg = seen["backend"], seen["cfg"]
    assert isinstance(backend, KubernetesBackend)
    assert (backend.run_id, backend.namespace, backend.owner, backend.launcher_host) == (RUN, NS, OWNER, LAUNCHER_IP)
    assert backend.platform.image == PLATFORMS["npu"].image
    shared_run = tmp_path / "shared" / "runs" / RUN
    assert cfg.run.output_dir == str(shared_run) and cfg.data.test_path == str(shared_run / "data" / "test.jsonl")
    assert summary["run/seconds"] == 1.0
    assert logged == {"run/iterations": 1.0, "reward/mean/final": 0.5, "reward/mean/best": 0.5, "run/seconds": 1.0}
    # the checkpoint stays on the shared volume: the model artifact names it, nothing copied into the pod
    assert resolve_checkpoint(tmp_path / "model") == shared_run / "checkpoints" / "final"
    assert not (tmp_path / "model" / "config.json").exists()
    assert (tmp_path / "run" / "metrics.jsonl").is_file() and not (tmp_path / "run" / "checkpoints").exists()
    assert not (tmp_path / "run" / "data").exists() and not (shared_run / "data").exists()
    assert (shared_run / "metrics.jsonl").is_file()  # the run folder stays (TensorBoard reads it there)


def test_the_launcher_refuses_what_stage_pods_cannot_run(tiny_model_dir, tmp_path):
    shared = tmp_path / "shared"
    with pytest.raises(ValueError, match="dock.mode='inprocess': the kubernetes worker backend runs the stages as pods"):
        train_task.check_shared_config(small_config(tiny_model_dir, shared / "r", "dock.mode=inprocess"), shared)
    with pytest.raises(ValueError, match=r"dock.directory=.*must be on the shared volume .*or use dock.warehouse=s3"):
        train_task.check_shared_config(small_config(tiny_model_dir, shared / "r", "dock.warehouse=directory",
                                                  f"dock.directory={tmp_path / 'store'}"), shared)
    with pytest.raises(ValueError, match="run.output_dir=.*must be on the shared volume"):
        train_task.check_shared_config(small_config(tiny_model_dir, tmp_path / "r"), shared)
    with pytest.raises(ValueError, match="worker_backend='kubernetes' needs run_id"):
        train_task.run_training([], tmp_path / "ds", tmp_path / "m", tmp_path / "r", log_metric=print, worker_backend="kubernetes")
    no_volume = Platform(name="cpu", shared_volume_claim="")
    backend = KubernetesBackend(RUN, namespace=NS, platform=no_volume, core_api=None, custom_api=None)
    with pytest.raises(ValueError, match="has no shared_volume_claim"):
        backend.shared_dir  # noqa: B018 - the property's check raises


def test_platform_travels_as_json():
    for platform in PLATFORMS.values():
        assert Platform.from_json(platform.to_json()) == platform
    with pytest.raises(ValueError, match="unexpected keyword argument 'gpus'"):
        Platform.from_json('{"name": "cpu", "gpus": 2}')
    with pytest.raises(ValueError, match="platform: not JSON"):
        Platform.from_json("npu")
