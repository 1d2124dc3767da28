# The DataLoader's spawn workers (train.num_workers) start by running this file again as __mp_main__, without the
# snakemake object: only the job's own process runs the job.
if __name__ == "__main__":
    from dflash_pipeline.jobs import start_job

    start_job(snakemake.log[0], snakemake.threads)

    from dflash_pipeline.bucket import use_settings
    from dflash_pipeline.train import launch

    use_settings(snakemake.config["store"])  # store.endpoint_url, store.region for this job's processes

    # On CPU (train.gpus: 0) this trains in this process; with GPUs it leases them and execs torchrun.
    launch(
        dict(snakemake.config["train"]),
        gpu_count=snakemake.config["gpu"]["count"],
        store=snakemake.input.store,  # the store, or its completion record in a bucket (a local copy)
        target=snakemake.params.target,
        drafter_dir=snakemake.output.drafter,
        init_dir=snakemake.output.drafter_init,
        log_csv=snakemake.output.log_csv,
        curves_png=snakemake.output.curves,
        timing_json=snakemake.output.timing,
        state_dir=snakemake.params.state_dir,
        snapshot_dirs=dict(zip(snakemake.params.snapshots, snakemake.output.snapshots)),
    )
