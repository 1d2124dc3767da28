"""A preloaded step's host work, on real steps (issue #21): what the trainer's loop does between two steps.

The token ids and response masks of tokenized shards (``results/tokenize/shard_*.parquet``), cut into the trainer's
length-grouped batches; for each of ``--steps`` batches, ``Preloaded.step`` (the trainer's code: the step's token
rows, ``pack_layouts`` on the host, the gathers and copies onto the device) over features of zeros in the device's
memory, with a stand-in for the store (its sample offsets; the features are not read). Prints the host's ms per
step: its call of ``pack_layouts`` and the whole ``Preloaded.step``. Run once per source tree, e.g.

    PYTHONPATH=/tmp/old/src python benchmarks/step_data_speed.py --tokens results/tokenize/shard_*.parquet --device cuda
    PYTHONPATH=src python benchmarks/step_data_speed.py --tokens results/tokenize/shard_*.parquet --device cuda
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import numpy as np
import pandas as pd
import torch

import dflash_pipeline
from dflash_pipeline.train import LengthGroupedBatches, split_indices
from dflash_pipeline import train_data
from dflash_pipeline.train_data import AnchorRule, Preloaded, pack_layouts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", nargs="+", required=True, help="tokenize shards (parquet)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--tokens-per-batch", type=int, default=4096)
    parser.add_argument("--max-anchors", type=int, default=512)
    parser.add_argument("--gamma", type=float, default=3.0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--layers", type=int, default=5, help="feature layers per token (the store's K)")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--gpu-behind-ms", type=float, default=0.0,
                        help="before each step, a GPU sleep of this many ms: the GPU behind the host, as in the loop "
                             "(the step's copies then wait in the GPU's queue, their pinned buffers still in use)")
    args = parser.parse_args()
    frame = pd.concat([pd.read_parquet(path) for path in args.tokens])
    lengths = frame["num_tokens"].to_numpy()
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    device = torch.device(args.device)
    preloaded = Preloaded.__new__(Preloaded)  # the trainer's Preloaded, its store's reads left out
    preloaded.store, preloaded.device, preloaded._loading = types.SimpleNamespace(sample_offsets=offsets), device, None
    preloaded.input_ids = np.concatenate(frame["input_ids"].tolist()).astype(np.int32)
    preloaded.loss_mask = np.concatenate(frame["loss_mask"].tolist()).astype(bool)
    preloaded.features = torch.zeros((int(offsets[-1]), args.layers, args.hidden), dtype=torch.bfloat16,
                                     device=device)
    rule = AnchorRule(args.block_size, args.gamma, args.max_anchors)
    train_ids, _ = split_indices(len(lengths), 0.02, 0)
    batches = LengthGroupedBatches(train_ids, lengths, args.tokens_per_batch, 0).batches(0)[: args.steps]

    layout_seconds = []

    def timed_layouts(*args, **kwargs):  # Preloaded.step's own call of pack_layouts, timed
        began = time.perf_counter()
        made = pack_layouts(*args, **kwargs)
        layout_seconds.append(time.perf_counter() - began)
        return made

    train_data.pack_layouts = timed_layouts
    for samples in batches[:20]:  # warm: the pinned-memory cache, the first CUDA calls
        preloaded.step(samples, rule, 0, args.layers, 0, args.hidden)
    per_repeat = []
    for _ in range(args.repeats):
        times, layout_seconds[:] = [], []
        for samples in batches:
            if args.gpu_behind_ms:
                torch.cuda._sleep(int(args.gpu_behind_ms * 1.98e6))  # ~1.98 GHz clock
            began = time.perf_counter()
            preloaded.step(samples, rule, 0, args.layers, 0, args.hidden)
            times.append(time.perf_counter() - began)
        per_repeat.append((statistics.median(layout_seconds), statistics.median(times)))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    results = dict(zip(("layouts (pack_layouts)", "Preloaded.step"), min(per_repeat, key=lambda r: r[1])))
    anchors = np.mean([sum(len(p.anchors) for p in preloaded.step(b, rule, 0, args.layers, 0, args.hidden))
                       for b in batches])
    print(f"# step_data_speed: {dflash_pipeline.__file__}, {args.device}, {len(batches)} steps of "
          f"<= {args.tokens_per_batch} tokens ({np.mean([lengths[b].sum() for b in batches]):.0f} tokens, "
          f"{np.mean([len(b) for b in batches]):.1f} samples, {anchors:.0f} anchors per step)")
    for name, seconds in results.items():
        print(f"| {name} | {1e3 * seconds:.3f} ms |")


if __name__ == "__main__":
    main()
