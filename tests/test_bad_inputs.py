"""Bad inputs a new user gives `dockrl`: each ends in one clear message naming what and where,
exit code 2 for an input error (1 for a failed run), and no traceback.

``CASES`` is also the table of docs/bad-inputs.md: ``test_the_bad_inputs_doc_is_current``
fails when the page differs from it; ``DOCKRL_WRITE_DOCS=1 pytest tests/test_bad_inputs.py``
(``make docs``) writes the page.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dockrl.cli import main

DOC = Path(__file__).parents[1] / "docs" / "bad-inputs.md"
FAST = ["run.progress=false", "data.generate_train=20", "data.generate_test=4", "data.eval_size=4", "trainer.iterations=1",
        "trainer.global_batch=2", "trainer.mini_batch=2", "rollout.n=2", "trainer.micro_batch=4", "rollout.max_response_length=4"]


@dataclass(frozen=True)
class Case:
    kind: str
    """What the input is about: config, model, data, run folder, run."""
    given: str
    """The input, as the page shows it."""
    argv: Callable[[Path, Path], list[str]]
    """The command line (after ``dockrl``), given a scratch folder and the tiny model; may write files there."""
    message: str
    """What the one-line error must contain (as the page shows it)."""
    code: int = 2


def run_args(tmp: Path, model: Path, *extra: str) -> list[str]:
    return ["train", f"model.path={model}", f"run.output_dir={tmp / 'run'}", f"run.cache_dir={tmp / 'cache'}", *FAST, *extra]


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def model_copy(tmp: Path, model: Path, *, weights: str = "keep", model_type: str | None = None) -> Path:
    """A copy of the tiny model's folder with its weights dropped or cut short, or another model_type."""
    out = tmp / "model"
    out.mkdir()
    for f in model.iterdir():
        if f.suffix == ".safetensors":
            if weights == "truncated":
                (out / f.name).write_bytes(f.read_bytes()[: f.stat().st_size // 2])
            elif weights == "keep":
                (out / f.name).write_bytes(f.read_bytes())
        elif f.is_file():
            (out / f.name).write_bytes(f.read_bytes())
    if model_type:
        doc = json.loads((out / "config.json").read_text()) | {"model_type": model_type}
        (out / "config.json").write_text(json.dumps(doc))
    return out


def other_tokenizer_model(tmp: Path) -> Path:
    """A tiny model whose tokenizer is not the tiny student's (another vocabulary size)."""
    from dockrl.run.models import build_tiny_model

    return build_tiny_model(tmp / "teacher", vocab_size=400)


def parquet_with_int_questions(tmp: Path) -> Path:
    path = tmp / "rows.parquet"
    pq.write_table(pa.table({"question": [1, 2], "answer": ["#### 1", "#### 2"]}), path)
    return path


def used_run_folder(tmp: Path, model: Path) -> list[str]:
    from dockrl.checkpoint.resume import FORMAT, STATE_FILE

    write(tmp / "run" / "metrics.jsonl", '{"iteration": 0}\n')
    write(tmp / "run" / "checkpoints" / "iter_000001" / STATE_FILE, json.dumps({"format": FORMAT, "next_iteration": 1}))
    return run_args(tmp, model)


def full_disk(tmp: Path, model: Path) -> list[str]:
    (tmp / "run").mkdir()
    (tmp / "run" / "config.yaml").symlink_to("/dev/full")  # every write there fails with ENOSPC, as on a full disk
    return run_args(tmp, model)


NO_CHECKPOINT = ("no checkpoint of the run in <run.output_dir> is complete: the same command starts it again there (the files of the "
                 "iterations it ran are set aside in <run.output_dir>.stopped-<n>)")
CTRL_C = f"interrupted (Ctrl-C); {NO_CHECKPOINT}"
SIGTERM = f"stopped (SIGTERM); {NO_CHECKPOINT}"
"""A run stopped before its first checkpoint (the tests below); after one, the message names it and run.resume=latest."""
BAD_LINES = "{oops\n" + json.dumps({"question": "q", "answer": "#### abc"}) + "\n"

CASES = [
    Case("config", "`trainer.lr=x`", lambda t, m: ["train", "trainer.lr=x"], "trainer.lr: got 'x'; expected a number"),
    Case("config", "`trainer.mini_batch=5` (global batch 6)", lambda t, m: ["train", "trainer.mini_batch=5"],
         "trainer.mini_batch: got 5; must divide trainer.global_batch=6"),
    Case("config", "`trainer.lr` (no value)", lambda t, m: ["train", "trainer.lr"],
         "override 'trainer.lr': expected section.field=value, e.g. trainer.lr=1e-5"),
    Case("config", "`--config` a file that does not exist", lambda t, m: ["train", "--config", str(t / "my.yaml")],
         "config file <path>/my.yaml does not exist"),
    Case("config", "`parallel.tp=2` with the hf training engine", lambda t, m: ["train", "parallel.tp=2"],
         "parallel.tp: got 2; trainer.engine='hf' trains one unsharded copy of the model in one process and ignores the parallel layout"),
    Case("config", "`trainer.lora.rank=8` with `trainer.engine=megatron`", lambda t, m: ["train", "trainer.lora.rank=8", "trainer.engine=megatron"],
         "trainer.lora.rank: got 8; not supported with trainer.engine='megatron': megatron-core 0.16.1 has no LoRA adapters"),
    Case("config", "`trainer.lora.rank=8` with `trainer.hybrid=true`",
         lambda t, m: ["train", "trainer.lora.rank=8", "trainer.hybrid=true", "trainer.engine=megatron"],
         "trainer.lora.rank: got 8; not supported with trainer.hybrid=True: the allgather–swap moves full megatron shards"),
    Case("config", "`trainer.lora.rank=1024` with `rollout.engine=vllm`", lambda t, m: ["train", "trainer.lora.rank=1024", "rollout.engine=vllm"],
         "trainer.lora.rank: got 1024; not supported with rollout.engine='vllm': vLLM serves adapters up to rank 512"),
    Case("config", "`trainer.lora.sync=merged` with LoRA off", lambda t, m: ["train", "trainer.lora.sync=merged"],
         "trainer.lora.sync: got 'merged'; is set but trainer.lora.rank is 0 (LoRA off)"),
    Case("config", "`trainer.lora.alpha=32` with LoRA off", lambda t, m: ["train", "trainer.lora.alpha=32"],
         "trainer.lora.alpha: got 32.0; is set but trainer.lora.rank is 0 (LoRA off)"),
    Case("config", "`data.generate_train=-5`", lambda t, m: ["prepare-data", "data.generate_train=-5"],
         "data.generate_train: got -5; expected a positive integer"),
    Case("config", "`data.eval_size=-1`", lambda t, m: ["train", "data.eval_size=-1"],
         "data.eval_size: got -1; expected an integer >= 0 (0: all test prompts)"),
    Case("config", "`algorithm.max_bad_reward_frac=2`", lambda t, m: ["train", "algorithm.max_bad_reward_frac=2"],
         "algorithm.max_bad_reward_frac: got 2.0; expected a fraction from 0 to 1"),
    Case("config", "`algorithm.scorer=no_such_module:Scorer`", lambda t, m: run_args(t, m, "algorithm.scorer=no_such_module:Scorer"),
         "algorithm.scorer: got 'no_such_module:Scorer', which does not import (ModuleNotFoundError"),
    Case("config", "`run.keep_rollouts=1.5`", lambda t, m: ["train", "run.keep_rollouts=1.5"],
         "run.keep_rollouts: got 1.5; expected 'off', 'all' or a fraction of the rows in (0, 1), e.g. 0.25"),
    Case("config", "`run.keep_rollouts=all` with `dock.warehouse=directory`",
         lambda t, m: run_args(t, m, "run.keep_rollouts=all", "dock.warehouse=directory", f"dock.directory={t / 'store'}"),
         "run.keep_rollouts: got 'all'; needs dock.warehouse=memory (got 'directory'): the dock shards write the kept rows"),
    Case("model", "`model.path` a folder without `config.json`", lambda t, m: ["prepare-model", f"model.path={t}"],
         "expected a local HF model folder with config.json"),
    Case("model", "`model.path` with `config.json` but no weights", lambda t, m: ["prepare-model", f"model.path={model_copy(t, m, weights='none')}"],
         "has config.json but no weights (*.safetensors or *.bin)"),
    Case("model", "`model.path` with a truncated `model.safetensors`",
         lambda t, m: ["prepare-model", f"model.path={model_copy(t, m, weights='truncated')}"],
         "model.path: <path>/model/model.safetensors is not a readable safetensors file"),
    Case("model", "`model.path` of an unknown architecture",
         lambda t, m: ["prepare-model", f"model.path={model_copy(t, m, model_type='fancy-arch')}"],
         "has model_type='fancy-arch', an architecture this transformers does not know"),
    Case("model", "`teacher.model.path` with another tokenizer than the student's",
         lambda t, m: run_args(t, m, "teacher.enable=true", f"teacher.model.path={other_tokenizer_model(t)}"),
         "teacher.model.path: the teacher's tokenizer (<path>/teacher) is not the student's"),
    Case("config", "`reward_model.kind=generative` with a template without `{response}`",
         lambda t, m: ["train", "reward_model.enable=true", "reward_model.model.path=judge", "reward_model.kind=generative",
                       "reward_model.generative.template=Rate it"],
         "reward_model.generative.template: got 'Rate it'; expected a prompt with a {response} field"),
    Case("data", "`data.train_path` a directory", lambda t, m: run_args(t, m, f"data.train_path={t}"),
         "data.train_path: data file <path> is a directory; expected a .jsonl or .parquet file"),
    Case("data", "`data.train_path` that does not exist", lambda t, m: run_args(t, m, f"data.train_path={t / 'no.jsonl'}"),
         "data.train_path: data file <path>/no.jsonl does not exist"),
    Case("data", "`data.train_path` an empty file", lambda t, m: run_args(t, m, f"data.train_path={write(t / 'e.jsonl', '')}"),
         "data.train_path: no usable row in <path>/e.jsonl: kept 0 rows, dropped 0"),
    Case("data", "`data.train_path` with no usable line",
         lambda t, m: run_args(t, m, "data.train_path=" + str(write(t / "bad.jsonl", BAD_LINES))),
         "data.train_path: no usable row in <path>/bad.jsonl: kept 0 rows, dropped 2"),
    Case("data", "`data.test_path` a CSV file", lambda t, m: run_args(t, m, f"data.test_path={write(t / 'rows.csv', 'question,answer')}"),
         "data.test_path: data file <path>/rows.csv: a .csv file; expected a .jsonl or .parquet file"),
    Case("data", "`data.train_path` a JSON array (not JSON Lines)",
         lambda t, m: run_args(t, m, f"data.train_path={write(t / 'rows.json', json.dumps([{'question': 'q', 'answer': '#### 1'}], indent=1))}"),
         "data.train_path: data file <path>/rows.json: a JSON array; expected JSON Lines, one object per line"),
    Case("data", "`data.train_path` Parquet with an integer `question` column",
         lambda t, m: run_args(t, m, f"data.train_path={parquet_with_int_questions(t)}"),
         "data.train_path: data file <path>/rows.parquet: column 'question' is int64; expected strings"),
    Case("run folder", "a fresh run into a folder that holds a run with a complete checkpoint", used_run_folder,
         "run.output_dir: <path>/run already holds a run (metrics.jsonl, checkpoints); a fresh run there would mix with it"),
    Case("run folder", "`run.output_dir` that is a file", lambda t, m: run_args(t, m, f"run.output_dir={write(t / 'f', '')}"),
         "run.output_dir: cannot create the run folder's lock file <path>/f/.dockrl.lock"),
    Case("run", "a full disk (a write fails with ENOSPC)", full_disk, "a write failed because the disk is full", code=1),
]


def _case_id(case: Case) -> str:
    return f"{case.kind}: {case.given}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_a_bad_input_is_one_clear_message(case, tmp_path, tiny_model_dir, capsys):
    argv = case.argv(tmp_path, tiny_model_dir)
    try:
        code = main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    err = capsys.readouterr().err
    message = case.message.replace("<path>", str(tmp_path))
    assert code == case.code, err
    assert "Traceback" not in err
    said = err[err.rfind("\ndockrl: ") + 1:] if "\ndockrl: " in err else err  # the error comes last, after the log
    assert said.startswith("dockrl: ") and message in said, f"expected {message!r} in:\n{err}"


def test_overrides_stand_on_both_sides_of_config(tmp_path, capsys):
    cfg = write(tmp_path / "my.yaml", "trainer:\n  iterations: 3\n")
    assert main(["train", "trainer.lr=x", "--config", str(cfg), "trainer.iterations=2"]) == 2  # parsed, then the value fails
    assert "trainer.lr: got 'x'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["train", "--config", str(cfg), "--iterations", "2"])
    assert "overrides are section.field=value (e.g. trainer.lr=1e-5), before or after --config FILE" in capsys.readouterr().err


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path, capsys):
    cfg = tmp_path / "f.yaml"
    cfg.write_bytes(b"trainer:\n  lr: \xff\xfe\n")
    assert main(["train", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert f"dockrl: config error: {cfg}: not UTF-8 text (byte 0xff at position 15, line 2)" in err and "Traceback" not in err


def test_a_value_error_comes_before_torch_is_imported():
    code = "import sys; from dockrl.cli import main; rc = main(['train', 'trainer.mini_batch=5']); print(rc, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout.split()
    assert out == ["2", "False"]


def test_a_missing_model_path_is_named_before_transformers_models_are_imported(tmp_path):
    missing = tmp_path / "no-model"
    code = ("import sys; from dockrl.cli import main; "
            f"rc = main(['train', 'model.path={missing}', 'run.output_dir={tmp_path / 'run'}', 'run.cache_dir={tmp_path / 'cache'}']); "
            "print(rc, 'dockrl.engines.hf.load' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.split() == ["2", "False"], proc.stderr
    assert f"dockrl: config error: model.path: got '{missing}'; expected a local HF model folder" in proc.stderr
    assert not (tmp_path / "run" / "config.yaml").exists()


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(FileNotFoundError, match="none.yaml does not exist"):
        main(["train", "--debug", "--config", str(tmp_path / "none.yaml")])


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "code", "line"), [(signal.SIGINT, 130, CTRL_C), (signal.SIGTERM, 143, SIGTERM)], ids=["ctrl-c", "sigterm"])
def test_a_stopped_run_is_one_line_and_its_exit_code(sig, code, line, tiny_model_dir, tmp_path):
    # far more iterations than run before the signal: on a loaded machine a 50-iteration run once ended
    # (exit 0, ~10 s) before this process sent it, and a signal to an exited process is not sent
    cmd = [sys.executable, "-m", "dockrl", *run_args(tmp_path, tiny_model_dir, "trainer.iterations=100000")]
    # SIGINT back to its default in the child: a suite started in the background of a shell runs with
    # SIGINT ignored, which the child would inherit (and Python then installs no Ctrl-C handler)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not (tmp_path / "run" / "config.yaml").is_file():  # accepted: the run has started
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() is not None else "slow"
        time.sleep(0.1)
    assert proc.poll() is None, proc.stderr.read()
    proc.send_signal(sig)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == code, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == f"dockrl: {line.replace('<run.output_dir>', str(tmp_path / 'run'))}"
    # stopped before its first checkpoint: the same command starts it again there (what the stopped run wrote set aside:
    # tests/run/test_run_lock.py)
    assert main(run_args(tmp_path, tiny_model_dir)) == 0
    assert [row["iteration"] for row in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())] == [0]


def test_a_stopped_run_says_whether_a_checkpoint_resumes_it(tmp_path):
    from dockrl.checkpoint.resume import FORMAT, STATE_FILE
    from dockrl.cli import resume_hint

    run = tmp_path / "run"
    # stopped before it was accepted: the folders it made are gone again, and nothing stands in the way
    assert resume_hint(str(run)) == f"nothing of the run was written ({run} does not exist): the same command starts it again"
    run.mkdir()
    assert resume_hint(str(run)) == NO_CHECKPOINT.replace("<run.output_dir>", str(run))
    partial = run / "checkpoints" / "iter_000002"
    partial.mkdir(parents=True)
    (partial / "optimizer.pt.tmp").write_bytes(b"cut short")  # stopped while writing it: no state file
    assert resume_hint(str(run)).startswith("no checkpoint of the run in")
    done = run / "checkpoints" / "iter_000001"
    done.mkdir()
    (done / STATE_FILE).write_text(json.dumps({"format": FORMAT, "next_iteration": 1}))
    assert resume_hint(str(run)) == f"the run goes on from its last complete checkpoint ({done}) with run.resume=latest"
    assert resume_hint(None) == "nothing was started"


OTHER_ROWS = [  # checked by the tests named, which need more than a command line
    ("run", "a custom scorer that returns NaN for every response", 1,
     "algorithm.scorer='<scorer>': 8 of 8 rewards of this iteration were bad (nan: 8), more than algorithm.max_bad_reward_frac=0.25",
     "tests/rewards/test_guard.py"),
    ("run", "a custom scorer that hangs", 1, "... were bad (timed out: 8) ...", "tests/rewards/test_guard.py"),
    ("run", "a custom scorer that returns strings, or one reward too few", 1,
     "... were bad (str: 8) ... / (wrong count (a 3 values result for 4 responses): 8)",
     "tests/rewards/test_guard.py"),
    ("run", "a dock shard that stops answering (SIGSTOP)", 1,
     "iteration <i>: dock shard 0 at grpc://<host:port> did not answer within <s> s while its process runs",
     "tests/launch/test_local_backend.py"),
    ("run", "a second run into a folder in use", 2, "run.output_dir: <path> is in use by another dockrl run (pid <pid> on <host>, since <time>)",
     "tests/run/test_run_lock.py"),
]


def render(cases: list[Case]) -> str:
    lines = [
        "# Bad inputs and what dockrl says",
        "",
        "Generated from `tests/test_bad_inputs.py` (`make docs`); a test checks that this page is current.",
        "Each row is a test: the command ends with one line `dockrl: <message>` on stderr (no traceback;",
        "`--debug` shows one), and the exit code: **2** for an input error, **1** for a run that failed.",
        "`<path>` stands for the path given.",
        "",
        "| kind | input | exit | message contains |",
        "|---|---|---|---|",
    ]
    for c in cases:
        message = c.message.replace("|", "\\|")
        lines.append(f"| {c.kind} | {c.given} | {c.code} | `{message}` |")
    lines += [
        f"| run | Ctrl-C during a run | 130 | `{CTRL_C}` |",
        f"| run | `kill` (SIGTERM) during a run | 143 | `{SIGTERM}` |",
        *(f"| {kind} | {given} | {code} | `{message}` (`{test}`) |" for kind, given, code, message, test in OTHER_ROWS),
        "",
        "Not an error, but reported when the data is loaded: lines dropped (invalid JSON, a missing field, an answer without",
        "a final `#### <number>`, a `#### abc` answer that is no number, a prompt longer than `data.max_prompt_length`) with",
        "their line numbers, and how many rows repeat an earlier question.",
        "",
    ]
    return "\n".join(lines)


def test_the_bad_inputs_doc_is_current():
    text = render(CASES)
    if os.environ.get("DOCKRL_WRITE_DOCS") == "1":
        DOC.parent.mkdir(exist_ok=True)
        DOC.write_text(text)
    assert DOC.is_file() and DOC.read_text() == text, "docs/bad-inputs.md is stale: run `make docs`"


@pytest.mark.slow
def test_a_hanging_scorer_fails_an_inprocess_run_instead_of_blocking_it(tiny_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parent))  # fake_scorers, for the scorer's own process too
    start = time.monotonic()
    code = main(run_args(tmp_path, tiny_model_dir, "algorithm.scorer=fake_scorers:FakeHangingScorer", "algorithm.reward_timeout_s=0.5",
                         "trainer.eval_before=false"))
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err
    assert "dockrl: algorithm.scorer='fake_scorers:FakeHangingScorer': 4 of 4 rewards of this iteration were bad (timed out: 4)" in err
    assert time.monotonic() - start < 300  # a 4-row iteration times out in 2 s; the rest is loading the model
