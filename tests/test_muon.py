"""BatchedMuon (dflash_pipeline.muon) against torch.optim.Muon: the same steps, state and checkpoints."""

import copy

import pytest
import torch

from dflash_pipeline.muon import BatchedMuon

# square, wide and tall matrices, several of a shape (the drafter's q/o, k/v, gate/up, down and fc kinds)
SHAPES = [(48, 48)] * 3 + [(16, 48)] * 2 + [(80, 48)] * 2 + [(48, 80)] * 2 + [(48, 144)]


def parameters(seed: int = 1) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g) * 0.05) for shape in SHAPES]


def relative(a: torch.Tensor, b: torch.Tensor, scale: torch.Tensor) -> float:
    return float((a - b).detach().norm() / scale.detach().norm())


@pytest.mark.parametrize("options", [dict(), dict(nesterov=False), dict(adjust_lr_fn="match_rms_adamw"),
                                     dict(momentum=0.5, ns_steps=3)])
def test_batched_muon_steps_equal_torch_muon(options):
    """Each step from the same weights and momentum moves every matrix as torch's Muon does. The weight decay is
    large so that a wrong one shows; one matrix without a gradient stays as it is in both."""
    ours, theirs = parameters(), parameters()
    kwargs = dict(lr=0.02, weight_decay=2.0, **options)
    batched, reference = BatchedMuon(ours, **kwargs), torch.optim.Muon(theirs, **kwargs)
    for step in range(4):
        g = torch.Generator().manual_seed(100 + step)
        before = [p.detach().clone() for p in theirs]
        for i, (p, q) in enumerate(zip(ours, theirs)):
            grad = None if i == 4 else torch.randn(p.shape, generator=g)
            p.grad, q.grad = grad, None if grad is None else grad.clone()
        batched.step()
        reference.step()
        for i, (p, q, b) in enumerate(zip(ours, theirs, before)):
            if i == 4:
                assert torch.equal(p, b) and torch.equal(q, b)
                continue
            # equal on the CPUs tried; bf16 matmuls batched may round differently elsewhere: Muon's bf16
            # Newton-Schulz turns a last-bit difference into ~1 % of the update
            assert relative(p, q, q - b) <= 0.03, (step, i)
            assert relative(batched.state[p]["momentum_buffer"], reference.state[q]["momentum_buffer"],
                            reference.state[q]["momentum_buffer"]) <= 1e-6
        with torch.no_grad():  # the next step from the same point: each step's own difference
            for p, q in zip(ours, theirs):
                p.copy_(q)
                if q in reference.state:
                    batched.state[p]["momentum_buffer"].copy_(reference.state[q]["momentum_buffer"])


def test_batched_muon_takes_torch_muons_checkpoint():
    ours, theirs = parameters(), parameters()
    batched, reference = BatchedMuon(ours, lr=0.02), torch.optim.Muon(theirs, lr=0.02)
    for p, q in zip(ours, theirs):
        q.grad = torch.randn_like(q)
    reference.step()
    batched.load_state_dict(copy.deepcopy(reference.state_dict()))  # as a checkpoint file holds it: not shared
    with torch.no_grad():
        for p, q in zip(ours, theirs):
            p.copy_(q)
    before = [q.detach().clone() for q in theirs]
    for p, q in zip(ours, theirs):
        p.grad = q.grad = torch.randn_like(q)
    batched.step()
    reference.step()
    for p, q, b in zip(ours, theirs, before):
        assert relative(p, q, q - b) <= 0.03
    assert reference.state_dict()["state"].keys() == batched.state_dict()["state"].keys()
