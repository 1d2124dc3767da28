DATA = config["data"]
if bool(DATA["source"]) == bool(DATA["sources"]):
    raise WorkflowError(
        "config: set data.source (one conversations file) or data.sources (a list of sources), "
        "not both and not neither (a config merged over config/config.yaml sets data.source: null "
        "to use data.sources)"
    )
# data.source is the one source of a run as before issue #36: its ids and output are kept as they were
SOURCES = DATA["sources"] or [{"name": "source", "path": DATA["source"]}]
PROMPT_SOURCES = [
    s["name"] for s in SOURCES if s.get("format", "conversations") != "conversations"
]
if PROMPT_SOURCES and not config["regenerate"]["enabled"]:
    raise WorkflowError(
        f"config: data.sources {PROMPT_SOURCES} hold prompts without answers; the target writes them "
        "(regenerate.enabled: true)"
    )
# the prompts of every scored set: none of them may be trained on
SCORED = {
    name: benchmark["prompts"]
    for name, benchmark in config["evaluate"]["benchmarks"].items()
}


rule prepare:
    input:
        sources=[str(resolve_path(source["path"])) for source in SOURCES],
        scored=[str(resolve_path(prompts)) for prompts in SCORED.values()],
    output:
        conversations="results/prepare/conversations.jsonl",
        counts=report(
            "results/prepare/counts.tsv",
            caption="../report/prepare_counts.rst",
            category="1. Data",
            labels={"table": "prepare counts"},
        ),
        tasks=report(
            "results/prepare/tasks.tsv",
            caption="../report/prepare_tasks.rst",
            category="1. Data",
            labels={"table": "prepare counts per task"},
        ),
        leaks=report(
            "results/prepare/leaks.tsv",
            caption="../report/prepare_leaks.rst",
            category="1. Data",
            labels={"table": "scored prompts found in the data"},
        ),
    log:
        "results/logs/prepare.log",
    conda:
        "../envs/dflash.yaml"
    threads: 1
    resources:
        mem_mb=8000,
    params:
        sources=SOURCES,
        single=not DATA["sources"],
        max_conversations=DATA["max_conversations"],
        seed=DATA["seed"],
        scored=SCORED,
        leakage=DATA["leakage"],
    script:
        "../workflow/scripts/prepare.py"
