"""Run metrics: a JSONL writer that feeds the run's trackers, a summary file, a reader, a plot and an HTML report.

Each training iteration produces a flat dict of namespaced scalars (``reward/mean``,
``actor/kl``, ``timing_s/rollout``, ``perf/tokens_per_s``, ...). ``MetricsWriter`` appends it
as one JSON line to ``<run_dir>/metrics.jsonl`` and hands it to the run's experiment trackers
(``dockrl.run.trackers``: TensorBoard under ``<run_dir>/tensorboard`` by default, MLflow, W&B);
run-level numbers (eval accuracy before/after, wall time) go to
``<run_dir>/summary.json``. ``read_metrics`` and ``plot_metrics`` read the JSONL back;
``metrics_report_html`` makes a page of them for the Kubeflow UI (``run_report`` writes it, the plot and the
rollouts page for the trackers that keep files), ``run_summary`` and ``run_summary_markdown`` the run's summary
(the pipeline's KFP Metrics and its Markdown page); ``dockrl.run.progress.Progress`` shows an ETA bar with a few
of the metrics.
"""

from __future__ import annotations

import base64
import html
import json
import logging
import math
import numbers
import os
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import yaml

if TYPE_CHECKING:
    from dockrl.run.trackers import TrackerSet

logger = logging.getLogger(__name__)

DEFAULT_PLOT_KEYS = ("reward/mean", "reward/accuracy", "rollout/response_length_mean", "actor/kl")


def _to_number(key: str, value: Any) -> float | int:
    """Return ``value`` as a Python int/float; accepts numpy scalars and one-element tensors."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    item = getattr(value, "item", None)
    if callable(item) and not isinstance(value, (str, bytes)):
        try:
            return _to_number(key, item())
        except (TypeError, ValueError, RuntimeError):
            pass
    raise TypeError(f"metric {key!r} must be a number, got {type(value).__name__}: {value!r}")


def _clean(metrics: Mapping[str, Any], where: str) -> tuple[dict[str, float | int], dict[str, float | int | None]]:
    """Validate ``metrics``; return (numbers for TensorBoard, JSON-safe values with nan/inf -> None)."""
    numeric: dict[str, float | int] = {}
    json_safe: dict[str, float | int | None] = {}
    for key, value in metrics.items():
        if not isinstance(key, str):
            raise TypeError(f"metric key {key!r} must be a str, got {type(key).__name__}")
        number = _to_number(key, value)
        numeric[key] = number
        if isinstance(number, float) and not math.isfinite(number):
            logger.warning("Metric %r is %s %s; written as null", key, number, where)
            json_safe[key] = None
        else:
            json_safe[key] = number
    return numeric, json_safe


def _iteration_of(line: str, path: Path) -> float:
    """The iteration of one metrics.jsonl line; ``inf`` (dropped) for a line cut short by a crash."""
    try:
        return int(json.loads(line)["iteration"]) if line.endswith("\n") else math.inf
    except (ValueError, KeyError, TypeError):
        logger.warning("%s: dropping an unreadable line %r", path, line[:80])
        return math.inf


class MetricsWriter:
    """Per-iteration metrics of a run: one JSON line per iteration, handed to the run's trackers.

    ``log(i, metrics)`` appends ``{"iteration": i, **metrics}`` to ``<run_dir>/metrics.jsonl``
    (flushed after every line, so a crash keeps what was written; an existing file is appended
    to, so a resumed run continues it) and hands the values to ``trackers`` (``dockrl.run.trackers.TrackerSet``;
    default: TensorBoard scalars at step ``i`` in ``<run_dir>/tensorboard``), whose failures never fail the run:
    from a tracker's first failure on, the line carries ``tracker/<name>/failures``. Non-finite floats become
    ``null`` in the JSONL, with one warning per value naming the key; non-numeric values raise ``TypeError`` naming
    the key and nothing of that iteration is written. ``on_log(i, metrics)``, when given, is called after
    each line is written (the pipeline's launcher streams the metrics to its KFP artifact).

    ``resume_from=k`` (a run resumed at iteration ``k``) first drops the lines of iterations
    ``>= k`` that an interrupted run wrote after its checkpoint (TensorBoard purges its steps ``>= k``: the run's
    ``RunInfo.resume_from``), so every iteration is logged once. ``finish`` ends the trackers' runs as finished;
    ``close`` without it, as failed.
    """

    def __init__(
        self, run_dir: str | Path, on_log: Callable[[int, dict[str, float]], None] | None = None, *, resume_from: int | None = None,
        trackers: TrackerSet | None = None,
    ):
        from dockrl.run.trackers import RunInfo, TrackerSet  # lazy: the trackers import the config, which reading metrics needs not

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.summary_path = self.run_dir / "summary.json"
        if resume_from is not None and self.metrics_path.exists():
            kept = [line for line in self.metrics_path.read_text(encoding="utf-8").splitlines(keepends=True)
                    if _iteration_of(line, self.metrics_path) < resume_from]
            tmp = self.metrics_path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(kept), encoding="utf-8")
            os.replace(tmp, self.metrics_path)
        self.trackers = trackers if trackers is not None else \
            TrackerSet.open(("tensorboard",), RunInfo(run_dir=self.run_dir, resume_from=resume_from))
        self._file = open(self.metrics_path, "a", encoding="utf-8")
        self._closed = self._finished = False
        self._on_log = on_log

    def log(self, iteration: int, metrics: Mapping[str, float | int]) -> None:
        """Append one iteration's metrics to the JSONL file and hand them to the trackers."""
        if self._closed:
            raise RuntimeError("MetricsWriter is closed")
        if "iteration" in metrics:
            raise ValueError("metric key 'iteration' is reserved")
        iteration = int(iteration)
        numeric, json_safe = _clean(metrics, f"at iteration {iteration}")
        self.trackers.log(iteration, numeric)
        counted = self.trackers.counters()
        line = json.dumps({"iteration": iteration, **json_safe, **counted}, allow_nan=False)
        self._file.write(line + "\n")
        self._file.flush()
        if self._on_log is not None:
            self._on_log(iteration, dict(metrics) | counted)

    def finish(self, summary: Mapping[str, float], artifacts: Sequence[Path] = ()) -> dict[str, float]:
        """End the trackers' runs as finished, with ``summary`` and ``artifacts`` (``run_report``); returns
        ``tracker/<name>/failures`` and ``tracker/<name>/unsent`` of the trackers that failed, for the summary."""
        self._finished = True
        return self.trackers.finish(summary, artifacts)

    def log_summary(self, metrics: Mapping[str, float | int]) -> None:
        """Merge ``metrics`` into ``<run_dir>/summary.json`` (new values win), written atomically."""
        _, json_safe = _clean(metrics, "in summary")
        summary: dict[str, Any] = {}
        if self.summary_path.exists():
            try:
                loaded = json.loads(self.summary_path.read_text(encoding="utf-8"))
                if isinstance(loaded, dict):
                    summary = loaded
                else:
                    logger.warning("%s does not hold a JSON object; replacing it", self.summary_path)
            except json.JSONDecodeError as exc:
                logger.warning("%s is not valid JSON (%s); replacing it", self.summary_path, exc)
        summary.update(json_safe)
        tmp = self.summary_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(summary, indent=2, sort_keys=True, allow_nan=False) + "\n", encoding="utf-8")
        os.replace(tmp, self.summary_path)

    def close(self) -> None:
        """Close the JSONL file and end the trackers' runs (as failed unless ``finish`` came first); safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._file.close()
        if not self._finished:
            self.trackers.finish({}, failed=True)

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


def read_metrics(path: str | Path) -> list[dict]:
    """Parse a metrics.jsonl file into a list of dicts (``null`` values come back as None).

    Blank lines are skipped. A malformed *last* line (a write cut short by a crash) is skipped
    with a warning; a malformed line elsewhere raises ``ValueError`` with its line number.
    """
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    rows: list[dict] = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError(f"expected a JSON object, got {type(row).__name__}")
        except ValueError as exc:
            if i == last:
                logger.warning("%s line %d is malformed (%s); skipped as a truncated write", path, i + 1, exc)
                continue
            raise ValueError(f"{path} line {i + 1}: {exc}") from exc
        rows.append(row)
    return rows


def plot_metrics(metrics_path: str | Path, out_png: str | Path, keys: Sequence[str] = DEFAULT_PLOT_KEYS) -> Path:
    """PNG with one subplot per key against iteration (2 columns; 2x2 for 4 keys).

    Missing or null values are skipped; a key absent from every line gets an empty subplot
    titled ``'<key> (no data)'``. Returns the path of the PNG.
    """
    import matplotlib  # lazy: half a second to import with pyplot, and only a plot needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: after matplotlib.use("Agg") (no display in a pod)

    rows = read_metrics(metrics_path)
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    n = max(len(keys), 1)
    ncols = 1 if n == 1 else 2
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3.5 * nrows), squeeze=False)
    try:
        flat = list(axes.flat)
        for ax, key in zip(flat, keys):
            points = [(r["iteration"], r[key]) for r in rows if r.get(key) is not None and "iteration" in r]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o" if len(points) < 30 else None, markersize=3)
                ax.set_title(key)
            else:
                ax.set_title(f"{key} (no data)")
            ax.set_xlabel("iteration")
            ax.grid(True, alpha=0.3)
        for ax in flat[len(keys):]:
            ax.set_visible(False)
        fig.tight_layout()
        fig.savefig(out, dpi=100)
    finally:
        plt.close(fig)
    return out


def metrics_report_html(run_dir: str | Path, keys: Sequence[str] = DEFAULT_PLOT_KEYS) -> str:
    """A self-contained HTML page of a run's curves, for the Kubeflow UI (an ``HTML`` artifact).

    It holds ``<run_dir>/metrics.png`` inline (base64; redrawn from ``metrics.jsonl`` if
    missing), a table with each numeric key's first, last, min and max over the iterations, and
    ``summary.json``'s run-level numbers. Nothing is fetched when the page is viewed. A run
    without ``metrics.jsonl`` (no iteration ran) gets a page that says so.
    """
    run = Path(run_dir)
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>dockrl run</title></head><body>"
                f"<p>No metrics: {html.escape(metrics.name)} was not written (no iteration ran).</p></body></html>\n")
    rows = read_metrics(metrics)
    png = run / "metrics.png"
    if not png.is_file():
        plot_metrics(metrics, png, keys)
    image = base64.b64encode(png.read_bytes()).decode("ascii")
    series = _series(rows)

    def cells(values: Sequence[object]) -> str:
        return "".join(f"<td>{html.escape(v if isinstance(v, str) else f'{v:.4g}')}</td>" for v in values)

    lines = [
        "<!DOCTYPE html>", '<html><head><meta charset="utf-8"><title>dockrl run</title>',
        "<style>body{font-family:sans-serif}table{border-collapse:collapse}td,th{border:1px solid #ccc;"
        "padding:2px 6px;text-align:right}td:first-child{text-align:left}</style></head><body>",
        f"<h2>dockrl run: {len(rows)} iteration(s)</h2>",
        f'<img alt="curves of {html.escape(", ".join(keys))}" src="data:image/png;base64,{image}">',
    ]
    summary = run / "summary.json"
    if summary.is_file():
        data = json.loads(summary.read_text())
        numbers_ = {k: v for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if numbers_:
            lines.append("<h3>Run</h3><table><tr><th>metric</th><th>value</th></tr>")
            lines += [f"<tr>{cells([k, float(v)])}</tr>" for k, v in sorted(numbers_.items())]
            lines.append("</table>")
    lines.append("<h3>Per iteration</h3><table><tr><th>metric</th><th>first</th><th>last</th><th>min</th><th>max</th></tr>")
    lines += [f"<tr>{cells([k, v[0], v[-1], min(v), max(v)])}</tr>" for k, v in sorted(series.items())]
    lines.append("</table></body></html>")
    return "\n".join(lines) + "\n"


def run_report(run_dir: str | Path) -> list[Path]:
    """Write and return the report files of a run, which the trackers with artifacts keep: ``metrics.png``
    (``plot_metrics``), ``metrics.html`` (``metrics_report_html``, the curves page the pipeline shows) and, with kept
    rollouts, ``rollouts.html`` (``dockrl.rollouts.page``). A rollouts page that cannot be made (its store
    unreachable) is left out with a warning: the report never fails a run that trained."""
    from dockrl.rollouts.keep import has_rows, kept_rollouts  # lazy: pyarrow's datasets, only with kept rollouts
    from dockrl.rollouts.page import rollouts_page_html

    run = Path(run_dir)
    files: list[Path] = []
    if (run / "metrics.jsonl").is_file():
        files.append(plot_metrics(run / "metrics.jsonl", run / "metrics.png"))
        curves = run / "metrics.html"
        curves.write_text(metrics_report_html(run), encoding="utf-8")
        files.append(curves)
    if (run / "rollouts").is_dir():
        try:
            kept = kept_rollouts(run)
            if has_rows(kept.rows):
                page = run / "rollouts.html"
                page.write_text(rollouts_page_html(kept, title=f"dockrl rollouts of {run.name}"), encoding="utf-8")
                files.append(page)
        except Exception as exc:  # noqa: BLE001 - a page for the trackers never fails a run that trained
            logger.warning("the rollouts page of %s is left out of the trackers' artifacts (%s: %s)", run, type(exc).__name__, exc)
    return files
SUMMARY_SERIES: dict[str, tuple[str, ...]] = {
    "reward/accuracy": ("final", "best"),
    "reward/mean": ("final", "best"),
    "actor/kl": ("final", "max"),
    "perf/response_tokens_per_s": ("mean",),
    "perf/rollout_tokens_per_s": ("mean",),
    "rollout/response_length_mean": ("final",),
    "timing_s/iteration": ("mean",),
}
"""The per-iteration metrics a run's summary keeps, and how each is reduced over the iterations:
``final`` (the last iteration's value), ``best`` and ``max`` (the highest), ``mean``."""

_REDUCE: dict[str, Callable[[list[float]], float]] = {
    "final": lambda v: v[-1], "best": max, "max": max, "mean": lambda v: sum(v) / len(v),
}


def _series(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[float]]:
    """Each key's finite numbers over ``rows``, in iteration order."""
    out: dict[str, list[float]] = {}
    for row in rows:
        for key, value in row.items():
            if key != "iteration" and isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                out.setdefault(key, []).append(float(value))
    return out


def _run_numbers(run: Path) -> dict[str, float]:
    """``summary.json``'s finite numbers (none where it is missing)."""
    path = run / "summary.json"
    data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    return {k: float(v) for k, v in data.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}


def run_summary(run_dir: str | Path) -> dict[str, float]:
    """A run's summary as named scalars: what the pipeline's KFP ``Metrics`` artifact holds, so that
    the UI's compare-runs table has one row per number, not one per number and iteration.

    ``run/iterations`` (iterations in ``metrics.jsonl``), each ``SUMMARY_SERIES`` key present as
    ``<key>/<reduction>`` (``reward/accuracy/best``, ``actor/kl/final``, ``perf/response_tokens_per_s/mean``),
    and the run-level numbers of ``summary.json`` as they are (``eval/accuracy_before``, ``run/seconds``:
    the wall time, ...). Non-finite values are left out. The curves stay in ``metrics.jsonl``,
    TensorBoard and ``metrics_report_html``.
    """
    run = Path(run_dir)
    rows = read_metrics(run / "metrics.jsonl") if (run / "metrics.jsonl").is_file() else []
    series = _series(rows)
    out = {"run/iterations": float(len(rows))}
    for key, reductions in SUMMARY_SERIES.items():
        if series.get(key):
            out |= {f"{key}/{how}": float(_REDUCE[how](series[key])) for how in reductions}
    return out | _run_numbers(run)


def _config_lines(run: Path) -> list[tuple[str, str]]:
    """What a reader of the summary asks first about a run, from its ``config.yaml``."""
    path = run / "config.yaml"
    cfg = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else None
    if not isinstance(cfg, dict):
        return []

    def get(where: str) -> object:
        section, key = where.split(".")
        return (cfg.get(section) or {}).get(key, "?")

    return [("algorithm", f"{get('algorithm.adv_estimator')} (KL coefficient {get('algorithm.kl_loss_coef')})"),
            ("model", str(get("model.path"))),
            ("batch", f"{get('trainer.global_batch')} prompts × {get('rollout.n')} responses per iteration"),
            ("learning rate", str(get("trainer.lr")))]


def run_summary_markdown(run_dir: str | Path) -> str:
    """A Markdown page of a run's summary, for the Kubeflow UI (a ``Markdown`` artifact, shown in the
    run's Visualizations): the run (algorithm, model, batch, learning rate, iterations, wall time),
    a table of the ``SUMMARY_SERIES`` metrics (first, final, best or max, mean over the iterations)
    and ``summary.json``'s run-level numbers. A run without ``metrics.jsonl`` gets a page that says so.
    """
    run = Path(run_dir)
    rows = read_metrics(run / "metrics.jsonl") if (run / "metrics.jsonl").is_file() else []
    series, numbers_ = _series(rows), _run_numbers(run)
    seconds = numbers_.get("run/seconds")
    about = [*_config_lines(run), ("iterations", str(len(rows)))]
    if seconds is not None:
        about.append(("wall time", f"{seconds / 60:.1f} min ({seconds:.0f} s)"))
    lines = ["# dockrl run", "", "| setting | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in about), ""]
    if not rows:
        lines.append("No iteration ran: `metrics.jsonl` was not written.")
    else:
        lines += ["## Training", "", "| metric | first | final | best / max | mean |", "|---|---:|---:|---:|---:|"]
        for key in SUMMARY_SERIES:
            if v := series.get(key):
                lines.append(f"| {key} | {v[0]:.4g} | {v[-1]:.4g} | {max(v):.4g} | {sum(v) / len(v):.4g} |")
    shown = {"run/seconds"}
    rest = {k: v for k, v in sorted(numbers_.items()) if k not in shown}
    if rest:
        lines += ["", "## Run", "", "| metric | value |", "|---|---:|", *(f"| {k} | {v:.4g} |" for k, v in rest.items())]
    lines += ["", "Every metric of every iteration: the curves page beside this one, TensorBoard (the run folder's "
              "`tensorboard/`) and `metrics.jsonl` in the run_dir artifact."]
    return "\n".join(lines) + "\n"
