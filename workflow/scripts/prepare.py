from dflash_pipeline.jobs import start_job

start_job(snakemake.log[0], snakemake.threads)

from dflash_pipeline.mix import prepare_mix
from dflash_pipeline.sources import Source

params = snakemake.params
prepare_mix(
    [Source.from_config(source) for source in params.sources],
    snakemake.output.conversations,
    snakemake.output.counts,
    out_tasks=snakemake.output.tasks,
    out_leaks=snakemake.output.leaks,
    max_conversations=params.max_conversations,
    seed=params.seed,
    scored=params.scored,
    leakage=params.leakage,
    single=params.single,
)
