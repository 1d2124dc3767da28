"""Feature codecs: how a shard's feature rows [n, K, D] are stored and read back (docs/design.md, "The store").

A codec is chosen once, from ``extract.store_dtype`` and the target's dtype (``store_codec``), or from a
shard's or store's attributes (``codec_from_attrs``); the writer and the reader use the same object. To add
one, subclass ``FeatureCodec`` and decorate it with ``register_codec``; it says

- ``row_arrays``: the row-chunked arrays it stores (row i belongs to token i; the first is ``features``), each
  with its row shape and element type. Every one of them is chunked, CRC-checked and digested like
  ``features``;
- ``encode``: feature rows (any device, any float dtype) -> those arrays' rows, plus ``feature_stats``;
- ``decode``: the arrays' rows (numpy, as stored) -> a feature tensor of dtype ``feature_dtype``;
- ``decodes_on_device``: whether streamed training hands the stored rows over as they are and decodes them on the
  training device (``decode_tensors``), for codecs whose stored bytes are fewer than the decoded ones;
- ``attrs``: what it records in the features array's, the shard's and the store's attributes
  (``logical_dtype`` = its registered name, plus whatever ``from_attrs`` needs to rebuild it).

The codecs here: ``float32`` and ``bfloat16`` are lossless (blosc byte-shuffle + zstd on top; bfloat16 is
stored as its uint16 bit pattern and viewed back without a copy); ``float8_e4m3fn`` stores each value as the
uint8 bit pattern of ``x / s`` rounded to e4m3, with one float32 scale per token and layer,
``s[t, k] = max_d |x[t, k, d]| / 448`` (1 for an all-zero vector), in the array ``feature_scales`` [T, K]. The
reader dequantises transparently (``q * s``) to ``dequantized_dtype`` (the target's compute dtype). Error bound
per element, with ``x^ = q * s`` in float32 (``fp8_error_bound``)::

    |x - x^| <= 2^-4 * |x| + 2^-10 * s

e4m3 keeps 3 mantissa bits, so rounding a normal value (|x / s| >= 2^-6) moves it by at most half a
unit in the last place, 2^-4 of its own magnitude; below that the subnormal spacing is 2^-9, so the
absolute error is at most 2^-10 * s, and elements with |x| <= 2^-10 * s = absmax * 2^-10 / 448
(about 2.2e-6 of the token's absmax in that layer) flush to zero. The token's largest element maps to
448 exactly. A bfloat16 ``dequantized_dtype`` adds the bfloat16 rounding of x^ (<= 2^-9 * |x^|).
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import torch

from .layout import StoreError

FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP8_SCALE = {"array": "feature_scales", "shape": "[T, K]", "dtype": "float32",
             "value": "max over d of |x[t, k, d]| / 448 (1 for an all-zero vector)", "decode": "x = q * s"}
DEQUANTIZED_DTYPES = ("bfloat16", "float32")


def feature_stats(values: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-layer statistics of features [n, K, D] (any device, no host sync): non-finite values,
    all-zero token vectors, max |x| and sum of x^2 over the finite values (float64 sums)."""
    finite = torch.isfinite(values)
    clean = torch.where(finite, values, torch.zeros((), dtype=values.dtype, device=values.device))
    token_absmax = clean.abs().amax(dim=2)
    return {
        "nonfinite": (~finite).sum(dim=(0, 2)),
        "zero_tokens": (values == 0).all(dim=2).sum(dim=0),
        "absmax": token_absmax.amax(dim=0).double(),
        "sum_squares": torch.linalg.vector_norm(clean, dim=2, dtype=torch.float32).square().double().sum(dim=0),
        "token_absmax": token_absmax,
    }


def quantize_fp8(x: torch.Tensor, absmax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-vector fp8 e4m3: ``x`` [..., D] -> (uint8 bit patterns [..., D], float32 scales [...]).

    ``s = max_d |x| / 448`` (1 where the vector is all zero), ``q = e4m3(x / s)`` computed in float32
    (round to nearest even). ``absmax`` may be passed when the caller has it already. Works on any device.
    """
    x = x.float()
    if absmax is None:
        absmax = x.abs().amax(dim=-1)
    scale = absmax.float() / FP8_E4M3_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (x / scale.unsqueeze(-1)).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(torch.uint8), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of ``quantize_fp8``: uint8 bit patterns [..., D] and scales [...] -> ``dtype`` values."""
    values = q.view(torch.float8_e4m3fn).float() * scale.float().unsqueeze(-1)
    return values.to(dtype)


def fp8_error_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The documented per-element bound on ``|x - dequantize_fp8(*quantize_fp8(x))|`` (float32 output):
    ``2^-4 |x| + 2^-10 s``, with a relative slack of 2^-20 for the float32 roundings of x/s and q*s."""
    bound = 2.0**-4 * x.float().abs() + 2.0**-10 * scale.float().unsqueeze(-1)
    return bound * (1 + 2.0**-20)


class FeatureCodec:
    """How feature rows are stored; see the module docstring for what a codec must say."""

    name: ClassVar[str]  # recorded as the ``logical_dtype``
    aliases: ClassVar[tuple[str, ...]] = ()  # other names ``extract.store_dtype`` may give it
    array_names: ClassVar[tuple[str, ...]] = ("features",)  # the keys of row_arrays, encode and decode
    decodes_on_device: ClassVar[bool] = False

    @classmethod
    def from_config(cls, target_dtype: str) -> FeatureCodec:
        """The codec for a target computing in ``target_dtype`` (float32, bfloat16 or float16)."""
        return cls()

    @classmethod
    def from_attrs(cls, attrs: dict) -> FeatureCodec:
        """The codec a shard's or store's attributes describe."""
        return cls()

    def row_arrays(self, num_layers: int, hidden_size: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Array name -> (shape of one row, element type as stored), for ``array_names``."""
        raise NotImplementedError

    def encode(self, features: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Features [n, K, D] -> (array name -> contiguous rows in the stored element type, ``feature_stats``),
        on the features' device, without a host synchronisation."""
        raise NotImplementedError

    def decode(self, rows: dict[str, np.ndarray]) -> torch.Tensor:
        """Stored rows of each array -> features [n, K, D] of ``feature_dtype``."""
        raise NotImplementedError

    def decode_tensors(self, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """``decode`` of stored rows already in tensors, on their device (codecs that ``decodes_on_device``)."""
        raise NotImplementedError

    def attrs(self) -> dict:
        """The attributes that say how ``features`` decode (in the features array's, shard's and store's)."""
        return {"logical_dtype": self.name}

    @property
    def feature_dtype(self) -> torch.dtype:
        raise NotImplementedError

    def decoded_shape(self, num_layers: int, hidden_size: int) -> tuple[int, int]:
        """The shape of one token's decoded features."""
        return num_layers, hidden_size

    def bind(self, store_path: str) -> FeatureCodec:
        """The codec reading a merged store at ``store_path``, for codecs that keep data beside the shards (the
        compact codec's basis); the others need nothing."""
        return self

    def coefficient_view(self) -> FeatureCodec:
        """A codec that decodes the stored coefficients only (the compact codec's); others have none."""
        raise StoreError(f"{self.name} features have no coefficients to read: train.coefficients needs a compact store")


CODECS: dict[str, type[FeatureCodec]] = {}
_ALIASES: dict[str, str] = {}


def register_codec(cls: type[FeatureCodec]) -> type[FeatureCodec]:
    """Make a codec known by its name and aliases (a class decorator)."""
    CODECS[cls.name] = cls
    _ALIASES.update({alias: cls.name for alias in cls.aliases})
    return cls


class _Lossless(FeatureCodec):
    dtype: ClassVar[torch.dtype]
    stored: ClassVar[torch.dtype]

    def row_arrays(self, num_layers, hidden_size):
        return {"features": ((num_layers, hidden_size), self.stored)}

    def encode(self, features):
        values = features.to(self.dtype).contiguous()
        return {"features": values.view(self.stored)}, feature_stats(values)

    def decode(self, rows):
        return torch.from_numpy(np.ascontiguousarray(rows["features"])).view(self.dtype)

    @property
    def feature_dtype(self):
        return self.dtype


@register_codec
class Float32Codec(_Lossless):
    name, dtype, stored = "float32", torch.float32, torch.float32


@register_codec
class Bfloat16Codec(_Lossless):
    name, dtype, stored = "bfloat16", torch.bfloat16, torch.uint16


@register_codec
class Fp8Codec(FeatureCodec):
    """fp8 e4m3 with one float32 scale per token and layer, dequantised to ``dequantized_dtype`` on reading."""

    name, aliases = "float8_e4m3fn", ("fp8_e4m3", "float8_e4m3")
    array_names = ("features", FP8_SCALE["array"])
    decodes_on_device = True  # 1 byte per value and a scale per vector, against 2 or 4 bytes decoded

    def __init__(self, dequantized_dtype: str = "bfloat16"):
        if dequantized_dtype not in DEQUANTIZED_DTYPES:
            raise ValueError(f"dequantized dtype must be bfloat16 or float32, not {dequantized_dtype!r}")
        self.dequantized_dtype = dequantized_dtype

    @classmethod
    def from_config(cls, target_dtype):
        return cls("float32" if target_dtype == "float32" else "bfloat16")

    @classmethod
    def from_attrs(cls, attrs):
        return cls(attrs.get("dequantized_dtype", "bfloat16"))

    def row_arrays(self, num_layers, hidden_size):
        return {"features": ((num_layers, hidden_size), torch.uint8), FP8_SCALE["array"]: ((num_layers,), torch.float32)}

    def encode(self, features):
        stats = feature_stats(features)  # of the values before quantisation
        values, scales = quantize_fp8(features, stats["token_absmax"])
        return {"features": values, FP8_SCALE["array"]: scales}, stats

    def decode(self, rows):
        if rows.get(FP8_SCALE["array"]) is None:
            raise StoreError("float8_e4m3fn features without their feature_scales")
        return self.decode_tensors({name: torch.from_numpy(np.ascontiguousarray(rows[name])) for name in self.array_names})

    def decode_tensors(self, rows):
        return dequantize_fp8(rows["features"], rows[FP8_SCALE["array"]], self.feature_dtype)

    def attrs(self):
        return {"logical_dtype": self.name, "feature_scale": dict(FP8_SCALE), "dequantized_dtype": self.dequantized_dtype}

    @property
    def feature_dtype(self):
        return getattr(torch, self.dequantized_dtype)


def store_codec(store_dtype: str, target_dtype: str) -> FeatureCodec:
    """The codec of ``extract.store_dtype`` for a target computing in ``target_dtype``: ``auto`` stores the
    target's dtype (float16 as bfloat16); fp8 is dequantised to float32 for a float32 target, else bfloat16."""
    name = target_dtype if store_dtype == "auto" else store_dtype
    name = "bfloat16" if name == "float16" else _ALIASES.get(name, name)
    if name not in CODECS:
        raise ValueError(f"store dtype must be one of {sorted(CODECS)} or {sorted(_ALIASES)}, not {store_dtype!r}")
    return CODECS[name].from_config(target_dtype)


def codec_from_attrs(attrs: dict) -> FeatureCodec:
    """The codec a shard's or store's attributes record (``logical_dtype``; float32 where it is absent)."""
    name = attrs.get("logical_dtype", "float32")
    if name not in CODECS:
        raise StoreError(f"features stored as {name!r}, which this version cannot read (known: {sorted(CODECS)})")
    return CODECS[name].from_attrs(attrs)
