"""What reruns a job (rules/common.smk, ``result_settings``): a rule's params hold only what its result depends on,
so changing a runtime key (threads, logging, speed knobs, the GPU count) plans no job, and changing a result key
does. Dry runs over a workflow whose outputs Snakemake has recorded as made (``--touch`` over placeholder files):
seconds, nothing computed."""

from __future__ import annotations

import re

import pytest
from workflow_helpers import default_config, scheduled_jobs, snakemake, write_config

from dflash_pipeline.config import RUNTIME_KEYS, result_settings


@pytest.fixture
def recorded(tmp_path):
    """A workdir of the default config whose every output exists and is recorded by Snakemake as made (its
    params included): a dry run plans nothing."""
    config = default_config()
    write_config(tmp_path, config)
    dry = snakemake(tmp_path, "-n", "all")
    outputs = {name.strip() for line in re.findall(r"^\s+output: (.*)$", dry.stdout + dry.stderr, re.M)
               for name in line.split(",")}
    assert "results/store.zarr" in outputs and "results/drafter" in outputs
    for name in outputs:
        path = tmp_path / name
        if path.suffix in ("", ".zarr"):  # the directory outputs: drafters, stores, the basis
            path.mkdir(parents=True, exist_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch()
    snakemake(tmp_path, "--touch", "all")
    assert scheduled_jobs(tmp_path, "all") == {}
    return tmp_path, config


def test_runtime_keys_rerun_no_job(recorded):
    workdir, config = recorded
    config["extract"]["threads"] = 3
    config["extract"]["io_threads"] = 2
    config["train"]["log_every"] = 7
    config["train"]["threads"] = 3
    config["train"]["num_workers"] = 1
    config["evaluate"]["processes"] = 2
    config["evaluate"]["threads"] = 1
    config["regenerate"]["threads"] = 1
    config["gpu"]["count"] = 3
    write_config(workdir, config)
    assert scheduled_jobs(workdir, "all") == {}


@pytest.mark.parametrize("section, key, value, reruns", [
    ("extract", "chunk_tokens", 128, {"extract", "merge", "train"}),
    ("train", "lr", 1e-3, {"train", "evaluate_part"}),
])
def test_result_keys_rerun_their_jobs(recorded, section, key, value, reruns):
    workdir, config = recorded
    config[section][key] = value
    write_config(workdir, config)
    assert reruns <= set(scheduled_jobs(workdir, "all"))


def test_result_settings_leave_out_the_runtime_keys_nested_ones_too():
    config = default_config()
    assert set(result_settings(config, "train")) == set(config["train"]) - set(RUNTIME_KEYS["train"])
    regenerate = result_settings(config, "regenerate")
    assert "threads" not in regenerate and regenerate["max_new_tokens"] == config["regenerate"]["max_new_tokens"]
    assert set(regenerate["server"]) == {"url", "model"}
    assert "concurrency" in config["regenerate"]["server"]  # the config itself is untouched
