"""Allgather–swap across 2 and 4 processes (gloo on 127.0.0.1): inference weights equal the full weights.

One spawn per world size runs several layouts in a row (see ``sync_worker``). Each layout syncs
twice, with an optimizer step on every rank's shard before each sync, and the inference-layout
weights of every rank must equal the same steps applied to the full HF weights, bit for bit.
"""

from __future__ import annotations

import datetime
import json

import pytest
import sync_worker
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import Qwen2Config, Qwen2ForCausalLM


@pytest.fixture(scope="module")
def untied_model_dir(tmp_path_factory):
    """3 layers (an uneven 2 + 1 split over 2 stages), vocab 251 (padded on both sides), untied head."""
    torch.manual_seed(1)
    config = Qwen2Config(
        vocab_size=251, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )
    out = tmp_path_factory.mktemp("untied-qwen2")
    Qwen2ForCausalLM(config).save_pretrained(out)
    return out


def job(model_dir, tp, pp, dp, infer_tp, *, bucket_bytes=16384, copy_on_cpu=False, infer_dtype="float32"):
    return {
        "model_dir": str(model_dir), "tp": tp, "pp": pp, "dp": dp, "infer_tp": infer_tp,
        "bucket_bytes": bucket_bytes, "copy_on_cpu": copy_on_cpu, "infer_dtype": infer_dtype,
    }


def run_spawn(world_size: int, jobs: list[dict], tmp_path) -> list[list[dict]]:
    # the rendezvous store listens on a port the OS picked for it, held until the workers are done
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=120))
    mp.spawn(sync_worker.main, args=(world_size, store.port, jobs, str(tmp_path)), nprocs=world_size, join=True)
    del store
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world_size)]


def check(results: list[list[dict]], jobs: list[dict], model_names: set[str]) -> None:
    for rank, per_rank in enumerate(results):
        assert len(per_rank) == len(jobs)
        for res in per_rank:
            j = res["job"]
            where = f"rank {rank}, (tp, pp, dp) = ({j['tp']}, {j['pp']}, {j['dp']}) → infer_tp {j['infer_tp']}"
            assert len(res["syncs"]) == 2
            for i, sync in enumerate(res["syncs"]):
                assert sync["mismatches"] == [], f"{where}, sync {i + 1}: {sync['mismatches']}"
                assert sync["restored_mismatch"] == [], f"{where}, sync {i + 1}: training weights not restored"
                assert set(sync["names"]) == model_names, where  # every weight, lm_head included when tied
                assert sync["buckets"] >= 2 and sync["seconds"] > 0
                assert sync["swapped"]["weights"] > 0 and sync["swapped"]["optimizer"] > 0, where
                if j["infer_tp"] <= j["tp"] and j["pp"] == 1:
                    # training shards (about) no bigger than inference shards, swapped out bucket by bucket:
                    # the tracked peak is the inference weights plus one gathered bucket (or checksum
                    # temporaries), with 5% for the training side's larger vocab padding
                    bound = 1.05 * sync["inference_bytes"] + max(sync["largest_gathered"], 6 * sync["largest_infer"])
                    assert sync["inference_bytes"] < sync["peak"] <= bound, where
            assert res["syncs"][0]["checksums"] != res["syncs"][1]["checksums"]  # the step changed the weights
    # ranks of the same inference TP' rank hold identical inference weights: identical checksums
    for k, j in enumerate(jobs):
        by_infer_rank: dict[int, list] = {}
        for rank, per_rank in enumerate(results):
            by_infer_rank.setdefault(rank % j["infer_tp"], []).append(per_rank[k]["syncs"][1]["checksums"])
        for sums in by_infer_rank.values():
            assert all(s == sums[0] for s in sums)
        # with TP (or PP) > 1 bytes cross the wire; every rank received something
        if j["tp"] * j["pp"] > 1:
            assert all(per_rank[k]["syncs"][0]["bytes_moved"] > 0 for per_rank in results)


def hf_names(model_dir) -> set[str]:
    model = Qwen2ForCausalLM(Qwen2Config.from_pretrained(model_dir))
    return set(model.state_dict())


@pytest.mark.slow
def test_sync_two_processes(untied_model_dir, tmp_path):
    jobs = [
        job(untied_model_dir, 2, 1, 1, 1, copy_on_cpu=True),
        job(untied_model_dir, 2, 1, 1, 2),
        job(untied_model_dir, 1, 2, 1, 1, copy_on_cpu=True),
        job(untied_model_dir, 1, 1, 2, 2),
        job(untied_model_dir, 2, 1, 1, 1, infer_dtype="bfloat16", bucket_bytes=40000),  # bf16 rollout of fp32 training
    ]
    check(run_spawn(2, jobs, tmp_path), jobs, hf_names(untied_model_dir))


@pytest.mark.slow
def test_sync_four_processes(tiny_model_dir, tmp_path):
    jobs = [
        job(tiny_model_dir, 2, 2, 1, 1, copy_on_cpu=True),
        job(tiny_model_dir, 2, 2, 1, 2),
        job(tiny_model_dir, 2, 1, 2, 2),
        job(tiny_model_dir, 1, 2, 2, 2, copy_on_cpu=True),
    ]
    check(run_spawn(4, jobs, tmp_path), jobs, hf_names(tiny_model_dir))
