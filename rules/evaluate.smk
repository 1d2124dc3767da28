rule evaluate:
    input:
        drafter=rules.train.output.drafter,
        untrained=rules.train.output.drafter_init,
        target=target_input,
    output:
        result="results/evaluate/{benchmark}/result.json",
        acceptance=report(
            "results/evaluate/{benchmark}/acceptance_per_position.png",
            caption="../report/acceptance.rst",
            category="4. Evaluation",
            subcategory="{benchmark}",
            labels={"benchmark": "{benchmark}", "figure": "per-position acceptance"},
        ),
        histogram=report(
            "results/evaluate/{benchmark}/accepted_length_histogram.png",
            caption="../report/histogram.rst",
            category="4. Evaluation",
            subcategory="{benchmark}",
            labels={"benchmark": "{benchmark}", "figure": "accepted lengths"},
        ),
        table=report(
            "results/evaluate/{benchmark}/tau_table.tsv",
            caption="../report/tau_table.rst",
            category="4. Evaluation",
            subcategory="{benchmark}",
            labels={"benchmark": "{benchmark}", "table": "tau vs baselines"},
        ),
    log:
        "results/logs/evaluate/{benchmark}.log",
    benchmark:
        "results/benchmarks/evaluate/{benchmark}.tsv"
    conda:
        "../envs/dflash.yaml"
    threads: config["evaluate"]["threads"]
    resources:
        gpu=1,
        mem_mb=8000,
    params:
        target=target_source(),
        dtype=config["target"]["dtype"],
        benchmark=lambda wildcards: config["evaluate"]["benchmarks"][
            wildcards.benchmark
        ],
        temperature=config["evaluate"]["temperature"],
        seed=config["evaluate"]["seed"],
        gpu_count=config["gpu"]["count"],
    script:
        "../workflow/scripts/evaluate.py"
