"""Engines receive the layout's device and keep every parameter and every dock tensor there.

Run on CPU with the ``meta`` device as the engines' device: a tensor left on the host meets a
meta tensor in some operation and torch raises "is not on the expected device", and the one
copy back to the host raises "meta tensors" — so a run that reaches that copy moved everything.
"""

from __future__ import annotations

import random

import pytest
import torch

from dockrl.config import AlgorithmConfig, load_config, resolve_auto
from dockrl.engines import factory
from dockrl.engines.hf.logprobs import response_log_probs
from dockrl.engines.hf.rollout import HFRolloutEngine
from dockrl.engines.hf.train import HFTrainEngine
from dockrl.parallel import ranks as ranks_module
from dockrl.stages import actor
from dockrl.stages.actor import accumulate_mini_batch

META = torch.device("meta")


class FakeAllOnes:
    """transformers asks whether a padding mask is all ones (a data-dependent ``.item()``, which a
    meta tensor cannot answer); this answers "no", so the masks are built as for a padded batch."""

    def __call__(self, tensor: torch.Tensor) -> bool:
        return False


@pytest.fixture
def meta_masks(monkeypatch):
    import transformers.masking_utils as masking

    monkeypatch.setattr(masking, "fast_all", FakeAllOnes())


def _placed(model: torch.nn.Module) -> set[torch.device]:
    return {t.device for t in (*model.parameters(), *model.buffers())}


def test_hf_engines_put_every_parameter_on_their_device(tiny_model_dir):
    engines = [
        HFTrainEngine(tiny_model_dir, trainable=True, device=META),
        HFTrainEngine(tiny_model_dir, trainable=False, device=META),
        HFRolloutEngine(tiny_model_dir, dtype="float32", device=META),
    ]
    for engine in engines:
        assert _placed(engine.model) == {META}
    params = dict(engines[2].model.named_parameters())
    name = next(iter(params))
    engines[2].load_weights([(name, torch.zeros(params[name].shape))])  # a host tensor lands on the device


class FakeProcessDevice:
    """Stands in for ``process_device`` on a node with accelerators: records what it was asked
    for and answers with the meta device."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def __call__(self, kind: str, local_rank: int = 0) -> torch.device:
        self.calls.append((kind, local_rank))
        return META


def test_the_factory_builds_every_engine_on_the_process_device(tiny_model_dir, monkeypatch):
    fake = FakeProcessDevice()
    monkeypatch.setattr(ranks_module.devices, "process_device", fake)
    cfg = resolve_auto(load_config(None, [f"model.path={tiny_model_dir}", "parallel.device=cuda", "rollout.dtype=float32"]))
    ranks = factory.process_ranks(cfg, trains=True)  # the hf actor: alone on its device, chosen once
    assert fake.calls == [("cuda", 0)] and ranks.device == META and ranks.model_group is None
    engines = [
        factory.build_train_engine(cfg, tiny_model_dir, ranks),
        factory.build_reference_engine(cfg, tiny_model_dir, ranks),
        factory.build_rollout_engine(cfg, tiny_model_dir, ranks),
    ]
    assert fake.calls == [("cuda", 0)]
    for engine in engines:
        assert engine.device == META and _placed(engine.model) == {META}


def _batch(vocab: int, pad: int, n: int = 8, seed: int = 0) -> dict[str, list]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 9))] for _ in range(n)]
    responses = [[rng.randrange(3, vocab) for _ in range(rng.randint(1, 7))] + [pad] for _ in range(n)]
    return {
        "prompt_ids": prompts, "response_ids": responses, "advantages": [rng.uniform(-1, 1) for _ in range(n)],
        "old_log_prob": [[-1.0] * len(r) for r in responses], "ref_log_prob": [[-1.1] * len(r) for r in responses],
    }


def test_log_probs_and_the_update_compute_on_the_device(tiny_model_dir, meta_masks):
    engine = HFTrainEngine(tiny_model_dir, trainable=True, device=META)
    batch = _batch(len(engine.tokenizer), engine.pad_id)
    out = response_log_probs(engine.model, batch["prompt_ids"], batch["response_ids"], pad_id=engine.pad_id,
                             temperature=0.7, autocast_bf16=False, with_entropy=True)
    assert {t.device for t in out} == {META}
    with pytest.raises(NotImplementedError, match="copy out of meta tensor"):  # the one copy of the whole call to the host
        engine.log_probs(batch["prompt_ids"], batch["response_ids"], temperature=0.7, micro_batch=4)
    algo = AlgorithmConfig(kl_loss_coef=0.1)
    # the dock's columns (advantages, old and reference log-probs) go to the device with the batch:
    # the first micro-batch runs through the forward pass and the loss up to the statistics' one host copy
    with pytest.raises(NotImplementedError, match="copy out of meta tensor"):
        accumulate_mini_batch(engine, batch, algo=algo, temperature=0.7, micro_batch=4)


class FakeHostColumns(actor.DeviceColumns):
    """The bug the test above guards against: dock columns left in host memory."""

    def get(self, device: torch.device) -> dict[str, torch.Tensor]:
        return super().get(torch.device("cpu"))


def test_a_dock_column_left_on_the_host_fails_on_the_device(tiny_model_dir, meta_masks, monkeypatch):
    engine = HFTrainEngine(tiny_model_dir, trainable=True, device=META)
    monkeypatch.setattr(actor, "DeviceColumns", FakeHostColumns)
    with pytest.raises(RuntimeError, match="is not on the expected device meta"):
        accumulate_mini_batch(engine, _batch(len(engine.tokenizer), engine.pad_id), algo=AlgorithmConfig(kl_loss_coef=0.1),
                              temperature=0.7, micro_batch=4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
def test_asking_for_a_gpu_where_there_is_none_fails_naming_the_field(tiny_model_dir):
    cfg = load_config(None, [f"model.path={tiny_model_dir}", "parallel.device=cuda"])  # a launcher may write it for GPU pods
    for trains in (True, False):
        with pytest.raises(RuntimeError, match=r"parallel.device='cuda': no cuda device is available.*Fix"):
            factory.process_ranks(cfg, trains=trains)


def test_a_vllm_build_for_another_device_kind_is_refused():
    from dockrl.engines.vllm.setup import check_platform

    check_platform("cpu", torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"installed vLLM runs on 'cpu'.*parallel.device='cuda'.*install vllm on this node"):
        check_platform("cpu", torch.device("cuda", 0))
