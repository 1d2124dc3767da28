"""What the extract job computes: the captured layers' outputs (``LayerCapture``, the forward stopped after the
last of them) over length-sorted samples cut into batches of little padding (``length_batches``)."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from ..target import decoder_layers


class _StopForward(Exception):
    """Raised by the last capture hook: the layers after it, the norm and the LM head are never run."""


class LayerCapture:
    """Forward hooks that keep the outputs of decoder layers ``layer_ids`` (z-lab numbering: the
    output of decoder layer x, which is ``output_hidden_states[x + 1]``) and stop the forward after
    the last of them."""

    def __init__(self, model: nn.Module, layer_ids: list[int]):
        layers = decoder_layers(model)
        if not layer_ids or min(layer_ids) < 0 or max(layer_ids) >= len(layers):
            raise ValueError(f"layer ids {layer_ids} out of range for a target of {len(layers)} layers")
        self.model, self.layers, self.layer_ids, self.outputs = model, layers, list(layer_ids), {}

    def _hook(self, index):
        def hook(module, args, output):
            self.outputs[index] = output[0] if isinstance(output, tuple) else output
            if index == max(self.layer_ids):
                raise _StopForward

        return hook

    @torch.no_grad()
    def layer_outputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The outputs [batch, seq, D] of the captured layers, in ``layer_ids`` order."""
        self.outputs.clear()
        base = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        handles = [self.layers[i].register_forward_hook(self._hook(i)) for i in set(self.layer_ids)]
        try:
            base(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        except _StopForward:
            pass
        finally:
            for handle in handles:
                handle.remove()
        outputs = [self.outputs[i] for i in self.layer_ids]
        self.outputs.clear()
        return outputs

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Features [batch, seq, K, D] of the captured layers, in ``layer_ids`` order."""
        return torch.stack(self.layer_outputs(input_ids, attention_mask), dim=2)


def length_batches(lengths: np.ndarray, tokens_per_batch: int, overhead_tokens: int | None = None) -> list[tuple[int, int]]:
    """Consecutive ranges of length-sorted samples whose padded size (rows x longest) stays within
    ``tokens_per_batch`` (a longer sample is a batch alone), chosen to minimise the padded tokens plus
    ``overhead_tokens`` per batch (the cost of one forward call in padded-token equivalents: launches and
    weight reads; default ``tokens_per_batch // 32``). An exact dynamic programme over the split points:
    a greedy fill wastes up to a batch's length spread on short samples, this finds the cheapest cut."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    if n == 0:
        return []
    overhead = tokens_per_batch // 32 if overhead_tokens is None else overhead_tokens
    best = np.full(n + 1, np.inf)
    best[0] = 0.0
    choice = np.zeros(n + 1, dtype=np.int64)
    for end in range(1, n + 1):
        width = int(lengths[end - 1])
        first = max(0, end - max(1, tokens_per_batch // max(width, 1)))
        starts = np.arange(first, end)
        cost = best[first:end] + (end - starts) * width + overhead
        pick = int(np.argmin(cost))  # ties: the earliest start, i.e. the fewest batches
        best[end], choice[end] = cost[pick], first + pick
    batches, end = [], n
    while end > 0:
        batches.append((int(choice[end]), end))
        end = int(choice[end])
    return batches[::-1]


def real_token_share(lengths: np.ndarray, batches: list[tuple[int, int]]) -> float:
    """Real tokens / computed (padded) tokens of right-padded batches of length-sorted samples."""
    padded = sum((end - start) * int(lengths[end - 1]) for start, end in batches)
    return float(np.sum(lengths)) / max(padded, 1)


def batched_layer_outputs(capture: LayerCapture, samples: list[np.ndarray], tokens_per_batch: int, device):
    """The captured layers' outputs of ``samples`` (length-sorted token ids), one right-padded batch at a time:
    yields (outputs [B, W, D] per layer, the batch's lengths)."""
    lengths = np.array([len(sample) for sample in samples], dtype=np.int64)
    for start, end in length_batches(lengths, tokens_per_batch):
        ids = np.zeros((end - start, int(lengths[end - 1])), dtype=np.int64)
        for row, sample in enumerate(samples[start:end]):
            ids[row, : len(sample)] = sample
        yield capture.layer_outputs(torch.from_numpy(ids).to(device)), lengths[start:end]
