"""A run's kept rollouts as one self-contained HTML page: the pipeline's ``rollouts_page`` (KFP's visualization
of an ``HTML`` artifact, beside the curves page) and ``dockrl rollouts page RUN --out page.html``.

The page holds, from the dataset read with ``pyarrow.dataset`` (``dockrl.rollouts.keep.read_rollouts``):

* ``#rewards``: the reward (``rm_score``) distribution of every iteration, a box plot (PNG inline, base64);
* ``#lengths``: histograms of the response and prompt lengths (tokens) of the first and last iteration;
* ``#samples``: per iteration, the best and the worst ``SAMPLES`` responses by reward (ties: the lower row),
  decoded with the run's tokenizer, in a table ``table.samples[data-iteration=N]``.

Nothing is fetched when the page is viewed.
"""

from __future__ import annotations

import base64
import html
import io
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from dockrl.rollouts.keep import KeptRollouts, has_rows, kept_rollouts, load_rollouts_tokenizer, read_rollouts

SAMPLES = 3
"""Best and worst responses shown per iteration (each)."""
TEXT_CHARS = 400
"""Characters of a response shown at most."""
STYLE = ("body{font-family:sans-serif;margin:1em}table{border-collapse:collapse;margin-bottom:1em}"
         "td,th{border:1px solid #ccc;padding:2px 6px;vertical-align:top}td.text{font-family:monospace;white-space:pre-wrap;"
         "max-width:60em}tr.best td:first-child{color:#070}tr.worst td:first-child{color:#a00}")


def _png(fig: Any) -> str:
    """The figure as a base64 PNG ``data:`` URI (the figure is closed)."""
    import matplotlib.pyplot as plt  # lazy: imported by _figures after matplotlib.use("Agg")

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _figures(table: pa.Table, iterations: list[int]) -> tuple[str, str]:
    """The reward box plot and the length histograms as PNG data URIs."""
    import matplotlib  # lazy: half a second to import with pyplot, and only the page needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: after matplotlib.use("Agg") (no display in a pod)

    by_it = {i: table.filter(pc.equal(table.column("iteration"), i)) for i in iterations}
    fig, ax = plt.subplots(figsize=(max(4.0, 0.5 * len(iterations) + 2), 3))
    rewards = [[v for v in by_it[i].column("rm_score").to_pylist() if v is not None] for i in iterations]
    ax.boxplot(rewards, showmeans=True)
    ax.set_xticks(range(1, len(iterations) + 1), [str(i) for i in iterations])
    ax.set(xlabel="iteration", ylabel="reward (rm_score)", title="reward per iteration")
    rewards_png = _png(fig)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3))
    shown = sorted({iterations[0], iterations[-1]})
    for ax, column in zip(axes, ("response_length", "prompt_length")):
        for i in shown:
            ax.hist(by_it[i].column(column).to_numpy(zero_copy_only=False), bins=20, histtype="step", label=f"iteration {i}")
        ax.set(xlabel=f"{column.replace('_', ' ')} (tokens)", ylabel="rows")
        ax.legend()
    return rewards_png, _png(fig)


def _samples(table: pa.Table, iteration: int, tokenizer: Any) -> list[str]:
    """The ``#samples`` table of one iteration: its best and worst responses by reward."""
    rows = table.filter(pc.and_(pc.equal(table.column("iteration"), iteration), pc.is_valid(table.column("rm_score"))))
    ranked = rows.sort_by([("rm_score", "descending"), ("row", "ascending")]).to_pylist()
    k = min(SAMPLES, len(ranked) // 2) if len(ranked) > 1 else len(ranked)
    chosen = [("best", r) for r in ranked[:k]] + [("worst", r) for r in reversed(ranked[len(ranked) - k:])] if k else []
    out = [f'<h3>iteration {iteration}</h3><table class="samples" data-iteration="{iteration}">',
           "<tr><th></th><th>row</th><th>reward</th><th>correct</th><th>length</th><th>response</th></tr>"]
    for kind, r in chosen:
        text = str(tokenizer.decode(r["response_ids"] or [], skip_special_tokens=True))
        text = text if len(text) <= TEXT_CHARS else text[: TEXT_CHARS - 1] + "…"
        correct = "-" if r["correct"] is None else str(r["correct"]).lower()
        out.append(f'<tr class="{kind}"><td>{kind}</td><td>{r["row"]}</td><td>{r["rm_score"]:.4f}</td><td>{correct}</td>'
                   f'<td>{r["response_length"]}</td><td class="text">{html.escape(text)}</td></tr>')
    out.append("</table>")
    return out


def _head(title: str) -> str:
    return (f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{STYLE}</style></head><body>")


def empty_page(title: str = "dockrl rollouts") -> str:
    """The page of a run that kept no rollouts."""
    return _head(title) + '<p id="empty">No kept rollouts: the run ran with run.keep_rollouts=off.</p></body></html>\n'


def rollouts_page_html(kept: KeptRollouts, title: str = "dockrl rollouts") -> str:
    """The page (see the module docstring) of ``kept``; a dataset without rows gets ``empty_page``."""
    if not has_rows(kept.rows):
        return empty_page(title)
    head = _head(title)
    table = read_rollouts(kept.rows, columns=["iteration", "row", "rm_score", "correct", "response_length", "prompt_length",
                                              "response_ids"])
    iterations = sorted(pc.unique(table.column("iteration")).to_pylist())
    rewards_png, lengths_png = _figures(table, iterations)
    tokenizer = load_rollouts_tokenizer(kept)
    stats = table.group_by("iteration").aggregate([("rm_score", "mean"), ("rm_score", "min"), ("rm_score", "max"),
                                                    ("response_length", "mean"), ("row", "count")]).sort_by("iteration")
    lines = [head, f"<h2>{html.escape(title)}: {table.num_rows} rows, {len(iterations)} iteration(s)</h2>",
             f'<section id="rewards"><h3>Reward per iteration</h3><img alt="reward per iteration" src="{rewards_png}">',
             '<table id="reward-table"><tr><th>iteration</th><th>rows</th><th>mean</th><th>min</th><th>max</th>'
             "<th>mean response length</th></tr>"]
    for s in stats.to_pylist():
        lines.append(f"<tr><td>{s['iteration']}</td><td>{s['row_count']}</td>"
                     + "".join(f"<td>{'-' if s[k] is None else format(s[k], '.4f')}</td>"
                               for k in ("rm_score_mean", "rm_score_min", "rm_score_max", "response_length_mean")) + "</tr>")
    lines += ["</table></section>",
              f'<section id="lengths"><h3>Lengths</h3><img alt="length histograms" src="{lengths_png}"></section>',
              '<section id="samples"><h3>Best and worst responses</h3>']
    for i in iterations:
        lines += _samples(table, i, tokenizer)
    lines.append("</section></body></html>")
    return "\n".join(lines) + "\n"


def write_rollouts_page(kept: KeptRollouts, out: str | Path) -> Path:
    """``dockrl rollouts page``: write ``rollouts_page_html`` of ``kept`` to ``out``; returns the path."""
    path = Path(out)
    path.write_text(rollouts_page_html(kept, title=f"dockrl rollouts of {kept.run_dir or kept.root}"), encoding="utf-8")
    return path


def rollouts_page_of_folder(folder: str | Path) -> str:
    """The page of a train task's ``rollouts`` artifact folder (an empty folder: a run that kept none)."""
    root = Path(folder)
    if not any(root.rglob("*.parquet")):
        return empty_page()
    return rollouts_page_html(kept_rollouts(root))
