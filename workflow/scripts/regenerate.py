from dflash_pipeline.jobs import start_job
from dflash_pipeline.gpu_lease import lease_gpus

start_job(snakemake.log[0], snakemake.threads)
settings = snakemake.config["regenerate"]
if settings["backend"] == "local":
    lease_gpus(1, count=snakemake.config["gpu"]["count"])  # before CUDA starts; [] without GPUs

from dflash_pipeline.regenerate import run_regenerate

run_regenerate(
    snakemake.input.conversations,
    snakemake.output.conversations,
    snakemake.output.counts,
    target=snakemake.params.target,
    revision=snakemake.params.revision,
    trust_remote_code=snakemake.params.trust_remote_code,
    dtype=snakemake.params.dtype,
    settings=settings,
    shard=int(snakemake.wildcards.shard),
    num_shards=snakemake.params.num_shards,
)
