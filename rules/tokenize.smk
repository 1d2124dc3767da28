rule tokenize:
    input:
        conversations="results/prepare/conversations.jsonl",
        target=target_input,
    output:
        tokens="results/tokenize/shard_{shard}.parquet",
        counts="results/tokenize/shard_{shard}.counts.tsv",
    log:
        "results/logs/tokenize/shard_{shard}.log",
    conda:
        "../envs/dflash.yaml"
    threads: config["extract"]["threads"]
    resources:
        mem_mb=2000,
    params:
        target=target_source(),
        revision=config["target"]["revision"],
        trust_remote_code=config["target"]["trust_remote_code"],
        num_shards=config["tokenize"]["num_shards"],
        max_length=config["tokenize"]["max_length"],
    script:
        "../workflow/scripts/tokenize.py"
