"""Which samples train together: the seeded train/validation split and the length-grouped global batches."""

from __future__ import annotations

import numpy as np
import torch

from .config import seeded


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """A hold-out split fixed by the seed: (train, validation), validation at least one sample."""
    if n < 2:
        raise ValueError(f"need at least 2 samples for a train/validation split, the store has {n}")
    order = torch.randperm(n, generator=seeded(seed, "split")).tolist()
    n_val = min(n - 1, max(1, round(n * val_fraction)))
    return sorted(order[n_val:]), sorted(order[:n_val])


class LengthGroupedBatches:
    """Global batches of similar-length samples with at most ``tokens_per_batch`` tokens (a longer sample is a
    batch alone), in a seeded order per epoch; rank r of W trains on ``batch[r::W]`` of each."""

    def __init__(self, indices, lengths, tokens_per_batch: int, seed: int, shuffle: bool = True):
        self.indices, self.lengths = list(indices), np.asarray(lengths)
        self.tokens_per_batch, self.seed, self.shuffle = tokens_per_batch, seed, shuffle

    def batches(self, epoch: int) -> list[list[int]]:
        order = self.indices
        if self.shuffle:  # a random order among equal lengths, then a stable sort by length
            order = [self.indices[j] for j in torch.randperm(len(order), generator=seeded(self.seed, epoch, "order"))]
        order = sorted(order, key=lambda i: self.lengths[i])
        batches, current, tokens = [], [], 0
        for i in order:
            if current and tokens + self.lengths[i] > self.tokens_per_batch:
                batches.append(current)
                current, tokens = [], 0
            current.append(i)
            tokens += int(self.lengths[i])
        if current:
            batches.append(current)
        if self.shuffle:
            batches = [batches[j] for j in torch.randperm(len(batches), generator=seeded(self.seed, epoch, "batches"))]
        return batches
