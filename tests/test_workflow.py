"""The workflow end to end on the real SmolLM2 target: prepare → tokenize → extract → merge.

One small run is shared by the tests of this module; each later test changes it the way a user would
(deleting an output, killing a job) and checks that the same command repairs exactly what is missing.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from dflash_pipeline.store import HiddenStateStore
from dflash_pipeline.target import load_target
from workflow_helpers import default_config, scheduled_jobs, snakemake, snakemake_command, write_config

STORE = "results/store.zarr"
TARGET = "store"  # the rule that asks for the store and every shard in it


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
    config["data"]["max_conversations"] = 24
    config["target"]["path"] = str(smollm2_dir)
    config["tokenize"]["max_length"] = 160
    config["extract"]["tokens_per_batch"] = 320
    config["gpu"] = {"count": 2}  # a fake device count: the lease hands out "GPUs" 0 and 1 on this CPU machine
    write_config(workdir, config)
    snakemake(workdir, TARGET)
    return workdir


def extract_intervals(workdir: Path) -> list[tuple[datetime, datetime, str]]:
    intervals = []
    for log in sorted((workdir / "results/logs/extract").glob("*.log")):
        text = log.read_text()
        start = re.search(r"^(\S+ \S+) INFO .*leased GPUs: (\S+)\)", text, re.M)
        end = re.findall(r"^(\S+ \S+) INFO .* tok/s", text, re.M)
        parse = lambda stamp: datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f")  # noqa: E731
        intervals.append((parse(start[1]), parse(end[-1]), start[2]))
    return intervals


def test_two_extract_jobs_run_at_once_on_distinct_leased_devices(workdir):
    intervals = extract_intervals(workdir)
    assert len(intervals) == 4
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


def _job_pids(workdir: Path, rule: str) -> list[int]:
    """Processes running a script job of ``rule`` for this workdir (Snakemake runs it as
    ``<workdir>/.snakemake/scripts/tmpXXXX.<rule>.py``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if f"{workdir}/.snakemake/scripts/" in cmdline and f".{rule}.py" in cmdline:
                pids.append(int(entry.name))
    return pids


def test_sigkill_of_an_extract_job_then_the_same_command_restores_the_identical_store(workdir):
    before = store_arrays(workdir)
    shard = workdir / "results/extract/shard_00002.zarr"
    shutil.rmtree(shard)
    run = subprocess.Popen(snakemake_command(workdir, TARGET), cwd=workdir, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    deadline, killed = time.time() + 300, []
    while time.time() < deadline and not killed:
        partial = Path(str(shard) + ".tmp")
        if partial.exists() and any((partial / "features").glob("c/*")):  # some feature chunks are written
            killed = _job_pids(workdir, "extract")
            for pid in killed:
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    assert killed, "the extract job was never seen writing"
    assert run.wait(timeout=300) != 0
    assert not shard.exists()  # nothing half-written looks complete
    snakemake(workdir, TARGET)
    assert shard.exists() and scheduled_jobs(workdir) == {}
    assert_same_arrays(before, store_arrays(workdir))
