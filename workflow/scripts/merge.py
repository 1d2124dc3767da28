from dflash_pipeline.jobs import start_job

start_job(snakemake.log[0], snakemake.threads)

from dflash_pipeline.bucket import use_settings
from dflash_pipeline.store.lease import check_held
from dflash_pipeline.store import run_merge

use_settings(snakemake.config["store"])  # store.endpoint_url, store.region for this job's processes
check_held(snakemake.config["store"])  # in a bucket: this run holds the lease of store.url

run_merge(
    list(snakemake.params.shards),  # local paths, or prefixes in the bucket
    list(snakemake.input.tokens),
    snakemake.params.store,
    snakemake.output.stats,
    tokenizer_source=snakemake.params.target,
    config_sections=snakemake.params.config_sections,
    records=list(snakemake.input.shards),  # in a bucket: the shards' completion records
    record_path=snakemake.output.store,  # in a bucket: the store's completion record, uploaded by Snakemake last
    basis=next(iter(snakemake.input.basis), None),
)
