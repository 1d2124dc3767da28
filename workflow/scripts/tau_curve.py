from dflash_pipeline.jobs import start_job

start_job(snakemake.log[0], snakemake.threads)

from dflash_pipeline.evaluate import combine_parts
from dflash_pipeline.evaluate_report import write_tau_curve

parts = snakemake.params.parts
files = list(snakemake.input)
results = {
    name: combine_parts(
        files[i * parts : (i + 1) * parts], limit=snakemake.params.curve_prompts
    )
    for i, name in enumerate(snakemake.params.drafters)
}
write_tau_curve(results, snakemake.output.table, snakemake.output.figure)
