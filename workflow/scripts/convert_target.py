from dflash_pipeline.jobs import start_job

start_job(snakemake.log[0], snakemake.threads)

from dflash_pipeline.target import convert_gguf

convert_gguf(snakemake.input.gguf, snakemake.output[0], dtype=snakemake.config["target"]["dtype"])
