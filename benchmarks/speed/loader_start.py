"""How long a streamed loader takes to start: a DataLoader of --workers spawn workers over a store of --samples
samples (2 tokens each, random bf16 features, written by the library), with ``dflash_pipeline.train`` imported as
the train job has it. Prints the seconds until ``iter()`` returns (every worker started) and until the first sample.

A spawn worker reads its pickled dataset only after importing the main module; a pickle over the pipe's 64 KiB made
the DataLoader start its workers one after another (journal, 2026-12-03 session 18).

  OMP_NUM_THREADS=1 python benchmarks/speed/loader_start.py --dir /tmp/loader_start --samples 16000 --workers 8
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

import dflash_pipeline.train  # noqa: F401  (the train job's imports, which each spawn worker repeats)
from dflash_pipeline.store import HiddenStateStore, ShardWriter, merge_shards, store_codec


def write_store(directory: Path, samples: int, layers: int = 5, hidden: int = 64) -> Path:
    lengths = [2] * samples
    writer = ShardWriter(directory / "shard_00000.zarr", num_tokens=sum(lengths), num_layers=layers,
                         hidden_size=hidden, codec=store_codec("bfloat16", "bfloat16"), chunk_tokens=256)
    writer.write(torch.randn(sum(lengths), layers, hidden).bfloat16())
    ids, masks = np.ones(sum(lengths), np.int32), np.ones(sum(lengths), np.uint8)
    names = [str(i) for i in range(samples)]
    writer.close(ids, masks, lengths, names, {"layer_ids": list(range(1, layers + 1)), "hidden_size": hidden})
    frame = pd.DataFrame({"id": names, "num_tokens": lengths, "input_ids": list(ids.reshape(-1, 2)),
                          "loss_mask": list(masks.reshape(-1, 2))})
    merge_shards([directory / "shard_00000.zarr"], [frame], directory / "store.zarr", {"target": "random"})
    return directory / "store.zarr"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--samples", type=int, default=16000)
    parser.add_argument("--workers", type=int, default=8)
    args = parser.parse_args()
    path = args.dir / f"{args.samples}" / "store.zarr"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_store(path.parent, args.samples)
    store = HiddenStateStore(path)
    began = time.perf_counter()
    samples = iter(torch.utils.data.DataLoader(store, batch_size=None, num_workers=args.workers,
                                               multiprocessing_context="spawn"))
    started = time.perf_counter()
    next(samples)
    print(f"{len(store)} samples, {args.workers} spawn workers: started in {started - began:.1f} s, "
          f"first sample after {time.perf_counter() - began:.1f} s")


if __name__ == "__main__":
    main()
