"""Command line: ``dockrl prepare-model | prepare-data | train | sft | pipeline | runs | rollouts | teardown | worker | dock-shard |
node | ranks | smoke | trainer-runtime | from-env | evaluate``.

    dockrl train                                   # the demo: SmolLM2-135M, GRPO, 20 iterations
    dockrl train --config my.yaml trainer.lr=1e-5  # a config file plus overrides
    dockrl train --print-config rollout.n=16       # the config as YAML (auto fields stay auto), nothing run
    dockrl sft data.train_path=chats.jsonl         # supervised fine-tuning on the same engine (docs/sft.md)
    dockrl pipeline -h                             # the Kubeflow pipeline (dockrl/kubeflow/pipeline_cli.py)
    dockrl worker -h                               # one stage of a distributed run (dockrl/stages/main.py)
    dockrl dock-shard -h                           # one dock shard (dockrl/dock/flight/shards.py)
    dockrl node -h                                 # several rank processes in one pod (dockrl/launch/node.py)
    dockrl ranks parallel.tp=2                     # where this process sits in a layout (under dockrl node: a node check)
    dockrl smoke --namespace team-rl | kubectl apply -f -   # an all-reduce across two pods, its bandwidth
    dockrl trainer-runtime parallel.tp=2 parallel.dp=4 trainer.hybrid=true   # a ClusterTrainingRuntime (YAML)
    dockrl runs                                    # local runs and their live processes
    dockrl runs prune /mnt/dockrl/runs --older-than-days 30 --keep 5   # old run folders of the shared volume
    dockrl rollouts show runs/demo --iteration 3   # the rollouts a run kept (run.keep_rollouts); rescore, replay, page
    dockrl teardown runs/demo                      # stop what a run left (its driver, its workers)

``worker`` and ``dock-shard`` are what the launcher starts, as local processes and as the
arguments of the stage pods (the images' entry point is ``dockrl``); ``node`` starts the rank
processes of a pod that holds several devices; ``fork-server`` is the local backend's: it forks
a local run's ``worker`` processes from one that imported their code (dockrl/launch/fork_server.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import logging
import signal
import sys
import textwrap
import typing
from pathlib import Path

from dockrl.config import Config, ConfigError, dump_config, load_config
from dockrl.launch.backend import WORKER_BACKENDS, WorkerFailed


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code: 0 done, 1 the run failed, 2 an input error
    (config, model, data, run folder), 130 interrupted. Errors are one message naming what and
    where, without a traceback unless ``--debug`` is given (anywhere on the line)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["pipeline"]:
        from dockrl.kubeflow.pipeline_cli import main as pipeline_main  # lazy: kfp (an optional extra) takes a second to import

        return pipeline_main(argv[1:])
    if argv[:1] == ["worker"]:
        from dockrl.stages.main import main as worker_main  # lazy: a stage worker imports torch and its engine

        return worker_main(argv[1:])
    if argv[:1] == ["dock-shard"]:
        from dockrl.dock.flight.shards import serve_shard  # lazy: pyarrow.flight, needed in a shard process only

        return serve_shard(argv[1:])
    if argv[:1] == ["fork-server"]:
        from dockrl.launch.fork_server import serve  # lazy: it imports a stage process's modules itself

        return serve(argv[1:])
    if argv[:1] == ["node"]:
        from dockrl.launch.node import main as node_main  # lazy: each subcommand imports what it runs only

        return node_main(argv[1:])
    if argv[:1] == ["ranks"]:
        from dockrl.launch.node import ranks_main  # lazy: as node

        return ranks_main(argv[1:])
    if argv[:1] == ["evaluate"]:
        from dockrl.kubeflow.steps import evaluate_main  # lazy: torch and the engines load when it evaluates

        return evaluate_main(argv[1:])
    if argv[:1] == ["smoke"]:
        from dockrl.launch.node import smoke_main  # lazy: as node

        return smoke_main(argv[1:])
    if argv[:1] == ["rollouts"]:
        from dockrl.rollouts.cli import main as rollouts_main  # lazy: pyarrow.dataset, torch, and transformers for the tokenizer

        return rollouts_main(argv[1:])
    if argv[:1] == ["export"]:
        return export_main(argv[1:])
    if argv[:1] == ["sandbox"]:
        return sandbox_main(argv[1:])
    if argv[:1] in (["runs"], ["teardown"]):
        return runs_main(argv)
    if argv[:1] == ["from-env"]:  # a TrainJob's member: its arguments in one variable (dockrl/launch/trainjob.py)
        from dockrl.launch.trainjob import args_from_env

        return main(args_from_env(argv[1:]))
    if argv[:1] == ["trainer-runtime"]:
        from dockrl.launch.kubernetes import trainer_runtime_main  # lazy: as node

        return trainer_runtime_main(argv[1:])
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    parser = argparse.ArgumentParser(prog="dockrl", description="RL post-training of LLMs through a transfer dock")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in [
        ("train", "run RL post-training: GRPO by default; RLOO, REINFORCE++, Dr. GRPO by algorithm.adv_estimator; "
                  "PPO with algorithm.adv_estimator=gae critic.enable=true"),
        ("sft", "supervised fine-tuning on data.train_path (chat messages, prompt/completion, or GSM8K question/answer), "
                "loss on the assistant's tokens; the sft section and trainer's engine, LoRA, lr and checkpoints (docs/sft.md)"),
        ("prepare-model", "export the packaged SmolLM2-135M-Instruct (or check model.path)"),
        ("prepare-data", "write the seeded train/test files"),
    ]:
        p = sub.add_parser(name, help=help_, description=help_, epilog=config_fields_help(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--config", help="YAML config file (default: the demo config)")
        if name in ("train", "sft"):
            p.add_argument("--print-config", action="store_true",
                           help="print the config (every field, defaults included; fields set to auto stay auto) as YAML and exit")
        p.add_argument("--debug", action="store_true", help="show the traceback of an error")
        p.add_argument("overrides", nargs="*", help="section.field=value, e.g. trainer.iterations=5 (before or after --config)")
    sub.add_parser("pipeline", help="the Kubeflow pipeline: compile, run --local, submit, schedule (dockrl pipeline -h)")
    sub.add_parser("worker", help="one stage of a distributed run, against its dock (dockrl worker -h)")
    sub.add_parser("dock-shard", help="one transfer dock shard (dockrl dock-shard -h)")
    sub.add_parser("fork-server", help="forks a local run's stage processes from one that imported their code (started by the driver)")
    sub.add_parser("node", help="several rank processes of a worker group in one pod shaped like a node (dockrl node -h)")
    sub.add_parser("ranks", help="this process's rank, device and coordinates in a parallel layout; --all-reduce: "
                   "an all-reduce's bandwidth (dockrl ranks -h)")
    sub.add_parser("evaluate", help="greedy accuracy of a model on a dataset folder's test split, as JSON (dockrl evaluate -h)")
    sub.add_parser("smoke", help="a JobSet of pods that all-reduce across nodes before a first run (dockrl smoke -h)")
    sub.add_parser("trainer-runtime", help="the Kubeflow Trainer ClusterTrainingRuntime of a config's runs, as YAML "
                   "(dockrl trainer-runtime -h)")
    sub.add_parser("from-env", help="run the arguments a variable holds as a JSON list (a TrainJob's member)")
    sub.add_parser("runs", help="list the local runs and their live processes")
    sub.add_parser("rollouts", help="a run's kept rollouts (run.keep_rollouts): show, rescore, replay, page (dockrl rollouts -h)")
    sub.add_parser("teardown", help="stop what a run left running (dockrl teardown -h)")
    sub.add_parser("sandbox", help="check that this machine (a worker pod) gives the sandbox the layers env.sandbox.require asks for; "
                   "`dockrl sandbox serve`: the sandbox executor of env.sandbox.backend=pod")
    sub.add_parser("export", help="a checkpoint as a self-contained HF folder; a LoRA run's adapter, merged with --merge (dockrl export -h)")
    args, rest = parser.parse_known_args(argv)
    for extra in rest:  # overrides may stand on both sides of --config: argparse leaves those after it here
        if extra.startswith("-") or "=" not in extra:
            parser.error(f"unrecognized argument {extra!r}; overrides are section.field=value (e.g. trainer.lr=1e-5), "
                         "before or after --config FILE")
        args.overrides.append(extra)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_dir = None
    try:
        cfg = load_config(args.config, args.overrides)  # before torch is imported: a bad value fails in a second
        if getattr(args, "print_config", False):
            print(dump_config(cfg, portable=True), end="")  # auto stays auto: the file fits the machine it runs on
            return 0
        run_dir = cfg.run.output_dir
        from dockrl import driver  # heavy imports after the config is known to be valid
        from dockrl.run import setup as run_setup

        if args.command == "prepare-model":
            print(run_setup.resolve_model(cfg))
        elif args.command == "prepare-data":
            print("\n".join(str(p) for p in run_setup.resolve_data(cfg)))
        elif args.command == "sft":
            from dockrl.sft import sft  # lazy: as the driver

            print(json.dumps(sft(cfg), indent=2))
        else:
            summary = driver.train(cfg)
            print(json.dumps(summary, indent=2))
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"dockrl: interrupted (Ctrl-C); {resume_hint(run_dir)}", file=sys.stderr)
        return 130
    except SystemExit as e:
        if e.code == 128 + signal.SIGTERM:  # sigterm_as_exit: the run's clean-up ran
            print(f"dockrl: stopped (SIGTERM); {resume_hint(run_dir)}", file=sys.stderr)
        raise
    except Exception as e:  # noqa: BLE001 - every error becomes one message; --debug shows the traceback
        if debug:
            raise
        code, message = describe_error(e, run_dir)
        print(f"dockrl: {message}", file=sys.stderr)
        return code
    return 0


def config_fields_help() -> str:
    """The config's sections and their fields, for ``--help`` (the meaning of each: ``dockrl/config/*sections.py``;
    a nested section's fields, e.g. ``reward_model.model.path``, are named by ``--print-config``)."""
    lines = ["config fields (section.field=value; all with their values: --print-config; meanings: dockrl/config/*sections.py):"]
    for section, cls in typing.get_type_hints(Config).items():
        lines.append(textwrap.fill(", ".join(f.name for f in dataclasses.fields(cls)), width=100, initial_indent=f"  {section}: ",
                                   subsequent_indent=" " * (len(section) + 4)))
    return "\n".join(lines)


def resume_hint(run_dir: str | None) -> str:
    """How a stopped run goes on: from its newest complete checkpoint, or (with none) started again."""
    if run_dir is None:
        return "nothing was started"
    from dockrl.checkpoint.resume import latest_checkpoint  # lazy: dockrl.checkpoint.resume imports torch

    if not Path(run_dir).is_dir():  # stopped before it was accepted: the folders it made are gone again
        return f"nothing of the run was written ({run_dir} does not exist): the same command starts it again"
    found = latest_checkpoint(run_dir)
    if found is not None:
        return f"the run goes on from its last complete checkpoint ({found}) with run.resume=latest"
    return (f"no checkpoint of the run in {run_dir} is complete: the same command starts it again there (the files of the "
            f"iterations it ran are set aside in {run_dir}.stopped-<n>)")


def describe_error(e: BaseException, run_dir: str | None = None) -> tuple[int, str]:
    """Exit code and one message for an error that ends a command (see ``main``)."""
    if isinstance(e, (ConfigError, FileNotFoundError)):  # config, model, data, run folder: what the user gave
        return 2, f"config error: {e}"
    if isinstance(e, WorkerFailed):  # a stage process died: its name and log tail say why
        return 1, str(e)
    text = str(e)
    if isinstance(e, OSError) and e.errno == errno.ENOSPC or "unexpected pos" in text or "No space left" in text:
        where = f" (run.output_dir={run_dir})" if run_dir else ""
        return 1, (f"a write failed because the disk is full{where}: {text.splitlines()[0] if text else e!r}; free space there and "
                   "continue with run.resume=latest")
    if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
        return 2, f"cannot write {e.filename or ''} ({e.strerror}); choose a writable run.output_dir / run.cache_dir"
    kind = type(e).__name__
    if kind in ("ScorerError", "DockTimeoutError", "DockError", "TimeoutError"):
        return 1, text
    if kind.startswith("Flight"):  # pyarrow.flight: a dock shard that does not answer
        notes = "; ".join(getattr(e, "__notes__", []))
        return 1, f"the dock did not answer ({kind}: {text.splitlines()[0] if text else ''}{'; ' + notes if notes else ''})"
    return 1, f"{kind}: {text} (run again with --debug for the traceback)"


def prune_main(argv: list[str]) -> int:
    """``dockrl runs prune RUNS_DIR --older-than-days N [--keep K] [--dry-run]``: old run folders of a shared volume."""
    parser = argparse.ArgumentParser(prog="dockrl runs prune", description=(
        "Remove the run folders of a shared volume's runs/ folder (e.g. /mnt/dockrl/runs) that nothing wrote to for "
        "--older-than-days days, except the --keep newest and any a live run holds. Prints the removed folders as JSON."))
    parser.add_argument("runs_dir", help="the runs/ folder of the shared volume")
    parser.add_argument("--older-than-days", type=float, required=True, help="age (days since the last write) to remove at")
    parser.add_argument("--keep", type=int, default=0, help="always keep this many newest run folders (default 0)")
    parser.add_argument("--dry-run", action="store_true", help="print what would be removed, remove nothing")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from dockrl.checkpoint.pruning import prune_runs  # lazy: pyarrow

    try:
        removed = prune_runs(args.runs_dir, older_than_days=args.older_than_days, keep=args.keep, dry_run=args.dry_run)
    except (ValueError, FileNotFoundError) as e:
        print(f"dockrl runs prune: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"removed" if not args.dry_run else "would_remove": [str(p) for p in removed]}, indent=2))
    return 0


def runs_main(argv: list[str]) -> int:
    """``dockrl runs`` (the local runs and their live processes) and ``dockrl teardown RUN``."""
    if argv[:2] == ["runs", "prune"]:
        return prune_main(argv[2:])
    parser = argparse.ArgumentParser(prog=f"dockrl {argv[0]}")
    if argv[0] == "teardown":
        parser.description = "Stop what a run left running: its driver (if it still holds the run folder) and its workers."
        parser.add_argument("run", help="run folder (run.output_dir) or run id (as `dockrl runs` lists it)")
        parser.add_argument("--backend", choices=WORKER_BACKENDS, default="local",
                            help="where the workers run (kubernetes: RUN is the pipeline run's id)")
        parser.add_argument("--namespace", default="", help="namespace of the workers (kubernetes; default: the current one)")
        parser.add_argument("--grace-s", type=float, default=5.0, help="seconds between SIGTERM and SIGKILL (local)")
    else:
        parser.description = ("List the local runs: run id, folder, driver, live processes. Distributed runs (their "
                              "launcher's record) and in-process runs (`dockrl train` with dock.mode=inprocess) alike, "
                              "while their driver runs; a run whose driver was killed stays listed until `dockrl teardown`.")
    args = parser.parse_args(argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from dockrl.launch.run_records import local_runs, teardown_local  # lazy: only `dockrl runs` and `dockrl teardown` need them

    if argv[0] == "runs":
        runs = local_runs()
        for r in runs:
            driver = f"driver {r['driver_pid']} {'running' if r['driver_alive'] else 'gone'}" if r["driver_pid"] else "no record"
            print(f"{r['run_id']}  {r['run_dir'] or '-'}  {driver}  {len(r['processes'])} live process(es) {r['processes']}")
        if not runs:
            print("no local runs")
        return 0
    try:
        if args.backend == "kubernetes":
            from dockrl.kubeflow.steps import teardown_run  # lazy: only `dockrl teardown --backend kubernetes` needs it

            print(json.dumps({"removed": teardown_run("kubernetes", args.run, namespace=args.namespace)}))
        else:
            print(json.dumps(teardown_local(args.run, grace_s=args.grace_s)))
    except ValueError as e:
        print(f"dockrl teardown: {e}", file=sys.stderr)
        return 2
    return 0


def sandbox_main(argv: list[str]) -> int:
    """``dockrl sandbox [env.sandbox.FIELD=VALUE ...]``: runs an empty program in the sandbox of this machine (run it
    in a worker pod of the site: the same image, user and security context) and prints the layers in force; exit 2,
    with what is missing and how to get it, when a layer of ``env.sandbox.require`` is not. With
    ``env.sandbox.backend=pod`` it asks the sandbox executor at ``DOCKRL_SANDBOX_URL`` instead (run it in a stage's pod).
    ``dockrl sandbox serve -h``: the executor (``dockrl.isolation.executor``)."""
    if argv[:1] == ["serve"]:
        from dockrl.isolation.executor import serve_main  # lazy: only this command serves

        return serve_main(argv[1:])
    parser = argparse.ArgumentParser(prog="dockrl sandbox", description=sandbox_main.__doc__)
    parser.add_argument("overrides", nargs="*", help="env.sandbox.FIELD=VALUE, e.g. env.sandbox.require=network,writes")
    args = parser.parse_args(argv)
    from dockrl.isolation.runner import require_layers  # lazy: only this command runs the sandbox here

    try:
        limits = load_config(None, args.overrides).env.sandbox
        in_force = require_layers(limits)
    except ConfigError as e:  # SandboxUnavailable among them
        print(f"dockrl sandbox: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"required": list(limits.require), "in_force": list(in_force)}))
    return 0


def export_main(argv: list[str]) -> int:
    """``dockrl export CHECKPOINT OUT [--dtype D] [--merge]``: ``dockrl.kubeflow.steps.export_model``. A LoRA
    run's checkpoint gives its adapter folder (``OUT/adapter``), and with ``--merge`` also the merged HF
    weights; any other checkpoint gives its full weights."""
    parser = argparse.ArgumentParser(prog="dockrl export", description=export_main.__doc__)
    parser.add_argument("checkpoint", help="a checkpoint folder, e.g. RUN/checkpoints/final")
    parser.add_argument("out", help="the folder to write")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"], help="of the written weights")
    parser.add_argument("--merge", action="store_true", help="a LoRA checkpoint: also the merged HF weights W + (alpha/rank)·B·A")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from dockrl.kubeflow.steps import export_model  # lazy: as resolve_checkpoint
    from dockrl.launch.artifacts import resolve_checkpoint  # lazy: the export step's modules, only for this command

    try:
        has_adapter = (resolve_checkpoint(args.checkpoint) / "adapter" / "adapter_config.json").is_file()
        info = export_model(args.checkpoint, args.out, args.dtype, merge=args.merge or not has_adapter)
    except (ValueError, FileNotFoundError) as e:
        print(f"dockrl export: {e}", file=sys.stderr)
        return 2
    print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
