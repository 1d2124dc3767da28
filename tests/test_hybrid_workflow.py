"""The whole default workflow, prepare -> evaluate, on CPU with a tiny random hybrid target.

The target is the ``qwen3_5_vl_dir`` fixture: a local ``Qwen3_5ForConditionalGeneration`` checkpoint
(Gated-DeltaNet + full attention, vision tower and MTP tensors, SmolLM2's tokenizer). Everything is sized
down (12 conversations of at most 96 tokens, 2 shards, one short epoch of a 1-layer drafter, 2 MT-Bench
prompts x 16 new tokens) so that ``snakemake`` with the default target (``all``) takes 1-2.5 minutes on
2 cores (mostly job start-up: imports and model loading).
"""

from __future__ import annotations

import json

from workflow_helpers import default_config, scheduled_jobs, snakemake, write_config

from dflash_pipeline.store import HiddenStateStore


def test_default_workflow_on_a_tiny_hybrid_target_is_lossless(tmp_path, qwen3_5_vl_dir):
    config = default_config()
    config["data"]["max_conversations"] = 12
    config["target"]["path"] = str(qwen3_5_vl_dir)
    config["tokenize"].update(num_shards=2, max_length=96)
    config["extract"]["tokens_per_batch"] = 384
    # the original answers: a random-weight target's own would be noise (regenerate: tests/test_workflow.py)
    config["regenerate"]["enabled"] = False
    config["gpu"] = {"count": 2}  # a fake device count: the lease hands out "GPUs" 0 and 1 on this CPU machine
    config["train"].update(epochs=1, num_layers=1, max_anchors=4, val_max_anchors=4, tokens_per_batch=384,
                           checkpoint_every=1000)
    config["evaluate"]["benchmarks"]["mt_bench"].update(limit=2, max_new_tokens=16)
    write_config(tmp_path, config)

    snakemake(tmp_path)  # the default target: store, drafter and every benchmark's evaluation
    assert scheduled_jobs(tmp_path, "all") == {}

    store = HiddenStateStore(tmp_path / "results/store.zarr")
    assert len(store) >= 8 and store.attrs["layer_ids"] == [1, 2, 3, 4, 5]  # K=5 ids from 1 to L-3 for L=8
    drafter = json.loads((tmp_path / "results/drafter/config.json").read_text())
    assert drafter["architectures"] == ["DFlashDraftModel"] and drafter["num_target_layers"] == 8
    result = json.loads((tmp_path / "results/evaluate/mt_bench/result.json").read_text())
    assert result["lossless"] is True and result["num_prompts"] == 2 and "stateful" in result["prompt_lookup_skipped"]
    assert all(row["tokens"] == 16 and row["matches_ar"] for row in result["rows"])
    assert result["verify_steps"] >= 2 and sum(result["accepted_length_histogram"]) == result["verify_steps"]

    # the jobs ran the hybrid model, text-only from the vision-language checkpoint
    logs = [*sorted((tmp_path / "results/logs/extract").glob("*.log")), tmp_path / "results/logs/evaluate/mt_bench/final/part_000.log"]
    assert len(logs) == 3
    for log in logs:
        text = log.read_text()
        assert "loaded the language model only" in text and "Qwen3_5ForCausalLM" in text, log
        assert "Gated-DeltaNet layers on cpu" in text, log
