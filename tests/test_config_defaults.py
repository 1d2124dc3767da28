"""One source for defaults: config/schema.yaml. TrainConfig (the trainer's own defaults, for callers without the
workflow) agrees with it key for key; config/config.yaml, the embedded CPU-sized run, departs from a default only
where the comment above the key says why, marked ``CPU:``."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import yaml

from dflash_pipeline.train import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = yaml.safe_load((ROOT / "config" / "schema.yaml").read_text())


def test_train_config_defaults_are_the_schema_defaults():
    schema = SCHEMA["properties"]["train"]["properties"]
    fields = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    assert fields.keys() == schema.keys()
    differ = {key: (value, schema[key].get("default")) for key, value in fields.items()
              if value != schema[key].get("default")}
    assert not differ, f"TrainConfig default != config/schema.yaml default: {differ}"


def key_comments(text: str) -> dict[tuple[str, ...], str]:
    """Path of each key of a YAML file -> the comment lines right above it."""
    comments, stack, block = {}, [], []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            block.append(stripped)
            continue
        match = re.match(r"( *)([A-Za-z_][\w-]*):", line)
        if match:
            depth = len(match[1]) // 2
            stack = stack[:depth] + [match[2]]
            comments[tuple(stack)] = "\n".join(block)
        block = []
    return comments


def overrides(config, schema, path=()) -> list[tuple[str, ...]]:
    """The paths of the leaves of ``config`` whose value is not the schema's default."""
    found = []
    for key, value in config.items():
        spec = schema.get("properties", {}).get(key, {})
        if isinstance(value, dict) and "properties" in spec:
            found += overrides(value, spec, (*path, key))
        elif isinstance(value, dict) and isinstance(spec.get("default"), dict):  # e.g. evaluate.benchmarks
            default = spec["default"]
            found += [(*path, key, name, leaf) for name, settings in value.items()
                      for leaf, v in settings.items() if default.get(name, {}).get(leaf, v) != v]
        elif "default" in spec and value != spec["default"]:
            found.append((*path, key))
    return found


def test_config_yaml_overrides_a_default_only_where_it_says_why():
    text = (ROOT / "config" / "config.yaml").read_text()
    comments = key_comments(text)
    found = overrides(yaml.safe_load(text), SCHEMA)
    assert ("train", "epochs") in found and ("evaluate", "benchmarks", "mt_bench", "limit") in found  # not vacuous
    silent = [".".join(path) for path in found
              if not any("CPU:" in comments.get(path[:n], "") for n in range(len(path), 1, -1))]
    assert not silent, f"config/config.yaml departs from config/schema.yaml's default without a 'CPU:' reason: {silent}"


def test_the_gpu_smoke_overlays_validate_over_the_quality_example():
    """benchmarks/smoke/gpu_smoke.sh merges gpu_smoke.yaml and then an overlay (streamed, the fast step, no prompt
    lookup) over the quality example: each result is a valid config, so the GPU run cannot stop on a misspelt key."""
    from snakemake.utils import update_config, validate

    from workflow_helpers import example_config

    overlays = sorted((ROOT / "benchmarks" / "smoke").glob("gpu_smoke_*.yaml"))
    assert {path.name for path in overlays} >= {"gpu_smoke_streamed.yaml", "gpu_smoke_fast_step.yaml",
                                                "gpu_smoke_no_lookup.yaml"}
    configs = {}
    for overlay in overlays:
        configs[overlay.name] = config = example_config("smollm2-quality.yaml")
        for path in (ROOT / "benchmarks" / "smoke" / "gpu_smoke.yaml", overlay):
            update_config(config, yaml.safe_load(path.read_text()))
        validate(config, str(ROOT / "config" / "schema.yaml"))
    fast = configs["gpu_smoke_fast_step.yaml"]["train"]
    assert fast["compile_layers"] and fast["flex_kernel_options"] == {"BLOCK_M": 64, "BLOCK_N": 64}
    assert configs["gpu_smoke_no_lookup.yaml"]["evaluate"]["prompt_lookup"] is False
