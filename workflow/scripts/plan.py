from dflash_pipeline.jobs import start_job

start_job(snakemake.log[0], snakemake.threads)

from dflash_pipeline.plan import run_plan

run_plan(
    snakemake.input.conversations,
    snakemake.params.target,
    dict(snakemake.config),
    snakemake.output.plan,
    snakemake.output.table,
)
