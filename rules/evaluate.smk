wildcard_constraints:
    drafter=r"final|\d+pct",
    part=r"\d{3}",
    benchmark=r"[A-Za-z0-9_-]+",


rule evaluate_part:
    input:
        drafter=evaluated_drafter,
        untrained=untrained_drafter,
        target=target_input,
    output:
        "results/evaluate/{benchmark}/parts/{drafter}/part_{part}.json",
    log:
        "results/logs/evaluate/{benchmark}/{drafter}/part_{part}.log",
    benchmark:
        "results/benchmarks/evaluate/{benchmark}/{drafter}/part_{part}.tsv"
    conda:
        "../envs/dflash.yaml"
    threads: config["evaluate"]["threads"]
    resources:
        gpu=1,
        mem_mb=8000,
    params:
        target=target_source(),
        dtype=config["target"]["dtype"],
        benchmark=lambda wildcards: evaluated_prompts(wildcards),
        # autoregressive + prompt lookup + the lossless check: for the final drafter
        baselines=lambda wildcards: wildcards.drafter == "final"
        and config["evaluate"]["baselines"],
        prompt_lookup=config["evaluate"]["prompt_lookup"],
        backbone_drafts=lambda wildcards: wildcards.drafter == "final"
        and config["evaluate"]["backbone_drafts"],
        # prompts rendered as the training data's were (the final drafter's and the snapshots' alike)
        thinking=TEMPLATE_THINKING,
        tree_budgets=lambda wildcards: (
            config["evaluate"]["tree_budgets"] if wildcards.drafter == "final" else []
        ),
        part=lambda wildcards: int(wildcards.part),
        parts=len(PARTS),
        temperature=config["evaluate"]["temperature"],
        seed=config["evaluate"]["seed"],
    script:
        "../workflow/scripts/evaluate_part.py"


rule evaluate:
    input:
        expand(
            "results/evaluate/{{benchmark}}/parts/final/part_{part}.json", part=PARTS
        ),
    output:
        **(
            {
                "trees": report(
                    "results/evaluate/{benchmark}/tau_vs_tree_budget.png",
                    caption="../report/trees.rst",
                    category="4. Evaluation",
                    subcategory="{benchmark}",
                    labels={
                        "benchmark": "{benchmark}",
                        "figure": "tau and speed vs tree budget",
                    },
                )
            }
            if config["evaluate"]["tree_budgets"]
            else {}
        ),
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
        categories=report(
            "results/evaluate/{benchmark}/tau_by_category.tsv",
            caption="../report/tau_by_category.rst",
            category="4. Evaluation",
            subcategory="{benchmark}",
            labels={"benchmark": "{benchmark}", "table": "tau by category"},
        ),
    log:
        "results/logs/evaluate/{benchmark}.log",
    conda:
        "../envs/dflash.yaml"
    threads: 1
    resources:
        mem_mb=2000,
    params:
        loop_ngram=config["evaluate"]["loop_ngram"],
    script:
        "../workflow/scripts/evaluate.py"


# evaluate.sampling_temperature: the final drafter (and the baselines) once more at that temperature, seeded
use rule evaluate_part as evaluate_sampled_part with:
    input:
        drafter=rules.train.output.drafter,
        untrained=[],
        target=target_input,
    output:
        "results/evaluate/{benchmark}/sampled/parts/part_{part}.json",
    log:
        "results/logs/evaluate/{benchmark}/sampled/part_{part}.log",
    benchmark:
        "results/benchmarks/evaluate/{benchmark}/sampled/part_{part}.tsv"
    params:
        target=target_source(),
        dtype=config["target"]["dtype"],
        benchmark=lambda wildcards: config["evaluate"]["benchmarks"][
            wildcards.benchmark
        ],
        baselines=config["evaluate"]["baselines"],
        prompt_lookup=config["evaluate"]["prompt_lookup"],
        # the chain alone: the backbone's drafts and the trees are the greedy evaluation's
        backbone_drafts=False,
        thinking=TEMPLATE_THINKING,
        tree_budgets=[],
        part=lambda wildcards: int(wildcards.part),
        parts=len(PARTS),
        temperature=config["evaluate"]["sampling_temperature"],
        seed=config["evaluate"]["seed"],


use rule evaluate as evaluate_sampled with:
    input:
        expand(
            "results/evaluate/{{benchmark}}/sampled/parts/part_{part}.json", part=PARTS
        ),
    output:
        result="results/evaluate/{benchmark}/sampled/result.json",
        acceptance=report(
            "results/evaluate/{benchmark}/sampled/acceptance_per_position.png",
            caption="../report/acceptance.rst",
            category="4. Evaluation",
            subcategory="{benchmark}",
            labels={
                "benchmark": "{benchmark}",
                "figure": "per-position acceptance, sampled",
            },
        ),
        histogram=report(
            "results/evaluate/{benchmark}/sampled/accepted_length_histogram.png",
            caption="../report/histogram.rst",
            category="4. Evaluation",
            subcategory="{benchmark}",
            labels={"benchmark": "{benchmark}", "figure": "accepted lengths, sampled"},
        ),
        table=report(
            "results/evaluate/{benchmark}/sampled/tau_table.tsv",
            caption="../report/tau_table.rst",
            category="4. Evaluation",
            subcategory="{benchmark}",
            labels={"benchmark": "{benchmark}", "table": "tau vs baselines, sampled"},
        ),
        categories=report(
            "results/evaluate/{benchmark}/sampled/tau_by_category.tsv",
            caption="../report/tau_by_category.rst",
            category="4. Evaluation",
            subcategory="{benchmark}",
            labels={"benchmark": "{benchmark}", "table": "tau by category, sampled"},
        ),
    log:
        "results/logs/evaluate/{benchmark}_sampled.log",


rule tau_curve:
    input:
        expand(
            "results/evaluate/{{benchmark}}/parts/{drafter}/part_{part}.json",
            drafter=SNAPSHOTS + ["final"],
            part=PARTS,
        ),
    output:
        table=report(
            "results/evaluate/{benchmark}/tau_vs_training_tokens.tsv",
            caption="../report/tau_curve.rst",
            category="4. Evaluation",
            subcategory="{benchmark}",
            labels={"benchmark": "{benchmark}", "table": "tau vs training tokens"},
        ),
        figure=report(
            "results/evaluate/{benchmark}/tau_vs_training_tokens.png",
            caption="../report/tau_curve.rst",
            category="4. Evaluation",
            subcategory="{benchmark}",
            labels={"benchmark": "{benchmark}", "figure": "tau vs training tokens"},
        ),
    log:
        "results/logs/evaluate/{benchmark}_tau_curve.log",
    conda:
        "../envs/dflash.yaml"
    threads: 1
    resources:
        mem_mb=2000,
    params:
        drafters=SNAPSHOTS + ["final"],
        parts=len(PARTS),
        curve_prompts=config["evaluate"]["curve_prompts"],
    script:
        "../workflow/scripts/tau_curve.py"
