from pathlib import Path

from dflash_pipeline.resources import resolve_path

SHARDS = [f"{i:05d}" for i in range(config["tokenize"]["num_shards"])]


wildcard_constraints:
    shard=r"\d{5}",


def target_source():
    """The target as rules load it: a converted GGUF under results/, else the configured path or hub id."""
    path = config["target"]["path"]
    if path.endswith(".gguf"):
        return "results/target"
    if path.startswith("pkg:") or Path(path).exists():
        return str(resolve_path(path))
    return path


def target_input(wildcards):
    """The target as an input file, where it is a file (hub ids are not)."""
    source = target_source()
    return [source] if Path(source).exists() or source == "results/target" else []
