"""Command line: ``dockrl pipeline compile | run | submit | schedule`` (the Kubeflow pipeline).

    dockrl pipeline compile grpo.yaml --platform npu
    dockrl pipeline run --local trainer.iterations=2           # whole pipeline via kfp.local
    dockrl pipeline submit --host http://localhost:8080 --experiment grpo trainer.lr=5e-6
    dockrl pipeline schedule --host http://localhost:8080 --cron "0 0 3 * * *"

Trailing ``section.field=value`` arguments become the pipeline's ``config_overrides`` and are
checked before anything is compiled or sent. The pipeline definitions (``pipelines/``,
``components/``) live beside the ``dockrl`` package in the source tree.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys
import tempfile
from pathlib import Path
from types import ModuleType

from dockrl.config import ConfigError, load_config

PLATFORM_CHOICES = ("npu", "gpu", "cpu")


def _import(module: str) -> ModuleType:
    """Import ``pipelines.<module>`` from the source tree that holds this package."""
    root = Path(__file__).resolve().parents[1]
    if not (root / "pipelines" / "grpo.py").is_file():
        raise ConfigError(f"{root / 'pipelines'} not found: `dockrl pipeline` needs the dockrl source tree "
                          "(pipelines/ and components/ beside dockrl/); install it with `pip install -e .`")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return importlib.import_module(f"pipelines.{module}")


def _params(args: argparse.Namespace) -> dict:
    return {"config_overrides": list(args.overrides), "worker_backend": args.worker_backend,
            "namespace": args.namespace, "export_dtype": args.export_dtype}


def _package(args: argparse.Namespace, tmp: str) -> Path:
    if args.package:
        return Path(args.package)
    return _import("grpo").compile_pipeline(Path(tmp) / "dockrl-grpo.yaml", platform=args.platform,
                                            worker_backend=args.worker_backend)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dockrl pipeline",
                                     description="the Kubeflow pipeline: compile, run locally, submit, schedule")
    sub = parser.add_subparsers(dest="action", required=True)

    p = sub.add_parser("compile", help="write the pipeline IR (YAML) for the Kubeflow UI or kfp.Client")
    p.add_argument("out", help="output file, e.g. grpo.yaml")
    p.add_argument("--platform", choices=PLATFORM_CHOICES, default="npu", help="accelerators of the train task (default: npu)")
    p.add_argument("--worker-backend", default="local", choices=("local", "kubernetes"),
                   help="default worker backend; kubernetes: stages as pods, the train task without accelerators")

    p = sub.add_parser("run", help="run the whole pipeline on this machine (kfp.local, no cluster)")
    p.add_argument("--local", action="store_true", required=True, help="required: run with kfp.local (use `submit` for a cluster)")
    p.add_argument("--pipeline-root", default="runs/pipeline", help="where the task artifacts go (default: runs/pipeline)")
    p.add_argument("--export-dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("overrides", nargs="*", help="section.field=value, e.g. trainer.iterations=2")

    for name, help_ in [("submit", "start one run on Kubeflow Pipelines"),
                        ("schedule", "create a recurring run on Kubeflow Pipelines (6-field cron)")]:
        p = sub.add_parser(name, help=help_)
        p.add_argument("--host", required=True, help="KFP API URL, e.g. http://localhost:8080")
        p.add_argument("--experiment", default="dockrl", help="experiment (created if missing; default: dockrl)")
        p.add_argument("--package", help="compiled pipeline YAML (default: compile one now for --platform)")
        p.add_argument("--platform", choices=PLATFORM_CHOICES, default="npu", help="when compiling now (default: npu)")
        p.add_argument("--worker-backend", default="local", choices=("local", "kubernetes"))
        p.add_argument("--namespace", default="", help="namespace of the workers (default: the launcher's own)")
        p.add_argument("--export-dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
        p.add_argument("--service-account", default="",
                       help="account of the run's pods (dockrl-launcher may start workers; default: KFP's)")
        p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the host to answer (default: 10)")
        if name == "submit":
            p.add_argument("--run-name", default="dockrl-grpo")
        else:
            p.add_argument("--cron", required=True, help="6 fields, seconds first, e.g. '0 0 3 * * *' (03:00 daily)")
            p.add_argument("--name", default="dockrl-grpo-recurring", help="recurring run name")
            p.add_argument("--max-concurrency", type=int, default=1, help="runs of this schedule at once (default: 1)")
        p.add_argument("overrides", nargs="*", help="section.field=value, passed as the pipeline's config_overrides")
    return parser


def _descendants(pid: int) -> list[int]:
    """Live processes below ``pid`` in the process tree, parents first."""
    from dockrl.launch.local import live_processes

    children: dict[int, list[int]] = {}
    for child, (parent, _) in live_processes().items():
        children.setdefault(parent, []).append(child)
    out, todo = [], list(children.get(pid, []))
    while todo:
        out.append(todo.pop(0))
        todo += children.get(out[-1], [])
    return out


def _forward_sigterm() -> None:
    """On SIGTERM, pass it on to every process below this one — the running ``kfp.local`` task
    (a shell that runs the executor), whose launcher then tears its workers down, and the
    workers — and exit with 143. Ctrl-C reaches the whole foreground process group by itself;
    a SIGTERM from a supervisor reaches only this process."""
    def handler(signum: int, frame: object) -> None:
        for pid in _descendants(os.getpid()):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if getattr(args, "overrides", None) is not None:
            load_config(None, args.overrides)  # a bad override fails here, naming its field
        if args.action == "compile":
            print(_import("grpo").compile_pipeline(args.out, platform=args.platform, worker_backend=args.worker_backend))
            return 0
        if args.action == "run":
            _forward_sigterm()
            grpo = _import("grpo")
            run_dir = grpo.run_local(args.overrides, args.pipeline_root, export_dtype=args.export_dtype)
            print(json.dumps(grpo.local_summary(run_dir), indent=2))
            return 0
        submit = _import("submit")
        if args.action == "schedule":
            submit.validate_cron(args.cron)  # before compiling anything
        with tempfile.TemporaryDirectory(prefix="dockrl-pipeline-") as tmp:
            package = _package(args, tmp)
            if args.action == "submit":
                out = submit.submit(args.host, package, params=_params(args), experiment=args.experiment,
                                    run_name=args.run_name, service_account=args.service_account, timeout_s=args.timeout)
            else:
                out = submit.schedule(args.host, package, cron=args.cron, params=_params(args), experiment=args.experiment,
                                      name=args.name, max_concurrency=args.max_concurrency,
                                      service_account=args.service_account, timeout_s=args.timeout)
        print(json.dumps(out, indent=2))
        return 0
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
