"""``dockrl export`` of a LoRA run's checkpoint: the adapter folder, and with ``--merge`` the merged HF
weights, which reload with the trained policy's logits (fp32, 1e-5)."""

from __future__ import annotations

import json

import torch
from engines.test_lora import logits, lora_engine, update
from peft import PeftModel
from transformers import AutoModelForCausalLM

from dockrl.cli import main
from dockrl.engines.hf.train import HFTrainEngine


def test_export_merge_writes_the_adapter_and_merged_weights_that_reload_equal(tiny_model_dir, tmp_path, capsys):
    actor = lora_engine(tiny_model_dir)
    update(actor)
    checkpoint = actor.save(tmp_path / "ckpt")
    out = tmp_path / "merged"
    assert main(["export", str(checkpoint), str(out), "--dtype", "float32", "--merge"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["adapter"] == "adapter" and info["adapter_parameters"] == sum(p.numel() for n, p in actor.model.named_parameters()
                                                                              if ".lora_" in n)
    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    torch.testing.assert_close(logits(merged), logits(actor.model), atol=1e-5, rtol=0)
    over_base = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32), out / "adapter")
    torch.testing.assert_close(logits(over_base), logits(actor.model), atol=1e-5, rtol=0)
    assert (out / "tokenizer_config.json").is_file()


def test_export_without_merge_writes_the_adapter_alone(tiny_model_dir, tmp_path, capsys):
    actor = lora_engine(tiny_model_dir)
    update(actor)
    out = tmp_path / "adapter-only"
    assert main(["export", str(actor.save(tmp_path / "ckpt")), str(out)]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "peft-adapter"
    assert (out / "adapter" / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()


def test_export_of_a_full_checkpoint_gives_its_weights(tiny_model_dir, tmp_path, capsys):
    full = HFTrainEngine(tiny_model_dir, trainable=False).save(tmp_path / "ckpt")
    out = tmp_path / "full"
    assert main(["export", str(full), str(out), "--dtype", "float32"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "safetensors" and not (out / "adapter").exists()
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)),
                               logits(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)), atol=0, rtol=0)
