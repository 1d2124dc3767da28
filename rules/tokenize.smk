rule tokenize:
    input:
        # the shard's conversations with target-written answers, or all prepared ones (tokenize keeps the shard's)
        conversations=(
            "results/regenerate/shard_{shard}.jsonl"
            if config["regenerate"]["enabled"]
            else "results/prepare/conversations.jsonl"
        ),
        target=target_input,
    output:
        tokens="results/tokenize/shard_{shard}.parquet",
        counts=report(
            "results/tokenize/shard_{shard}.counts.tsv",
            caption="../report/tokenize_counts.rst",
            category="1. Data",
            subcategory="tokenize",
            labels={"table": "tokenize counts", "shard": "{shard}"},
        ),
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
        # what training sees of answers that loop (regenerate's or stored ones)
        loops=config["regenerate"]["loops"],
        loop_ngram=config["regenerate"]["loop_ngram"],
        thinking=TEMPLATE_THINKING,
    script:
        "../workflow/scripts/tokenize.py"
