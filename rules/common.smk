import json
from pathlib import Path

from snakemake.exceptions import WorkflowError

from dflash_pipeline.resources import resolve_path

SHARDS = [f"{i:05d}" for i in range(config["tokenize"]["num_shards"])]
# drafter snapshots after these percentages of the training steps (train.snapshots)
SNAPSHOTS = [f"{p}pct" for p in sorted(config["train"]["snapshots"] or [])]
# evaluate jobs per benchmark and drafter (evaluate.parts)
PARTS = [f"{i:03d}" for i in range(config["evaluate"]["parts"])]


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


def compact_basis(wildcards=None):
    """The compact store's basis file (extract.store_dtype: compact): an input of every extract job and of merge."""
    if config["extract"]["store_dtype"] == "compact":
        return ["results/compact/basis.zarr"]
    return []


def target_input(wildcards):
    """The target as an input file, where it is a file (hub ids are not)."""
    source = target_source()
    return [source] if Path(source).exists() or source == "results/target" else []


def _gguf_block_count(path):
    """``<architecture>.block_count`` from a GGUF file's header, read up to that key (no tensor is touched)."""
    import struct

    # GGUF value types: 0..7 and 10..12 are scalars (struct codes below), 8 string, 9 array
    scalars = dict(zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd"))
    with open(path, "rb") as f:

        def read(fmt):
            return struct.unpack(f"<{fmt}", f.read(struct.calcsize(f"<{fmt}")))[0]

        def value(kind):
            if kind == 8:  # string
                return f.read(read("Q")).decode("utf-8", "replace")
            if kind == 9:  # array: skip it
                item, count = read("I"), read("Q")
                if item in scalars:
                    f.seek(count * struct.calcsize(f"<{scalars[item]}"), 1)
                else:
                    for _ in range(count):
                        value(item)
                return None
            return read(scalars[kind])

        if f.read(4) != b"GGUF" or read("I") < 2:
            return None
        read("Q")  # tensor count
        fields = {}
        for _ in range(read("Q")):
            key = value(8)
            fields[key] = value(read("I"))
            architecture = fields.get("general.architecture")
            if architecture and f"{architecture}.block_count" in fields:
                return int(fields[f"{architecture}.block_count"])
    return None


def target_num_layers():
    """The target's decoder layer count at DAG-build time, without loading it: ``num_hidden_layers`` of a local
    checkpoint's config.json (of its ``text_config`` for multimodal ones) or the GGUF header's block count.
    None for a hub id: then the extract job checks the ids when it has loaded the target.
    """
    path = config["target"]["path"]
    if not (path.startswith("pkg:") or Path(path).exists()):
        return None
    local = resolve_path(path)
    if local.suffix == ".gguf":
        return _gguf_block_count(local)
    if not (local / "config.json").exists():
        return None
    settings = json.loads((local / "config.json").read_text())
    return (settings.get("text_config") or settings).get("num_hidden_layers")


def check_layer_ids():
    """extract.layer_ids against the target's depth, before any job starts."""
    layer_ids = config["extract"]["layer_ids"]
    if not layer_ids:
        return  # the default ids are spread inside the target's depth
    layers = target_num_layers()
    bad = [i for i in layer_ids if layers is not None and not 0 <= i < layers]
    if bad:
        raise WorkflowError(
            f"config: extract.layer_ids {bad} out of range: the target {config['target']['path']} has {layers} "
            f"decoder layers, ids 0..{layers - 1} (z-lab numbering: id x = the output of decoder layer x)"
        )


check_layer_ids()


def evaluated_drafter(wildcards):
    if wildcards.drafter == "final":
        return rules.train.output.drafter
    return f"results/train/snapshots/{wildcards.drafter}"


def untrained_drafter(wildcards):
    """The untrained drafter, as a floor beside the final one only."""
    if wildcards.drafter == "final" and config["evaluate"]["untrained_baseline"]:
        return rules.train.output.drafter_init
    return []


def evaluated_prompts(wildcards):
    """The benchmark's settings; a snapshot is evaluated on its first evaluate.curve_prompts prompts only."""
    benchmark = dict(config["evaluate"]["benchmarks"][wildcards.benchmark])
    curve = config["evaluate"]["curve_prompts"]
    if wildcards.drafter != "final" and curve:
        benchmark["limit"] = min(benchmark["limit"] or curve, curve)
    return benchmark
