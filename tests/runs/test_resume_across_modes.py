"""A checkpoint holds one dock snapshot format: a run cut in one ``dock.mode`` resumes in the other.

Each cut run stops once iteration 2's metrics are written (the checkpoint after iteration 1 holds
iteration 2 open with its prompts) and resumes in the other mode; the result is the uninterrupted
run's, to fp32 rounding, whichever mode ran which iterations.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_distributed import workers_path  # noqa: F401 - fixture: fake scorers importable, no process left behind
from test_distributed_resume import VARYING, metric_close, read_rows, run_config
from transformers import AutoModelForCausalLM

from dockrl import driver
from dockrl.checkpoint.resume import checkpoint_dir


class Interrupt(Exception):
    pass


def same_learning(a: list[dict], b: list[dict]) -> None:
    """Equal iteration indexes; the learning metrics (reward, rollout, actor) equal to fp32 rounding.

    The weight sync's counters differ between the modes (one process copies tensors, two send buckets).
    """
    assert [x["iteration"] for x in a] == [x["iteration"] for x in b]
    for x, y in zip(a, b):
        keys = [k for k in x if k.startswith(("reward/", "rollout/", "actor/")) and not k.startswith(VARYING)]
        assert len(keys) > 10 and set(keys) <= set(y)
        for k in keys:
            assert metric_close(k, x[k], y[k]), (x["iteration"], k, x[k], y[k])


def stop_in_iteration_2(it: int, metrics: dict) -> None:
    if it == 2:  # its metrics line is written, the checkpoint after iteration 1 is complete
        raise Interrupt


SCORER = "algorithm.scorer=fake_scorers:FakeHashScorer"


@pytest.fixture(scope="module")
def straight(tiny_model_dir, tmp_path_factory) -> Path:
    """The folder of the uninterrupted in-process run both directions are compared with: run once."""
    out = tmp_path_factory.mktemp("uninterrupted")
    driver.train(run_config(tiny_model_dir, out, "straight", SCORER, "dock.mode=inprocess"))
    return out / "straight"


@pytest.mark.slow  # two runs of the tiny model, one of them distributed, and the module's uninterrupted one: ~1-2 min on 2 busy cores
@pytest.mark.parametrize(("first", "then"), [("inprocess", "distributed"), ("distributed", "inprocess")])
def test_a_run_cut_in_one_dock_mode_resumes_in_the_other(first, then, tiny_model_dir, tmp_path, workers_path, straight):  # noqa: F811
    with pytest.raises(Interrupt):
        driver.train(run_config(tiny_model_dir, tmp_path, "cut", SCORER, f"dock.mode={first}"), on_iteration=stop_in_iteration_2)
    cut = tmp_path / "cut"
    meta = json.loads((checkpoint_dir(cut, 2) / "dock" / "meta.json").read_text())
    assert meta["layout"]["iteration"] == 2 and len(meta["shards"]) == 2  # iteration 2 open on both shards

    driver.train(run_config(tiny_model_dir, tmp_path, "cut", SCORER, f"dock.mode={then}", "run.resume=latest"))
    same_learning(read_rows(cut), read_rows(straight))
    resumed = AutoModelForCausalLM.from_pretrained(cut / "checkpoints" / "final").state_dict()
    for name, p in AutoModelForCausalLM.from_pretrained(straight / "checkpoints" / "final").state_dict().items():
        torch.testing.assert_close(resumed[name], p, rtol=1e-5, atol=1e-6, msg=name)
