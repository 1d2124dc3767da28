from dflash_pipeline.jobs import start_job

start_job(snakemake.log[0], snakemake.threads)

import logging

from dflash_pipeline.prepare import prepare

counts = prepare(
    snakemake.input[0],
    snakemake.output.conversations,
    snakemake.output.counts,
    max_conversations=snakemake.params.max_conversations,
    seed=snakemake.params.seed,
)
logging.info("prepare counts: %s", dict(counts))
