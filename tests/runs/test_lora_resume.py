"""A LoRA run (``trainer.lora``) resumes: the actor starts from the base weights of ``model.path`` with the
checkpoint's adapter and the adapters' optimizer state, the rollout copy loads the same adapter, and
the resumed run ends where the uninterrupted one does."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from test_resume import FAKES, Interrupt, read_rows, same_rows, tiny_run

from dockrl import driver
from dockrl.engines.hf.lora import ADAPTER_DIR
from dockrl.checkpoint.resume import checkpoint_dir, final_dir

LORA = ("trainer.lora.rank=4", "trainer.lora.alpha=8", "rollout.engine=hf", "rollout.dtype=bfloat16")
"""A bf16 rollout copy: it holds the base weights and the adapters, and each sync sends the adapter alone."""


@pytest.mark.slow  # three short runs of the tiny model
def test_an_interrupted_lora_run_resumes_to_the_uninterrupted_result(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(FAKES))
    driver.train(tiny_run(tiny_model_dir, tmp_path, "straight", *LORA))

    def stop_in_iteration_2(it: int, metrics: dict) -> None:
        if it == 2:
            raise Interrupt

    with pytest.raises(Interrupt):
        driver.train(tiny_run(tiny_model_dir, tmp_path, "cut", *LORA), on_iteration=stop_in_iteration_2)
    cut = tmp_path / "cut"
    assert (checkpoint_dir(cut, 2) / ADAPTER_DIR / "adapter_model.safetensors").is_file()
    driver.train(tiny_run(tiny_model_dir, tmp_path, "cut", *LORA, "run.resume=latest"))
    rows = read_rows(cut)
    same_rows(rows, read_rows(tmp_path / "straight"))  # the rollout sampled with the resumed adapter, the actor stepped on
    adapter = load_file(final_dir(cut) / ADAPTER_DIR / "adapter_model.safetensors")
    straight = load_file(final_dir(tmp_path / "straight") / ADAPTER_DIR / "adapter_model.safetensors")
    assert adapter.keys() == straight.keys()
    for name, t in straight.items():
        torch.testing.assert_close(adapter[name], t, rtol=1e-5, atol=1e-6, msg=name)
    numel = sum(t.numel() for t in adapter.values())
    assert all(r["weight_sync/bytes"] == numel * 4 for r in rows)  # fp32 adapter tensors, nothing else
