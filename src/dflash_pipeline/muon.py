"""torch's Muon with one launch sequence per shape (issue #21): the same update as ``torch.optim.Muon``.

torch's Muon (2.11-2.13, no foreach path) runs its Newton-Schulz iteration one matrix at a time: ~25 kernels per
matrix, ~900 for the drafter's 36 matrices, each a host call. The training step is bound by the host's launches,
so ``BatchedMuon`` stacks the matrices of one shape and iterates on the stack (``torch.baddbmm``), and does the
momentum and the weight updates with foreach ops: ~20 kernels per shape (the drafter has five shapes). The state
(``momentum_buffer`` per parameter), the hyper-parameters and their defaults are torch's, so checkpoints move
between the two.
"""

from __future__ import annotations

import torch
from torch.optim._muon import _adjust_lr  # torch's own per-shape scale: the same updates by construction


class BatchedMuon(torch.optim.Muon):
    """``torch.optim.Muon``, its step batched over the matrices of each shape."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            if any(p.grad.is_sparse or torch.is_complex(p) for p in params):
                raise RuntimeError("Muon supports neither sparse gradients nor complex parameters")
            grads = [p.grad for p in params]
            bufs = [self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad)) for p in params]
            momentum, lr = group["momentum"], float(group["lr"])
            torch._foreach_lerp_(bufs, grads, 1 - momentum)
            updates = torch._foreach_lerp(grads, bufs, momentum) if group["nesterov"] else bufs
            by_shape: dict[tuple, list[int]] = {}
            for i, p in enumerate(params):
                by_shape.setdefault((p.shape, p.dtype), []).append(i)
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
            for (shape, _), members in by_shape.items():
                stacked = torch.stack([updates[i] for i in members])
                ortho = newton_schulz(stacked, group["ns_coefficients"], group["ns_steps"], group["eps"])
                torch._foreach_add_([params[i] for i in members], list(ortho.to(params[members[0]].dtype).unbind(0)),
                                    alpha=-_adjust_lr(lr, group["adjust_lr_fn"], shape))
        return loss


def newton_schulz(stacked: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                  eps: float) -> torch.Tensor:
    """torch's ``_zeropower_via_newtonschulz`` (bf16) of every matrix of ``stacked`` [G, A, B] at once."""
    a, b, c = coefficients
    x = stacked.bfloat16()
    tall = x.size(1) > x.size(2)
    if tall:
        x = x.mT
    x = x / torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x

