from dflash_pipeline.jobs import start_job
from dflash_pipeline.gpu_lease import lease_gpus

start_job(snakemake.log[0], snakemake.threads)
lease_gpus(1, count=snakemake.config["gpu"]["count"])  # before CUDA starts; [] without GPUs

from dflash_pipeline.bucket import use_settings
from dflash_pipeline.store.lease import check_held
from dflash_pipeline.extract import run_extract

use_settings(snakemake.config["store"])  # store.endpoint_url, store.region for this job's processes
check_held(snakemake.config["store"])  # in a bucket: this run holds the lease of store.url

run_extract(
    snakemake.input.tokens,
    snakemake.params.shard,  # results/extract/shard_N.zarr, or its prefix in the bucket
    record_path=snakemake.output[0],  # in a bucket: the completion record, uploaded by Snakemake last
    target=snakemake.params.target,
    revision=snakemake.params.revision,
    trust_remote_code=snakemake.params.trust_remote_code,
    random_weights_seed=snakemake.params.random_weights_seed,
    dtype=snakemake.params.dtype,
    settings=snakemake.config["extract"],
    shard=int(snakemake.wildcards.shard),
    basis=next(iter(snakemake.input.basis), None),
)
