rule merge:
    input:
        shards=expand("results/extract/shard_{shard}.zarr", shard=SHARDS),
        tokens=expand("results/tokenize/shard_{shard}.parquet", shard=SHARDS),
        target=target_input,
        basis=compact_basis,
    output:
        store=directory("results/store.zarr"),
        stats=report(
            "results/store_stats.tsv",
            caption="../report/store_stats.rst",
            category="2. Store",
            labels={"table": "store statistics"},
        ),
    log:
        "results/logs/merge.log",
    benchmark:
        "results/benchmarks/merge.tsv"
    conda:
        "../envs/dflash.yaml"
    threads: 1
    resources:
        mem_mb=4000,
    params:
        target=target_source(),
        config_sections={
            k: config[k] for k in ("data", "target", "tokenize", "extract")
        },
    script:
        "../workflow/scripts/merge.py"


rule store:
    """The hidden-state store and the extract shards it is made of (a deleted shard is rebuilt)."""
    input:
        "results/store.zarr",
        expand("results/extract/shard_{shard}.zarr", shard=SHARDS),
