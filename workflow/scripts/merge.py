from dflash_pipeline.jobs import start_job

start_job(snakemake.log[0], snakemake.threads)

from dflash_pipeline.store import run_merge

run_merge(
    list(snakemake.input.shards),
    list(snakemake.input.tokens),
    snakemake.output.store,
    snakemake.output.stats,
    tokenizer_source=snakemake.params.target,
    config_sections=snakemake.params.config_sections,
    basis=next(iter(snakemake.input.basis), None),
)
