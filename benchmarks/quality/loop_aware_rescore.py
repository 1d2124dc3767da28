#!/usr/bin/env python3
"""The loop-aware figures (issue #50, ``dflash_pipeline.loops``) of stored evaluation results: their rows hold each
response's ``accepted``, ``committed`` and ``output_ids``, so τ over the steps before each output's first repeated
n-token run can be computed without decoding again. Prompt lookup's loop-aware τ needs its per-forward record
(``pld_committed``, written since issue #50); older results print n/a there.

  python benchmarks/quality/loop_aware_rescore.py RESULT.json [NAME=RESULT.json ...] [--ngram 16]

One line per result: τ on all steps (mean / pooled), τ loop-aware (mean / pooled), the share of outputs that end in
a loop, the share of output tokens at or after the onset; the same for prompt lookup.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from dflash_pipeline.evaluate import loop_metrics  # noqa: E402

COLUMNS = ("tau_mean", "tau_pooled", "tau_loop_aware_mean", "tau_loop_aware_pooled", "loop_output_share",
           "loop_token_share")


def rescore(result: dict, ngram: int) -> dict:
    return loop_metrics(result["rows"], result["block_size"], ngram)


def cells(figures: dict, prefix: str = "") -> list[str]:
    values = [figures.get(prefix + key) for key in COLUMNS]
    return ["n/a" if v is None else f"{v:.3f}" for v in values]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="result.json files, each optionally NAME=PATH")
    p.add_argument("--ngram", type=int, default=16, help="n of the repeated run that marks a loop's onset")
    args = p.parse_args(argv)
    print(f"| run | prompts | method | τ mean | τ pooled | loop-aware τ mean | loop-aware τ pooled | outputs ending in a "
          f"loop | tokens after onset (n = {args.ngram}) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for spec in args.results:
        name, _, path = spec.rpartition("=")
        result = json.loads(Path(path).read_text())
        figures = rescore(result, args.ngram)
        name = name or path
        for method, prefix in (("drafter", ""), ("prompt lookup", "prompt_lookup_")):
            print(f"| {name} | {len(result['rows'])} | {method} | " + " | ".join(cells(figures, prefix)) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
