if (
    config["regenerate"]["backend"] == "server"
    and not config["regenerate"]["server"]["url"]
):
    raise WorkflowError(
        "config: regenerate.backend is server but regenerate.server.url is not set "
        "(the base URL of an OpenAI-compatible server, e.g. http://localhost:8000)"
    )
if config["regenerate"]["enabled"]:
    try:
        check_batch_tokens(config["regenerate"])
    except ValueError as error:
        raise WorkflowError(f"config: {error}")

# What the output depends on (a change reruns the jobs): the settings of the backend in use, less the runtime keys
# (the thread count; the server's concurrency, timeout and retries).
REGENERATE_SETTINGS = result_settings(config, "regenerate")
del REGENERATE_SETTINGS[
    "decode" if config["regenerate"]["backend"] == "server" else "server"
]
# what training sees of answers that loop is tokenize's (it reads loops and loop_ngram); regenerate only counts them
for key in ("loops", "loop_ngram"):
    del REGENERATE_SETTINGS[key]


rule regenerate:
    input:
        conversations="results/prepare/conversations.jsonl",
        target=target_input,
    output:
        conversations="results/regenerate/shard_{shard}.jsonl",
        counts=report(
            "results/regenerate/shard_{shard}.counts.tsv",
            caption="../report/regenerate_counts.rst",
            category="1. Data",
            subcategory="regenerate",
            labels={"table": "regenerate counts", "shard": "{shard}"},
        ),
    log:
        "results/logs/regenerate/shard_{shard}.log",
    benchmark:
        "results/benchmarks/regenerate/shard_{shard}.tsv"
    conda:
        "../envs/dflash.yaml"
    threads: config["regenerate"]["threads"]
    resources:
        gpu=1 if config["regenerate"]["backend"] == "local" else 0,
        mem_mb=8000,
    params:
        target=target_source(),
        revision=config["target"]["revision"],
        trust_remote_code=config["target"]["trust_remote_code"],
        dtype=config["regenerate"]["dtype"] or config["target"]["dtype"],
        num_shards=config["tokenize"]["num_shards"],
        regenerate=REGENERATE_SETTINGS,
    script:
        "../workflow/scripts/regenerate.py"
