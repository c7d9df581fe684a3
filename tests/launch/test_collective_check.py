"""The collective check before a first run: ``dockrl ranks --all-reduce`` joins every rank process
in one process group of the device's backend and prints an all-reduce's bandwidth; ``dockrl smoke``
renders it as a JobSet of pods shaped like a run's, with every site hook of the platform.

The slow test runs the two pods of a rendered smoke JobSet as two ``dockrl node`` processes on
this machine (gloo: the cpu platform), meeting at "pod 0" as they would across nodes."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys

import pytest
import yaml

from dockrl.cli import main as cli_main
from dockrl.launch.jobset import member_host
from dockrl.launch.node import SMOKE_RUN_ID, smoke_objects
from dockrl.launch.platform import PLATFORMS
from dockrl.process.env import RDZV_PORT

NS = "team-rl"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pod(objects: list[dict]) -> tuple[dict, dict]:
    [jobset] = [o for o in objects if o["kind"] == "JobSet"]
    [rjob] = jobset["spec"]["replicatedJobs"]
    return rjob["template"]["spec"], rjob["template"]["spec"]["template"]


def test_one_process_prints_its_place_and_an_all_reduce_bandwidth(capsys, monkeypatch):
    for name in ("DOCKRL_REPLICA", "DOCKRL_REPLICAS", "DOCKRL_NODE_PROCS"):
        monkeypatch.delenv(name, raising=False)
    assert cli_main(["ranks", "--all-reduce", "--size-mib", "1", "--iterations", "2", "parallel.device=cpu"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["rank"], report["world_size"], report["device"]) == (0, 1, "cpu")
    ar = report["all_reduce"]
    assert (ar["backend"], ar["bytes"], ar["iterations"]) == ("gloo", 2**20, 2)
    assert ar["seconds"] > 0 and ar["algbw_gbps"] == pytest.approx(ar["bytes"] / ar["seconds"] / 1e9)
    assert ar["busbw_gbps"] == 0.0  # one rank moves nothing: 2(n-1)/n = 0


def test_bad_sizes_are_refused_naming_the_option(capsys):
    with pytest.raises(SystemExit):
        cli_main(["ranks", "--all-reduce", "--iterations", "0"])
    assert "--iterations 0" in capsys.readouterr().err


def test_the_smoke_jobset_has_a_nodes_devices_per_pod_and_every_site_hook(validate_jobset, validate_strict):
    site = dataclasses.replace(
        PLATFORMS["npu"], host_paths={"/usr/local/Ascend/driver": "/usr/local/Ascend/driver", "/etc/hccn.conf": "/etc/hccn.conf"},
        env={"HCCL_BUFFSIZE": "200"}, extra_resources={"rdma/hca_shared_devices_a": "1"},
        pod_labels={"ring-controller.atlas": "ascend-910b"}, scheduler="volcano")
    objects = smoke_objects(site, pods=2, namespace=NS)
    assert [o["kind"] for o in objects] == ["Secret", "NetworkPolicy", "PodGroup", "JobSet"]
    validate_strict(objects[0])
    validate_jobset(objects[3])
    job, pod = _pod(objects)
    assert (job["completions"], job["activeDeadlineSeconds"]) == (2, 3600)
    spec = pod["spec"]
    [c] = spec["containers"]
    assert c["args"][:5] == ["node", "--nproc-per-node", "8", "--rdzv-timeout-s", "2400"]
    assert c["args"][c["args"].index("--") + 1:][:2] == ["ranks", "--all-reduce"]
    assert {"parallel.dp=16", "parallel.device=npu"} <= set(c["args"])
    assert c["resources"]["limits"] == {"huawei.com/Ascend910": 8, "rdma/hca_shared_devices_a": "1"}
    assert {"mountPath": "/etc/hccn.conf", "name": "host-0", "readOnly": True} in c["volumeMounts"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HCCL_BUFFSIZE"] == "200" and env["MASTER_ADDR"] == member_host(SMOKE_RUN_ID, "smoke", 0, NS)
    assert pod["metadata"]["labels"]["ring-controller.atlas"] == "ascend-910b"
    assert spec["schedulerName"] == "volcano" and spec["securityContext"]["supplementalGroups"] == [1000]


def test_dockrl_smoke_prints_the_objects_as_yaml(capsys, tmp_path):
    config = tmp_path / "site-platform.yaml"
    config.write_text("devices_per_node: 4\nhost_paths: {/etc/hccn.conf: /etc/hccn.conf}\n")
    assert cli_main(["smoke", "--namespace", NS, "--platform-config", str(config), "--pods", "3"]) == 0
    objects = list(yaml.safe_load_all(capsys.readouterr().out))
    job, pod = _pod(objects)
    assert job["completions"] == 3 and "parallel.dp=12" in pod["spec"]["containers"][0]["args"]


@pytest.mark.slow
def test_two_pods_all_reduce_over_gloo_and_print_the_bandwidth(tmp_path):
    """The two pods of a rendered smoke JobSet (cpu platform: a process per pod) as two processes."""
    _, pod = _pod(smoke_objects(PLATFORMS["cpu"], pods=2, namespace=NS, size_mib=16, iterations=3))
    [c] = pod["spec"]["containers"]
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == (member_host(SMOKE_RUN_ID, "smoke", 0, NS), str(RDZV_PORT))
    port = _free_port()
    procs = []
    for index in range(2):
        pod_env = {**os.environ, "DOCKRL_REPLICA": str(index), "DOCKRL_REPLICAS": env["DOCKRL_REPLICAS"],
                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}  # pod 0 is this machine
        procs.append(subprocess.Popen([sys.executable, "-m", "dockrl", *c["args"]], env=pod_env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=tmp_path))
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err[-2000:]
        reports += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert sorted(r["rank"] for r in reports) == [0, 1]
    [seconds] = {r["all_reduce"]["seconds"] for r in reports}  # the slowest rank's time, agreed by both
    for r in reports:
        ar = r["all_reduce"]
        assert (r["world_size"], ar["backend"], ar["bytes"], ar["iterations"]) == (2, "gloo", 16 * 2**20, 3)
        assert ar["algbw_gbps"] > 0 and ar["busbw_gbps"] == pytest.approx(ar["algbw_gbps"])  # 2(n-1)/n = 1 for two ranks
    print(f"all-reduce of 16 MiB over gloo, 2 processes: {seconds * 1e3:.1f} ms, bus bandwidth {reports[0]['all_reduce']['busbw_gbps']:.2f} GB/s")
