rule extract:
    input:
        tokens="results/tokenize/shard_{shard}.parquet",
        target=target_input,
    output:
        store_output("extract/shard_{shard}"),
    log:
        "results/logs/extract/shard_{shard}.log",
    benchmark:
        "results/benchmarks/extract/shard_{shard}.tsv"
    conda:
        "../envs/dflash.yaml"
    threads: config["extract"]["threads"]
    resources:
        gpu=1,
        mem_mb=8000,
    params:
        target=target_source(),
        revision=config["target"]["revision"],
        trust_remote_code=config["target"]["trust_remote_code"],
        random_weights_seed=config["target"]["random_weights_seed"],
        dtype=config["target"]["dtype"],
        extract=config["extract"],
        gpu_count=config["gpu"]["count"],
        # where the shard's arrays go: results/extract/shard_N.zarr, or its prefix in the bucket (store.url)
        shard=lambda wildcards: store_location(f"extract/shard_{wildcards.shard}"),
    script:
        "../workflow/scripts/extract.py"
