"""The compact codec (issue #34): a token's K x D features stored as r coefficients of a fitted basis (the math:
``store/compact.py``).

- ``features`` [T, r]: the coefficients c = U^T x, as fp8 e4m3 bit patterns (uint8) with one float32 scale per
  token in ``feature_scales`` [T] (s = max_j |c_j| / 448), or as bfloat16 bit patterns (uint16).
- The basis U [K*D, r] float32 is fitted once, before extraction, by the ``compact_basis`` job on a sample of the
  first shard, and written as the array ``compact_basis`` of a group (``write_basis``). Every extract job encodes
  with that one basis and records its sha256; ``merge`` refuses shards whose sha256 differs from the basis file's
  and hard-links the basis into the store's root, so the store holds it once, checksummed.
- Reading (``HiddenStateStore``): ``decode`` gives back x^ = U c [n, K, D] in ``dequantized_dtype``; the basis is
  read on first use and checked against the recorded sha256. ``coefficient_view`` decodes the coefficients only,
  [n, 1, r] (the trainer's fc' = fc U reads them without the basis).
- Each shard records, per layer, the relative error of what it stores, sqrt(sum |x_k - x^_k|^2 / sum |x_k|^2)
  (``relative_error``), and the largest per-token relative error |x - x^| / |x| over the K layers together
  (``max_token_relative_error``), measured on every token as it is encoded: the store's stated bound. A
  ``dequantized_dtype`` of bfloat16 adds its rounding (<= 2^-8 |x^| per element) on reading.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch
import zarr

from . import compact
from .codec import DEQUANTIZED_DTYPES, FeatureCodec, feature_stats, register_codec
from .layout import StoreError

BASIS_ARRAY = "compact_basis"
COEFFICIENT_DTYPES = {"fp8_e4m3": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn", "bfloat16": "bfloat16"}


def write_basis(basis: compact.Basis, path) -> dict:
    """The basis as the array ``compact_basis`` of a new Zarr group at ``path`` (rows in chunks of 4,096, no
    compression), its description (``Basis.describe``, with its sha256) and energies in the array's attributes."""
    group = zarr.open_group(str(path), mode="w", zarr_format=3)
    values = basis.vectors.numpy().astype("<f4")
    array = group.create_array(BASIS_ARRAY, shape=values.shape, chunks=(min(4096, len(values)), values.shape[1]),
                               dtype="float32", compressors=[])
    array[:] = values
    description = basis.describe()
    array.attrs.update({**description, "energy": basis.energy.tolist()})
    return description


def read_basis(group_path) -> compact.Basis:
    """The basis of a group written by ``write_basis`` (a basis file or a compact store's root), checked against
    its recorded sha256."""
    array = zarr.open_array(str(Path(group_path) / BASIS_ARRAY), mode="r")
    attrs = dict(array.attrs)
    vectors = torch.from_numpy(np.ascontiguousarray(array[:], dtype=np.float32))
    basis = compact.Basis(vectors, torch.tensor(attrs["energy"], dtype=torch.float32), attrs["layers"],
                          attrs["hidden_size"], attrs["weighting"], attrs["per_layer"])
    if basis.sha256() != attrs["basis_sha256"]:
        raise StoreError(f"{group_path}: {BASIS_ARRAY} does not match its recorded sha256 (check: basis)")
    return basis


@register_codec
class CompactCodec(FeatureCodec):
    """Coefficients of a fitted basis (see the module docstring). Built with the basis (writing) or from the
    attributes and then ``bind``-ed to the store that holds the basis (reading)."""

    name = "compact"

    def __init__(self, description: dict, coefficients: str = "fp8_e4m3", dequantized_dtype: str = "bfloat16",
                 basis: compact.Basis | None = None):
        if coefficients not in COEFFICIENT_DTYPES:
            raise ValueError(f"compact coefficients must be one of {sorted(COEFFICIENT_DTYPES)}, not {coefficients!r}")
        if dequantized_dtype not in DEQUANTIZED_DTYPES:
            raise ValueError(f"dequantized dtype must be bfloat16 or float32, not {dequantized_dtype!r}")
        self.description, self.coefficients = dict(description), COEFFICIENT_DTYPES[coefficients]
        self.dequantized_dtype, self._basis, self.basis_path = dequantized_dtype, basis, None
        self._device_basis = None
        self.rank = int(self.description["rank"])
        fp8 = self.coefficients == "float8_e4m3fn"
        self.array_names = ("features", "feature_scales") if fp8 else ("features",)

    @classmethod
    def with_basis(cls, basis: compact.Basis, coefficients: str, target_dtype: str) -> "CompactCodec":
        return cls(basis.describe(), coefficients, "float32" if target_dtype == "float32" else "bfloat16", basis)

    @classmethod
    def from_config(cls, target_dtype):
        raise ValueError("extract.store_dtype compact needs its basis: the compact_basis job fits it "
                         "(CompactCodec.with_basis)")

    @classmethod
    def from_attrs(cls, attrs):
        return cls(attrs["compact"], attrs["compact"]["coefficients"], attrs.get("dequantized_dtype", "bfloat16"))

    def bind(self, store_path: str) -> "CompactCodec":
        self.basis_path = store_path
        return self

    @property
    def basis(self) -> compact.Basis:
        if self._basis is None:
            if self.basis_path is None:
                raise StoreError("compact features decode with their basis: read them through the merged store "
                                 "(HiddenStateStore), which holds it")
            basis = read_basis(self.basis_path)
            if basis.sha256() != self.description["basis_sha256"]:
                raise StoreError(f"{self.basis_path}: its basis is not the one the features were encoded with "
                                 "(check: basis)")
            self._basis = basis
        return self._basis

    def __getstate__(self):  # DataLoader workers read the basis again (or never: coefficient views)
        return {**self.__dict__, "_basis": None, "_device_basis": None}

    def row_arrays(self, num_layers, hidden_size):
        if (num_layers, hidden_size) != (self.description["layers"], self.description["hidden_size"]):
            raise StoreError(f"a basis of {self.description['layers']} x {self.description['hidden_size']} features "
                             f"for {num_layers} x {hidden_size}")
        stored = torch.uint8 if self.coefficients == "float8_e4m3fn" else torch.uint16
        arrays = {"features": ((self.rank,), stored), "feature_scales": ((), torch.float32)}
        return {name: arrays[name] for name in self.array_names}

    def _basis_on(self, device) -> compact.Basis:
        """The basis with its vectors on ``device`` (kept: the extract job encodes every batch on the GPU)."""
        if self._device_basis is None or self._device_basis.vectors.device != torch.device(device):
            basis = self.basis
            self._device_basis = dataclasses.replace(basis, vectors=basis.vectors.to(device))
        return self._device_basis

    def encode(self, features):
        stats = feature_stats(features)
        x, basis = features.float(), self._basis_on(features.device)
        values, scales = compact.encode(x, basis, self.coefficients)
        error = x - compact.decode(values, scales, basis)
        norms = torch.linalg.vector_norm(x.flatten(1), dim=1).clamp_min(torch.finfo(torch.float32).tiny)
        stats.update(error_squares=torch.linalg.vector_norm(error, dim=2).square().double().sum(0),
                     max_token_relative_error=(torch.linalg.vector_norm(error.flatten(1), dim=1) / norms).amax())
        rows = {"features": values.view(torch.uint8 if scales is not None else torch.uint16)}
        if scales is not None:
            rows["feature_scales"] = scales
        return rows, stats

    def decode(self, rows):
        values, scales = self._coefficients(rows)
        return compact.decode(values, scales, self.basis, self.feature_dtype)

    def _coefficients(self, rows):
        values = torch.from_numpy(np.ascontiguousarray(rows["features"]))
        if self.coefficients == "bfloat16":
            return values.view(torch.bfloat16), None
        if rows.get("feature_scales") is None:
            raise StoreError("compact fp8 coefficients without their feature_scales")
        return values, torch.from_numpy(np.ascontiguousarray(rows["feature_scales"]))

    def coefficient_view(self) -> "CoefficientView":
        return CoefficientView(self)

    def attrs(self):
        return {"logical_dtype": self.name, "dequantized_dtype": self.dequantized_dtype,
                "compact": {**self.description, "coefficients": self.coefficients, "basis_array": BASIS_ARRAY}}

    @property
    def feature_dtype(self):
        return getattr(torch, self.dequantized_dtype)


class CoefficientView(FeatureCodec):
    """A compact store read as its coefficients: rows [n, 1, r] in the dequantized dtype, no basis needed."""

    name = "compact coefficients"

    def __init__(self, codec: CompactCodec):
        self.codec, self.array_names = codec, codec.array_names

    def decode(self, rows):
        values, scales = self.codec._coefficients(rows)
        return compact.decode_coefficients(values, scales).to(self.feature_dtype).unsqueeze(1)

    def decoded_shape(self, num_layers, hidden_size):
        return 1, self.codec.rank

    @property
    def feature_dtype(self):
        return self.codec.feature_dtype


def compact_codec(basis_path, settings: dict, target_dtype: str) -> CompactCodec:
    """The extract job's codec: the basis file of the ``compact_basis`` job, ``extract.compact.coefficients``."""
    return CompactCodec.with_basis(read_basis(basis_path), settings["compact"]["coefficients"], target_dtype)


def basis_sha256(path) -> str:
    """The recorded sha256 of a basis file (what extract shards record and merge compares)."""
    return dict(zarr.open_array(str(Path(path) / BASIS_ARRAY), mode="r").attrs)["basis_sha256"]

