"""How far bf16 greedy regeneration (``regenerate.dtype: bfloat16``) parts from the fp32 target's greedy answers.

    OMP_NUM_THREADS=1 python benchmarks/quality/regenerate_dtype_agreement.py [--target results/target]
        [--conversations .gpu/R/sharegpt_first_turns_regenerated_by_smollm2.jsonl] [--limit 24]
        [--max-new-tokens 128] [--batch-size 8] [--bf16-batch-1]

Prompts: each record's first turn (``regenerate.turn_segments``' first prompt, or MT-Bench's ``turns[0]``)
rendered by ``regenerate.render_prompt``; the first ``--limit`` of at most ``--max-prompt-tokens`` tokens, sorted
by length and batched as the regenerate job does. Answers come from ``regenerate.generate_batch`` (left-padded
greedy ``generate``): fp32 one prompt at a time (the reference: evaluation's batch-1 fp32 target), fp32 batched
(today's regeneration), bf16 batched (the proposed one) and, with ``--bf16-batch-1``, bf16 one at a time (does
bf16 depend on batch composition? ~2.5x the batched time on CPU). Per pair: answers identical token for token;
for the others the first differing position (tokens, and share of the reference answer's length); the mean share
of reference tokens before the first divergence (identical = 1). Answers stop at ``--max-new-tokens`` (default
128 for CPU time; the quality run uses 256): later divergences go unseen. CPU kernels round unlike a GPU's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common.py
from common import first_difference  # noqa: E402

from dflash_pipeline.regenerate import generate_batch, render_prompt, turn_segments
from dflash_pipeline.target import load_target, load_tokenizer


def first_user_turn(record: dict) -> list[dict]:
    if record.get("turns"):
        return [{"role": "user", "content": record["turns"][0]}]
    return turn_segments(record["messages"])[0][0]  # the first turn's prompt, as regeneration builds it


def compare(name: str, reference: list[list[int]], other: list[list[int]]) -> None:
    diffs = [first_difference(r, o) for r, o in zip(reference, other)]
    split = [(d, d / len(r)) for d, r in zip(diffs, reference) if d is not None]
    before = statistics.mean(1.0 if d is None else d / len(r) for d, r in zip(diffs, reference))
    line = f"{name:<30} identical {len(diffs) - len(split):>2}/{len(diffs)} ({1 - len(split) / len(diffs):6.1%})"
    if split:
        (positions, shares), mean, median = zip(*split), statistics.mean, statistics.median
        line += (f"  first diff at token mean {mean(positions):5.1f} median {median(positions):5.1f}"
                 f" (share of answer {mean(shares):.2f} / {median(shares):.2f})")
    print(line + f"  mean share before divergence {before:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="results/target")
    parser.add_argument("--conversations", default=".gpu/R/sharegpt_first_turns_regenerated_by_smollm2.jsonl")
    parser.add_argument("--limit", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-prompt-tokens", type=int, default=768)
    parser.add_argument("--bf16-batch-1", action="store_true", help="also bf16 one prompt at a time")
    args = parser.parse_args()
    torch.set_num_threads(1)

    tokenizer, prompts = load_tokenizer(args.target), []
    with open(args.conversations, encoding="utf-8") as handle:
        for line in handle:
            ids = render_prompt(tokenizer, first_user_turn(json.loads(line)))
            prompts += [ids] if len(ids) <= args.max_prompt_tokens else []
            if len(prompts) == args.limit:
                break
    prompts.sort(key=len)
    print(f"{len(prompts)} prompts of {len(prompts[0])}-{len(prompts[-1])} tokens, max_new_tokens "
          f"{args.max_new_tokens}, batch size {args.batch_size}")

    answers, size = {}, args.batch_size
    for dtype, sizes in {"float32": (1, size), "bfloat16": (size,) + (1,) * args.bf16_batch_1}.items():
        model = load_target(args.target, dtype=dtype, device="cpu")
        for rows in sizes:
            started = time.perf_counter()
            out = [o for i in range(0, len(prompts), rows)
                   for o in generate_batch(model, prompts[i: i + rows], args.max_new_tokens)]
            answers[dtype, rows], seconds = [tokens for tokens, _ in out], time.perf_counter() - started
            print(f"{dtype} batch {rows}: {sum(map(len, answers[dtype, rows]))} tokens in {seconds:.0f} s; "
                  f"{sum(hit for _, hit in out)} answers at the cap")

    reference = answers["float32", 1]
    compare(f"bf16 batch {size} vs fp32 batch 1", reference, answers["bfloat16", size])
    compare(f"fp32 batch {size} vs fp32 batch 1", reference, answers["float32", size])
    compare(f"bf16 batch {size} vs fp32 batch {size}", answers["float32", size], answers["bfloat16", size])
    if args.bf16_batch_1:
        compare("bf16 batch 1 vs fp32 batch 1", reference, answers["bfloat16", 1])
        compare(f"bf16 batch {size} vs bf16 batch 1", answers["bfloat16", 1], answers["bfloat16", size])


if __name__ == "__main__":
    main()
