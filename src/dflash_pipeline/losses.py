"""DFlash training targets and loss (DESIGN.md section 5, "Training"): pure functions, no model, no optimiser.

For a sequence of T tokens, block i is anchored at ``anchors[i]`` = a; its slot k (0 <= k < B) holds the
data token a (k = 0) or the mask token, sits at RoPE position a + k, and predicts the data token a + k.
Slot 0 gets no loss; slot k >= 1 is trained only where a + k < T and ``loss_mask[a + k]``, with weight
``exp(-(k - 1) / gamma)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

IGNORE = -100
_GAMMA_TABLE = ((8, 4.0), (10, 5.0), (16, 7.0))  # the paper's values


def default_gamma(block_size: int) -> float:
    """gamma = 7 for B=16, 5 for B=10, 4 for B=8 (paper); other B: piecewise-linear through those three
    points (the 8-10 segment below 10, the 10-16 segment above), extended linearly, clamped to >= 1.
    E.g. B=4 -> 2, B=12 -> 5.67, B=32 -> 12.33."""
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    (x0, y0), (x1, y1) = _GAMMA_TABLE[:2] if block_size <= 10 else _GAMMA_TABLE[1:]
    return max(1.0, y0 + (block_size - x0) * (y1 - y0) / (x1 - x0))


def slot_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """Tensor [B]: w_0 = 0, w_k = exp(-(k-1)/gamma) for k >= 1."""
    gamma = default_gamma(block_size) if gamma is None else gamma
    w = torch.tensor([math.exp(-(k - 1) / gamma) for k in range(block_size)], dtype=torch.float32)
    w[0] = 0.0
    return w


def sample_anchors(loss_mask: torch.Tensor, max_anchors: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Up to ``max_anchors`` positions p, uniformly without replacement, among those with loss_mask[p] and
    loss_mask[p + 1] (a response token whose next token is also a response token); sorted LongTensor.
    Position 0 qualifies like any other (its block then sees an empty context)."""
    m = loss_mask.bool().cpu()
    candidates = torch.nonzero(m[:-1] & m[1:]).flatten()
    if candidates.numel() > max_anchors:
        candidates = candidates[torch.randperm(candidates.numel(), generator=generator)[:max_anchors]]
    return candidates.sort().values


def make_block_token_ids(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int):
    """[n, B]: the anchor's data token in slot 0, the mask token in slots 1..B-1."""
    blocks = torch.full((anchors.numel(), block_size), mask_token_id, dtype=torch.long, device=input_ids.device)
    blocks[:, 0] = input_ids[anchors.to(input_ids.device)]
    return blocks


def block_targets(input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, block_size: int,
                  gamma: float | None = None):
    """labels [n, B] (data token a+k, or IGNORE) and weights [n, B] (slot weight where trained, else 0)."""
    T = input_ids.shape[0]
    positions = anchors.to(input_ids.device)[:, None] + torch.arange(block_size, device=input_ids.device)
    inside = positions < T
    clamped = positions.clamp(max=T - 1)
    valid = inside & loss_mask.to(input_ids.device).bool()[clamped]
    valid[:, 0] = False
    labels = torch.where(valid, input_ids[clamped].long(), torch.full_like(clamped, IGNORE))
    weights = slot_weights(block_size, gamma).to(input_ids.device)[None, :] * valid
    return labels, weights


def _chunk_loss(hidden, weight, labels, weights):
    logits = F.linear(hidden.to(weight.dtype), weight).float()
    ce = F.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="none")
    return (ce * weights).sum(), logits.argmax(-1)


def chunked_lm_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                    weights: torch.Tensor, chunk_size: int = 1024):
    """Weighted cross-entropy of ``hidden @ lm_head_weight.T`` without ever holding all [N, V] logits:
    each chunk of rows is checkpointed, so backward recomputes its logits too (fp32 softmax).

    Returns (weighted loss sum, weight sum, correct [N] bool: argmax == label, False where ignored).
    Mean loss = loss_sum / weight_sum.
    """
    losses, predictions = [], []
    weights = weights.float() * (labels != IGNORE)
    for start in range(0, hidden.shape[0], chunk_size):
        chunk = slice(start, start + chunk_size)
        args = (hidden[chunk], lm_head_weight, labels[chunk], weights[chunk])
        if torch.is_grad_enabled() and (hidden.requires_grad or lm_head_weight.requires_grad):
            loss, pred = checkpoint(_chunk_loss, *args, use_reentrant=False)
        else:
            loss, pred = _chunk_loss(*args)
        losses.append(loss)
        predictions.append(pred)
    loss_sum = torch.stack(losses).sum() if losses else hidden.new_zeros((), dtype=torch.float32)
    pred = torch.cat(predictions) if predictions else labels.new_empty(0)
    return loss_sum, weights.sum(), (pred == labels) & (labels != IGNORE)


def acceptance_proxy(correct: torch.Tensor) -> torch.Tensor:
    """Teacher-forced acceptance per block: leading correct slots (of slots 1..B-1, given as [n, B-1]) + 1."""
    return correct.long().cumprod(dim=-1).sum(dim=-1) + 1
