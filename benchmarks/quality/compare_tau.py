#!/usr/bin/env python3
"""Two evaluations of the same prompts (``results/evaluate/<benchmark>/result.json``) side by side: pooled and
mean τ, their ratio with a 95 % bootstrap interval over the prompts (paired: the same resampled prompts for
both), how many prompts each wins, τ on the first N prompts (the τ-vs-tokens curve's subset) and whether every
output is the same token for token (greedy speculative decoding is lossless, so two drafters on one target must
agree). The interval covers the choice of prompts only, not the run-to-run spread of training.

  python benchmarks/quality/compare_tau.py BASE.json OTHER.json [--first 20] [--resamples 10000] [--loop-aware]

``--loop-aware``: the ratio, its interval and the prompts won on each prompt's loop-aware τ (its verify steps that
start before its output's loop onset, ``dflash_pipeline.loops``, n = the result's ``loop_ngram``), the figure
quality decisions are made on (issue #50); a prompt with no such step in either result is left out and counted.
"""

from __future__ import annotations

import argparse
import json
import random

from dflash_pipeline.evaluate import acceptance_metrics
from dflash_pipeline.loops import loop_aware_figures


def load_result(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def tau(rows: list[dict], block_size: int) -> dict:
    """``tau_mean`` and ``tau_pooled`` of these rows, as the evaluation computes them."""
    return acceptance_metrics([r["accepted"] for r in rows], [r["committed"] for r in rows], block_size)


def prompt_taus(rows: list[dict], loop_ngram: int | None = None) -> list[float | None]:
    """Each prompt's τ: its row's, or with ``loop_ngram`` over its verify steps that start before its loop onset
    (None: no such step)."""
    if loop_ngram is None:
        return [r["tau"] for r in rows]
    return [loop_aware(r, loop_ngram)["tau_loop_aware_mean"] for r in rows]


def loop_aware(rows: dict | list[dict], loop_ngram: int) -> dict:
    """The evaluation's loop-aware figures of one row or of rows (``loops.loop_aware_figures``)."""
    rows = [rows] if isinstance(rows, dict) else rows
    return loop_aware_figures([r["committed"] for r in rows], [r["output_ids"] for r in rows], loop_ngram)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("base")
    p.add_argument("other")
    p.add_argument("--first", type=int, default=20)
    p.add_argument("--resamples", type=int, default=10000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loop-aware", action="store_true", help="compare each prompt's loop-aware tau")
    args = p.parse_args(argv)

    base_result, other_result = load_result(args.base), load_result(args.other)
    base, other = base_result["rows"], other_result["rows"]
    if [r["id"] for r in base] != [r["id"] for r in other]:
        raise SystemExit("the two results cover different prompts")
    ngram = base_result.get("loop_ngram", 16) if args.loop_aware else None
    pairs = [(b, o) for b, o in zip(prompt_taus(base, ngram), prompt_taus(other, ngram))
             if b is not None and o is not None]
    tau_b, tau_o = [b for b, _ in pairs], [o for _, o in pairs]
    n = len(pairs)
    rng = random.Random(args.seed)
    ratios = sorted(
        sum(tau_o[i] for i in idx) / sum(tau_b[i] for i in idx)
        for idx in ([rng.randrange(n) for _ in range(n)] for _ in range(args.resamples))
    )
    lo, hi = ratios[int(0.025 * args.resamples)], ratios[int(0.975 * args.resamples) - 1]
    k = min(args.first, len(base))
    same = sum(b["output_ids"] == o["output_ids"] for b, o in zip(base, other))
    print(f"prompts: {len(base)}; outputs identical: {same}/{len(base)}")
    if args.loop_aware:
        print(f"loop-aware (n = {ngram}): {n} prompts with a step before the onset, {len(base) - n} left out")
    print(f"{'':>10} {'tau mean':>9} {'pooled':>7} {f'first {k}':>9}" + (f" {'loop-aware mean / pooled':>25}"
                                                                         if args.loop_aware else ""))
    for name, result in (("base", base_result), ("other", other_result)):
        rows, B = result["rows"], result["block_size"]
        every, first = tau(rows, B), tau(rows[:k], B)
        aware = ""
        if args.loop_aware:
            figures = loop_aware(rows, ngram)
            aware = f" {figures['tau_loop_aware_mean']:15.3f} / {figures['tau_loop_aware_pooled']:.3f}"
        print(f"{name:>10} {every['tau_mean']:9.3f} {every['tau_pooled']:7.3f} {first['tau_mean']:9.3f}{aware}")
    figure = "loop-aware mean tau" if args.loop_aware else "mean tau"
    print(f"other / base ({figure}): {sum(tau_o) / sum(tau_b):.4f}, 95 % bootstrap over prompts [{lo:.4f}, {hi:.4f}]")
    print(f"per prompt: other higher {sum(o > b for b, o in zip(tau_b, tau_o))}, "
          f"lower {sum(o < b for b, o in zip(tau_b, tau_o))}, equal {sum(o == b for b, o in zip(tau_b, tau_o))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
