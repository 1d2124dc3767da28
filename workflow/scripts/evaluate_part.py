from dflash_pipeline.jobs import start_job
from dflash_pipeline.gpu_lease import lease_gpus

start_job(snakemake.log[0], snakemake.threads)
lease_gpus(1, count=snakemake.config["gpu"]["count"])  # before CUDA starts; [] without GPUs

from dflash_pipeline.evaluate import evaluate_drafter
from dflash_pipeline.regenerate import template_kwargs

benchmark = snakemake.params.benchmark
evaluate_drafter(
    snakemake.input.drafter,
    snakemake.params.target,
    benchmark["prompts"],
    max_new_tokens=benchmark["max_new_tokens"],
    limit=benchmark["limit"],
    stride=benchmark["stride"],
    temperature=snakemake.params.temperature,
    out_json=snakemake.output[0],
    dtype=snakemake.params.dtype,
    seed=snakemake.params.seed,
    chat_template_kwargs=template_kwargs(snakemake.params.thinking),
    baseline_drafter_dir=snakemake.input.untrained or None,
    baselines=snakemake.params.baselines,
    with_prompt_lookup=snakemake.params.prompt_lookup,
    backbone_drafts=snakemake.params.backbone_drafts,
    part=snakemake.params.part,
    parts=snakemake.params.parts,
    processes=snakemake.config["evaluate"]["processes"],
    category_field=benchmark.get("category_field", "category"),
    tree_budgets=snakemake.params.tree_budgets,
)
