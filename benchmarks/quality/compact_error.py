"""Bytes per token and reconstruction error of the compact store's settings on real target hidden states (issue #34).

The features of real conversations are captured as the extractor does (``LayerCapture``, the target in fp32), or
read from a merged store (``--store``). A basis is fitted on the first ``--fit`` conversations (the sample of the
first shard a workflow fits it on) and every setting is measured on the next ``--eval`` ones, which the fit never
saw. Per setting (rank, weighting, joint or per layer, coefficient dtype):

- bytes per token as stored (``compact.bytes_per_token``) and after the store's compression (blosc byte-shuffle +
  zstd over chunks of 256 tokens, measured on the held-out rows);
- the per-token relative error |x - x^| / |x| (median, 99th percentile), over the K layers together and per layer
  (median);
- with ``--drafter DIR`` (a trained DFlash checkpoint of this target): the per-token cosine between its ``fc``'s
  output on x and on x^ (median, 1st percentile): what the drafter's context sees before ``hidden_norm``.
References in the same table: bf16 and the store's fp8 (per token and layer scales).

    python benchmarks/quality/compact_error.py --target results/target [--conversations FILE.jsonl[.gz]] [--fit 100]
        [--eval 60] [--ranks 576 1152] [--cache features.pt] [--drafter results/drafter]
    python benchmarks/quality/compact_error.py --store results/store.zarr --fit-tokens 4096 [--drafter results/drafter]
"""

from __future__ import annotations

import argparse
import gzip
import json
import time
from pathlib import Path

import numcodecs
import numpy as np
import torch

from dflash_pipeline.store import compact
from dflash_pipeline.store import HiddenStateStore, quantize_fp8, dequantize_fp8

# SmolLM2's own answers: the quality recipe's data
REGENERATED = "benchmarks/logs/study_2026-12-01/regenerated.jsonl.gz"
ZSTD = numcodecs.Blosc(cname="zstd", clevel=3, shuffle=numcodecs.Blosc.SHUFFLE)  # the store's compressor


def capture(target: str, path: str, count: int, max_length: int, layers: list[int]) -> list[torch.Tensor]:
    from dflash_pipeline.extract import LayerCapture
    from dflash_pipeline.target import load_target, load_tokenizer
    from dflash_pipeline.tokenization import tokenize_conversation

    model = load_target(target, dtype="float32", device="cpu")
    tokenizer, grab = load_tokenizer(target), LayerCapture(model, layers)
    samples = []
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as lines:
        for line in lines:
            if len(samples) == count:
                break
            ids, _ = tokenize_conversation(tokenizer, json.loads(line)["messages"])
            samples.append(grab(torch.from_numpy(ids[:max_length]).long()[None])[0])
    return samples


def from_store(path: str, fit_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the first ``fit_tokens`` of shard 0, every later shard's rows) of a merged store, decoded to float32."""
    store = HiddenStateStore(path)
    ends = store.shard_token_offsets
    fit = store.read_features(0, slice(0, min(fit_tokens, int(ends[1])))).float()
    held = [store.read_features(s, slice(0, int(ends[s + 1] - ends[s]))).float() for s in range(1, len(ends) - 1)]
    return fit, torch.cat(held)


def compressed_bytes(array: np.ndarray, chunk: int = 256) -> int:
    array = np.ascontiguousarray(array)
    return sum(len(ZSTD.encode(array[i : i + chunk])) for i in range(0, len(array), chunk))


def summary(x: torch.Tensor, approx: torch.Tensor, fc: torch.Tensor | None) -> dict:
    rel = (x - approx).flatten(1).norm(dim=1) / x.flatten(1).norm(dim=1)
    layer = ((x - approx).norm(dim=2) / x.norm(dim=2)).median(dim=0).values
    row = {"rel_median": rel.median().item(), "rel_p99": rel.quantile(0.99).item(),
           "rel_layers": " / ".join(f"{v:.3f}" for v in layer.tolist())}
    if fc is not None:
        a, b = x.flatten(1) @ fc.T, approx.flatten(1) @ fc.T
        cos = torch.nn.functional.cosine_similarity(a, b, dim=1)
        row.update(fc_cos_median=cos.median().item(), fc_cos_p1=cos.quantile(0.01).item())
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="results/target")
    parser.add_argument("--conversations", default=REGENERATED,
                        help="default: the study's answers (benchmarks/logs/restore_artifacts.sh brings them back)")
    parser.add_argument("--store", help="read the features of a merged store instead of capturing them")
    parser.add_argument("--fit-tokens", type=int, default=1 << 16, help="--store: tokens of shard 0 to fit on")
    parser.add_argument("--fit", type=int, default=100, help="conversations to fit the basis on")
    parser.add_argument("--eval", type=int, default=60, help="held-out conversations to measure on")
    parser.add_argument("--max-length", type=int, default=1152)
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 8, 14, 20, 27])
    parser.add_argument("--ranks", type=int, nargs="+", default=[288, 576, 864, 1152, 1440])
    parser.add_argument("--weightings", nargs="+", default=list(compact.WEIGHTINGS))
    parser.add_argument("--per-layer", action="store_true", help="also fit each layer alone (rank / K columns each)")
    parser.add_argument("--cache", help="a .pt file: the captured features are saved there, or read if it exists")
    parser.add_argument("--drafter", help="a trained DFlash checkpoint: the cosine of its fc's output")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    start = time.perf_counter()

    if args.store:
        fit_x, held_x = from_store(args.store, args.fit_tokens)
        source = f"{args.store}: {len(fit_x)} tokens of shard 0 to fit, {len(held_x)} of the other shards held out"
    else:
        if args.cache and Path(args.cache).exists():
            samples = torch.load(args.cache)
        else:
            samples = capture(args.target, args.conversations, args.fit + args.eval, args.max_length, args.layers)
            if args.cache:
                torch.save(samples, args.cache)
        fit_x, held_x = torch.cat(samples[: args.fit]), torch.cat(samples[args.fit : args.fit + args.eval])
        source = (f"{args.conversations}: {args.fit} conversations ({len(fit_x)} tokens) to fit, the next "
                  f"{args.eval} ({len(held_x)} tokens) held out")
    K, D = held_x.shape[1:]
    fc = None
    if args.drafter:
        from safetensors.torch import load_file

        fc = load_file(str(Path(args.drafter) / "model.safetensors"))["fc.weight"].float()
    print(f"{source}; K = {K}, D = {D}; captured/read in {time.perf_counter() - start:.0f} s\n")

    rows = []
    bf16 = held_x.to(torch.bfloat16)
    rows.append({"setting": "bf16 (today)", "bytes": 2 * K * D,
                 "zstd": compressed_bytes(bf16.view(torch.uint16).numpy()) / len(held_x),
                 **summary(held_x, bf16.float(), fc)})
    q, s = quantize_fp8(held_x)
    rows.append({"setting": "fp8 e4m3, scale per token and layer (today)", "bytes": K * D + 4 * K,
                 "zstd": (compressed_bytes(q.numpy()) + compressed_bytes(s.numpy())) / len(held_x),
                 **summary(held_x, dequantize_fp8(q, s), fc)})
    fits = [(w, False) for w in args.weightings] + ([(w, True) for w in args.weightings] if args.per_layer else [])
    for weighting, per_layer in fits:
        fit = compact.BasisFit(K, D, weighting=weighting, per_layer=per_layer)
        fit.add(fit_x)
        for rank in args.ranks:
            basis = fit.fit(rank)
            for dtype in ("bfloat16", "float8_e4m3fn"):
                values, scales = compact.encode(held_x, basis, dtype)
                stored = values.view(torch.uint16 if dtype == "bfloat16" else torch.uint8).numpy()
                packed = compressed_bytes(stored) + (compressed_bytes(scales.numpy()) if scales is not None else 0)
                name = f"rank {rank}, {weighting}{', per layer' if per_layer else ''}, {dtype.split('_')[0]} coeff."
                rows.append({"setting": name, "bytes": compact.bytes_per_token(rank, dtype),
                             "zstd": packed / len(held_x),
                             **summary(held_x, compact.decode(values, scales, basis), fc)})
    raw = 2 * K * D
    head = ("| setting | B/token | × vs bf16 | B/token zstd | × vs bf16 zstd | rel. error median / p99 | "
            "per layer (median) |" + (" fc cos median / p1 |" if fc is not None else ""))
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for row in rows:
        line = (f"| {row['setting']} | {row['bytes']:,} | {raw / row['bytes']:.2f} | {row['zstd']:,.0f} | "
                f"{rows[0]['zstd'] / row['zstd']:.2f} | {row['rel_median']:.4f} / {row['rel_p99']:.4f} | "
                f"{row['rel_layers']} |")
        if fc is not None:
            line += f" {row['fc_cos_median']:.4f} / {row['fc_cos_p1']:.4f} |"
        print(line)
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
