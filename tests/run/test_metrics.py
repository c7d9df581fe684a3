"""Tests for dockrl.run.metrics: JSONL + TensorBoard writer, summary, plot, progress bar."""

from __future__ import annotations

import json
import logging
import math

import pytest

from dockrl.run.metrics import MetricsWriter, plot_metrics, read_metrics
from dockrl.run.progress import Progress

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _log_three(run_dir):
    with MetricsWriter(run_dir) as writer:
        for i in range(3):
            writer.log(i, {"reward/mean": 0.1 * i, "actor/kl": 0.01 * i, "rollout/n": 8 + i})


def test_log_writes_jsonl_lines(tmp_path):
    _log_three(tmp_path)
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 3
    rows = [json.loads(line) for line in lines]
    assert [r["iteration"] for r in rows] == [0, 1, 2]
    assert rows[2]["reward/mean"] == pytest.approx(0.2)
    assert rows[1]["actor/kl"] == pytest.approx(0.01)
    assert rows[2]["rollout/n"] == 10
    assert read_metrics(tmp_path / "metrics.jsonl") == rows


def test_on_log_sees_each_iteration_after_it_is_written(tmp_path):
    seen = []

    def on_log(i, metrics):
        seen.append((i, metrics, len((tmp_path / "metrics.jsonl").read_text().splitlines())))

    with MetricsWriter(tmp_path, on_log=on_log) as writer:
        writer.log(0, {"reward/mean": 0.5})
        writer.log(1, {"reward/mean": float("nan")})
    assert seen[0] == (0, {"reward/mean": 0.5}, 1)
    assert seen[1][0] == 1 and seen[1][2] == 2 and math.isnan(seen[1][1]["reward/mean"])


def test_log_appends_when_reopened(tmp_path):
    _log_three(tmp_path)
    with MetricsWriter(tmp_path) as writer:
        writer.log(3, {"reward/mean": 0.3})
    assert [r["iteration"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]


def test_line_is_flushed_before_close(tmp_path):
    writer = MetricsWriter(tmp_path)
    try:
        writer.log(0, {"reward/mean": 1.0})
        assert read_metrics(tmp_path / "metrics.jsonl") == [{"iteration": 0, "reward/mean": 1.0}]
    finally:
        writer.close()
    writer.close()  # idempotent


def test_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _log_three(tmp_path)
    tb_dir = tmp_path / "tensorboard"
    assert list(tb_dir.glob("events.out.tfevents.*"))
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    assert "reward/mean" in acc.Tags()["scalars"]
    events = acc.Scalars("reward/mean")
    assert [e.step for e in events] == [0, 1, 2]
    assert [e.value for e in events] == pytest.approx([0.0, 0.1, 0.2])


def test_nan_becomes_null_with_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="dockrl.run.metrics"):
        with MetricsWriter(tmp_path) as writer:
            writer.log(0, {"reward/mean": 0.5, "actor/kl": float("nan"), "perf/x": float("inf")})
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "Infinity" not in text
    row = json.loads(text)
    assert row["actor/kl"] is None and row["perf/x"] is None
    assert row["reward/mean"] == 0.5
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert sum("actor/kl" in m for m in warnings) == 1
    assert sum("perf/x" in m for m in warnings) == 1


def test_non_numeric_raises_type_error(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        with pytest.raises(TypeError, match="reward/mean"):
            writer.log(0, {"actor/kl": 0.1, "reward/mean": "high"})
    assert (tmp_path / "metrics.jsonl").read_text() == ""  # nothing partial written


def test_numpy_and_tensor_scalars_accepted(tmp_path):
    np = pytest.importorskip("numpy")
    import torch

    with MetricsWriter(tmp_path) as writer:
        writer.log(0, {"a": np.float32(0.5), "b": torch.tensor(2.0), "c": np.int64(3), "d": True})
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"iteration": 0, "a": 0.5, "b": 2.0, "c": 3, "d": 1}]


def test_summary_merges(tmp_path):
    with MetricsWriter(tmp_path) as writer:
        writer.log_summary({"eval/accuracy_before": 0.25, "run/time_s": 10.0})
        writer.log_summary({"eval/accuracy_after": 0.5, "run/time_s": 12.5})
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == {"eval/accuracy_before": 0.25, "eval/accuracy_after": 0.5, "run/time_s": 12.5}
    with MetricsWriter(tmp_path) as writer:  # merges with a file from an earlier writer
        writer.log_summary({"extra": 1})
    assert json.loads((tmp_path / "summary.json").read_text())["eval/accuracy_before"] == 0.25


def test_read_metrics_skips_truncated_last_line(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"iteration": 0, "a": 1}\n{"iteration": 1, "a"')
    with caplog.at_level(logging.WARNING, logger="dockrl.run.metrics"):
        assert read_metrics(path) == [{"iteration": 0, "a": 1}]
    assert caplog.records
    path.write_text('{"iteration": 0\n{"iteration": 1, "a": 1}\n')
    with pytest.raises(ValueError, match="line 1"):
        read_metrics(path)


def test_plot_metrics_with_missing_key(tmp_path):
    _log_three(tmp_path)
    out = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "plots" / "metrics.png")
    assert out == tmp_path / "plots" / "metrics.png"
    data = out.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_plot_metrics_odd_key_count(tmp_path):
    _log_three(tmp_path)
    out = plot_metrics(tmp_path / "metrics.jsonl", tmp_path / "m.png", keys=("reward/mean", "actor/kl", "nope"))
    assert out.read_bytes().startswith(PNG_MAGIC)


def test_progress_disabled(capsys):
    with Progress(total=3, desc="train", enable=False) as bar:
        for i in range(3):
            bar.update({"reward/mean": 0.1 * i})
        assert bar.n == 3
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_progress_enabled(capsys):
    with Progress(total=4, desc="train", initial=1) as bar:
        bar.update({"reward/mean": 0.12345, "reward/accuracy": 0.5, "actor/kl": math.nan, "other": 9.0})
        bar.update({})
        bar.update(None)
        assert bar.n == 4
    err = capsys.readouterr().err
    assert "train" in err
    assert "0.123" in err
    assert "other" not in err


def test_metrics_report_html_holds_the_plot_and_a_table_of_every_metric(tmp_path):
    import base64
    import re

    from dockrl.run.metrics import metrics_report_html

    with MetricsWriter(tmp_path) as w:
        for it, (reward, kl) in enumerate([(0.1, 0.0), (0.4, 0.02), (0.3, float("nan"))]):
            w.log(it, {"reward/mean": reward, "actor/kl": kl})
        w.log_summary({"eval/accuracy_before": 0.07, "run/seconds": 12.5})
    page = metrics_report_html(tmp_path)
    assert "3 iteration(s)" in page
    png = base64.b64decode(re.search(r'src="data:image/png;base64,([^"]+)"', page).group(1))
    assert png.startswith(b"\x89PNG") and (tmp_path / "metrics.png").is_file()  # drawn when the run had none
    row = re.search(r"<tr><td>reward/mean</td>(.*?)</tr>", page).group(1)
    assert re.findall(r"<td>([^<]*)</td>", row) == ["0.1", "0.3", "0.1", "0.4"]  # first, last, min, max
    kl = re.search(r"<tr><td>actor/kl</td>(.*?)</tr>", page).group(1)
    assert re.findall(r"<td>([^<]*)</td>", kl) == ["0", "0.02", "0", "0.02"]  # the nan is left out
    assert "<td>eval/accuracy_before</td><td>0.07</td>" in page
    assert "No metrics: metrics.jsonl was not written" in metrics_report_html(tmp_path / "empty")


def test_the_runs_summary_is_a_few_named_numbers_whatever_the_iterations(tmp_path):
    """What the pipeline's KFP Metrics artifact holds: one scalar per summary number, not one per metric and iteration."""
    from dockrl.run.metrics import SUMMARY_SERIES, run_summary

    with MetricsWriter(tmp_path) as w:
        for it in range(50):
            w.log(it, {"reward/mean": it / 100, "reward/accuracy": 0.5 if it == 7 else 0.25, "actor/kl": 0.01 * (it % 5),
                       "perf/response_tokens_per_s": 100.0 + it, "actor/loss": float("nan") if it == 49 else 1.0, "other": it})
        w.log_summary({"eval/accuracy_before": 0.07, "run/seconds": 12.5, "eval/accuracy_after": float("nan")})  # written as null
    summary = run_summary(tmp_path)
    assert summary == {
        "run/iterations": 50.0, "reward/accuracy/final": 0.25, "reward/accuracy/best": 0.5, "reward/mean/final": 0.49,
        "reward/mean/best": 0.49, "actor/kl/final": 0.04, "actor/kl/max": 0.04, "perf/response_tokens_per_s/mean": 124.5,
        "eval/accuracy_before": 0.07, "run/seconds": 12.5,
    }
    assert len(summary) < 2 * sum(map(len, SUMMARY_SERIES.values()))  # not a number per iteration
    assert run_summary(tmp_path / "empty") == {"run/iterations": 0.0}


def test_the_runs_markdown_summary_has_the_run_and_a_table_per_metric(tmp_path):
    from dockrl.config import load_config, save_config
    from dockrl.run.metrics import run_summary_markdown

    save_config(load_config(None, ["algorithm.adv_estimator=rloo", "trainer.lr=2e-6"]), tmp_path / "config.yaml")
    with MetricsWriter(tmp_path) as w:
        for it, reward in enumerate([0.1, 0.4, 0.3]):
            w.log(it, {"reward/mean": reward, "actor/kl": 0.01})
        w.log_summary({"eval/accuracy_before": 0.07, "run/seconds": 125.0})
    page = run_summary_markdown(tmp_path)
    assert page.startswith("# dockrl run\n")
    assert "| algorithm | rloo (KL coefficient 0.0) |" in page and "| learning rate | 2e-06 |" in page
    assert "| iterations | 3 |" in page and "| wall time | 2.1 min (125 s) |" in page
    assert "| reward/mean | 0.1 | 0.3 | 0.4 | 0.2667 |" in page  # first, final, best, mean
    assert "| eval/accuracy_before | 0.07 |" in page
    assert "No iteration ran" in run_summary_markdown(tmp_path / "empty")
