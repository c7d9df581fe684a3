"""What reads a run's kept rollouts back: ``dockrl rollouts rescore`` (a new reward beside the old one; with a
generative judge too, and as the rescore pipeline), ``distill`` (a teacher's reverse KL to the policy), ``replay`` (an
iteration's actor loss and gradient norm, recomputed) and ``page`` (the HTML page)."""

from __future__ import annotations

import shutil

import pyarrow.parquet as pq
import pytest
from fake_scorers import FakeDigitScorer

from dockrl import driver
from dockrl.cli import main
from dockrl.config import ConfigError, GenerativeJudgeConfig, load_config
from dockrl.engines.hf.rollout import HFRolloutEngine
from dockrl.engines.judge import GenerativeJudge
from dockrl.rollouts.keep import kept_rollouts, load_rollouts_tokenizer, read_rollouts
from dockrl.rollouts.rescore import rescore
from dockrl.rollouts.teacher import teacher_kl
from dockrl.run.models import build_tiny_model

SHORT = ["run.progress=false", "trainer.iterations=3", "trainer.global_batch=2", "trainer.mini_batch=1", "trainer.micro_batch=2",
         "rollout.n=4", "rollout.max_response_length=8", "rollout.dtype=float32", "trainer.autocast_bf16=false", "trainer.lr=1e-3",
         "trainer.eval_before=false", "trainer.eval_after=false", "data.generate_train=8", "data.generate_test=4", "data.eval_size=4",
         "algorithm.scorer=fake_scorers:FakeRandomScorer", "algorithm.kl_loss_coef=0.01", "trainer.save_every=1",
         "run.keep_rollouts=all"]


@pytest.fixture(scope="module")
def kept_run(tiny_model_dir, tmp_path_factory):
    """A run of 3 iterations (2 mini-batches each, a KL term) that kept every row and saved every checkpoint."""
    tmp = tmp_path_factory.mktemp("kept")
    run = tmp / "run"
    driver.train(load_config(None, [f"model.path={tiny_model_dir}", f"run.output_dir={run}", f"run.cache_dir={tmp / 'cache'}", *SHORT]))
    return run


def test_rescore_puts_a_new_reward_beside_the_old_for_every_row(kept_run, tmp_path, capsys):
    kept = kept_rollouts(kept_run)
    table, bad = rescore(kept, "fake_scorers:FakeDigitScorer")
    stored = read_rollouts(kept.root, columns=["iteration", "row", "rm_score", "response_ids", "ground_truth"])
    assert table.num_rows == stored.num_rows == 3 * 2 * 4 and not bad
    assert table.column("old").to_pylist() == stored.column("rm_score").to_pylist()  # the reward the run trained with
    texts = load_rollouts_tokenizer(kept).batch_decode(stored.column("response_ids").to_pylist(), skip_special_tokens=True)
    assert table.column("new").to_pylist() == FakeDigitScorer().score(texts, stored.column("ground_truth").to_pylist())
    assert table.column("old").to_pylist() != table.column("new").to_pylist()

    capsys.readouterr()
    out = tmp_path / "rescored.parquet"
    assert main(["rollouts", "rescore", str(kept_run), "--scorer", "fake_scorers:FakeDigitScorer", "--iteration", "1",
                 "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["iteration", "row", "old", "new"] and len(lines) == 1 + 8 + 2
    one = table.filter(table.column("iteration").to_numpy() == 1).to_pylist()
    for line, r in zip(lines[1:9], one):
        assert line.split() == ["1", str(r["row"]), f"{r['old']:.4f}", f"{r['new']:.4f}"]
    assert lines[9].startswith("iteration 1: mean old ") and lines[10].startswith("(8 rows rescored, ")
    assert pq.read_table(out).to_pylist() == one


def test_rescore_errors_name_what_is_wrong(kept_run, tmp_path, capsys):
    with pytest.raises(ConfigError, match=r"^algorithm.scorer: got 'fake_scorers:NoSuchScorer', which does not import"):
        rescore(kept_rollouts(kept_run), "fake_scorers:NoSuchScorer")
    assert main(["rollouts", "rescore", str(tmp_path), "--scorer", "fake_scorers:FakeDigitScorer"]) == 2
    assert "holds no kept rollouts" in capsys.readouterr().err


def test_errors_of_each_command_on_a_run_are_one_line_and_exit_2(kept_run, tmp_path, capsys):
    """``replay`` of an iteration whose checkpoint is gone and ``rescore`` with a scorer that does not import: one
    line each, exit code 2, no traceback."""
    run_dir = tmp_path / "run"
    shutil.copytree(kept_run, run_dir, ignore=shutil.ignore_patterns("checkpoints"))
    for argv, says in ((["replay", "--iteration", "1"], "is not a complete checkpoint"),
                       (["rescore", "--scorer", "no_such_module:Scorer"], "does not import")):
        capsys.readouterr()
        assert main(["rollouts", argv[0], str(run_dir), *argv[1:]]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and says in err, err


def test_a_bad_value_of_the_new_scorer_is_flagged_on_its_row(kept_run):
    table, bad = rescore(kept_rollouts(kept_run), "fake_scorers:FakeMostlyFineScorer", iteration=0)  # an inf first in each batch
    assert table.column("new_bad").to_pylist() == [True] + [False] * 7 and bad == {"inf": 1}
    assert table.column("new").to_pylist() == [0.0] + [1.1] * 7


@pytest.mark.parametrize("iteration", [0, 2])  # from the run's model (a fresh optimizer); from checkpoints/iter_000002 and its optimizer
def test_replay_reproduces_the_logged_actor_loss_and_grad_norm_bit_for_bit(kept_run, iteration, capsys):
    from dockrl.rollouts.replay import logged_metrics, replay

    ran = replay(kept_rollouts(kept_run), iteration)
    logged = logged_metrics(kept_run, iteration)
    for key in ("actor/loss", "actor/pg_loss", "actor/kl", "actor/grad_norm"):
        assert ran[key] == logged[key], key  # fp32 on CPU: the same bits
    assert ran["replay/old_log_prob_equal"] == 1.0 and logged["actor/grad_norm"] > 0
    capsys.readouterr()
    assert main(["rollouts", "replay", str(kept_run), "--iteration", str(iteration)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == f"iteration {iteration}: reproduced exactly" and out[-2] == "old_log_prob: the same bits as kept"
    loss = next(line.split() for line in out if line.startswith("actor/loss "))
    assert loss[1] == loss[2] == repr(logged["actor/loss"])


def test_the_rollouts_page_has_rewards_lengths_and_samples(kept_run, tmp_path, capsys):
    from dockrl.rollouts.page import SAMPLES

    out = tmp_path / "page.html"
    assert main(["rollouts", "page", str(kept_run), "--out", str(out)]) == 0
    page = PageParser.of(out.read_text())
    assert [s for s in page.ids if s in ("rewards", "lengths", "samples", "reward-table")] == ["rewards", "reward-table", "lengths", "samples"]
    assert len(page.images) == 2 and all(src.startswith("data:image/png;base64,") for src in page.images)
    stored = read_rollouts(kept_rollouts(kept_run).root, columns=["iteration", "row", "rm_score"]).to_pylist()
    assert page.tables == {str(i): 2 * SAMPLES for i in range(3)}  # best and worst per iteration
    for i in range(3):  # the best row of each iteration comes first: the highest reward, the lowest row among ties
        best = max((r for r in stored if r["iteration"] == i), key=lambda r: (r["rm_score"], -r["row"]))
        assert page.first_rows[str(i)][:3] == ["best", str(best["row"]), f"{best['rm_score']:.4f}"]
    from dockrl.rollouts.page import empty_page

    assert 'id="empty"' in empty_page()


def test_the_rollouts_page_renders_in_a_headless_browser(kept_run, tmp_path):
    """Chromium (Debian's; .ci/run installs it) loads the page from a file, writes a screenshot into the test's folder
    and the DOM it built: the sections, the images decoded to their size, a samples table per iteration."""
    import shutil
    import subprocess

    import numpy as np
    from matplotlib.image import imread

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        pytest.skip("no chromium on this machine (.ci/run installs Debian's)")
    out = tmp_path / "page.html"
    assert main(["rollouts", "page", str(kept_run), "--out", str(out)]) == 0
    # the page's images report their decoded size into the DOM that --dump-dom prints (a probe script of the test)
    probe = out.read_text().replace("</body>", "<script>window.addEventListener('load', () => { for (const i of document.images) "
                                    "i.dataset.decoded = i.naturalWidth + 'x' + i.naturalHeight; });</script></body>")
    probed = tmp_path / "probed.html"
    probed.write_text(probe)
    flags = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1200,1600",
             f"--user-data-dir={tmp_path / 'profile'}", "--virtual-time-budget=5000"]
    shot = tmp_path / "page.png"
    subprocess.run([*flags, f"--screenshot={shot}", probed.as_uri()], check=True, capture_output=True, timeout=120)
    dom = subprocess.run([*flags, "--dump-dom", probed.as_uri()], check=True, capture_output=True, text=True, timeout=120).stdout
    page = PageParser.of(dom)
    assert {"rewards", "lengths", "samples"} <= set(page.ids) and page.tables == {str(i): 6 for i in range(3)}
    assert len(page.decoded) == 2 and all(int(w) > 100 and int(h) > 100 for w, h in (d.split("x") for d in page.decoded))
    pixels = imread(shot)
    assert pixels.shape[:2] == (1600, 1200) and np.std(pixels[..., :3]) > 0.05  # drawn, not a blank page


class PageParser:
    """The parts of a page the tests check: element ids, image sources and decoded sizes, and per samples table its
    row count and first row's cells."""

    @classmethod
    def of(cls, text: str) -> PageParser:
        from html.parser import HTMLParser

        page = cls()

        class Parser(HTMLParser):
            table: str | None = None
            cells: list[str] | None = None

            def handle_starttag(self, tag, attrs):
                a = dict(attrs)
                if "id" in a:
                    page.ids.append(a["id"])
                if tag == "img":
                    page.images.append(a.get("src", ""))
                    if "data-decoded" in a:
                        page.decoded.append(a["data-decoded"])
                if tag == "table" and a.get("class") == "samples":
                    self.table = a["data-iteration"]
                    page.tables[self.table] = 0
                if tag == "tr" and self.table is not None and a.get("class") in ("best", "worst"):
                    page.tables[self.table] += 1
                    self.cells = [] if page.tables[self.table] == 1 else None
                if tag == "td" and self.cells is not None:
                    self.cells.append("")

            def handle_data(self, data):
                if self.cells:
                    self.cells[-1] += data

            def handle_endtag(self, tag):
                if tag == "tr" and self.cells is not None and self.table is not None:
                    page.first_rows[self.table], self.cells = self.cells, None
                if tag == "table":
                    self.table = None

        Parser().feed(text)
        return page

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.images: list[str] = []
        self.decoded: list[str] = []
        self.tables: dict[str, int] = {}
        self.first_rows: dict[str, list[str]] = {}


def test_the_same_reward_again_changes_no_row(kept_run):
    from dockrl.rollouts.rescore import per_iteration

    table, _ = rescore(kept_rollouts(kept_run), "fake_scorers:FakeRandomScorer", iteration=0)  # the run's own scorer, same seed
    stats = per_iteration(table)
    assert stats["rescore/changed"] == 0 and stats["rescore/rows"] == 8
    assert stats["rescore/old_mean/iter_0000"] == pytest.approx(stats["rescore/new_mean/iter_0000"], abs=1e-6)


def test_distill_measures_the_policy_s_reverse_kl_to_a_teacher(kept_run, tiny_model_dir, tmp_path, capsys):
    """The run's own initial model as the teacher: the rows of iteration 0 were sampled by those weights, so their
    reverse KL is 0 up to float noise; later iterations' policies have moved away from it."""
    table = teacher_kl(kept_rollouts(kept_run), tiny_model_dir)
    assert table.num_rows == 3 * 2 * 4 and table.column_names == ["iteration", "row", "tokens", "reverse_kl"]
    rows = table.to_pylist()
    assert all(r["tokens"] >= 1 for r in rows)
    assert max(abs(r["reverse_kl"]) for r in rows if r["iteration"] == 0) < 1e-4
    assert max(abs(r["reverse_kl"]) for r in rows if r["iteration"] == 2) > 1e-3

    capsys.readouterr()
    out = tmp_path / "kl.parquet"
    assert main(["rollouts", "distill", str(kept_run), "--teacher", str(tiny_model_dir), "--iteration", "2", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    two = [r for r in rows if r["iteration"] == 2]
    tokens = sum(r["tokens"] for r in two)
    assert lines[0].split() == ["iteration", "rows", "tokens", "reverse_kl"]
    assert lines[1].split() == ["2", "8", str(tokens), f"{sum(r['reverse_kl'] * r['tokens'] for r in two) / tokens:.4f}"]
    assert pq.read_table(out).to_pylist() == [pytest.approx(r) for r in two]

    other = build_tiny_model(tmp_path / "other-tokenizer", vocab_size=400)
    capsys.readouterr()  # the build's progress bar
    assert main(["rollouts", "distill", str(kept_run), "--teacher", str(other)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"dockrl rollouts distill: --teacher: the teacher's tokenizer ({other}) is not the student's"), err


JUDGE = ["reward_model.generative.template=Question: {prompt} Answer: {response} Score 0 to 10.",
         "reward_model.generative.max_new_tokens=4", "reward_model.micro_batch_size=8"]


def test_rescore_with_a_generative_judge_gives_its_verdicts_beside_the_old_reward(kept_run, tiny_model_dir, capsys):
    kept = kept_rollouts(kept_run)
    judge = [f"reward_model.model.path={tiny_model_dir}", "reward_model.generative.parser=judge_parsers:verdict_length", *JUDGE]
    table, bad = rescore(kept, judge=judge, iteration=1)
    stored = read_rollouts(kept.root, 1, ["iteration", "row", "prompt_ids", "response_ids", "ground_truth", "rm_score"])
    cfg = GenerativeJudgeConfig(template=JUDGE[0].split("=", 1)[1], parser="judge_parsers:verdict_length", max_new_tokens=4)
    alone = GenerativeJudge(HFRolloutEngine(tiny_model_dir, dtype="float32"), load_rollouts_tokenizer(kept), cfg)
    want = alone.verdicts(stored.column("prompt_ids").to_pylist(), stored.column("response_ids").to_pylist(),
                          stored.column("ground_truth").to_pylist(), micro_batch=8)
    assert table.column("new").to_pylist() == pytest.approx([v.score for v in want]) and not bad
    assert table.column("old").to_pylist() == stored.column("rm_score").to_pylist()

    unread, bad = rescore(kept, judge=[f"reward_model.model.path={tiny_model_dir}", "reward_model.generative.parser=judge_parsers:undecided",
                                       "reward_model.generative.unparsed_score=-1", *JUDGE], iteration=1)
    assert unread.column("new").to_pylist() == [-1.0] * 8 and all(unread.column("new_bad").to_pylist()) and bad == {"unparsed": 8}
    with pytest.raises(ConfigError, match=r"^judge: got \['trainer.lr=1'\]; expected reward_model.\* settings"):
        rescore(kept, judge=["trainer.lr=1"])
    with pytest.raises(ValueError, match=r"exactly one"):
        rescore(kept, "fake_scorers:FakeDigitScorer", judge=judge)
    capsys.readouterr()
    assert main(["rollouts", "rescore", str(kept_run), "--iteration", "1", *[f"--judge={j}" for j in judge]]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "(8 rows rescored, 8 changed)"


@pytest.mark.slow
def test_the_rescore_pipeline_runs_the_judge_locally(kept_run, tiny_model_dir, tmp_path, monkeypatch):
    """The rescore pipeline with a judge (the built-in number parser) over a run's kept rollouts, through kfp.local."""
    from dockrl.pipelines.grpo import task_metadata
    from dockrl.pipelines.rescore import run_rescore_local

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    judge = [f"reward_model.model.path={tiny_model_dir}", "reward_model.generative.unparsed_score=-1", *JUDGE]
    run = run_rescore_local(kept_run, "", tmp_path / "root", judge=judge)
    table = pq.read_table(run / "rescore-rollouts" / "rescored" / "rescored.parquet")
    want, _ = rescore(kept_rollouts(kept_run), judge=judge)
    assert table.num_rows == 3 * 2 * 4 and table.to_pylist() == want.to_pylist()
    meta = task_metadata(run, "rescore-rollouts", "rescored")
    assert meta["judge"] == judge and meta["rows"] == 24
    assert task_metadata(run, "rescore-rollouts", "metrics")["rescore/rows"] == 24
