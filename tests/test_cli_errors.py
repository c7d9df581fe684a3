"""Every ``dockrl`` subcommand ends a user error with exit code 2 and one line that says what is wrong (after
argparse's usage, for an argument argparse refuses): never a traceback."""

from __future__ import annotations

import pytest

from dockrl.cli import main

CASES = [
    (["train", "trainer.lr=abc"], "trainer.lr: got 'abc'; expected a number"),
    (["train", "--config", "{tmp}/missing.yaml"], "missing.yaml does not exist"),
    (["train", "--bogus"], "unrecognized argument '--bogus'"),
    (["prepare-data", "data.generate_train=-1"], "data.generate_train: got -1"),
    (["prepare-model", "model.path={tmp}/no-model"], "no-model"),
    (["sft", "sft.epochs=0"], "sft.epochs: got 0; expected a positive integer"),
    (["sft", "data.train_path={tmp}/chats.jsonl"], "data.train_path: data file {tmp}/chats.jsonl does not exist"),
    (["sft", "--bogus"], "unrecognized argument '--bogus'"),
    (["pipeline", "schedule", "--host", "http://127.0.0.1:9", "--cron", "0 3 * * *"], "has 5 field(s)"),
    (["pipeline", "compile", "{tmp}/pipeline.txt"], "expected a .yaml or .json file name"),
    (["pipeline", "submit", "--host", "http://127.0.0.1:9", "--package", "{tmp}/nope.yaml"], "nope.yaml does not exist"),
    (["pipeline", "upload", "--host", "http://127.0.0.1:9", "--package", "{tmp}/nope.yaml"], "nope.yaml does not exist"),
    (["pipeline", "submit", "--host", "http://127.0.0.1:9", "--package", "{tmp}/nope.yaml", "--version", "1"],
     "give the package or the version of a registered pipeline, not both"),
    (["pipeline", "compile", "{tmp}/grpo.yaml", "--overlay", "{tmp}/build/images-digests.yaml"],
     "{tmp}/build/images-digests.yaml does not exist; --overlay takes a kustomize overlay folder (its kustomization.yaml, e.g. "
     "manifests/overlays/npu) or a file of images: entries"),
    (["pipeline", "compile", "{tmp}/typo/grpo.yaml"], "pipeline package {tmp}/typo/grpo.yaml: the folder {tmp}/typo does not exist"),
    (["pipeline", "run", "--local", "trainer.lr=abc"], "trainer.lr: got 'abc'"),
    (["rollouts", "show", "{tmp}", "--iteration", "0"], "holds no kept rollouts"),
    (["rollouts", "replay", "{tmp}", "--iteration", "0"], "holds no kept rollouts"),
    (["export", "{tmp}/no-checkpoint", "{tmp}/out"], "is not an HF checkpoint"),
    (["teardown", "{tmp}/no-run"], "is neither a run folder nor a run id"),
    (["teardown", "{tmp}"], "{tmp} is not a run folder: it has no .dockrl.lock"),
    (["ranks", "parallel.tp=abc"], "parallel.tp"),
    (["node", "--bogus"], "the following arguments are required: --nproc-per-node"),
    (["worker", "--bogus"], "the following arguments are required"),
    (["dock-shard", "--bogus"], "unrecognized arguments: --bogus"),
    (["fork-server", "--bogus"], "unrecognized arguments: --bogus"),
    (["sandbox", "env.sandbox.require=disks"], "env.sandbox.require: got ['disks']"),
    (["sandbox", "env.sandbox.backend=pod"], "env.sandbox.backend=pod: DOCKRL_SANDBOX_URL is unset"),
    (["sandbox", "serve", "env.sandbox.pod_slots=0"], "env.sandbox.pod_slots: got 0"),
    (["evaluate", "{tmp}/model", "{tmp}", "--out", "{tmp}/m.json", "trainer.lr=abc"], "trainer.lr: got 'abc'"),
    (["evaluate", "{tmp}/model", "{tmp}", "--out", "{tmp}/m.json"], "DATASET {tmp}: a folder without dataset.json"),
    (["prepare-data", "data.train_path={tmp}/no.jsonl"], "data.train_path: data file {tmp}/no.jsonl does not exist"),
]


def run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's own refusal
        return int(e.code or 0)


@pytest.mark.parametrize(("argv", "says"), CASES, ids=[" ".join(a[:2]) for a, _ in CASES])
def test_a_user_error_is_one_line_and_exit_2(argv, says, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # nothing a command might write lands in the repository
    code = run([a.replace("{tmp}", str(tmp_path)) for a in argv])
    says = says.replace("{tmp}", str(tmp_path))
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith((" ", "usage:"))]
    assert code == 2, err
    assert lines and lines[-1].startswith("dockrl") and says.replace("{tmp}", str(tmp_path)) in lines[-1], err
    assert len([line for line in lines if not line.startswith("20")]) == 1, err  # one message (log lines start with their date)



SUBCOMMANDS = ["train", "prepare-model", "prepare-data", "pipeline", "worker", "dock-shard", "fork-server", "node", "ranks", "smoke",
               "evaluate", "runs", "rollouts", "teardown", "sandbox", "export"]


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_prints_its_help_and_exits_0(command, capsys):
    assert run([command, "--help"]) == 0, capsys.readouterr().err
    assert capsys.readouterr().out.startswith(f"usage: dockrl {command}")
