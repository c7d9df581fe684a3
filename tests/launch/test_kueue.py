"""Runs Kueue and Volcano admit, and a launcher that says why it waits (docs/kubeflow.md, "Kueue and Volcano").

* Every supported configuration renders at most ``KUEUE_MAX_PODSETS`` (8) replicated jobs, Kueue's
  PodSets: the 8 that Kueue releases before mid-2026 allow a Workload (its CRD's ``spec.podSets``
  ``maxItems``; 18 since). The dock shards are one replicated job of N indexed pods.
* While Kueue holds the JobSet suspended, the launcher logs every minute what it waits for (the
  suspension, the Workload's ``QuotaReserved`` / ``Admitted`` conditions) and fails within
  ``Platform.admission_timeout_s`` where waiting will not admit the run.

The API is the fake of conftest.py (FakeKubernetesApi); time is a fake clock, so the minutes pass at once.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
from test_kubernetes_backend import GROUPS, NS, OWNER, RUN, platform
from test_ppo_runs import ppo_run

from dockrl.config import load_config
from dockrl.launch.backend import WorkerFailed
from dockrl.launch.distributed import SHARDS_GROUP, worker_groups
from dockrl.launch.jobset import KUEUE_MAX_PODSETS, KUEUE_PRIORITY_LABEL, KUEUE_QUEUE_LABEL, render_jobset
from dockrl.launch.kubernetes import KubernetesBackend
from dockrl.launch.platform import PLATFORMS
from dockrl.stages.table import STAGES

KUEUE = {"scheduler": "kueue", "queue": "team-rl", "priority_class": "rl-batch"}


def grpo(tiny_model_dir, tmp_path, *extra: str):
    return load_config(None, [f"model.path={tiny_model_dir}", f"run.output_dir={tmp_path / 'run'}", "dock.mode=distributed", *extra])


CONFIGS = {
    # name: (config, platform, replicated jobs expected)
    "ppo+kl, 4 shards": (lambda d, t: ppo_run(d, t, "run", "dock.mode=distributed", "dock.shards=4", "algorithm.kl_loss_coef=0.05"),
                         "gpu", ["dock-shard", "rollout", "reward", "reference", "critic", "actor"]),
    "grpo, 8 shards": (lambda d, t: grpo(d, t, "dock.shards=8", "trainer.global_batch=8", "trainer.mini_batch=8", "algorithm.kl_loss_coef=0.05"),
                       "npu", ["dock-shard", "rollout", "reward", "reference", "actor"]),
    "hybrid tp2·dp4": (lambda d, t: grpo(d, t, "trainer.hybrid=true", "trainer.engine=megatron", "rollout.engine=vllm", "parallel.tp=2",
                                         "parallel.dp=4", "trainer.global_batch=8", "trainer.mini_batch=8", "algorithm.kl_loss_coef=0.05"),
                       "npu", ["dock-shard", "hybrid", "reward", "reference"]),
    # every stage a run can switch on, beside the most shards above
    "ppo+kl+reward model, 8 shards": (lambda d, t: ppo_run(d, t, "run", "dock.mode=distributed", "dock.shards=8", "trainer.global_batch=8",
                                                           "algorithm.kl_loss_coef=0.05", "reward_model.enable=true",
                                                           f"reward_model.model.path={d}"),
                                      "gpu", ["dock-shard", "rollout", "reward-model", "reward", "reference", "critic", "actor"]),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_no_supported_configuration_renders_more_podsets_than_kueue_admits(name, tiny_model_dir, tmp_path, validate_jobset, capsys):
    make, plat, expected = CONFIGS[name]
    cfg = make(tiny_model_dir, tmp_path)
    backend = KubernetesBackend(RUN, namespace=NS, platform=platform(plat, **KUEUE), core_api=None, custom_api=None,
                                owner=OWNER, launcher_ip="10.0.0.7")
    groups = worker_groups(cfg, backend, backend.serve_ports(cfg.dock.shards), "10.0.0.7:29500", "t", RUN)
    [jobset] = [o for o in backend.render(groups) if o["kind"] == "JobSet"]
    validate_jobset(jobset)
    rjobs = {r["name"]: r["template"]["spec"] for r in jobset["spec"]["replicatedJobs"]}
    assert list(rjobs) == expected and len(rjobs) <= KUEUE_MAX_PODSETS == 8
    assert rjobs[SHARDS_GROUP]["completions"] == rjobs[SHARDS_GROUP]["parallelism"] == cfg.dock.shards  # N indexed pods
    assert jobset["metadata"]["labels"][KUEUE_QUEUE_LABEL] == "team-rl"
    assert jobset["metadata"]["labels"][KUEUE_PRIORITY_LABEL] == "rl-batch"
    with capsys.disabled():
        shapes = ", ".join(f"{g}×{spec['parallelism']}" for g, spec in rjobs.items())
        print(f"\n  {name}: {len(rjobs)} PodSets ({shapes})")


def test_the_stage_table_cannot_grow_past_kueues_limit_and_rendering_refuses_it():
    # the most groups any config can have: the shards, every stage process (rollout and actor, or the hybrid actor: not both)
    most = 1 + sum(1 for row in STAGES if row.kind == "process" and row.name != "hybrid") + 2
    assert most <= KUEUE_MAX_PODSETS
    many = [dataclasses.replace(GROUPS[2], name=f"stage-{i}") for i in range(KUEUE_MAX_PODSETS + 1)]
    with pytest.raises(ValueError, match=r"9 replicated jobs, more than the 8 PodSets a Kueue Workload holds"):
        render_jobset(many, run_id=RUN, namespace=NS, platform=PLATFORMS["npu"])


def test_the_volcano_podgroup_carries_the_pod_labels(validate_strict):
    plat = platform("npu", scheduler="volcano", pod_labels={"ring-controller.atlas": "ascend-910b"})
    group = {o["kind"]: o for o in render_jobset(GROUPS, run_id=RUN, namespace=NS, platform=plat)}["PodGroup"]
    assert group["metadata"]["labels"]["ring-controller.atlas"] == "ascend-910b"  # MindCluster reads it on the job too
    assert group["metadata"]["labels"]["dockrl.io/run"] == RUN
    assert "kueue.x-k8s.io/priority-class" not in str(group)
    with pytest.raises(ValueError, match="priority_class='Not A Name'"):
        platform("npu", priority_class="Not A Name")


class FakeClock:
    """Monotonic seconds that advance ``step`` on every read: each look of the launcher is ``step`` later."""

    def __init__(self, step: float) -> None:
        self.now, self.step = 0.0, step

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def suspended_run(cluster, clock: FakeClock, **changes) -> KubernetesBackend:
    """A started run whose JobSet Kueue's webhook suspended on creation."""
    b = KubernetesBackend(RUN, namespace=NS, platform=platform("npu", **changes), core_api=cluster.core(),
                          custom_api=cluster.custom(), owner=OWNER, poll_s=0.0, clock=clock)
    b.start(GROUPS)
    cluster.set_jobset(NS, suspend=True)
    return b


def waits(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "waiting for admission" in r.getMessage()]


def test_a_jobset_kueue_never_takes_logs_every_minute_and_fails_within_the_admission_timeout(cluster, caplog):
    """The JobSet is suspended, but no Workload appears for it (Kueue down, or not taking it): the
    launcher fails after admission_timeout_s, not a day."""
    clock = FakeClock(step=10.0)
    b = suspended_run(cluster, clock, **KUEUE, admission_timeout_s=300)
    with caplog.at_level(logging.INFO), pytest.raises(WorkerFailed) as err:
        b.wait_ready(b.start_timeout_s)
    assert 300 < clock.now <= 330  # within the admission timeout (and a look), far below queue_timeout_s (24 h)
    assert (err.value.group, err.value.member) == ("jobset", b.name)
    assert "no Kueue Workload for it (more than Platform.admission_timeout_s=300): Kueue never set its QuotaReserved " \
           "condition" in err.value.reason
    assert "LocalQueue 'team-rl' exists in namespace 'team-rl'" in err.value.reason
    said = waits(caplog)
    assert [m.split(" waiting for admission for ")[1].split(" s ")[0] for m in said] == ["0", "60", "120", "180", "240", "300"]
    assert all("JobSet suspended; no Kueue Workload for it yet; failing after Platform.admission_timeout_s=300 s" in m for m in said)


def test_a_suspended_jobset_without_a_queue_name_and_no_workload_fails_naming_the_missing_queue(cluster):
    """Compiled with scheduler 'default' for a namespace whose JobSets Kueue suspends, and no Workload appears."""
    clock = FakeClock(step=30.0)
    b = suspended_run(cluster, clock, admission_timeout_s=120)  # scheduler default: the JobSet names no queue
    with pytest.raises(WorkerFailed, match=r"QuotaReserved condition, nor will by waiting; check that the JobSet names no "
                                           r"LocalQueue \(platform scheduler='default'\), but Kueue manages this namespace"):
        b.wait_ready(b.start_timeout_s)
    assert clock.now <= 60 + 120 + 30  # first seen suspended at 60 s: failed at the first look past the timeout


def test_a_workload_waiting_for_quota_is_logged_with_its_conditions_and_waits_for_the_queue_timeout(cluster, caplog):
    clock = FakeClock(step=20.0)
    b = suspended_run(cluster, clock, **KUEUE, admission_timeout_s=60, queue_timeout_s=600)
    pending = "couldn't assign flavors to pod set hybrid: insufficient unused quota for huawei.com/Ascend910 in flavor ascend, 4 more needed"
    workload = cluster.set_workload(NS, [{"type": "QuotaReserved", "reason": "Pending", "message": pending}])
    with caplog.at_level(logging.INFO), pytest.raises(WorkerFailed) as err:
        b.wait_ready(b.start_timeout_s)
    assert 600 < clock.now <= 40 + 600 + 20  # quota may free up: it waits the queue timeout (from 40 s), not the admission timeout
    assert f"not admitted by kueue (queue 'team-rl') within Platform.queue_timeout_s=600 s: JobSet suspended; Kueue Workload " \
           f"{workload}: QuotaReserved=False (Pending: {pending})" in err.value.reason
    said = waits(caplog)
    assert len(said) == 11 and all(f"QuotaReserved=False (Pending: {pending})" in m for m in said)


@pytest.mark.parametrize("reason, message", [  # as Kueue words them (its workload controller and flavor assigner)
    ("Inadmissible", "LocalQueue team-rl doesn't exist"),
    ("Pending", "couldn't assign flavors to pod set hybrid: insufficient quota for huawei.com/Ascend910 in flavor ascend, "
                "request > maximum capacity (32 > 16)"),
    ("Pending", "couldn't assign flavors to pod set reference: insufficient quota for huawei.com/Ascend910 in flavor ascend, "
                "previously considered podsets requests (16) + current podset request (1) > maximum capacity (16)"),
])
def test_a_workload_that_waiting_will_not_admit_fails_after_the_admission_timeout(cluster, reason, message):
    clock = FakeClock(step=20.0)
    b = suspended_run(cluster, clock, **KUEUE, admission_timeout_s=60)
    cluster.set_workload(NS, [{"type": "QuotaReserved", "reason": reason, "message": message}])
    with pytest.raises(WorkerFailed) as err:
        b.wait_ready(b.start_timeout_s)
    assert clock.now <= 40 + 60 + 20  # first seen at 40 s, failed at the first look past the admission timeout
    assert "and waiting will not admit it (more than Platform.admission_timeout_s=60)" in err.value.reason
    assert f"QuotaReserved=False ({reason}: {message})" in err.value.reason


def test_a_workload_one_flavor_could_hold_once_quota_frees_keeps_waiting(cluster):
    clock = FakeClock(step=20.0)
    b = suspended_run(cluster, clock, **KUEUE, admission_timeout_s=60, queue_timeout_s=300)
    cluster.set_workload(NS, [{"type": "QuotaReserved", "reason": "Pending", "message": (
        "couldn't assign flavors to pod set hybrid: insufficient unused quota for huawei.com/Ascend910 in flavor ascend-a, "
        "8 more needed, insufficient quota for huawei.com/Ascend910 in flavor ascend-b, request > maximum capacity (16 > 8)")}])
    with pytest.raises(WorkerFailed, match="within Platform.queue_timeout_s=300 s"):
        b.wait_ready(b.start_timeout_s)
    assert clock.now > 300


def test_once_admitted_the_run_stops_saying_it_waits(cluster, caplog):
    from test_kubernetes_backend import _running

    clock = FakeClock(step=20.0)
    b = suspended_run(cluster, clock, **KUEUE)
    cluster.set_workload(NS, [{"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "message": "Quota reserved"},
                              {"type": "Admitted", "status": "True", "reason": "Admitted", "message": "The workload is admitted"}])
    with caplog.at_level(logging.INFO):
        b.check()
        cluster.set_jobset(NS, suspend=False)  # Kueue admitted it: the JobSet controller creates the Jobs
        _running(cluster)
        b.wait_ready(60)
    [said] = waits(caplog)
    assert "QuotaReserved=True (QuotaReserved: Quota reserved), Admitted=True (Admitted: The workload is admitted)" in said
