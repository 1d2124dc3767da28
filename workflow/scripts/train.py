from dflash_pipeline.jobs import start_job

start_job(snakemake.log[0], snakemake.threads)

from dflash_pipeline.train import launch

# On CPU (train.gpus: 0) this trains in this process; with GPUs it leases them and execs torchrun.
launch(
    dict(snakemake.params.train),
    gpu_count=snakemake.params.gpu_count,
    store=snakemake.input.store,
    target=snakemake.params.target,
    drafter_dir=snakemake.output.drafter,
    init_dir=snakemake.output.drafter_init,
    log_csv=snakemake.output.log_csv,
    curves_png=snakemake.output.curves,
    timing_json=snakemake.output.timing,
    state_dir=snakemake.params.state_dir,
    snapshot_dirs=dict(zip(snakemake.params.snapshots, snakemake.output.snapshots)),
)
