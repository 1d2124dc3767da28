"""One training step's parts (docs/design.md, "DFlash, precisely"): the packed forward and loss, the gradients of
a global batch across ranks, the optimisers and the learning-rate schedule. No host sync in any of them."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..drafter import DFlashDrafter
from ..losses import LOSS_CHUNK_ROWS, LogitsTransform, SelectorLoss, chunked_lm_loss
from ..muon import BatchedMuon
from ..train_data import Pack
from .config import TrainConfig


def packed_forward(drafter, pack: Pack, amp: bool, train: bool, chunk_rows: int = LOSS_CHUNK_ROWS):
    """Weighted loss sum, weight sum and correct [n, B-1] (validation only) of a pack; only the slots with a
    loss reach the LM head. ``chunk_rows``: slots per chunk of the LM head and loss (the memory/launch trade-off of
    ``chunked_lm_loss``). A DFlash2 drafter's loss sum includes its selector term (``selector_loss``), weighted by
    ``drafter.selector_loss_weight``."""
    # FlexAttention routes fewer than 128 queries to its decoding kernel, which has no kernel for some shapes
    # (e.g. head_dim 16): such small packs take the dense mask, which is small for them anyway.
    impl = "sdpa" if pack.blocks.numel() < 128 else None
    with torch.autocast(pack.context.device.type, dtype=torch.bfloat16, enabled=amp):
        hidden = drafter.forward_blocks(pack.context, pack.anchors, pack.blocks, lengths=pack.lengths,
                                        block_counts=pack.block_counts, attn_impl=impl)
        n, B, D = hidden.shape
        config = drafter.config
        transform = None
        if config.output_multiplier != 1.0 or config.final_logit_softcapping is not None:
            transform = LogitsTransform(config.output_multiplier, config.final_logit_softcapping)
        loss, weight, correct = chunked_lm_loss(hidden.reshape(n * B, D).index_select(0, pack.slots),
                                                drafter.lm_head.weight, pack.labels, pack.weights, chunk_rows,
                                                predict=not train, compiled=drafter.pointwise_compiled,
                                                transform=transform, selector_loss=selector_loss(drafter, pack))
    if train:
        return loss, weight, None
    dense = torch.zeros(n * B, dtype=torch.bool, device=hidden.device)
    dense[pack.slots] = correct
    return loss, weight, dense.view(n, B)[:, 1:]


def selector_loss(drafter, pack: Pack) -> SelectorLoss | None:
    """A DFlash2 drafter's selector term over the pack's loss slots, teacher-forced: slot k's predecessor is the
    gold token of slot k-1 (the anchor's for slot 1), and only slots whose slots 1..k all have a label take part (a
    predecessor is then always a label of the pack), each with ``selector_loss_weight`` * its slot weight. None for
    a DFlash drafter or a weight of 0."""
    weight = drafter.selector_loss_weight
    if drafter.candidate_selector is None or not weight:
        return None
    B, slots = drafter.block_size, pack.slots
    block, k = slots // B, slots % B
    index = torch.arange(slots.shape[0], device=slots.device)
    eligible = index - torch.searchsorted(slots, block * B) == k - 1  # slots are sorted, slot 0 never among them
    predecessors = torch.where(k == 1, pack.blocks[block, 0], pack.labels[(index - 1).clamp(min=0)])
    return SelectorLoss(drafter.candidate_selector, predecessors, pack.weights * eligible * weight)


def accumulate_gradients(drafter, packs: list[Pack], total_weight: torch.Tensor, amp: bool,
                         chunk_rows: int = LOSS_CHUNK_ROWS) -> torch.Tensor:
    """Forward + backward of a step's packs; each pack's loss is divided by ``total_weight`` (the global batch's),
    so the accumulated gradients are those of the global mean. -> loss sum (float64, on the device)."""
    loss_sum = torch.zeros((), dtype=torch.float64, device=total_weight.device)
    for pack in packs:
        loss, _, _ = packed_forward(drafter, pack, amp, train=True, chunk_rows=chunk_rows)
        (loss / total_weight.float()).backward()
        loss_sum += loss.detach().double()
    return loss_sum


# ---- across ranks (no-ops in one process) ----
def all_sum(tensor: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor


def all_sum_grads(params) -> None:
    """Sum the gradients over ranks (a rank with no sequence in this batch contributes zeros)."""
    if dist.is_initialized():
        for p in params:
            p.grad = torch.zeros_like(p) if p.grad is None else p.grad
        for handle in [dist.all_reduce(p.grad, async_op=True) for p in params]:
            handle.wait()


# ---- optimisers ----
def cosine_with_warmup(total_steps: int, warmup_ratio: float):
    warmup = max(1, round(total_steps * warmup_ratio))

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total_steps - warmup))))

    return factor


def make_optimizers(cfg: TrainConfig, drafter: DFlashDrafter) -> list[torch.optim.Optimizer]:
    """AdamW over every trainable weight; or Muon over the 2-D weights of the draft layers and ``fc`` (at
    ``muon_lr``; its Newton-Schulz work shared by the ranks under DDP) and AdamW over the rest (norms, biases)."""
    named = [(name, p) for name, p in drafter.named_parameters() if p.requires_grad]
    adamw = dict(lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    if cfg.optimizer == "adamw":
        return [torch.optim.AdamW([p for _, p in named], **adamw)]
    if cfg.optimizer != "muon":
        raise ValueError(f"train.optimizer {cfg.optimizer!r}: expected adamw or muon")
    matrices = [p for name, p in named if p.ndim == 2 and name.startswith(("layers.", "fc."))]
    others = [p for name, p in named if not (p.ndim == 2 and name.startswith(("layers.", "fc.")))]
    # under DDP the ranks share the Newton-Schulz work (muon.py): the same update as one process's
    group = dist.group.WORLD if dist.is_initialized() else None
    return [BatchedMuon(matrices, lr=cfg.muon_lr, weight_decay=cfg.weight_decay, process_group=group),
            torch.optim.AdamW(others, **adamw)]


def make_schedulers(optimizers, total_steps: int, warmup_ratio: float) -> list:
    """One cosine-with-warm-up schedule for every optimiser."""
    schedule = cosine_with_warmup(total_steps, warmup_ratio)
    return [torch.optim.lr_scheduler.LambdaLR(o, schedule) for o in optimizers]
