"""Prompt lookup's τ on all steps and loop-aware (issue #50), with no drafter: transformers' prompt-lookup decoding of
a prompt set by the target alone, each target forward's committed tokens recorded, as the evaluation records them
(``evaluate.prompt_lookup``), and the figures of ``evaluate.loop_metrics`` overall and per category. Prompt lookup's τ
does not depend on the drafter, so one run serves every recipe scored on the same prompts and settings.

    python benchmarks/quality/prompt_lookup_tau.py TARGET PROMPTS OUT.json [--limit N] [--stride K]
        [--max-new-tokens 256] [--temperature 0] [--loop-ngram 16]

TARGET: a converted checkpoint directory or the SmolLM2 GGUF (pkg: paths allowed); PROMPTS: MT-Bench's question.jsonl
or Arena-Hard's (its category field: --category-field subcategory). The rows keep prompt lookup's per-forward record
(``pld_committed``, ``pld_output_ids``), so the figures can be recomputed with another n.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from tqdm import tqdm

from dflash_pipeline.evaluate import LOOKUP_FIRST_STEP_START, load_prompts, prompt_lookup
from dflash_pipeline.loops import loop_aware_figures
from dflash_pipeline.resources import resolve_path
from dflash_pipeline.target import load_target, load_tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target")
    parser.add_argument("prompts")
    parser.add_argument("out")
    parser.add_argument("--limit", type=int)
    parser.add_argument("--stride", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loop-ngram", type=int, default=16)
    parser.add_argument("--category-field", default="category")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    target = str(resolve_path(args.target))
    tokenizer = load_tokenizer(target)
    model = load_target(target, dtype="float32", device=args.device)
    prompts = load_prompts(args.prompts, tokenizer, args.limit, None, args.stride, args.category_field)
    rows = []
    for index, prompt in enumerate(tqdm(prompts, desc="prompt lookup", unit="prompt")):
        if args.temperature > 0:
            torch.manual_seed(args.seed + index)
        run = prompt_lookup(model, prompt["prompt_ids"], args.max_new_tokens, args.temperature)
        rows.append({"id": prompt["id"], "index": index, "category": prompt.get("category"),
                     "pld_committed": run["committed"], "pld_output_ids": run["tokens"], "pld_tokens": len(run["tokens"]),
                     "pld_forwards": run["forwards"], "pld_tau": run["tau"], "pld_seconds": run["seconds"]})
    def figures_of(chosen: list[dict]) -> dict:
        forwards = sum(r["pld_forwards"] for r in chosen)
        return {"tau_mean": sum(r["pld_tau"] for r in chosen) / len(chosen),
                "tau_pooled": sum(r["pld_tokens"] for r in chosen) / forwards,
                **loop_aware_figures([r["pld_committed"] for r in chosen], [r["pld_output_ids"] for r in chosen],
                                     args.loop_ngram, LOOKUP_FIRST_STEP_START)}

    figures = {f"prompt_lookup_{key}": value for key, value in figures_of(rows).items()}
    categories = sorted({row["category"] for row in rows if row["category"] is not None})
    by_category = {name: figures_of([r for r in rows if r["category"] == name]) for name in categories}
    result = {**figures, "by_category": by_category, "num_prompts": len(rows), "max_new_tokens": args.max_new_tokens,
              "temperature": args.temperature, "loop_ngram": args.loop_ngram, "target": args.target,
              "prompts": args.prompts, "device": args.device, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
