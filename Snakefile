from snakemake.utils import min_version, validate

min_version("9.0")


configfile: "config/config.yaml"


validate(config, "config/schema.yaml")


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/target.smk"
include: "rules/prepare.smk"
include: "rules/plan.smk"
include: "rules/regenerate.smk"
include: "rules/tokenize.smk"
include: "rules/extract.smk"
include: "rules/merge.smk"
include: "rules/train.smk"
include: "rules/evaluate.smk"


rule all:
    default_target: True
    input:
        "results/plan.tsv",
        rules.store.input,
        "results/drafter",
        expand(
            "results/evaluate/{benchmark}/result.json",
            benchmark=config["evaluate"]["benchmarks"],
        ),
        expand(
            "results/evaluate/{benchmark}/sampled/result.json",
            benchmark=(
                config["evaluate"]["benchmarks"]
                if config["evaluate"]["sampling_temperature"]
                else []
            ),
        ),
        expand(
            "results/evaluate/{benchmark}/tau_vs_training_tokens.tsv",
            benchmark=config["evaluate"]["benchmarks"] if SNAPSHOTS else [],
        ),
