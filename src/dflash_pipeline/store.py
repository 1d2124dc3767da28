"""The hidden-state store (Zarr v3).

Each ``extract`` job writes one *shard*: a Zarr group with token-major arrays of the samples it owns
(``input_ids`` int32 [T], ``loss_mask`` uint8 [T], ``sample_offsets`` int64 [n+1] and ``features``
[T, K, D]). ``merge`` makes one store of them by hard-linking every shard under ``shards/<index>/``
(no feature byte is copied) and adding a global index (``sample_offsets`` [N+1] over the concatenated
token space, ``shard_token_offsets`` [S+1]) and a manifest. bfloat16 is stored as its uint16 bit
pattern with ``logical_dtype: bfloat16`` in the array attributes and viewed back without a copy.

Feature codecs (``logical_dtype``): ``float32`` and ``bfloat16`` are lossless (blosc byte-shuffle + zstd
on top); ``float8_e4m3fn`` stores each value as the uint8 bit pattern of ``x / s`` rounded to e4m3, with
one float32 scale per token and layer, ``s[t, k] = max_d |x[t, k, d]| / 448`` (1 for an all-zero
vector), in the array ``feature_scales`` [T, K]. The reader dequantises transparently (``q * s``) to
the shard's ``dequantized_dtype`` (the target's compute dtype). Error bound per element, with
``x^ = q * s`` in float32 (``fp8_error_bound``)::

    |x - x^| <= 2^-4 * |x| + 2^-10 * s

e4m3 keeps 3 mantissa bits, so rounding a normal value (|x / s| >= 2^-6) moves it by at most half a
unit in the last place, 2^-4 of its own magnitude; below that the subnormal spacing is 2^-9, so the
absolute error is at most 2^-10 * s, and elements with |x| <= 2^-10 * s = absmax * 2^-10 / 448
(about 2.2e-6 of the token's absmax in that layer) flush to zero. The token's largest element maps to
448 exactly. A bfloat16 ``dequantized_dtype`` adds the bfloat16 rounding of x^ (<= 2^-9 * |x^|).
"""

from __future__ import annotations

import hashlib
import os
import sys
import warnings
import time
from pathlib import Path

import crc32c
import numcodecs
import numpy as np
import torch
import zarr
from zarr.codecs import BloscCodec, BytesCodec

from .atomic import BackgroundFsync, atomic_path

FORMAT_VERSION = 1
INDEX_CONVENTION = "layer id x = output of decoder layer x = transformers output_hidden_states[x + 1]"
STORED = {"float32": (torch.float32, "float32"), "bfloat16": (torch.uint16, "uint16"),
          "float8_e4m3fn": (torch.uint8, "uint8")}
DTYPE_ALIASES = {"fp8_e4m3": "float8_e4m3fn", "float8_e4m3": "float8_e4m3fn"}
FP8_E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP8_SCALE = {"array": "feature_scales", "shape": "[T, K]", "dtype": "float32",
             "value": "max over d of |x[t, k, d]| / 448 (1 for an all-zero vector)", "decode": "x = q * s"}


def logical_dtype_name(name: str) -> str:
    """The stored ``logical_dtype`` of a configured store dtype (``fp8_e4m3`` -> ``float8_e4m3fn``)."""
    name = DTYPE_ALIASES.get(name, name)
    if name not in STORED:
        raise ValueError(f"store dtype must be one of {sorted(STORED)} or {sorted(DTYPE_ALIASES)}, not {name!r}")
    return name


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


class StoreError(ValueError):
    """A shard or store failed a check; the message names the shard and the check."""


# ---- integrity ----
# Every row-chunked array X of a shard (features, feature_scales, input_ids, loss_mask, sample_offsets) has
# a companion array X_crc32c: uint32 [number of chunks], the CRC-32C of each chunk's rows as stored (the
# decoded bytes, C order). blosc keeps no checksum: a flipped byte in a compressed chunk mostly decodes,
# without an error, to other values; a deleted chunk file reads as the fill value; a chunk rewritten through
# zarr is valid zarr. A CRC of the decoded rows catches all three. ``HiddenStateStore`` checks every chunk a
# sample touches (CRC-32C runs at ~12 GB/s on one core; reads cost 7-20 % more CPU); ``verify`` checks every
# chunk and the per-shard digests (``crc_digest``).
CRC_SUFFIX = "_crc32c"


def crc_digest(crcs) -> str:
    """A shard array's digest: blake2b-128 of its per-chunk CRC-32C values (uint32, little-endian). It
    changes with any chunk's bytes, costs nothing beyond the CRCs the writer computes anyway (a blake2b of
    all feature bytes, ~0.6 GB/s on one core, was the writer's limit at ~12k tokens/s of a 27B target)."""
    return hashlib.blake2b(np.asarray(crcs, dtype="<u4").tobytes(), digest_size=16).hexdigest()


def chunk_crc32c(rows: np.ndarray, chunk_rows: int) -> np.ndarray:
    """CRC-32C of each run of ``chunk_rows`` rows of ``rows`` (C-order bytes) -> uint32 [ceil(n / chunk_rows)].
    ``crc32c`` releases the GIL while it sums (google_crc32c holds it: the preload's threads would stall the
    trainer's own Python, e.g. its compilation)."""
    rows = np.ascontiguousarray(rows)
    return np.array([crc32c.crc32c(rows[i : i + chunk_rows]) for i in range(0, len(rows), chunk_rows)],
                    dtype=np.uint32)


def compressors(compression: str, level: int = 3) -> list:
    """``zstd``: blosc byte-shuffle + zstd (≈1.4× on bf16 activations); ``none``: raw bytes."""
    if compression == "none":
        return []
    if compression == "zstd":
        return [BloscCodec(cname="zstd", clevel=level, shuffle="shuffle")]
    raise ValueError(f"unknown compression {compression!r} (expected 'zstd' or 'none')")


def encode_features(features: torch.Tensor, logical_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
    """``ShardWriter.encode`` without a writer: (values, scales or None, ``feature_stats``)."""
    if logical_dtype == "float8_e4m3fn":
        stats = feature_stats(features)
        values, scales = quantize_fp8(features, stats["token_absmax"])
        return values, scales, stats
    values = features.to({"float32": torch.float32, "bfloat16": torch.bfloat16}[logical_dtype])
    return values.contiguous(), None, feature_stats(values)


class _RowWriter:
    """Appends token rows to one Zarr array in whole chunks. A run of several whole chunks is written with
    one assignment, so Zarr encodes its chunks concurrently; a partial chunk waits in a buffer."""

    def __init__(self, array, chunk_tokens: int, flusher: BackgroundFsync | None = None):
        self.array, self.chunk_tokens, self.flusher = array, chunk_tokens, flusher
        # a LocalStore: its chunks are files that can be flushed early
        self.flush_early = flusher is not None and getattr(array.store, "root", None) is not None
        self.buffer = np.empty((chunk_tokens, *array.shape[1:]), dtype=array.dtype)
        self.written = self.buffered = 0
        self.crcs: list[int] = []  # CRC-32C per chunk, in chunk order (every write starts at a chunk boundary)
        self.seconds = {"zarr_write": 0.0, "crc": 0.0}  # where the writer's time goes

    def append(self, data: np.ndarray) -> None:
        """``data`` [n, ...] in the array's dtype; it is no longer read when this returns."""
        if not len(data):
            return
        data = np.ascontiguousarray(data)
        if self.buffered:
            take = min(len(data), self.chunk_tokens - self.buffered)
            self.buffer[self.buffered : self.buffered + take] = data[:take]
            self.buffered += take
            data = data[take:]
            if self.buffered == self.chunk_tokens:
                self._write(self.buffer)
                self.buffered = 0
        whole = len(data) // self.chunk_tokens * self.chunk_tokens
        if whole:
            self._write(data[:whole])
        rest = len(data) - whole
        if rest:
            self.buffer[:rest] = data[whole:]
            self.buffered = rest

    def _write(self, block: np.ndarray) -> None:
        if self.written + len(block) > self.array.shape[0]:
            raise StoreError(f"{self.array.name}: {self.written + len(block)} rows for an array of "
                             f"{self.array.shape[0]}")
        if self.written % self.chunk_tokens:
            raise StoreError(f"{self.array.name}: a write at row {self.written}, inside a chunk")
        started = time.perf_counter()
        self.array[self.written : self.written + len(block)] = block
        written = time.perf_counter()
        self.crcs.extend(chunk_crc32c(block, self.chunk_tokens).tolist())
        self.seconds["zarr_write"] += written - started
        self.seconds["crc"] += time.perf_counter() - written
        if self.flush_early:
            first, end = self.written // self.chunk_tokens, -(-(self.written + len(block)) // self.chunk_tokens)
            self.flusher.submit(chunk_file(self.array, i) for i in range(first, end))
        self.written += len(block)

    def flush(self) -> None:
        if self.buffered:
            self._write(self.buffer[: self.buffered])
            self.buffered = 0


class ShardWriter:
    """Writes one shard sequentially, sample by sample, in whole chunks, and keeps its statistics.

    Two ways in: ``write(features)`` (a CPU tensor of one or more samples' tokens in any float dtype;
    encodes and counts statistics here), or ``write_encoded(values, scales)`` with rows already in the
    stored form plus ``add_stats`` (what ``extract`` does: it encodes and counts on the GPU).
    ``flush_early``: fsync each chunk file in a background thread as soon as it is written.
    """

    def __init__(self, path, *, num_tokens: int, num_layers: int, hidden_size: int, logical_dtype: str,
                 chunk_tokens: int = 256, compression: str = "zstd", dequantized_dtype: str = "bfloat16",
                 flush_early: bool = True):
        logical_dtype = logical_dtype_name(logical_dtype)
        if dequantized_dtype not in ("bfloat16", "float32"):
            raise ValueError(f"dequantized dtype must be bfloat16 or float32, not {dequantized_dtype!r}")
        self.group = zarr.open_group(str(path), mode="w", zarr_format=3)
        self.logical_dtype, self.dequantized_dtype = logical_dtype, dequantized_dtype
        self.view_dtype, numpy_dtype = STORED[logical_dtype]
        self.features = self.group.create_array(
            "features", shape=(num_tokens, num_layers, hidden_size), chunks=(chunk_tokens, num_layers, hidden_size),
            dtype=numpy_dtype, compressors=compressors(compression), fill_value=0,
        )
        self.features.attrs.update(self.encoding())
        self.flusher = BackgroundFsync() if flush_early else None
        self.rows = _RowWriter(self.features, chunk_tokens, self.flusher)
        self.scale_rows = None
        if logical_dtype == "float8_e4m3fn":
            scales = self.group.create_array(
                FP8_SCALE["array"], shape=(num_tokens, num_layers), chunks=(chunk_tokens, num_layers),
                dtype="float32", compressors=compressors(compression), fill_value=0,
            )
            self.scale_rows = _RowWriter(scales, chunk_tokens, self.flusher)
        self.num_tokens, self.chunk_tokens, self.compression = num_tokens, chunk_tokens, compression
        self.stats = {
            "nonfinite": torch.zeros(num_layers, dtype=torch.int64),
            "zero_tokens": torch.zeros(num_layers, dtype=torch.int64),
            "absmax": torch.zeros(num_layers, dtype=torch.float64),
            "sum_squares": torch.zeros(num_layers, dtype=torch.float64),
        }

    def encoding(self) -> dict:
        """The attributes that say how ``features`` decode (also in the shard and store attributes)."""
        if self.logical_dtype == "float8_e4m3fn":
            return {"logical_dtype": self.logical_dtype, "feature_scale": dict(FP8_SCALE),
                    "dequantized_dtype": self.dequantized_dtype}
        return {"logical_dtype": self.logical_dtype}

    @property
    def written(self) -> int:
        return self.rows.written + self.rows.buffered

    def encode(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, dict]:
        """Features [n, K, D] (any device, any float dtype) -> (contiguous values to store: float32,
        bfloat16 or fp8 bit patterns as uint8; ``.view(self.view_dtype)`` gives the array dtype), scales
        [n, K] or None, statistics). The statistics are those of the values as stored (bf16 and fp32) or,
        for fp8, of the values before quantisation. No host synchronisation."""
        return encode_features(features, self.logical_dtype)

    def add_stats(self, stats: dict) -> None:
        """Fold per-layer statistics (``feature_stats`` of some rows, or sums of them) into the shard's."""
        self.stats["nonfinite"] += stats["nonfinite"].cpu()
        self.stats["zero_tokens"] += stats["zero_tokens"].cpu()
        self.stats["absmax"] = torch.maximum(self.stats["absmax"], stats["absmax"].cpu().double())
        self.stats["sum_squares"] += stats["sum_squares"].cpu().double()

    def write(self, features: torch.Tensor) -> None:
        """Append the features [t, K, D] of the next sample(s) (a CPU tensor)."""
        values, scales, stats = self.encode(features)
        self.add_stats(stats)
        self.write_encoded(values.view(self.view_dtype).numpy(), None if scales is None else scales.numpy())

    def write_encoded(self, values: np.ndarray, scales: np.ndarray | None = None) -> None:
        """Append rows already in the stored form: ``values`` [n, K, D] in the array dtype (uint16 bit
        patterns for bf16, uint8 for fp8), ``scales`` [n, K] float32 for fp8. Statistics come separately
        (``add_stats``). The arrays are no longer read when this returns (the caller may reuse them)."""
        if (scales is None) != (self.scale_rows is None):
            raise StoreError(f"{self.logical_dtype} features {'need' if scales is None else 'take no'} scales")
        if self.written + len(values) > self.num_tokens:
            raise StoreError(f"shard of {self.num_tokens} tokens given {self.written + len(values)} feature rows")
        self.rows.append(values)
        if scales is not None:
            self.scale_rows.append(scales)

    def close(self, input_ids: np.ndarray, loss_mask: np.ndarray, sample_lengths, sample_ids, attrs: dict) -> dict:
        """Flush the last chunk, write the token arrays and the shard attributes; returns the attributes."""
        self.rows.flush()
        if self.scale_rows is not None:
            self.scale_rows.flush()
        if self.flusher is not None:
            self.flusher.close()
        if self.rows.written != self.num_tokens or len(input_ids) != self.num_tokens:
            raise StoreError(f"shard wrote {self.rows.written} feature rows for {len(input_ids)} tokens")
        offsets = np.concatenate([[0], np.cumsum(sample_lengths, dtype=np.int64)])
        chunk = max(1, min(self.num_tokens, 1 << 20))
        crcs = {"features": self.rows.crcs}
        if self.scale_rows is not None:
            crcs[FP8_SCALE["array"]] = self.scale_rows.crcs
        for name, values in (("input_ids", input_ids.astype(np.int32)), ("loss_mask", loss_mask.astype(np.uint8)),
                             ("sample_offsets", offsets)):
            array = self.group.create_array(name, data=values, chunks=(min(len(values), chunk) or 1,),
                                            compressors=compressors(self.compression))
            crcs[name] = chunk_crc32c(values, array.chunks[0])
        for name, values in crcs.items():
            values = np.asarray(values, dtype=np.uint32)
            self.group.create_array(name + CRC_SUFFIX, data=values, chunks=(max(1, len(values)),), compressors=[])
        layers = self.stats["nonfinite"].numel()
        rms = (self.stats["sum_squares"] / max(1, self.num_tokens * self.features.shape[2])).sqrt()
        meta = {
            **attrs,
            "format_version": FORMAT_VERSION,
            **self.encoding(),
            "compression": self.compression,
            "num_samples": len(sample_ids),
            "num_tokens": self.num_tokens,
            "sample_ids": list(sample_ids),
            **{SHARD_DIGESTS[name]: crc_digest(values) for name, values in crcs.items() if name in SHARD_DIGESTS},
            "chunk_checksums": "crc32c of each chunk's stored rows, in <array>" + CRC_SUFFIX,
            "stats": {
                "nonfinite": self.stats["nonfinite"].tolist(),
                "zero_tokens": self.stats["zero_tokens"].tolist(),
                "absmax": self.stats["absmax"].tolist(),
                "rms": rms.tolist(),
            },
        }
        assert layers == len(meta["stats"]["rms"])
        self.group.attrs.update(meta)
        return meta


def decode_features(raw: np.ndarray, logical_dtype: str, scales: np.ndarray | None = None,
                    dequantized_dtype: str = "bfloat16") -> torch.Tensor:
    """Stored feature rows -> a tensor in the logical dtype (bf16 viewed without a copy; fp8 dequantised
    to ``dequantized_dtype`` with its per-token, per-layer scales)."""
    features = torch.from_numpy(np.ascontiguousarray(raw))
    if logical_dtype == "bfloat16":
        return features.view(torch.bfloat16)
    if logical_dtype == "float8_e4m3fn":
        if scales is None:
            raise StoreError("float8_e4m3fn features without their feature_scales")
        return dequantize_fp8(features, torch.from_numpy(np.ascontiguousarray(scales)),
                              getattr(torch, dequantized_dtype))
    return features


def read_shard_features(group, rows: slice, attrs: dict | None = None) -> torch.Tensor:
    """Decoded feature rows of one shard group (``attrs``: the shard's attributes, read if not given)."""
    attrs = dict(group.attrs) if attrs is None else attrs
    logical = attrs.get("logical_dtype", "float32")
    scales = group[FP8_SCALE["array"]][rows] if logical == "float8_e4m3fn" else None
    return decode_features(group["features"][rows], logical, scales, attrs.get("dequantized_dtype", "bfloat16"))


def feature_layers(attrs: dict) -> list:
    """Names of the feature array's layers: the captured layer ids, then "final" where the final hidden is stored."""
    return list(attrs.get("layer_ids") or []) + (["final"] if attrs.get("final_hidden") else [])


def check_shard(name: str, attrs: dict, input_ids: np.ndarray, sample_offsets: np.ndarray, tokenized) -> None:
    """The merge-time checks of one shard against its tokenised shard; raises ``StoreError`` naming both."""
    for k, layer in enumerate(feature_layers(attrs)):
        if attrs["stats"]["nonfinite"][k]:
            raise StoreError(f"{name}: layer {layer}: {attrs['stats']['nonfinite'][k]} non-finite values (check: finite)")
        if attrs["stats"]["zero_tokens"][k]:
            raise StoreError(f"{name}: layer {layer}: {attrs['stats']['zero_tokens'][k]} all-zero token vectors "
                             "(check: no zero features)")
    expected_ids = np.concatenate(list(tokenized["input_ids"])) if len(tokenized) else np.zeros(0, np.int32)
    expected_offsets = np.concatenate([[0], np.cumsum(tokenized["num_tokens"].to_numpy(), dtype=np.int64)])
    if list(attrs["sample_ids"]) != list(tokenized["id"]):
        raise StoreError(f"{name}: sample ids differ from the tokenized shard (check: samples)")
    if not np.array_equal(sample_offsets, expected_offsets):
        raise StoreError(f"{name}: sample lengths differ from the tokenized shard (check: lengths)")
    if not np.array_equal(input_ids, expected_ids):
        raise StoreError(f"{name}: token ids differ from the tokenized shard (check: token ids)")


def _hardlink_tree(source: Path, destination: Path) -> None:
    for root, _, files in os.walk(source):
        target = destination / Path(root).relative_to(source)
        target.mkdir(parents=True, exist_ok=True)
        for name in files:
            os.link(Path(root) / name, target / name)


def merge_shards(shard_paths: list, tokenized_frames: list, out_path, manifest: dict) -> dict:
    """Check every shard, then build one store of them by hard links plus a global index."""
    shard_attrs, lengths = [], []
    for index, (path, tokenized) in enumerate(zip(shard_paths, tokenized_frames)):
        group = zarr.open_group(str(path), mode="r")
        attrs = dict(group.attrs)
        if attrs.get("format_version") != FORMAT_VERSION:
            raise StoreError(f"{path}: format version {attrs.get('format_version')} (check: format)")
        if shard_attrs and feature_layers(attrs) != feature_layers(shard_attrs[0]):
            raise StoreError(f"{path}: layers {feature_layers(attrs)} differ from shard 0's (check: layers)")
        if shard_attrs and attrs.get("logical_dtype") != shard_attrs[0].get("logical_dtype"):
            raise StoreError(f"{path}: feature dtype {attrs.get('logical_dtype')} differs from shard 0's "
                             f"{shard_attrs[0].get('logical_dtype')} (check: dtype)")
        check_shard(str(path), attrs, group["input_ids"][:], group["sample_offsets"][:], tokenized)
        shard_attrs.append(attrs)
        lengths.append(np.diff(group["sample_offsets"][:]))
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    sample_offsets = np.concatenate([[0], np.cumsum(all_lengths, dtype=np.int64)])
    shard_token_offsets = np.concatenate([[0], np.cumsum([a["num_tokens"] for a in shard_attrs], dtype=np.int64)])
    first = shard_attrs[0] if shard_attrs else {}
    summary = {
        "format_version": FORMAT_VERSION,
        "num_shards": len(shard_paths),
        "num_samples": int(len(all_lengths)),
        "num_tokens": int(sample_offsets[-1]),
        "supervised_tokens": int(sum(int(t["loss_mask"].map(np.sum).sum()) for t in tokenized_frames)),
        "layer_ids": first.get("layer_ids"),
        "final_hidden": bool(first.get("final_hidden")),
        "hidden_size": first.get("hidden_size"),
        "logical_dtype": first.get("logical_dtype"),
        **{key: first[key] for key in ("feature_scale", "dequantized_dtype", "random_weights_seed") if key in first},
        "compression": first.get("compression"),
        "index_convention": INDEX_CONVENTION,
        "shards": [{k: a[k] for k in ("num_samples", "num_tokens", "features_digest", "stats")} for a in shard_attrs],
    }
    with atomic_path(out_path) as tmp:
        root = zarr.open_group(str(tmp), mode="w", zarr_format=3)
        root.create_group("shards")
        for index, path in enumerate(shard_paths):
            _hardlink_tree(Path(path), Path(tmp) / "shards" / f"{index:05d}")
        root.create_array("sample_offsets", data=sample_offsets, chunks=(max(1, len(sample_offsets)),))
        root.create_array("shard_token_offsets", data=shard_token_offsets, chunks=(len(shard_token_offsets),))
        root.attrs.update({"manifest": manifest, **summary})
    return summary


class HiddenStateStore:
    """Read access to a merged store: ``store[i]`` → ``(input_ids, loss_mask, features)`` of sample i.

    Only the path is pickled, so it can be handed to DataLoader workers started with ``spawn``; each
    process opens the Zarr arrays on first use. A read error is raised, never replaced by another sample.
    """

    def __init__(self, path):
        self.path = str(path)
        root = zarr.open_group(self.path, mode="r")
        self.attrs = dict(root.attrs)
        self.sample_offsets = root["sample_offsets"][:]
        self.shard_token_offsets = root["shard_token_offsets"][:]
        self.logical_dtype = self.attrs["logical_dtype"]
        self._shards = None
        self._arrays: dict = {}  # (shard, array name) -> (zarr array, CRC-32C per chunk or None)
        self._verified: set = set()  # (shard, array name): token arrays whose chunks were all checked once

    def __getstate__(self):
        return {**self.__dict__, "_shards": None, "_arrays": {}, "_verified": set()}

    def __len__(self) -> int:
        return len(self.sample_offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.sample_offsets)

    @property
    def manifest(self) -> dict:
        return self.attrs["manifest"]

    @property
    def num_tokens(self) -> int:
        return int(self.sample_offsets[-1])

    @property
    def feature_shape(self) -> tuple[int, int]:
        """(layers, hidden) of a token's features: the K captured layers, then the target's final normed hidden
        state where the store holds it (``final_hidden``)."""
        return len(feature_layers(self.attrs)), int(self.attrs["hidden_size"])

    @property
    def feature_dtype(self) -> torch.dtype:
        """The dtype ``store[i]`` returns features in (fp8 stores: the dtype they are dequantised to)."""
        name = {"float8_e4m3fn": self.attrs.get("dequantized_dtype", "bfloat16")}.get(self.logical_dtype,
                                                                                       self.logical_dtype)
        return getattr(torch, name)

    def token_array(self, name: str) -> np.ndarray:
        """``input_ids`` (int64) or ``loss_mask`` (bool) of every token, all shards concatenated (CRC-checked)."""
        sizes = np.diff(self.shard_token_offsets)
        rows = [self._rows(s, name, slice(0, int(size)), f"shard {s}") for s, size in enumerate(sizes)]
        return np.concatenate(rows or [np.zeros(0, np.int64)]).astype(bool if name == "loss_mask" else np.int64)

    def feature_pieces(self, rows_per_piece: int):
        """(shard, rows) pieces that cover every shard's feature rows, each a whole number of chunks."""
        for shard in range(len(self.shard_token_offsets) - 1):
            size = int(self.shard_token_offsets[shard + 1] - self.shard_token_offsets[shard])
            chunk = self._shard(shard)["features"].chunks[0]
            step = max(chunk, rows_per_piece // chunk * chunk)
            yield from ((shard, slice(a, min(a + step, size))) for a in range(0, size, step))

    def read_features(self, shard: int, rows: slice, label: str | None = None) -> torch.Tensor:
        """Decoded feature rows of one shard (CRC-checked), as ``store[i]`` returns them."""
        label = label or f"rows {rows.start}..{rows.stop}"
        scales = self._rows(shard, FP8_SCALE["array"], rows, label) if self.logical_dtype == "float8_e4m3fn" else None
        return decode_features(self._rows(shard, "features", rows, label), self.logical_dtype, scales,
                               self.attrs.get("dequantized_dtype", "bfloat16"))

    def _shard(self, index: int):
        if self._shards is None:
            root = zarr.open_group(self.path, mode="r")
            self._shards = [root[f"shards/{s:05d}"] for s in range(len(self.shard_token_offsets) - 1)]
        return self._shards[index]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a store of {len(self)} samples")
        start, end = int(self.sample_offsets[i]), int(self.sample_offsets[i + 1])
        shard = int(np.searchsorted(self.shard_token_offsets, start, side="right")) - 1
        begin = start - int(self.shard_token_offsets[shard])
        rows = slice(begin, begin + end - start)
        input_ids = torch.from_numpy(self._rows(shard, "input_ids", rows, f"sample {i}").astype(np.int64))
        loss_mask = torch.from_numpy(self._rows(shard, "loss_mask", rows, f"sample {i}").astype(bool))
        return input_ids, loss_mask, self.read_features(shard, rows, f"sample {i}")

    def _rows(self, shard: int, name: str, rows: slice, what: str) -> np.ndarray:
        """Rows of one array of a shard; every chunk they touch is checked against its CRC-32C (stores written
        before checksums: not checked). Raises ``StoreError`` naming the shard, never returns other rows.
        The token arrays (chunks of up to 2^20 tokens, also checked against the tokenized shards by merge) are
        checked on their first read in each process; features on every read."""
        if (shard, name) not in self._arrays:
            group = self._shard(shard)
            try:
                crcs = group[name + CRC_SUFFIX][:]
            except KeyError:
                crcs = None
            self._arrays[shard, name] = group[name], crcs
        array, crcs = self._arrays[shard, name]
        where = f"{self.path}: {what}: shard {shard:05d} {name}"
        size = array.chunks[0]
        first, last = rows.start // size, -(-rows.stop // size)
        try:
            if crcs is None or (shard, name) in self._verified:
                return array[rows]
            if name in ("input_ids", "loss_mask"):
                first, last = 0, len(crcs)
            block = read_chunks(array, first, last)
        except Exception as error:  # an undecodable chunk, a truncated file, ...
            raise StoreError(f"{where} rows {rows.start}..{rows.stop}: unreadable: {error} (check: read)") from error
        bad = np.flatnonzero(chunk_crc32c(block, size) != crcs[first:last])
        if bad.size:
            chunk = first + int(bad[0])
            raise StoreError(f"{where} chunk {chunk} (rows {chunk * size}..{(chunk + 1) * size}) does not match its "
                             f"CRC-32C: the stored bytes changed after they were written (check: crc32c); "
                             f"`dflash-pipeline verify {self.path}` checks the whole store")
        if name in ("input_ids", "loss_mask"):
            self._verified.add((shard, name))
        return block[rows.start - first * size : rows.stop - first * size]


def chunk_file(array, index: int) -> Path:
    """The file of chunk ``index`` (counted along the rows) of an array in a local store."""
    return Path(array.store.root) / array.path / array.metadata.encode_chunk_key((index, *(0,) * (array.ndim - 1)))


def read_chunks(array, first: int, last: int) -> np.ndarray:
    """The rows of chunks ``first``..``last - 1`` of an array as this package writes them (a local store, bytes then
    at most one blosc codec), each chunk file read and decoded in the calling thread. Reads through zarr share its
    one event loop, which holds them to ~1 GiB/s whatever the number of threads (benchmarks/RESULTS.md, "Where the
    train job's time went"); these scale with the threads (one thread alone decodes slower than zarr's pool).
    Any other array is read by zarr."""
    size = array.chunks[0]
    stop = min(last * size, array.shape[0])
    root, codecs = getattr(array.store, "root", None), array.metadata.codecs
    plain = (root is not None and sys.byteorder == "little" and isinstance(codecs[0], BytesCodec)
             and all(isinstance(c, BloscCodec) for c in codecs[1:]) and len(codecs) <= 2)
    if not plain:
        return array[first * size : stop]
    block = np.empty((stop - first * size, *array.shape[1:]), dtype=array.dtype)
    for i in range(first, last):
        rows = block[(i - first) * size : (i + 1 - first) * size]
        try:
            data = chunk_file(array, i).read_bytes()
        except FileNotFoundError:  # zarr writes no chunk that equals the fill value
            rows[...] = array.metadata.fill_value
            continue
        if len(codecs) == 2 and len(rows) == size:
            _BLOSC.decode(data, out=rows)
            continue
        if len(codecs) == 2:
            data = _BLOSC.decode(data)
        rows[...] = np.frombuffer(data, dtype=array.dtype).reshape(size, *array.shape[1:])[: len(rows)]
    return block


_BLOSC = numcodecs.Blosc()  # decoding reads the codec's settings from each chunk's header


# digests recorded per shard by ``ShardWriter.close``: array -> attribute
SHARD_DIGESTS = {"features": "features_digest", FP8_SCALE["array"]: "feature_scales_digest",
                 "input_ids": "input_ids_digest"}


def _verify_shard(label: str, group, recorded: dict | None, read_bytes: int = 64 << 20) -> list[str]:
    """Every chunk of every array of one shard against its CRC-32C, and the recorded digests of those CRCs."""
    attrs, problems = dict(group.attrs), []
    if recorded is not None and recorded.get("features_digest") != attrs.get("features_digest"):
        problems.append(f"{label}: features_digest {attrs.get('features_digest')} differs from the store's record "
                        f"{recorded.get('features_digest')} (check: manifest)")
    with warnings.catch_warnings():  # Snakemake's .snakemake_timestamp in a directory output is not zarr
        warnings.filterwarnings("ignore", message=".*not recognized as a component of a Zarr hierarchy")
        names = sorted(name for name in group.array_keys() if not name.endswith(CRC_SUFFIX))
    for name in names:
        array = group[name]
        try:
            crcs = group[name + CRC_SUFFIX][:]
        except KeyError:
            crcs = None
        digested = SHARD_DIGESTS.get(name) in attrs
        computed = []  # the CRC-32C of each chunk as read now
        size = array.chunks[0]
        row_bytes = max(1, int(np.prod(array.shape[1:], dtype=np.int64)) * array.dtype.itemsize)
        step = size * max(1, read_bytes // (size * row_bytes))
        bad = []
        for start in range(0, array.shape[0], step):
            try:
                block = np.ascontiguousarray(array[start : start + step])
            except Exception as error:
                problems.append(f"{label}: {name} rows {start}..{start + step}: unreadable: {error} (check: read)")
                digested = False
                break
            got = chunk_crc32c(block, size)
            computed.extend(got.tolist())
            if crcs is not None:
                first = start // size
                bad += [first + int(j) for j in np.flatnonzero(got != crcs[first : first + len(got)])]
        if crcs is not None and len(crcs) != -(-array.shape[0] // size):
            problems.append(f"{label}: {name}: {len(crcs)} checksums for {-(-array.shape[0] // size)} chunks "
                            "(check: crc32c)")
        if bad:
            shown = ", ".join(f"{c} (rows {c * size}..{min((c + 1) * size, array.shape[0])})" for c in bad[:8])
            problems.append(f"{label}: {name}: {len(bad)} chunk(s) do not match their CRC-32C: {shown}"
                            f"{' ...' if len(bad) > 8 else ''} (check: crc32c)")
        if digested and crc_digest(computed) != attrs[SHARD_DIGESTS[name]]:
            problems.append(f"{label}: {name}: the bytes do not match the shard's {SHARD_DIGESTS[name]} "
                            "(check: digest)")
    if not any(name == "features" for name in names):
        problems.append(f"{label}: no features array (check: arrays)")
    return problems


def verify(path, *, jobs: int = 1) -> list[str]:
    """Re-read every byte of a merged store (or of one ``extract`` shard) and compare it with what was
    recorded when it was written: the CRC-32C of every chunk of every array, each shard's digests
    (``features_digest``, ``feature_scales_digest``, ``input_ids_digest``), the store's copy of them and
    the global index. Returns the problems, one line each, starting with the shard (empty: intact).
    ``jobs`` shards are read at once (threads)."""
    from concurrent.futures import ThreadPoolExecutor

    root = zarr.open_group(str(path), mode="r")
    if "shards" not in root:  # one extract shard
        return _verify_shard(str(path), root, None)
    attrs = dict(root.attrs)
    records = attrs.get("shards") or []
    offsets = root["shard_token_offsets"][:]
    groups = [root[f"shards/{index:05d}"] for index in range(len(offsets) - 1)]
    labels = [f"{path}: shard {index:05d}" for index in range(len(groups))]
    problems = []
    if len(records) != len(groups):
        problems.append(f"{path}: {len(groups)} shards, the store attributes describe {len(records)} (check: index)")
    lengths = []
    try:
        for label, group, start, end in zip(labels, groups, offsets[:-1], offsets[1:]):
            shard_offsets = group["sample_offsets"][:]
            lengths.append(np.diff(shard_offsets))
            if shard_offsets[-1] != end - start or group.attrs.get("num_tokens") != end - start:
                problems.append(f"{label}: {shard_offsets[-1]} tokens, the store index says {end - start} "
                                "(check: index)")
        expected = np.concatenate([[0], np.cumsum(np.concatenate(lengths or [np.zeros(0, np.int64)]),
                                                  dtype=np.int64)])
        if not np.array_equal(root["sample_offsets"][:], expected):
            problems.append(f"{path}: sample_offsets differ from the shards' sample lengths (check: index)")
    except Exception as error:  # an undecodable offsets chunk: the shard checks below name it
        problems.append(f"{path}: the sample index cannot be read: {error} (check: index)")
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        for found in pool.map(_verify_shard, labels, groups, [*records, *[None] * len(groups)][: len(groups)]):
            problems += found
    return problems


def package_versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    versions = {}
    for name in ("dflash-pipeline", "torch", "transformers", "zarr", "numpy", "numcodecs"):
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def config_hash(sections: dict) -> str:
    import json

    return hashlib.sha256(json.dumps(sections, sort_keys=True).encode()).hexdigest()


def run_merge(shard_paths: list, tokenized_paths: list, out_path, stats_tsv, *, tokenizer_source: str,
              config_sections: dict) -> dict:
    """The ``merge`` job: check the shards, build the store and its manifest, write the statistics table."""
    import pandas as pd

    from .target import load_tokenizer, target_config_hashes, tokenizer_hashes
    from .tokenization import read_tokenized

    target = config_sections["target"]
    tokenizer = load_tokenizer(tokenizer_source, revision=target.get("revision"),
                               trust_remote_code=target.get("trust_remote_code", False))
    manifest = {
        "target": target["path"],
        "target_revision": target.get("revision"),
        "config_sha256": config_hash(config_sections),
        "package_versions": package_versions(),
        "index_convention": INDEX_CONVENTION,
        **tokenizer_hashes(tokenizer),
        **target_config_hashes(tokenizer_source, revision=target.get("revision"),
                               trust_remote_code=target.get("trust_remote_code", False)),
    }
    summary = merge_shards(shard_paths, [read_tokenized(p) for p in tokenized_paths], out_path, manifest)
    rows = []
    for index, shard in enumerate(summary["shards"]):
        for k, layer in enumerate(feature_layers(summary)):
            rows.append({"shard": index, "samples": shard["num_samples"], "tokens": shard["num_tokens"], "layer": layer,
                         "rms": shard["stats"]["rms"][k], "absmax": shard["stats"]["absmax"][k],
                         "nonfinite": shard["stats"]["nonfinite"][k], "zero_tokens": shard["stats"]["zero_tokens"][k]})
    with atomic_path(stats_tsv) as tmp:
        pd.DataFrame(rows).to_csv(tmp, sep="\t", index=False, float_format="%.6g")
    return summary
