from dflash_pipeline.jobs import start_job
from dflash_pipeline.gpu_lease import lease_gpus

start_job(snakemake.log[0], snakemake.threads)
lease_gpus(1, count=snakemake.config["gpu"]["count"])  # before CUDA starts; [] without GPUs

from dflash_pipeline.extract import run_fit_basis

run_fit_basis(
    snakemake.input.tokens,
    snakemake.output[0],
    target=snakemake.params.target,
    revision=snakemake.params.revision,
    trust_remote_code=snakemake.params.trust_remote_code,
    random_weights_seed=snakemake.params.random_weights_seed,
    dtype=snakemake.params.dtype,
    settings=snakemake.config["extract"],
)
