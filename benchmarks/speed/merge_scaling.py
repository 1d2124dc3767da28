"""Merge cost against feature bytes: 4 vs 64 shards of the same size, and 4 shards 16x larger.

    OMP_NUM_THREADS=1 python benchmarks/speed/merge_scaling.py [--tokens-per-shard 4096] [--workdir /tmp/merge-bench]

Shards are synthetic (random bf16 features, SmolLM2 shape K=5, D=576), written with the same ShardWriter
as `extract`; only `merge_shards` is timed. Prints a table and the ratios to the 4-shard case.
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from dflash_pipeline.store import ShardWriter, merge_shards, store_codec

K, D = 5, 576


def write_shard(path: Path, num_tokens: int, sample_tokens: int, seed: int) -> pd.DataFrame:
    g = torch.Generator().manual_seed(seed)
    lengths = [sample_tokens] * (num_tokens // sample_tokens)
    writer = ShardWriter(path, num_tokens=sum(lengths), num_layers=K, hidden_size=D,
                         codec=store_codec("bfloat16", "bfloat16"))
    ids, masks = [], []
    for n in lengths:
        writer.write(torch.randn(n, K, D, generator=g).to(torch.bfloat16))
        ids.append(np.random.default_rng(seed).integers(0, 49152, n, dtype=np.int32))
        masks.append(np.ones(n, dtype=np.uint8))
    names = [f"{path.stem}-{i}" for i in range(len(lengths))]
    writer.close(np.concatenate(ids), np.concatenate(masks), lengths, names, {"layer_ids": [1, 8, 14, 20, 27],
                                                                             "hidden_size": D})
    return pd.DataFrame({"id": names, "num_tokens": lengths, "input_ids": ids, "loss_mask": masks})


def case(workdir: Path, shards: int, tokens: int) -> dict:
    root = workdir / f"{shards}x{tokens}"
    shutil.rmtree(root, ignore_errors=True)
    frames = [write_shard(root / f"shard_{i:05d}.zarr", tokens, 512, i) for i in range(shards)]
    paths = [root / f"shard_{i:05d}.zarr" for i in range(shards)]
    feature_bytes = sum(f.stat().st_size for p in paths for f in (p / "features").rglob("*") if f.is_file())
    started = time.perf_counter()
    merge_shards(paths, frames, root / "store.zarr", {})
    seconds = time.perf_counter() - started
    files = sum(1 for _ in (root / "store.zarr").rglob("*"))
    shutil.rmtree(root)
    return {"shards": shards, "tokens/shard": tokens, "feature MB": feature_bytes / 1e6, "store files": files,
            "merge s": seconds}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens-per-shard", type=int, default=4096)
    parser.add_argument("--workdir", default="/tmp/merge-bench")
    args = parser.parse_args()
    torch.set_num_threads(1)
    workdir = Path(args.workdir)
    n = args.tokens_per_shard
    rows = [case(workdir, 4, n), case(workdir, 64, n), case(workdir, 4, 16 * n)]
    table = pd.DataFrame(rows)
    base = table.iloc[0]
    table["bytes ratio"] = table["feature MB"] / base["feature MB"]
    table["time ratio"] = table["merge s"] / base["merge s"]
    table["ms per MB"] = 1000 * table["merge s"] / table["feature MB"]
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3g}"))


if __name__ == "__main__":
    main()
