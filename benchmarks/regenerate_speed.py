"""Cost of one batched greedy decode step in regeneration (``regenerate.generate_batch``), by KV-cache sizing and dtype.

    python benchmarks/regenerate_speed.py --config DIR [--rows 768] [--widths 128 512] [--device cuda]

DIR holds a target's ``config.json`` (e.g. SmolLM2-135M-Instruct's); the model is built from it with random
weights (speed depends on the shape only). Per prompt width, one left-padded batch of ``--rows`` prompts whose
lengths spread over the lower half of the width (as in a length-sorted batch), generated with ``--short`` and
``--long`` new tokens: the difference over the extra steps is the decode step's cost, prefill excluded.
Variants: fp32 with the static cache pre-sized to ``--fixed-cache`` slots (the regenerate job before this
change), fp32 with the cache sized to the batch (now), bf16 sized to the batch (``regenerate.dtype: bfloat16``).
Prints ms per decode step, generated tokens/s at that step rate, and the ratio to the first variant.
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoConfig

from dflash_pipeline.regenerate import generate_batch
from dflash_pipeline.target import load_target


def step_ms(model, prompts, short: int, long: int, cache: int | None) -> float:
    def timed(n):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        generate_batch(model, prompts, n, max_cache_len=cache)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - start

    return (timed(long) - timed(short)) / (long - short) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="directory with the target's config.json")
    parser.add_argument("--rows", type=int, default=768)
    parser.add_argument("--widths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--short", type=int, default=8)
    parser.add_argument("--long", type=int, default=40)
    parser.add_argument("--fixed-cache", type=int, default=1152, help="the old static cache: prompt cap + new tokens")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()

    config = AutoConfig.from_pretrained(args.config)
    generator = torch.Generator().manual_seed(0)
    variants = [("fp32, cache pre-sized", "float32", args.fixed_cache),
                ("fp32, cache sized to batch", "float32", None),
                ("bf16, cache sized to batch", "bfloat16", None)]
    rows = []
    for name, dtype, cache in variants:
        model = load_target(args.config, dtype=dtype, device=args.device, random_weights_seed=0)
        model.generation_config.eos_token_id = None  # random weights: every row runs to the cap
        for width in args.widths:
            lengths = torch.randint(width // 2, width + 1, (args.rows,), generator=generator).tolist()
            prompts = [torch.randint(0, config.vocab_size, (n,), generator=generator).tolist() for n in lengths]
            generate_batch(model, prompts[:8], 2, max_cache_len=cache)  # warm-up
            ms = step_ms(model, prompts, args.short, args.long, cache)
            rows.append((name, width, ms))
            print(f"{name:28s} width {width:4d}: {ms:7.1f} ms/step", flush=True)
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    print(f"\n{args.rows} rows, decode steps {args.short}->{args.long}, device {args.device}")
    print(f"{'variant':28s} {'width':>5s} {'ms/step':>8s} {'tok/s':>8s} {'speed-up':>8s}")
    base = {width: ms for name, width, ms in rows if name == variants[0][0]}
    for name, width, ms in rows:
        print(f"{name:28s} {width:5d} {ms:8.1f} {args.rows / ms * 1000:8.0f} {base[width] / ms:8.2f}")


if __name__ == "__main__":
    main()
