rule train:
    input:
        store=store_file("store"),
        target=target_input,
    output:
        drafter=directory("results/drafter"),
        # The untrained drafter (same seed, same format): the evaluation's baseline.
        drafter_init=directory("results/train/drafter_init"),
        # The drafter after train.snapshots percent of the steps: the evaluation's tau-vs-tokens curve.
        snapshots=[directory(f"results/train/snapshots/{name}") for name in SNAPSHOTS],
        log_csv=report(
            "results/train/log.csv",
            caption="../report/train_curves.rst",
            category="3. Training",
            labels={"table": "training log"},
        ),
        curves=report(
            "results/train/curves.png",
            caption="../report/train_curves.rst",
            category="3. Training",
            labels={"figure": "training curves"},
        ),
        # Where the job's time went (the loop, steps, data waits, validations, checkpoints; config/README.md).
        timing="results/train/timing.json",
    log:
        "results/logs/train.log",
    benchmark:
        "results/benchmarks/train.tsv"
    conda:
        "../envs/dflash.yaml"
    threads: config["train"]["threads"]
    resources:
        gpu=config["train"]["gpus"],
        mem_mb=16000,
    params:
        target=target_source(),
        train=result_settings(config, "train"),
        # Checkpoints for resuming: deliberately not an output (Snakemake deletes the outputs of a
        # failed job); a stale one (other config or store) is ignored by the trainer.
        state_dir="results/train/state",
        snapshots=[int(name.removesuffix("pct")) for name in SNAPSHOTS],
    script:
        "../workflow/scripts/train.py"
