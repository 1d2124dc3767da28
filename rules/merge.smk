rule merge:
    input:
        shards=[store_file(f"extract/shard_{shard}") for shard in SHARDS],
        tokens=expand("results/tokenize/shard_{shard}.parquet", shard=SHARDS),
        target=target_input,
        basis=compact_basis,
    output:
        store=store_output("store"),
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
        # where the arrays are: local paths, or prefixes in the bucket (store.url)
        shards=[store_location(f"extract/shard_{shard}") for shard in SHARDS],
        store=lambda wildcards, output: (
            store_location("store") if STORE_URL else output.store
        ),
        config_sections={
            k: result_settings(config, k)
            for k in ("data", "target", "tokenize", "extract")
        },
    script:
        "../workflow/scripts/merge.py"


rule store:
    """The hidden-state store and the extract shards it is made of (a deleted shard is rebuilt)."""
    input:
        store_file("store"),
        [store_file(f"extract/shard_{shard}") for shard in SHARDS],
