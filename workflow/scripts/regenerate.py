from dflash_pipeline.jobs import start_job
from dflash_pipeline.gpu_lease import lease_gpus

start_job(snakemake.log[0], snakemake.threads)
settings = dict(snakemake.params.regenerate)
# counted, not decoded: not a param, so that changing it reruns no regeneration
settings["loop_ngram"] = snakemake.config["regenerate"]["loop_ngram"]
if settings["backend"] == "local":
    lease_gpus(1, count=snakemake.params.gpu_count)  # before CUDA starts; [] without GPUs
else:  # transport settings: not params, so that changing them reruns nothing
    settings["server"] = {**snakemake.config["regenerate"]["server"], **settings["server"]}

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
