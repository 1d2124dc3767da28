rule compact_basis:
    """The compact store's basis, fitted once on a sample of the first shard before any extract job, so that every
    shard is encoded with the same one (a rerun of one extract job keeps it; a new basis re-extracts every shard).
    """
    input:
        tokens="results/tokenize/shard_00000.parquet",
        target=target_input,
    output:
        directory("results/compact/basis.zarr"),
    log:
        "results/logs/compact_basis.log",
    benchmark:
        "results/benchmarks/compact_basis.tsv"
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
        # what the fit reads: a change of the coefficients' dtype re-extracts the shards, not the basis
        extract={
            **{
                k: config["extract"][k]
                for k in ("layer_ids", "num_layers", "tokens_per_batch")
            },
            "compact": {
                k: v
                for k, v in config["extract"]["compact"].items()
                if k != "coefficients"
            },
        },
    script:
        "../workflow/scripts/compact_basis.py"


rule extract:
    input:
        tokens="results/tokenize/shard_{shard}.parquet",
        target=target_input,
        basis=compact_basis,
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
        extract=result_settings(config, "extract"),
        # where the shard's arrays go: results/extract/shard_N.zarr, or its prefix in the bucket (store.url)
        shard=lambda wildcards: store_location(f"extract/shard_{wildcards.shard}"),
    script:
        "../workflow/scripts/extract.py"
