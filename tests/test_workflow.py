"""The workflow end to end on the real SmolLM2 target: prepare → regenerate → tokenize → extract → merge.

One small run is shared by the tests of this module; each later test changes it the way a user would
(deleting an output, killing a job) and checks that the same command repairs exactly what is missing.
"""

from __future__ import annotations

import json
import re
import shutil
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from dflash_pipeline.store import HiddenStateStore
from dflash_pipeline.target import load_target
from workflow_helpers import (default_config, example_config, kill_job_when, scheduled_jobs, snakemake,
                              start_snakemake, write_config)

STORE = "results/store.zarr"
TARGET = "store"  # the rule that asks for the store and every shard in it
SHARDS = 2  # two regenerate, tokenize and extract jobs: one at a time on each fake GPU


def store_arrays(workdir: Path) -> dict[str, np.ndarray]:
    root = zarr.open_group(str(workdir / STORE), mode="r")
    arrays = {"sample_offsets": root["sample_offsets"][:]}
    for name, shard in root["shards"].groups():
        for array in ("input_ids", "loss_mask", "sample_offsets", "features"):
            arrays[f"{name}/{array}"] = shard[array][:]
    return arrays


def assert_same_arrays(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for name in before:
        assert np.array_equal(before[name], after[name]), name


@pytest.fixture(scope="module")
def workdir(tmp_path_factory, smollm2_dir):
    workdir = tmp_path_factory.mktemp("workflow")
    config = default_config()
    config["data"]["max_conversations"] = 16
    config["target"]["path"] = str(smollm2_dir)
    config["tokenize"].update(num_shards=SHARDS, max_length=160)
    config["extract"]["tokens_per_batch"] = 320
    # regenerate on, as in the default; small batches so that a killed job has finished batches to resume from
    # (one thread each: two run at once on the two fake GPUs, as extract jobs do)
    config["regenerate"].update(max_new_tokens=16, max_prompt_tokens=144, batch_size=2, threads=1)
    config["gpu"] = {"count": 2}  # a fake device count: the lease hands out "GPUs" 0 and 1 on this CPU machine
    write_config(workdir, config)
    snakemake(workdir, TARGET)
    return workdir


def gpu_job_intervals(workdir: Path) -> list[tuple[datetime, datetime, str]]:
    """When each regenerate and extract job held its leased device, and which device."""
    intervals = []
    logs = sorted(workdir.glob("results/logs/regenerate/*.log")) + sorted(workdir.glob("results/logs/extract/*.log"))
    for log in logs:
        text = log.read_text()
        start = re.search(r"^(\S+ \S+) INFO .*leased GPUs: (\S+)\)", text, re.M)
        end = re.findall(r"^(\S+ \S+) INFO .* tok/s", text, re.M)
        parse = lambda stamp: datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f")  # noqa: E731
        intervals.append((parse(start[1]), parse(end[-1]), start[2]))
    return intervals


def test_two_gpu_jobs_run_at_once_on_distinct_leased_devices(workdir):
    # regenerate and extract jobs (gpu=1 each): since regenerate shrank the samples, extract jobs alone are
    # too short to be sure to overlap; two regenerate jobs start together after prepare
    intervals = gpu_job_intervals(workdir)
    assert len(intervals) == 2 * SHARDS
    overlapping = [(a, b) for i, a in enumerate(intervals) for b in intervals[i + 1 :] if a[0] < b[1] and b[0] < a[1]]
    assert overlapping, intervals
    assert all(a[2] != b[2] for a, b in overlapping)


def test_stored_features_equal_output_hidden_states_of_each_sample_alone(workdir, smollm2_dir):
    store = HiddenStateStore(workdir / STORE)
    layer_ids = store.attrs["layer_ids"]
    assert layer_ids == [1, 8, 14, 20, 27]
    model = load_target(str(smollm2_dir))
    assert len(store) >= 8
    worst = 0.0
    for i in range(len(store)):
        input_ids, loss_mask, features = store[i]
        assert loss_mask.sum() >= 2
        with torch.no_grad():
            hidden = model(input_ids[None], output_hidden_states=True).hidden_states
        for k, layer in enumerate(layer_ids):
            reference = hidden[layer + 1][0]
            worst = max(worst, float((features[:, k] - reference).abs().max() / reference.abs().max()))
    assert worst <= 1e-5


def test_deleting_one_extract_output_reruns_exactly_that_job_and_merge(workdir):
    before = store_arrays(workdir)
    shutil.rmtree(workdir / "results/extract/shard_00001.zarr")
    assert scheduled_jobs(workdir) == {"extract": 1, "merge": 1, "store": 1}
    snakemake(workdir, TARGET)
    assert scheduled_jobs(workdir) == {}
    assert_same_arrays(before, store_arrays(workdir))


def test_tokenize_reads_the_regenerated_conversations_and_the_counts_add_up(workdir):
    from dflash_pipeline.tokenization import read_tokenized

    prepared = [json.loads(line) for line in (workdir / "results/prepare/conversations.jsonl").open()]
    for shard in range(SHARDS):
        counts = dict(line.split("\t") for line in (workdir / f"results/regenerate/shard_{shard:05d}.counts.tsv")
                      .read_text().splitlines()[1:])
        counts = {key: int(value) for key, value in counts.items()}
        assert counts["succeeded"] + counts["failed"] + counts["skipped"] == counts["input"] > 0
        regenerated = [json.loads(line) for line in (workdir / f"results/regenerate/shard_{shard:05d}.jsonl").open()]
        assert len(regenerated) == counts["succeeded"] > 0
        assert not (workdir / f"results/regenerate/shard_{shard:05d}.partial.jsonl").exists()
        for record in regenerated:  # one regenerated answer: the original conversation's is gone
            original = next(r for r in prepared if r["id"] == record["id"])
            assert record["messages"][-1]["role"] == "assistant"
            assert sum(m["role"] == "assistant" for m in record["messages"]) == 1
            assert record["messages"][-1] not in original["messages"]
        tokenized = read_tokenized(workdir / f"results/tokenize/shard_{shard:05d}.parquet")
        assert set(tokenized["id"]) <= {r["id"] for r in regenerated}
    assert sum(1 for _ in (workdir / "results/regenerate").glob("shard_*.jsonl")) == SHARDS


def test_sigkill_of_an_extract_job_then_the_same_command_restores_the_identical_store(workdir):
    before = store_arrays(workdir)
    shard = workdir / "results/extract/shard_00001.zarr"
    shutil.rmtree(shard)
    run = start_snakemake(workdir, TARGET)
    partial = Path(str(shard) + ".tmp")
    killed = kill_job_when(run, workdir, "extract",  # once some feature chunks are written
                            lambda: partial.exists() and any((partial / "features").glob("c/*")))
    assert killed, "the extract job was never seen writing"
    assert run.wait(timeout=300) != 0
    assert not shard.exists()  # nothing half-written looks complete
    snakemake(workdir, TARGET)
    assert shard.exists() and scheduled_jobs(workdir) == {}
    assert_same_arrays(before, store_arrays(workdir))


def test_sigkill_of_a_regenerate_job_then_the_same_command_resumes_from_its_finished_batches(workdir):
    before, output = store_arrays(workdir), workdir / "results/regenerate/shard_00001.jsonl"
    expected = output.read_bytes()
    output.unlink()  # and what is made of it: as if the run had been killed while regenerating shard 2
    (workdir / "results/tokenize/shard_00001.parquet").unlink()
    shutil.rmtree(workdir / "results/extract/shard_00001.zarr")
    partial = workdir / "results/regenerate/shard_00001.partial.jsonl"
    assert scheduled_jobs(workdir) == {"regenerate": 1, "tokenize": 1, "extract": 1, "merge": 1, "store": 1}
    run = start_snakemake(workdir, TARGET)
    # once the header and a batch of 2 replies are written
    killed = kill_job_when(run, workdir, "regenerate",
                            lambda: partial.exists() and len(partial.read_text().splitlines()) >= 3)
    assert killed, "the regenerate job was never seen writing"
    assert run.wait(timeout=300) != 0
    assert not output.exists() and partial.exists()  # nothing half-written looks complete; the replies are kept
    snakemake(workdir, TARGET)
    log = (workdir / "results/logs/regenerate/shard_00001.log").read_text()
    resumed = re.search(r"resuming with (\d+) recorded replies", log)
    assert resumed and int(resumed[1]) >= 2, log[-2000:]
    assert "turn 1 batch 1/" not in log  # the first batch was not generated again
    assert output.read_bytes() == expected and not partial.exists()
    assert scheduled_jobs(workdir) == {}
    assert_same_arrays(before, store_arrays(workdir))


def test_smollm2_quality_example_config_validates():
    """The one-H200 quality recipe merges over the default config and passes the schema (as --configfile does)."""
    config = example_config("smollm2-quality.yaml")
    assert config["gpu"]["count"] == 1 and config["evaluate"]["parts"] == 1 and config["train"]["gpus"] == 1
    assert config["regenerate"]["enabled"] and config["target"]["dtype"] == "float32"
    assert config["data"]["max_conversations"] is None and config["train"]["epochs"] == 4
    assert config["train"]["optimizer"] == "muon" and config["train"]["tokens_per_batch"] == 4096
