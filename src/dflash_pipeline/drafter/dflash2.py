"""What DFlash2 adds to the DFlash drafter (config/README.md, "DFlash2"): the names and numerics of the ``dflash``
package's ``DFlash2DraftModel``, which vLLM, SGLang and llama.cpp load.

- ``GroupedDynamicCausalConv`` around each layer's attention and MLP: one projection of the sublayer's input gives
  per-position taps for a causal convolution before the sublayer and one after it,
  out[i, c] = sum_{t < K} (base[t, c] + delta[i, t, g(c)]) * x[i - t, c], zero before the block's first slot
  (a block never sees another). Identity at initialisation (base tap 0 = 1, the projection zero): a fresh DFlash2
  drafter computes what its DFlash backbone computes.
- ``CandidateSelector``: the top-K tokens of each slot's logits rescored by a rank-r bilinear term,
  score(prev -> cand) = logit(cand) + <A[prev] * P h, B[cand]>, walked from the anchor (greedy, or sampled from the
  K-way softmax). The codebooks are stored without ``.weight`` (the published checkpoints' names). B starts at zero,
  so the fresh selector's walk is the backbone's argmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def grouped_dynamic_convolve(x, dynamic, base, group_size: int, block_size: int):
    """x [.., S, D] (S a multiple of ``block_size``, blocks one after another), dynamic [.., S, K, D // group_size],
    base [K, D] -> [.., S, D]: each block convolved on its own, causally."""
    shape, D = x.shape, x.shape[-1]
    groups = D // group_size
    blocks = x.reshape(-1, block_size, groups, group_size)
    dynamic = dynamic.reshape(-1, block_size, base.shape[0], groups, 1).to(x.dtype)
    out = torch.zeros_like(blocks)
    for tap in range(base.shape[0]):
        values = blocks if tap == 0 else F.pad(blocks[:, :-tap], (0, 0, 0, 0, tap, 0))
        out = out + base[tap].view(1, 1, groups, group_size).to(x.dtype) * values
        out = torch.addcmul(out, dynamic[:, :, tap], values)
    return out.view(shape)


class GroupedDynamicCausalConv(nn.Module):
    def __init__(self, hidden_size: int, kernel_size: int, group_size: int, block_size: int):
        super().__init__()
        self.kernel_size, self.group_size, self.block_size = kernel_size, group_size, block_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))  # [before / after, tap, channel]
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * (hidden_size // group_size), bias=False)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The identity: tap 0 = 1, no dynamic part."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def prepare(self, x):
        """The convolution before the sublayer -> (its output, the taps of the one after)."""
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, x.shape[-1] // self.group_size)
        before = grouped_dynamic_convolve(x, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size,
                                          self.block_size)
        return before, dynamic[..., 1, :, :]

    def finish(self, x, dynamic):
        return grouped_dynamic_convolve(x, dynamic, self.base_kernel[1], self.group_size, self.block_size)


def around(conv: GroupedDynamicCausalConv | None, sublayer, x):
    """``sublayer(x)``, wrapped in ``conv``'s two convolutions when there is one (DFlash2)."""
    if conv is None:
        return sublayer(x)
    x, dynamic = conv.prepare(x)
    return conv.finish(sublayer(x), dynamic)


class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    @torch.no_grad()
    def reset_parameters(self, std: float) -> None:
        """A normal predecessor codebook and a zero successor codebook: no transition term yet (SpecForge's init)."""
        nn.init.normal_(self.predecessor_codebook, std=std)
        self.successor_codebook.zero_()

    def transition(self, hidden, predecessors, candidates):
        """hidden [.., D], predecessor token ids [..], candidate ids [.., K] -> the bilinear term [.., K]. The rows
        are looked up with ``F.embedding``, whose CUDA backward splits a frequent token's many rows among threads
        (indexing's gives each token one warp: a comma among nearly every row's candidates is summed serially)."""
        context = F.embedding(predecessors, self.predecessor_codebook) * self.hidden_projection(hidden).to(
            self.predecessor_codebook.dtype)
        return torch.einsum("...r,...kr->...k", context, F.embedding(candidates, self.successor_codebook))

    @torch.no_grad()
    def walk(self, hidden, logits, anchor, temperature: float = 0.0, generator: torch.Generator | None = None):
        """The path through one block: hidden [P, D] and logits [P, V] of the P drafted slots, the anchor token id
        -> (tokens [P], candidates [P, K], q [P, K] or None). Greedy at temperature 0; else each slot's token is
        drawn from q = softmax(scores / temperature) over its K candidates (the distribution its draft came from)."""
        unary, candidates = logits.float().topk(self.top_k, dim=-1)
        projected = self.hidden_projection(hidden).to(self.predecessor_codebook.dtype)
        successors = self.successor_codebook[candidates]  # [P, K, r]
        predecessor = torch.as_tensor(anchor, device=logits.device)
        path, q_rows = [], []
        for slot in range(logits.shape[0]):
            context = self.predecessor_codebook[predecessor] * projected[slot]
            scores = unary[slot] + (successors[slot] @ context).float()
            if temperature > 0:
                q = torch.softmax(scores / temperature, dim=-1)
                index = torch.multinomial(q, 1, generator=generator)[0]
                q_rows.append(q)
            else:
                index = scores.argmax()
            predecessor = candidates[slot, index]
            path.append(predecessor)
        return torch.stack(path), candidates, torch.stack(q_rows) if q_rows else None
