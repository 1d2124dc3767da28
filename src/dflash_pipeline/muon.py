"""torch's Muon with one launch sequence per shape (issue #21), its Newton-Schulz work shared by the ranks (issue #35):
the same update as ``torch.optim.Muon``.

torch's Muon (2.11-2.13, no foreach path) runs its Newton-Schulz iteration one matrix at a time: ~25 kernels per
matrix, ~900 for the drafter's 36 matrices, each a host call. The training step is bound by the host's launches,
so ``BatchedMuon`` stacks the matrices of one shape and iterates on the stack (``torch.baddbmm``), and does the
momentum and the weight updates with foreach ops: ~20 kernels per shape (the drafter has five shapes). The state
(``momentum_buffer`` per parameter), the hyper-parameters and their defaults are torch's, so checkpoints move
between the two.

At the 27B drafter's shape the Newton-Schulz iterations are ~2e14 FLOPs per step (1.7 B parameters), ~0.35 s of an
H200, and under data parallelism every rank would repeat them on the same all-reduced gradients. With a
``process_group`` each rank orthogonalises only its share of the matrices (``shard_assignment``: whole matrices,
balanced by their Newton-Schulz FLOPs), then one all-gather of the bf16 results gives every rank every update. The
momentum and the weight updates stay on every rank (cheap, and the state stays torch's: a checkpoint of any rank
resumes any world size). Each matrix's Newton-Schulz is the same computation sharded or not (per-matrix norms and
matmuls in a batch of its shape; only the batch's size differs), so the update equals the unsharded one: bitwise on
the CPU (tests/test_muon.py); on GPUs a batched GEMM may pick another kernel for another batch size, which changes
the bf16 rounding, not the result beyond it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.optim._muon import _adjust_lr  # torch's own per-shape scale: the same updates by construction


def newton_schulz_cost(shape) -> int:
    """FLOPs of one Newton-Schulz iteration of an A x B matrix, up to a constant: with m = min(A, B) and n = max,
    the Gram matrix (m^2 n), its square (m^3) and the product with x (m^2 n), as ``newton_schulz`` computes them."""
    m, n = sorted(shape)
    return m * m * (2 * n + m)


def shard_assignment(shapes: list, world: int) -> list[int]:
    """The rank that orthogonalises each matrix: the costliest first, each to the least-loaded rank (ties: the
    lowest rank) — the same on every rank."""
    load, owner = [0] * world, [0] * len(shapes)
    for index in sorted(range(len(shapes)), key=lambda i: -newton_schulz_cost(shapes[i])):
        rank = min(range(world), key=lambda r: load[r])
        owner[index] = rank
        load[rank] += newton_schulz_cost(shapes[index])
    return owner


class BatchedMuon(torch.optim.Muon):
    """``torch.optim.Muon``, its step batched over the matrices of each shape; with ``process_group``, the
    Newton-Schulz work of the step shared by its ranks (all of them must step the same parameters)."""

    def __init__(self, params, *args, process_group=None, **kwargs):
        super().__init__(params, *args, **kwargs)
        self.process_group = process_group

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
            ortho = self.orthogonalize(updates, group)
            torch._foreach_mul_(params, 1 - lr * group["weight_decay"])
            for (shape, _), members in _by_shape(params, range(len(params))).items():
                torch._foreach_add_([params[i] for i in members], [ortho[i] for i in members],
                                    alpha=-_adjust_lr(lr, group["adjust_lr_fn"], shape))
        return loss

    def orthogonalize(self, updates: list[torch.Tensor], group: dict) -> list[torch.Tensor]:
        """Newton-Schulz of every update (in bf16, returned in the updates' dtype), batched by shape; with a process
        group, each rank computes its share (``shard_assignment``) and an all-gather (bf16) brings the others'."""
        dtype = updates[0].dtype
        if any(u.dtype != dtype for u in updates):
            raise ValueError("BatchedMuon: parameters of one group must share a dtype")
        world = dist.get_world_size(self.process_group) if self.process_group is not None else 1
        owner = shard_assignment([u.shape for u in updates], world)
        rank = dist.get_rank(self.process_group) if world > 1 else 0
        ortho: list[torch.Tensor | None] = [None] * len(updates)
        for _, members in _by_shape(updates, [i for i in range(len(updates)) if owner[i] == rank]).items():
            stacked = newton_schulz(torch.stack([updates[i] for i in members]), group["ns_coefficients"],
                                    group["ns_steps"], group["eps"])
            for i, matrix in zip(members, (stacked if world > 1 else stacked.to(dtype)).unbind(0)):
                ortho[i] = matrix
        if world == 1:
            return ortho
        shares = [[i for i in range(len(updates)) if owner[i] == r] for r in range(world)]
        size = max(sum(updates[i].numel() for i in share) for share in shares)
        mine = torch.zeros(size, dtype=torch.bfloat16, device=updates[0].device)
        if shares[rank]:
            flat = torch.cat([ortho[i].reshape(-1) for i in shares[rank]])
            mine[: flat.numel()] = flat
        gathered = torch.empty(world * size, dtype=torch.bfloat16, device=mine.device)
        dist.all_gather_into_tensor(gathered, mine, group=self.process_group)
        gathered = gathered.to(dtype)
        for r, share in enumerate(shares):
            offset = r * size
            for i in share:
                ortho[i] = gathered[offset : offset + updates[i].numel()].view(updates[i].shape)
                offset += updates[i].numel()
        return ortho


def _by_shape(tensors, indices) -> dict[tuple, list[int]]:
    groups: dict[tuple, list[int]] = {}
    for i in indices:
        groups.setdefault((tuple(tensors[i].shape), tensors[i].dtype), []).append(i)
    return groups


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
