"""Store shards of random samples for the tests (tests/test_store.py, tests/test_bucket.py)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from dflash_pipeline.store import ShardWriter, store_codec

K, D = 3, 8


def make_shard(path, lengths, *, dtype="float32", seed=0, corrupt=None, name=None):
    """Write a shard of random samples (``path``: a directory, or a zarr store with its ``name``); returns (features
    per sample, tokenized frame)."""
    g = torch.Generator().manual_seed(seed)
    writer = ShardWriter(path, num_tokens=sum(lengths), num_layers=K, hidden_size=D,
                         codec=store_codec(dtype, "bfloat16"), chunk_tokens=4)
    feats, ids, masks = [], [], []
    for n in lengths:
        f = (torch.randn(n, K, D, generator=g) * 3).to(torch.float32 if dtype == "float32" else torch.bfloat16)
        if corrupt == "nan":
            f[0, 1, 2] = float("nan")
        if corrupt == "zero":
            f[-1, 2] = 0
        feats.append(f)
        writer.write(f)
        ids.append(torch.randint(0, 100, (n,), generator=g).numpy().astype(np.int32))
        masks.append((torch.rand(n, generator=g) > 0.3).numpy().astype(np.uint8))
    sample_ids = [f"{name or path.name}-{i}" for i in range(len(lengths))]
    writer.close(np.concatenate(ids), np.concatenate(masks), lengths, sample_ids,
                 {"layer_ids": [1, 2, 3], "hidden_size": D})
    frame = pd.DataFrame({"id": sample_ids, "num_tokens": lengths, "input_ids": ids, "loss_mask": masks})
    return feats, frame
