import json
from pathlib import Path

from snakemake.exceptions import WorkflowError

from dflash_pipeline.config import check_batch_tokens, result_settings
from dflash_pipeline.gguf_header import gguf_block_count
from dflash_pipeline.resources import resolve_path

SHARDS = [f"{i:05d}" for i in range(config["tokenize"]["num_shards"])]
# drafter snapshots after these percentages of the training steps (train.snapshots)
SNAPSHOTS = [f"{p}pct" for p in sorted(config["train"]["snapshots"] or [])]
# evaluate jobs per benchmark and drafter (evaluate.parts)
PARTS = [f"{i:03d}" for i in range(config["evaluate"]["parts"])]
# the chat template's thinking switch of every rendered prompt, tokenized for training or evaluated: the one the
# answers were generated under (regenerate.thinking, where regenerate runs; None: the template's default)
TEMPLATE_THINKING = (
    config["regenerate"]["thinking"] if config["regenerate"]["enabled"] else None
)


wildcard_constraints:
    shard=r"\d{5}",


# What reruns a job: its params hold only what its result depends on, a config section as
# result_settings(config, section) gives it (less the runtime keys: threads, logging, speed knobs, the GPU count;
# dflash_pipeline.config.RUNTIME_KEYS) or the few keys a rule reads. The scripts read the runtime keys (or the
# whole section) from snakemake.config, which Snakemake does not track.


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
        return gguf_block_count(local)
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


# ---- where the store lives (store.url; docs/storage.md) ----
# Local: results/<name>.zarr directories. In a bucket: zarr writes the arrays straight to
# <store.url>/data/<name>.zarr, and Snakemake tracks the completion record <store.url>/complete/<name>.json that the
# job writes locally and Snakemake's S3 plugin uploads after the job has succeeded: the last object of a shard.
STORE_URL = (config["store"]["url"] or "").rstrip("/") or None
STORE_BUCKET = {key: config["store"][key] for key in ("endpoint_url", "region")}

if STORE_URL:

    storage bucket:
        provider="s3",
        endpoint_url=config["store"]["endpoint_url"],
        region=config["store"]["region"] or "us-east-1",


def check_store_bucket():
    """Credentials and bucket of store.url, before any job: one sentence when they fail."""
    if workflow.storage_settings.default_storage_provider and not STORE_URL:
        raise WorkflowError(
            "--default-storage-provider is set but store.url is not: the store's shards are Zarr directories that a "
            "storage plugin would upload object by object after each job with no completion marker; set store.url "
            "to s3://bucket/prefix (docs/storage.md)"
        )
    if STORE_URL and config["extract"]["store_dtype"] == "compact":
        raise WorkflowError(
            "store.url with extract.store_dtype: compact: a compact store's basis is kept beside the shards on a "
            "local disk only; use a local store or another store_dtype"
        )
    if STORE_URL:
        from dflash_pipeline.bucket import Bucket, BucketError

        try:
            Bucket(**STORE_BUCKET).check(STORE_URL)
        except BucketError as error:
            raise WorkflowError(f"store.url: {error}") from None


check_store_bucket()

# One run writes a store.url at a time (docs/storage.md, "One run per prefix"): the lease is taken when the run
# starts (not in a dry run), before any job or output is touched, and released when it ends.
STORE_LEASE = []


def take_store_lease():
    if STORE_URL:
        from dflash_pipeline.bucket import Bucket, BucketError
        from dflash_pipeline.store.lease import Lease

        lease = Lease(
            STORE_URL, Bucket(**STORE_BUCKET), config["store"]["lease_seconds"]
        )
        try:
            lease.take()
        except BucketError as error:
            raise WorkflowError(f"store.url: {error}") from None
        STORE_LEASE.append(lease)


def release_store_lease():
    while STORE_LEASE:
        STORE_LEASE.pop().release()


onstart:
    take_store_lease()


onsuccess:
    release_store_lease()


onerror:
    release_store_lease()


def store_location(name):
    """Where the arrays of ``name`` (``extract/shard_00000``, ``store``) live: a local path or an s3:// URL."""
    if STORE_URL:
        from dflash_pipeline.bucket import data_url

        return data_url(STORE_URL, name)
    return f"results/{name}.zarr"


def store_file(name):
    """What Snakemake tracks of ``name``: its completion record in the bucket, or the local directory itself."""
    if STORE_URL:
        from dflash_pipeline.bucket import record_url

        return storage.bucket(record_url(STORE_URL, name))
    return f"results/{name}.zarr"


def store_output(name):
    return store_file(name) if STORE_URL else directory(store_file(name))
