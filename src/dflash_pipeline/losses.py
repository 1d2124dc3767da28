"""DFlash training targets and loss (docs/design.md, "DFlash, precisely"): pure functions, no model, no optimiser.

For a sequence of T tokens, block i is anchored at ``anchors[i]`` = a; its slot k (0 <= k < B) holds the
data token a (k = 0) or the mask token, sits at RoPE position a + k, and predicts the data token a + k.
Slot 0 gets no loss; slot k >= 1 is trained only where a + k < T and ``loss_mask[a + k]``, with weight
``exp(-(k - 1) / gamma)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

IGNORE = -100
# Rows of logits per chunk of the LM-head loss: 4096 x 49,152 fp32 (SmolLM2) = 0.8 GB.
LOSS_CHUNK_ROWS = 4096
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


def make_block_token_ids(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int):
    """[n, B]: the anchor's data token in slot 0, the mask token in slots 1..B-1."""
    blocks = torch.full((anchors.numel(), block_size), mask_token_id, dtype=torch.long, device=input_ids.device)
    blocks[:, 0] = input_ids[anchors.to(input_ids.device)]
    return blocks


def softmax_cross_entropy(logits, target, w, with_grad: bool = True):
    """Rows of logits [n, V], labels [n, 1], row weights [n, 1] -> (sum_i w_i * CE_i, its gradient with respect
    to the logits, w * (softmax - onehot), in the logits' dtype, or None without ``with_grad``); fp32 inside.
    Pointwise ops and row reductions only, so that torch.compile makes them a few fused kernels."""
    x = logits.float()
    lse = x.logsumexp(-1, keepdim=True)
    loss = ((lse - x.gather(1, target)) * w).sum()
    if not with_grad:
        return loss, None
    label = (torch.arange(x.shape[1], device=x.device) == target).float()
    return loss, ((torch.exp(x - lse) - label) * w).to(logits.dtype)


_compiled_softmax_cross_entropy = None


def compiled_softmax_cross_entropy(logits, target, w, with_grad: bool = True):
    global _compiled_softmax_cross_entropy
    if _compiled_softmax_cross_entropy is None:
        _compiled_softmax_cross_entropy = torch.compile(softmax_cross_entropy, dynamic=True)
    return _compiled_softmax_cross_entropy(logits, target, w, with_grad)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """sum_i w_i * CE(hidden_i @ weight.T, label_i), chunk by chunk: the forward also computes the gradients
    and keeps only them, so backward is a multiplication and no [N, V] tensor outlives its chunk (no
    recomputation, unlike checkpointing the chunks)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, chunk_size, predict, compiled):
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        predictions = []
        loss_and_grad = compiled_softmax_cross_entropy if compiled else softmax_cross_entropy
        with torch.autocast(hidden.device.type, enabled=False):  # the dtypes below are explicit
            for start in range(0, hidden.shape[0], chunk_size):
                rows = slice(start, start + chunk_size)
                h, target, w = hidden[rows].to(weight.dtype), labels[rows].clamp(min=0)[:, None], weights[rows, None]
                logits = F.linear(h, weight)
                if predict:
                    predictions.append(logits.argmax(-1))
                chunk_loss, grad = loss_and_grad(logits, target, w, need_hidden or need_weight)
                loss += chunk_loss
                if need_hidden:
                    grad_hidden[rows] = grad @ weight
                if need_weight:
                    grad_weight += grad.T.float() @ h.float()
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return loss, torch.cat(predictions) if predictions else labels.new_empty(0)

    @staticmethod
    def backward(ctx, grad_loss, _):
        grad_hidden, grad_weight = ctx.saved_tensors
        grad_hidden = None if grad_hidden is None else grad_hidden * grad_loss.to(grad_hidden.dtype)
        grad_weight = None if grad_weight is None else (grad_weight * grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def chunked_lm_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                    weights: torch.Tensor, chunk_size: int = LOSS_CHUNK_ROWS, predict: bool = True,
                    compiled: bool = False):
    """Weighted cross-entropy of ``hidden @ lm_head_weight.T`` (fp32 softmax) without ever holding more than
    ``chunk_size`` rows of logits; the gradients are computed in the forward (``_FusedLinearCrossEntropy``),
    with ``softmax_cross_entropy`` compiled if ``compiled``.

    Returns (weighted loss sum, weight sum, correct [N] bool: argmax == label, False where ignored; None
    unless ``predict``). Mean loss = loss_sum / weight_sum.
    """
    weights = weights.float() * (labels != IGNORE)
    loss_sum, pred = _FusedLinearCrossEntropy.apply(hidden, lm_head_weight, labels, weights, chunk_size, predict,
                                                   compiled)
    return loss_sum, weights.sum(), (pred == labels) & (labels != IGNORE) if predict else None


def acceptance_proxy(correct: torch.Tensor) -> torch.Tensor:
    """Teacher-forced acceptance per block: leading correct slots (of slots 1..B-1, given as [n, B-1]) + 1."""
    return correct.long().cumprod(dim=-1).sum(dim=-1) + 1
