"""DFlash training targets and loss (docs/design.md, "DFlash, precisely"): pure functions, no model, no optimiser.

For a sequence of T tokens, block i is anchored at ``anchors[i]`` = a; its slot k (0 <= k < B) holds the
data token a (k = 0) or the mask token, sits at RoPE position a + k, and predicts the data token a + k.
Slot 0 gets no loss; slot k >= 1 is trained only where a + k < T and ``loss_mask[a + k]``, with weight
``exp(-(k - 1) / gamma)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


@dataclass
class SelectorLoss:
    """DFlash2's selector term of the loss: per row (slot), the token before its label (the anchor's for slot 1)
    and its weight (0: no selector loss; the trainer gives a * the slot's weight where slots 1..k all have a
    label). The term is sum_i weight_i * CE over the row's top-K candidates (``selector_targets``) of
    logit(cand) + ``selector.transition``."""

    selector: torch.nn.Module
    predecessors: torch.Tensor  # [N] token ids
    weights: torch.Tensor  # [N]


@dataclass
class LogitsTransform:
    """logits = c * tanh(m * z / c) (c: ``softcap``, None: m * z); the engines' ``output_multiplier`` and
    ``final_logit_softcapping``."""

    multiplier: float = 1.0
    softcap: float | None = None

    def __call__(self, z):
        """z -> (logits, d logits / d z), fp32."""
        x = z.float() * self.multiplier
        if self.softcap is None:
            return x, self.multiplier
        t = torch.tanh(x / self.softcap)
        return self.softcap * t, self.multiplier * (1 - t * t)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """sum_i w_i * CE(hidden_i @ weight.T, label_i), chunk by chunk: the forward also computes the gradients
    and keeps only them, so backward is a multiplication and no [N, V] tensor outlives its chunk (no
    recomputation, unlike checkpointing the chunks). With a ``SelectorLoss``, its term is added and its gradient,
    which reaches the logits of the K candidates, the hidden states and the selector's weights (``selector_params``,
    given after the others so that backward can return theirs), computed in the same chunks."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, chunk_size, predict, compiled, transform, selector_loss,
                *selector_params):
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_params = [torch.zeros_like(p) if need else None
                       for p, need in zip(selector_params, ctx.needs_input_grad[9:])]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        predictions = []
        loss_and_grad = compiled_softmax_cross_entropy if compiled else softmax_cross_entropy
        with_grad = need_hidden or need_weight or any(g is not None for g in grad_params)
        with torch.autocast(hidden.device.type, enabled=False):  # the dtypes below are explicit
            for start in range(0, hidden.shape[0], chunk_size):
                rows = slice(start, start + chunk_size)
                h, target, w = hidden[rows].to(weight.dtype), labels[rows].clamp(min=0)[:, None], weights[rows, None]
                logits, slope = F.linear(h, weight), None
                if transform is not None:
                    logits, slope = transform(logits)
                if predict:
                    predictions.append(logits.argmax(-1))
                chunk_loss, grad = loss_and_grad(logits, target, w, with_grad)
                loss += chunk_loss
                hidden_grad = None
                if selector_loss is not None:
                    selector_sum, grad, hidden_grad, choice = _selector_chunk(
                        selector_loss, rows, hidden[rows], logits, target[:, 0], grad, need_hidden, grad_params)
                    loss += selector_sum
                    if predict:
                        predictions[-1] = torch.where(selector_loss.weights[rows] > 0, choice, predictions[-1])
                if grad is None:
                    continue
                if slope is not None:
                    grad = (grad.float() * slope).to(weight.dtype)
                if need_hidden:
                    grad_hidden[rows] = grad @ weight
                    if hidden_grad is not None:
                        grad_hidden[rows] += hidden_grad.to(grad_hidden.dtype)
                if need_weight:
                    grad_weight += grad.T.float() @ h.float()
        ctx.save_for_backward(grad_hidden, grad_weight, *grad_params)
        ctx.weight_dtype = weight.dtype
        return loss, torch.cat(predictions) if predictions else labels.new_empty(0)

    @staticmethod
    def backward(ctx, grad_loss, _):
        grad_hidden, grad_weight, *grad_params = ctx.saved_tensors
        grad_hidden = None if grad_hidden is None else grad_hidden * grad_loss.to(grad_hidden.dtype)
        grad_weight = None if grad_weight is None else (grad_weight * grad_loss).to(ctx.weight_dtype)
        grad_params = [None if g is None else g * grad_loss.to(g.dtype) for g in grad_params]
        return grad_hidden, grad_weight, None, None, None, None, None, None, None, *grad_params


def selector_targets(logits, labels, top_k: int):
    """Training candidates: the top-K of each row's logits [n, V] with the gold label [n] put in place of the lowest
    where it is missing -> (candidates [n, K], the gold's index [n], whether the top-K held it [n])."""
    candidates = logits.topk(top_k, dim=-1).indices
    found = candidates == labels[:, None]
    covered = found.any(-1)
    candidates[:, -1] = torch.where(covered, candidates[:, -1], labels)
    index = torch.where(covered, found.int().argmax(-1), top_k - 1)
    return candidates, index, covered


def _selector_chunk(term: SelectorLoss, rows: slice, hidden, logits, labels, grad, need_hidden: bool,
                    grad_params: list):
    """The selector term of one chunk (rows ``rows``; ``logits`` after the transform): its weighted sum, the
    logits' gradient ``grad`` with the term's added at the candidates, the term's gradient to the chunk's hidden
    states (None without ``need_hidden``) and the selector's choice per row (-1 where the top-K misses the label: the
    walk cannot draft it). Its gradients to the selector's weights are added to ``grad_params``
    (``selector.parameters()`` order; None: not wanted)."""
    w = term.weights[rows].float()
    candidates, index, covered = selector_targets(logits.detach(), labels, term.selector.top_k)
    params = list(term.selector.parameters())
    with torch.enable_grad():
        h = hidden.detach().to(params[0].dtype).requires_grad_(need_hidden)
        transition = term.selector.transition(h, term.predecessors[rows], candidates)
        log_q = (logits.detach().gather(1, candidates).float() + transition.float()).log_softmax(-1)
        grad_scores = (log_q.exp() - F.one_hot(index, log_q.shape[1])) * w[:, None]
        wanted = [p for p, g in zip(params, grad_params) if g is not None] + ([h] if need_hidden else [])
        grads = iter(torch.autograd.grad(transition, wanted, grad_scores.to(transition.dtype), allow_unused=True)
                     if wanted else [])
    for g in grad_params:
        if g is not None:
            step = next(grads)
            if step is not None:
                g += step
    total = -(log_q.detach().gather(1, index[:, None])[:, 0] * w).sum()
    if grad is not None:  # only the K candidates' columns change (added in fp32, rounded once)
        grad.scatter_(1, candidates, (grad.gather(1, candidates).float() + grad_scores.detach()).to(grad.dtype))
    choice = torch.where(covered, candidates.gather(1, log_q.detach().argmax(-1, keepdim=True))[:, 0], -1)
    return total, grad, next(grads) if need_hidden else None, choice


def chunked_lm_loss(hidden: torch.Tensor, lm_head_weight: torch.Tensor, labels: torch.Tensor,
                    weights: torch.Tensor, chunk_size: int = LOSS_CHUNK_ROWS, predict: bool = True,
                    compiled: bool = False, transform: LogitsTransform | None = None,
                    selector_loss: SelectorLoss | None = None):
    """Weighted cross-entropy of ``hidden @ lm_head_weight.T`` (fp32 softmax) without ever holding more than
    ``chunk_size`` rows of logits; the gradients are computed in the forward (``_FusedLinearCrossEntropy``),
    with ``softmax_cross_entropy`` compiled if ``compiled``. ``transform``: the logits' multiplier and soft cap
    (None: none). ``selector_loss``: DFlash2's selector term, added to the loss sum (the weight sum stays the
    labels').

    Returns (weighted loss sum, weight sum, correct [N] bool: argmax == label, False where ignored; None
    unless ``predict``). Mean loss = loss_sum / weight_sum. With a selector term, a row that has one is correct when
    the selector, given the gold token before, chooses the label among the top-K: up to a block's first miss these
    are the choices of the walk itself, so the acceptance proxy of a DFlash2 drafter is its walk's.
    """
    weights = weights.float() * (labels != IGNORE)
    params = list(selector_loss.selector.parameters()) if selector_loss is not None else []
    loss_sum, pred = _FusedLinearCrossEntropy.apply(hidden, lm_head_weight, labels, weights, chunk_size, predict,
                                                   compiled, transform, selector_loss, *params)
    return loss_sum, weights.sum(), (pred == labels) & (labels != IGNORE) if predict else None


def acceptance_proxy(correct: torch.Tensor) -> torch.Tensor:
    """Teacher-forced acceptance per block: leading correct slots (of slots 1..B-1, given as [n, B-1]) + 1."""
    return correct.long().cumprod(dim=-1).sum(dim=-1) + 1
