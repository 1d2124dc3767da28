"""What the rules' params hold. What reruns a job (rules/common.smk, ``result_settings``): only what its result
depends on, so changing a runtime key (threads, logging, speed knobs, the GPU count) plans no job, and changing a
result key does. What reaches a job: regenerate.thinking renders the evaluation's prompts as it rendered the
training data's. Dry runs over a workflow whose outputs Snakemake has recorded as made (``--touch`` over placeholder
files, params recorded): seconds, nothing computed."""

from __future__ import annotations

import base64
import json
import re
from collections import Counter
from pathlib import Path

import pytest
from workflow_helpers import default_config, scheduled_jobs, snakemake, write_config

from dflash_pipeline.config import RUNTIME_KEYS, result_settings


def record(tmp_path: Path, config: dict) -> None:
    """Make every output of ``config``'s workflow in ``tmp_path`` exist and be recorded by Snakemake as made (its
    params included): a dry run plans nothing."""
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


def recorded_params(workdir: Path, rule: str) -> dict[str, list[str]]:
    """Output -> the params Snakemake recorded for it (their reprs), for every output of ``rule``."""
    found = {}
    for path in (workdir / ".snakemake" / "metadata").iterdir():
        record = json.loads(path.read_text())
        if record["rule"] == rule:
            found[base64.urlsafe_b64decode(path.name).decode()] = record["params"]
    return found


@pytest.fixture
def recorded(tmp_path):
    config = default_config()
    record(tmp_path, config)
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


def test_regenerate_thinking_reaches_every_evaluate_part_job(tmp_path):
    """The params of each evaluate_part job (the final drafter's and a snapshot's) with regenerate.thinking false
    are those without it but for one value: None (the template's default) became False."""
    params = {}
    for thinking in (None, False):
        config = default_config()
        config["regenerate"]["thinking"] = thinking
        config["train"]["snapshots"] = [50]  # the tau curve's parts too
        (tmp_path / str(thinking)).mkdir()
        record(tmp_path / str(thinking), config)
        params[thinking] = recorded_params(tmp_path / str(thinking), "evaluate_part")
    assert {Path(name).parent.name for name in params[False]} == {"final", "50pct"}
    assert params[False].keys() == params[None].keys()
    for name in params[False]:
        with_switch, without = Counter(params[False][name]), Counter(params[None][name])
        assert (with_switch - without, without - with_switch) == ({"False": 1}, {"None": 1}), name
