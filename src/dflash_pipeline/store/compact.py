"""The compact feature store's math: a fitted linear low-rank basis of the K captured layers (issue #34; the codec
that stores with it: ``compact_codec``; training over its coefficients: ``train/compact_fc.py``).

A token's features x [K, D] are read as one vector of K*D numbers. A basis ``U`` [K*D, r] with orthonormal columns,
fitted once on a sample of the first shard, turns them into r coefficients ``c = U^T x``; the store keeps c (in
bfloat16, or fp8 e4m3 with one float32 scale per token) and the reader gives back ``x^ = U c``. The basis is
uncentred (no mean is subtracted): the drafter's first operation on the features is the bias-free linear ``fc``,
so fc(x^) = fc U c, and training can keep ``fc' = fc U`` [D, r] over the coefficients themselves; the export
writes ``fc = fc' U^T``, an ordinary DFlash checkpoint (``full_fc``).

The fit (``BasisFit``): the top-r eigenvectors of the second-moment matrix sum_t w_t x_t x_t^T (float64), with
``weighting`` "energy" (w_t = 1: the basis that keeps the most squared norm over all tokens, which a few tokens of
huge norm dominate, e.g. SmolLM2's first ``<|im_start|>``) or "token" (w_t = 1 / |x_t|^2: every token's direction
counts alike); ``per_layer`` fits each layer's D x D block alone (r / K columns each: a block-diagonal U).
Each column's sign makes its largest-magnitude entry positive, so a fit on the same data gives the same basis.

Round-trip error per token (U has orthonormal columns, so the two parts are orthogonal)::

    |x - x^|^2 = (|x|^2 - |c|^2)  +  |c - c^|^2
                 projection          coefficient rounding

The projection part depends on the data and is measured when a shard is written (``token_errors``); the rounding
part is bounded a priori (``rounding_bound``): fp8 e4m3 with a per-token scale s = max|c| / 448 moves each
coefficient by at most 2^-4 |c_j| + 2^-10 s (the store's fp8 bound), bfloat16 by at most 2^-8 |c_j| (8 significant
bits, rounded to nearest), so
|c - c^| <= sqrt(sum_j bound_j^2).
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import torch

from .codec import dequantize_fp8, fp8_error_bound, quantize_fp8

COEFFICIENT_DTYPES = {"bfloat16": 2, "float8_e4m3fn": 1}  # -> bytes per stored coefficient
WEIGHTINGS = ("energy", "token")


@dataclasses.dataclass(frozen=True)
class Basis:
    """``vectors`` [K*D, r] float32 with orthonormal columns; ``energy`` [r]: the fit's weighted second moment along
    each column (descending within a layer's block)."""

    vectors: torch.Tensor
    energy: torch.Tensor
    num_layers: int
    hidden_size: int
    weighting: str = "energy"
    per_layer: bool = False

    @property
    def rank(self) -> int:
        return self.vectors.shape[1]

    def sha256(self) -> str:
        """Checksum of the basis as stored: its float32 values, little-endian, C order."""
        return hashlib.sha256(np.ascontiguousarray(self.vectors.numpy(), dtype="<f4").tobytes()).hexdigest()

    def describe(self) -> dict:
        return {"method": "linear low-rank basis, uncentred", "rank": self.rank, "weighting": self.weighting,
                "per_layer": self.per_layer, "layers": self.num_layers, "hidden_size": self.hidden_size,
                "basis_sha256": self.sha256()}


class BasisFit:
    """Accumulates the second moments of feature rows [n, K, D] (``add``, any device), then ``fit(rank)``."""

    def __init__(self, num_layers: int, hidden_size: int, *, weighting: str = "energy", per_layer: bool = False,
                 device="cpu"):
        if weighting not in WEIGHTINGS:
            raise ValueError(f"basis weighting must be one of {WEIGHTINGS}, not {weighting!r}")
        self.num_layers, self.hidden_size = num_layers, hidden_size
        self.weighting, self.per_layer = weighting, per_layer
        shape = (num_layers, hidden_size, hidden_size) if per_layer else (num_layers * hidden_size,) * 2
        self.moments = torch.zeros(shape, dtype=torch.float64, device=device)
        self.tokens = 0

    def add(self, features: torch.Tensor, rows_per_step: int = 4096) -> None:
        if features.shape[1:] != (self.num_layers, self.hidden_size):
            raise ValueError(f"features of shape {tuple(features.shape)} for a basis of {self.num_layers} x "
                             f"{self.hidden_size}")
        for start in range(0, features.shape[0], rows_per_step):
            x = features[start : start + rows_per_step].to(self.moments.device, torch.float64)
            if not torch.isfinite(x).all():
                raise ValueError("non-finite features in the basis sample")
            if self.per_layer:
                x = x.transpose(0, 1)  # [K, n, D]
                w = x.square().sum(-1, keepdim=True) if self.weighting == "token" else None
                self.moments += (x / w.clamp_min(1e-30)).transpose(1, 2) @ x if w is not None else x.transpose(1, 2) @ x
            else:
                x = x.reshape(x.shape[0], -1)
                w = x.square().sum(-1, keepdim=True) if self.weighting == "token" else None
                self.moments += (x / w.clamp_min(1e-30)).T @ x if w is not None else x.T @ x
            self.tokens += x.shape[-2]

    def fit(self, rank: int) -> Basis:
        K, D = self.num_layers, self.hidden_size
        if not 0 < rank <= K * D or (self.per_layer and rank % K):
            rule = " (per layer: a multiple of K)" if self.per_layer else ""
            raise ValueError(f"rank {rank} for {K} x {D} features{rule}")
        if self.tokens < rank:
            raise ValueError(f"a basis of rank {rank} from {self.tokens} sample tokens: the sample is too small")
        blocks = self.moments if self.per_layer else self.moments[None]
        take = rank // K if self.per_layer else rank
        vectors = torch.zeros(K * D, rank, dtype=torch.float64, device=self.moments.device)
        energy = []
        for k, moments in enumerate(blocks):
            values, eigvecs = torch.linalg.eigh((moments + moments.T) / 2)  # ascending
            top = eigvecs[:, -take:].flip(1)
            rows = slice(k * D, (k + 1) * D) if self.per_layer else slice(None)
            vectors[rows, k * take : (k + 1) * take] = top
            energy.append(values[-take:].flip(0) / self.tokens)
        signs = torch.sign(vectors.gather(0, vectors.abs().argmax(0, keepdim=True)))
        return Basis((vectors * signs).float().cpu().contiguous(), torch.cat(energy).float().cpu(), K, D,
                     self.weighting, self.per_layer)


def fit_basis(features: torch.Tensor, rank: int, **options) -> Basis:
    """A basis of ``rank`` columns fitted on feature rows [n, K, D] (``BasisFit``'s options)."""
    fit = BasisFit(features.shape[1], features.shape[2], **options)
    fit.add(features)
    return fit.fit(rank)


def coefficients(features: torch.Tensor, basis: Basis) -> torch.Tensor:
    """Features [n, K, D] -> float32 coefficients [n, r] = x U (on the features' device)."""
    return features.reshape(features.shape[0], -1).float() @ basis.vectors.to(features.device)


def reconstruct(coefficients: torch.Tensor, basis: Basis, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Coefficients [n, r] -> features [n, K, D] = U c."""
    x = coefficients.float() @ basis.vectors.to(coefficients.device).T
    return x.view(-1, basis.num_layers, basis.hidden_size).to(dtype)


def encode(features: torch.Tensor, basis: Basis, dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Features [n, K, D] -> stored coefficients: (bfloat16 [n, r], None) or (fp8 e4m3 bit patterns uint8 [n, r],
    float32 scales [n])."""
    c = coefficients(features, basis)
    if dtype == "bfloat16":
        return c.to(torch.bfloat16), None
    if dtype == "float8_e4m3fn":
        return quantize_fp8(c)
    raise ValueError(f"coefficient dtype must be one of {sorted(COEFFICIENT_DTYPES)}, not {dtype!r}")


def decode_coefficients(values: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """Stored coefficients (``encode``'s output) -> float32 coefficients [n, r]."""
    if values.dtype == torch.bfloat16:
        return values.float()
    if scales is None:
        raise ValueError("fp8 coefficients without their scales")
    return dequantize_fp8(values, scales)


def decode(values: torch.Tensor, scales: torch.Tensor | None, basis: Basis,
           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored coefficients -> features [n, K, D] in ``dtype``."""
    return reconstruct(decode_coefficients(values, scales), basis, dtype)


def rounding_bound(c: torch.Tensor, dtype: str, scales: torch.Tensor | None = None) -> torch.Tensor:
    """Per token, the bound on |c - c^| (float32 coefficients [n, r] -> [n]) of storing them in ``dtype``."""
    if dtype == "bfloat16":
        per_element = 2.0**-8 * c.abs() * (1 + 2.0**-20)
    else:
        per_element = fp8_error_bound(c, scales)
    return torch.linalg.vector_norm(per_element, dim=1)


def token_errors(features: torch.Tensor, basis: Basis, values: torch.Tensor,
                 scales: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """Per token [n], measured where a shard is written: ``norm`` |x|, ``projection`` |x - U U^T x| and ``total``
    |x - x^| of the stored coefficients, each per layer too (``*_layer`` [n, K]: |x_k - x^_k|, |x_k|)."""
    x = features.float()
    c = coefficients(x, basis)
    stored = reconstruct(decode_coefficients(values, scales), basis)
    projected = reconstruct(c, basis)
    return {"norm": x.flatten(1).norm(dim=1), "projection": (x - projected).flatten(1).norm(dim=1),
            "total": (x - stored).flatten(1).norm(dim=1), "norm_layer": x.norm(dim=2),
            "total_layer": (x - stored).norm(dim=2)}


def default_rank(num_layers: int, hidden_size: int, fraction: float = 1 / 3) -> int:
    """``fraction`` of K * D coefficients, a multiple of 64: 1/3 gives 960 for SmolLM2 (5 x 576), ~6x fewer bytes
    than bf16 with fp8 coefficients, the setting benchmarks/journal/2026-12-04_results.md ("The compact store") measured."""
    return max(64, round(num_layers * hidden_size * fraction / 64) * 64)


def bytes_per_token(rank: int, dtype: str) -> int:
    """Stored bytes of one token's coefficients before compression (fp8: plus its float32 scale)."""
    return rank * COEFFICIENT_DTYPES[dtype] + (4 if dtype == "float8_e4m3fn" else 0)
