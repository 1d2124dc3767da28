"""Reconstruction error of the store's fp8 e4m3 mode (per-vector scales) on real target hidden states: for
each captured layer, the relative Frobenius error ||x - x^|| / ||x|| over all tokens, the largest per-token
relative error and the median one (a few tokens — the first ``<|im_start|>`` of SmolLM2 from layer 14 on — hold
half of a layer's squared norm in one dimension, which fp8 stores almost exactly, so the Frobenius error is
dominated by them; the median is the typical token's), the same Frobenius error of plain bf16 rounding as a reference, and the number of elements
outside ``fp8_error_bound`` (expected 0). One fp32 forward per conversation (chat template, truncated to
``--max-length`` tokens), features captured as the extractor does (``LayerCapture``).

    python benchmarks/quality/fp8_error.py [--target results/target] [--conversations FILE.jsonl] [--samples 32]
        [--max-length 1024] [--layers 1 8 14 20 27]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from dflash_pipeline.extract import LayerCapture
from dflash_pipeline.store import dequantize_fp8, fp8_error_bound, quantize_fp8
from dflash_pipeline.target import load_target, load_tokenizer
from dflash_pipeline.tokenization import tokenize_conversation

CONVERSATIONS = ".gpu/R/sharegpt_first_turns_regenerated_by_smollm2.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="results/target")
    parser.add_argument("--conversations", default=CONVERSATIONS)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--max-length", type=int, default=1024)
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 8, 14, 20, 27])
    args = parser.parse_args()

    start = time.perf_counter()
    model = load_target(args.target, dtype="float32", device="cpu")
    tokenizer = load_tokenizer(args.target)
    capture = LayerCapture(model, args.layers)
    K = len(args.layers)
    # per layer: sum x^2, sum (x - fp8)^2, sum (x - bf16)^2 (float64), max per-token relative error, violations
    norm2, fp8_err2, bf16_err2 = (torch.zeros(K, dtype=torch.float64) for _ in range(3))
    token_max, violations = torch.zeros(K), torch.zeros(K, dtype=torch.int64)
    tokens, per_token_errors = 0, []
    with open(args.conversations) as lines:
        for _, line in zip(range(args.samples), lines):
            ids, _ = tokenize_conversation(tokenizer, json.loads(line)["messages"])
            ids = torch.from_numpy(ids[: args.max_length]).long()[None]
            x = capture(ids)[0]  # [T, K, D] float32
            q, scale = quantize_fp8(x)
            fp8_err = x - dequantize_fp8(q, scale)
            bf16_err = x - x.to(torch.bfloat16).float()
            norm2 += x.double().square().sum(dim=(0, 2))
            fp8_err2 += fp8_err.double().square().sum(dim=(0, 2))
            bf16_err2 += bf16_err.double().square().sum(dim=(0, 2))
            per_token = fp8_err.norm(dim=2) / x.norm(dim=2).clamp_min(torch.finfo(torch.float32).tiny)
            token_max = torch.maximum(token_max, per_token.amax(dim=0))
            per_token_errors.append(per_token)
            violations += (fp8_err.abs() > fp8_error_bound(x, scale)).sum(dim=(0, 2))
            tokens += x.shape[0]

    D = model.config.hidden_size
    print(f"{tokens} tokens from {args.samples} conversations (<= {args.max_length} tokens each), "
          f"D = {D}, {time.perf_counter() - start:.0f} s")
    print(f"stored bytes per token per layer: fp8 {D + 4} (D + 4-byte scale), bf16 {2 * D}\n")
    print("| layer | fp8 rel. Frobenius error | fp8 per-token rel. error, median / max | bf16 rel. Frobenius error "
          "| bound violations |")
    print("|---:|---:|---:|---:|---:|")
    token_median = torch.cat(per_token_errors).median(dim=0).values
    fp8_rel, bf16_rel = (fp8_err2 / norm2).sqrt(), (bf16_err2 / norm2).sqrt()
    for k, layer in enumerate(args.layers):
        print(f"| {layer} | {fp8_rel[k]:.3e} | {token_median[k]:.3e} / {token_max[k]:.3e} | {bf16_rel[k]:.3e} | {violations[k]} |")


if __name__ == "__main__":
    main()
