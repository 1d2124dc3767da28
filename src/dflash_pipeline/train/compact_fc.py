"""Training a drafter over a compact store's coefficients (docs/design.md, "The store"): the drafter's first
operation on the features is the bias-free linear ``fc``, so over the reconstruction x^ = U c it is fc(U c) =
(fc U) c; training keeps ``fc' = fc U`` [D, r] over the coefficients themselves, and the export writes
``fc = fc' U^T``, an ordinary DFlash checkpoint (the basis: ``store/compact.py``)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..store.compact import Basis


def coefficient_fc(fc: nn.Linear, basis: Basis) -> nn.Linear:
    """A bias-free Linear(r -> D) over coefficients equal to ``fc`` over the reconstruction U c: weight fc.W U (same
    device and dtype as ``fc``)."""
    if fc.bias is not None or fc.in_features != basis.vectors.shape[0]:
        raise ValueError(f"fc of {fc.in_features} inputs{' with a bias' if fc.bias is not None else ''} for a basis "
                         f"over {basis.vectors.shape[0]} features")
    weight = fc.weight.detach().float() @ basis.vectors.to(fc.weight.device)
    out = nn.Linear(basis.rank, fc.out_features, bias=False, device=fc.weight.device, dtype=fc.weight.dtype)
    with torch.no_grad():
        out.weight.copy_(weight)
    return out


def full_fc_weight(fc_weight: torch.Tensor, basis: Basis) -> torch.Tensor:
    """The ordinary drafter's fc weight [D, K*D] = fc' U^T of a coefficient fc' weight [D, r] (float32 product, in
    fc''s dtype)."""
    return (fc_weight.detach().float() @ basis.vectors.to(fc_weight.device).T).to(fc_weight.dtype)


@contextlib.contextmanager
def exported_fc(drafter: nn.Module, basis: Basis):
    """The coefficient drafter as the ordinary one for the duration (e.g. of ``save_dflash``): its ``fc`` is the
    bias-free Linear(K*D -> D) of weight fc' U^T; fc' is back in place afterwards."""
    trained = drafter.fc
    full = nn.Linear(basis.vectors.shape[0], trained.out_features, bias=False, device=trained.weight.device,
                     dtype=trained.weight.dtype)
    with torch.no_grad():
        full.weight.copy_(full_fc_weight(trained.weight, basis))
    drafter.fc = full
    try:
        yield drafter
    finally:
        drafter.fc = trained


