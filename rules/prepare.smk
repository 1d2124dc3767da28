rule prepare:
    input:
        str(resolve_path(config["data"]["source"])),
    output:
        conversations="results/prepare/conversations.jsonl",
        counts=report(
            "results/prepare/counts.tsv",
            caption="../report/prepare_counts.rst",
            category="1. Data",
            labels={"table": "prepare counts"},
        ),
    log:
        "results/logs/prepare.log",
    conda:
        "../envs/dflash.yaml"
    threads: 1
    resources:
        mem_mb=4000,
    params:
        max_conversations=config["data"]["max_conversations"],
        seed=config["data"]["seed"],
    script:
        "../workflow/scripts/prepare.py"
