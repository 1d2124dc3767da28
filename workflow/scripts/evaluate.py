from dflash_pipeline.jobs import start_job

start_job(snakemake.log[0], snakemake.threads)

from pathlib import Path

from dflash_pipeline.evaluate import combine_parts
from dflash_pipeline.evaluate_report import write_report_files

result = combine_parts(
    list(snakemake.input),
    out_json=snakemake.output.result,
    loop_ngram=snakemake.params.loop_ngram,
)
write_report_files(result, Path(snakemake.output.table).parent)
