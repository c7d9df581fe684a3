"""Command line: ``dockrl pipeline compile | run | upload | submit | schedule`` (the Kubeflow pipeline).

    dockrl pipeline compile grpo.yaml --platform npu --worker-backend kubernetes \
        --registry registry.example.com/ml --tag 0.1.0 --pull-secret regcred
    dockrl pipeline compile grpo.yaml --platform npu --overlay manifests/overlays/npu   # images from the overlay
    dockrl pipeline run --local trainer.iterations=2           # whole pipeline via kfp.local
    dockrl pipeline compile alignment.yaml --kind alignment --platform gpu   # SFT → GRPO (pipelines/alignment.py)
    dockrl pipeline run --local --kind alignment --sft-override sft.epochs=2 trainer.iterations=2
    dockrl pipeline upload --host http://localhost:8080 --package grpo.yaml   # a new version of pipeline dockrl-grpo
    dockrl pipeline submit --host http://localhost:8080 --pipeline dockrl-grpo trainer.lr=5e-6   # its newest version
    dockrl pipeline submit --host https://kubeflow.example.com/pipeline --namespace team-a --package grpo.yaml
    dockrl pipeline schedule --host http://localhost:8080 --pipeline dockrl-grpo --version 0.1.0-3737ee0c1234-1a2b3c4d \
        --cron "0 0 3 * * *"

``upload`` registers a package (``--package``, or one compiled now from the compile options) as a
new version of a pipeline (``dockrl.pipelines.submit.upload``). ``submit`` and ``schedule`` run a
registered version: with ``--pipeline``/``--version`` and no package nor compile options, the named
version (default: the newest) as it is; else the package, uploaded first. Compile options (platform,
worker backend, images, task requests, the finished workflow's TTL) are fixed in the package. A KFP
backend older than 2.17.0 is refused (``dockrl.pipelines.submit.MIN_KFP_VERSION``;
``--metadata-keepalive`` accepts 2.15 and 2.16 where the cluster works around it). Trailing
``section.field=value`` arguments become the run's ``config_overrides`` (one per line) and are
checked before anything is compiled or sent. The pipeline definitions are the packages
``dockrl.pipelines`` and ``dockrl.components`` (they need the ``kfp`` extra).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

from dockrl.config import ConfigError, load_config
from dockrl.kubeflow.local_run import LocalRunOutput, forward_sigterm
from dockrl.launch.backend import WORKER_BACKENDS
from dockrl.launch.platform import get_platform
from dockrl.launch.platform_files import images_from_kustomization, platform_from_file, with_images
from dockrl.pipelines import submit
from dockrl.pipelines.grpo import (
    PIPELINE_KINDS,
    PIPELINE_NAME,
    PipelineSettings,
    Requests,
    compile_pipeline,
    compiled_worker_backend,
    local_summary,
    run_local,
)

PLATFORM_CHOICES = ("npu", "gpu", "cpu")


COMPILE_OPTIONS = ("kind", "platform", "worker_backend", "registry", "tag", "pull_secret", "overlay", "request", "platform_config",
                   "train_retries", "ttl_after_finished")
"""Options of ``compile`` (and of ``upload``/``submit``/``schedule`` without ``--package``): compile-time settings."""


def _params(args: argparse.Namespace) -> dict:
    return {"config_overrides": "\n".join(args.overrides), "export_dtype": args.export_dtype}


def _settings(args: argparse.Namespace) -> PipelineSettings:
    """The ``PipelineSettings`` the compile options ask for."""
    images = images_from_kustomization(args.overlay) if args.overlay else {}
    if args.registry:
        images["registry"] = args.registry
    if args.tag:
        images["tag"] = args.tag
    platform = get_platform(args.platform or "npu")
    if args.platform_config:
        platform = platform_from_file(platform, args.platform_config)
    platform = with_images(platform, pull_secret=args.pull_secret, **images)
    requests = {}
    for item in args.request:
        task, _, sizes = item.partition("=")
        cpu, _, memory = sizes.partition(",")
        if not (task and cpu and memory):
            raise ValueError(f"--request {item!r}: expected TASK=CPU,MEMORY, e.g. train=4,16Gi")
        requests[task] = Requests(cpu=cpu, memory=memory)
    return PipelineSettings(platform=platform, worker_backend=args.worker_backend or "local", requests=requests,
                            train_retries=args.train_retries or 0, ttl_after_finished_s=args.ttl_after_finished or 0)


def _package(args: argparse.Namespace, tmp: str) -> Path | None:
    """The package to upload: ``--package`` (compile options refused: they cannot change it), or
    one compiled now from the compile options; None for ``submit``/``schedule`` of a registered
    version (``--pipeline`` or ``--version``, and neither a package nor a compile option)."""
    compiling = [o for o in COMPILE_OPTIONS if getattr(args, o) not in (None, "", [])]
    if args.action != "upload" and not args.package and not compiling and (args.pipeline or args.version):
        return None
    if args.package:
        given = [f"--{o.replace('_', '-')}" for o in compiling]
        backend = compiled_worker_backend(args.package) if args.worker_backend and Path(args.package).is_file() else None
        if backend and args.worker_backend != backend:
            raise ValueError(f"--worker-backend {args.worker_backend}: the package {args.package} was compiled for the "
                             f"{backend!r} worker backend, which a run cannot change; recompile it with "
                             f"`dockrl pipeline compile --worker-backend {args.worker_backend}` or drop --package")
        others = [g for g in given if g != "--worker-backend"]
        if others:
            raise ValueError(f"{', '.join(others)}: compile options, but --package {args.package} is already compiled; "
                             "recompile it with them, or drop --package to compile one now")
        return Path(args.package)
    kind = args.kind or "grpo"
    return compile_pipeline(Path(tmp) / f"dockrl-{kind}.yaml", settings=_settings(args), kind=kind)


def _add_compile_options(p: argparse.ArgumentParser, *, when: str = "") -> None:
    p.add_argument("--kind", choices=PIPELINE_KINDS, default=None,
                   help=f"the pipeline: grpo, sft, or alignment (SFT, then GRPO from the SFT model){when} (default: grpo)")
    p.add_argument("--platform", choices=PLATFORM_CHOICES, default=None,
                   help=f"accelerators, node selector, tolerations and image of the accelerator pods{when} (default: npu)")
    p.add_argument("--worker-backend", default=None, choices=WORKER_BACKENDS,
                   help="local: the stages run in the train task's pod; kubernetes: stages as pods, the train task "
                        f"on the cpu image without accelerators{when} (default: local)")
    p.add_argument("--registry", default="", help="registry of the images, e.g. registry.example.com/ml: the images are "
                   "<registry>/dockrl-{cpu,npu,gpu} (default: ghcr.io/dockrl, or the overlay's)")
    p.add_argument("--tag", default="", help="tag of the images, never 'latest' (default: this release's, or the overlay's)")
    p.add_argument("--pull-secret", default="", help="image pull Secret of every pod of the run (default: none)")
    p.add_argument("--overlay", default="", help="take registry, tag and digests from this kustomize overlay's images:, "
                   "e.g. manifests/overlays/npu (--registry/--tag win)")
    p.add_argument("--request", action="append", default=[], metavar="TASK=CPU,MEMORY",
                   help="CPU and memory request of a task, e.g. train=4,16Gi (repeatable; defaults: pipelines/grpo.py)")
    p.add_argument("--platform-config", default="", metavar="FILE",
                   help="YAML of this site's platform fields over the preset: devices_per_node, cpu_per_device, "
                   "memory_per_device, network_interface, extra_resources, pod_labels, pod_annotations, env, architectures, ...")
    p.add_argument("--train-retries", type=int, default=None, metavar="N",
                   help="times KFP retries a train task whose launcher exited with an error (a worker pod failed, was "
                   "evicted or its node lost); each retry resumes from the latest checkpoint. The launcher's own pod "
                   "deleted, evicted or on a lost node is retried only where the workflow controller's default retry "
                   "policy says so (docs/kubeflow.md, Retries) (default 0)")
    p.add_argument("--ttl-after-finished", type=int, default=None, metavar="SECONDS",
                   help="seconds the cluster keeps a finished run's Argo Workflow, its pods and their logs (the run's "
                   "record, artifacts and metrics stay in KFP); default: the cluster's own clean-up")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dockrl pipeline",
                                     description="the Kubeflow pipeline: compile, run locally, upload, submit, schedule")
    sub = parser.add_subparsers(dest="action", required=True)

    p = sub.add_parser("compile", help="write the pipeline IR (YAML) for the Kubeflow UI or kfp.Client")
    p.add_argument("out", help="output file, e.g. grpo.yaml")
    _add_compile_options(p)

    p = sub.add_parser("run", help="run the whole pipeline on this machine (kfp.local, no cluster)")
    p.add_argument("--local", action="store_true", required=True, help="required: run with kfp.local (use `submit` for a cluster)")
    p.add_argument("--pipeline-root", default="runs/pipeline", help="where the task artifacts go (default: runs/pipeline)")
    p.add_argument("--export-dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--shared-dir", default="", help="the folder that plays the shared volume: put the run's own model and "
                   "data there (default: <pipeline-root>/shared); as root, the tasks that do not mount it do not see it")
    p.add_argument("--kind", choices=PIPELINE_KINDS, default="grpo", help="the pipeline: grpo, sft, or alignment (default: grpo)")
    p.add_argument("--sft-override", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="--kind alignment: an override of the SFT phase alone, over the overrides of both (repeatable)")
    p.add_argument("overrides", nargs="*", help="section.field=value, e.g. trainer.iterations=2")

    p = sub.add_parser("upload", help="register a package as a new version of a pipeline on Kubeflow Pipelines")
    _add_server_options(p, when=", when compiling now")
    p.add_argument("--pipeline", default="", help="pipeline name (created if missing; default: the package's, dockrl-grpo)")

    for name, help_ in [("submit", "start one run of a registered pipeline version on Kubeflow Pipelines"),
                        ("schedule", "create a recurring run of a registered pipeline version (6-field cron)")]:
        p = sub.add_parser(name, help=help_)
        _add_server_options(p, when=", when compiling now")
        p.add_argument("--pipeline", default="", help="the registered pipeline to run (alone: its --version as it is, "
                       "nothing uploaded; with a package or compile options: where that package is uploaded; default: "
                       "the package's name, dockrl-grpo)")
        p.add_argument("--version", default="", help="the version of --pipeline to run, by name (default: the newest)")
        p.add_argument("--experiment", default="dockrl", help="experiment (created if missing; default: dockrl)")
        p.add_argument("--export-dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
        p.add_argument("--service-account", default="",
                       help="account of the run's pods (default: KFP's, pipeline-runner; see manifests/README.md)")
        if name == "submit":
            p.add_argument("--run-name", default="", help="default: <algorithm>-<model>-<UTC date and time>")
        else:
            p.add_argument("--cron", required=True, help="6 fields, seconds first, e.g. '0 0 3 * * *' (03:00 daily)")
            p.add_argument("--name", default="", help="recurring run name (default: <algorithm>-<model>-recurring-<UTC date>)")
            p.add_argument("--max-concurrency", type=int, default=1, help="runs of this schedule at once (default: 1)")
        p.add_argument("overrides", nargs="*", help="section.field=value, passed as the pipeline's config_overrides")
    return parser


def _add_server_options(p: argparse.ArgumentParser, *, when: str) -> None:
    """The KFP host, its authentication, and the package (given, or compiled now from the compile options)."""
    p.add_argument("--host", required=True, help="KFP API URL, e.g. http://localhost:8080")
    p.add_argument("--package", help="compiled pipeline YAML (default: compile one now with the compile options)")
    _add_compile_options(p, when=when)
    p.add_argument("--namespace", default="",
                   help="multi-user KFP: the profile namespace the pipeline, experiment and run belong to (default: none, "
                        "single-user KFP); the run's workers live in the run's namespace")
    p.add_argument("--token", default=os.environ.get("DOCKRL_KFP_TOKEN", ""),
                   help="multi-user KFP: bearer token (default: $DOCKRL_KFP_TOKEN; prefer the variable, a "
                        "command line is visible to other users of the machine)")
    p.add_argument("--cookies", default=os.environ.get("DOCKRL_KFP_COOKIES", ""),
                   help="multi-user KFP: session cookie(s) of the central dashboard, e.g. 'authservice_session=...' "
                        "(default: $DOCKRL_KFP_COOKIES)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the host to answer (default: 10)")
    p.add_argument("--metadata-keepalive", action="store_true",
                   help="the cluster keeps KFP's metadata gRPC connections alive (the EnvoyFilter in docs/kubernetes.md, "
                        "KFP version): accept a KFP backend from 2.15.0 instead of 2.17.0 (amd64 nodes only)")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if getattr(args, "overrides", None) is not None:
            load_config(None, args.overrides)  # a bad override fails here, naming its field
        if args.action == "compile":
            print(compile_pipeline(args.out, settings=_settings(args), kind=args.kind or "grpo"))
            return 0
        if args.action == "run":
            forward_sigterm()
            with LocalRunOutput() as output:  # the failed task and its error come last, not 45 lines up
                try:
                    run_dir = run_local(args.overrides, args.pipeline_root, export_dtype=args.export_dtype, shared_dir=args.shared_dir or None,
                                        kind=args.kind, sft_overrides=args.sft_override)
                except RuntimeError as e:
                    raise RuntimeError(output.failure(e)) from None
            print(json.dumps(local_summary(run_dir), indent=2))
            return 0
        if args.action == "schedule":
            submit.validate_cron(args.cron)  # before compiling anything
        with tempfile.TemporaryDirectory(prefix="dockrl-pipeline-") as tmp:
            package = _package(args, tmp)
            auth = {"namespace": args.namespace, "token": args.token, "cookies": args.cookies, "timeout_s": args.timeout,
                    "metadata_keepalive": args.metadata_keepalive}
            if args.action == "upload":
                assert package is not None  # upload always has one: given, or compiled now
                out = submit.upload(args.host, package, pipeline_name=args.pipeline, **auth)
            else:
                pipeline = args.pipeline or ("" if package else PIPELINE_NAME)  # a package's own name, or dockrl-grpo's versions
                run = {"pipeline": pipeline, "version": args.version, "params": _params(args), "experiment": args.experiment,
                       "service_account": args.service_account, **auth}
                if args.action == "submit":
                    out = submit.submit(args.host, package, run_name=args.run_name, **run)
                else:
                    out = submit.schedule(args.host, package, cron=args.cron, name=args.name, max_concurrency=args.max_concurrency,
                                          **run)
        print(json.dumps(out, indent=2))
        return 0
    except KeyboardInterrupt:
        print(f"dockrl pipeline {args.action}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    except ConfigError as e:
        print(f"dockrl pipeline: config error: {e}", file=sys.stderr)
        return 2
    except (ValueError, FileNotFoundError) as e:
        print(f"dockrl pipeline: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # PipelineError, a failed local task
        print(f"dockrl pipeline {args.action}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
