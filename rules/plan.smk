rule plan:
    """The capacity plan (dflash-pipeline plan) of this config and the prepared conversations: tokens, store size
    per store setting, extraction and training GPU-hours, peak memory, where the store fits.
    """
    input:
        conversations="results/prepare/conversations.jsonl",
        target=target_input,
    output:
        plan="results/plan.md",
        table=report(
            "results/plan.tsv",
            caption="../report/plan.rst",
            category="0. Plan",
            labels={"table": "capacity plan"},
        ),
    log:
        "results/logs/plan.log",
    conda:
        "../envs/dflash.yaml"
    threads: 1
    resources:
        mem_mb=4000,
    params:
        target=target_source(),
        # what the plan reads of the config: a change reruns it
        config_sections={
            k: result_settings(config, k)
            for k in ("data", "tokenize", "extract", "train", "gpu")
        },
    script:
        "../workflow/scripts/plan.py"
