from dflash_pipeline.jobs import start_job

start_job(snakemake.log[0], snakemake.threads)

import logging

from dflash_pipeline.regenerate import template_kwargs
from dflash_pipeline.target import load_tokenizer
from dflash_pipeline.tokenization import tokenize_shard

tokenizer = load_tokenizer(
    snakemake.params.target,
    revision=snakemake.params.revision,
    trust_remote_code=snakemake.params.trust_remote_code,
)
counts = tokenize_shard(
    snakemake.input.conversations,
    tokenizer,
    shard=int(snakemake.wildcards.shard),
    num_shards=snakemake.params.num_shards,
    max_length=snakemake.params.max_length,
    out_parquet=snakemake.output.tokens,
    out_counts=snakemake.output.counts,
    loops=snakemake.params.loops,
    loop_ngram=snakemake.params.loop_ngram,
    **template_kwargs(snakemake.params.thinking),
)
logging.info("tokenize counts: %s", dict(counts))
