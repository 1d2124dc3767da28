#!/usr/bin/env python3
"""τ per category of a benchmark (MT-Bench's 8, Arena-Hard's subcategories) for one or more evaluations of it
(``results/evaluate/<benchmark>/result.json``), with prompt lookup's τ on the same prompts where the result has it:
rows are matched to the prompt file's records by their id (``question_id``, ``uid`` or ``id``).

  python benchmarks/quality/tau_by_category.py QUESTIONS.jsonl BEFORE.json [AFTER.json ...] [--field category]
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from dflash_pipeline.evaluate import acceptance_metrics  # noqa: E402


def categories(questions: Path, field: str) -> dict[str, str]:
    records = [json.loads(line) for line in questions.read_text(encoding="utf-8").split("\n") if line.strip()]
    return {str(r.get("question_id", r.get("uid", r.get("id")))): str(r[field]) for r in records}


def table(result: dict, category_of: dict[str, str]) -> dict[str, dict]:
    """category -> prompts, τ mean and pooled, prompt lookup's τ mean (where measured)."""
    groups = collections.defaultdict(list)
    for row in result["rows"]:
        groups[category_of[str(row["id"])]].append(row)
    out = {}
    for name, rows in sorted(groups.items()) + [("all", result["rows"])]:
        tau = acceptance_metrics([r["accepted"] for r in rows], [r["committed"] for r in rows], result["block_size"])
        lookup = [r["pld_tau"] for r in rows if r.get("pld_tau") is not None]
        out[name] = {"prompts": len(rows), "tau_mean": tau["tau_mean"], "tau_pooled": tau["tau_pooled"],
                     "prompt_lookup_tau_mean": sum(lookup) / len(lookup) if lookup else None}
    return out


def cell(entry: dict | None) -> str:
    if entry is None:
        return "-"
    lookup = entry["prompt_lookup_tau_mean"]
    return f"{entry['tau_mean']:.3f} / {entry['tau_pooled']:.3f} / " + ("-" if lookup is None else f"{lookup:.3f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("questions", type=Path)
    p.add_argument("results", nargs="+", type=Path)
    p.add_argument("--field", default="category", help="the prompt records' category field (Arena-Hard: subcategory)")
    args = p.parse_args(argv)
    category_of = categories(args.questions, args.field)
    tables = [table(json.loads(path.read_text()), category_of) for path in args.results]
    header = ["category", "prompts"] + [f"{path.parent.name}: tau mean / pooled / lookup" for path in args.results]
    print("\t".join(header))
    for name in tables[0]:
        print("\t".join([name, str(tables[0][name]["prompts"]), *(cell(t.get(name)) for t in tables)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
