"""Writing one shard: a Zarr group with token-major arrays of the samples an ``extract`` job owns (``input_ids``
int32 [T], ``loss_mask`` uint8 [T], ``sample_offsets`` int64 [n+1], and the codec's feature arrays, ``features``
[T, K, D] first), each with its chunk checksums (``integrity``)."""

from __future__ import annotations

import time

import numpy as np
import torch
import zarr
from zarr.abc.store import Store

from ..atomic import BackgroundFsync
from .codec import FeatureCodec
from .integrity import CRC_SUFFIX, DIGEST_SUFFIX, chunk_crc32c, crc_digest
from .layout import FORMAT_VERSION, StoreError, chunk_file, compressors


def fold_stats(totals: dict, stats: dict) -> dict:
    """Fold one batch's statistics into running totals (in place): ``absmax`` and ``max_*`` keys by maximum, every
    other key summed (float64 for floats)."""
    for key, value in stats.items():
        value = value.double() if value.is_floating_point() else value
        if key not in totals:
            totals[key] = value.clone()
        elif key == "absmax" or key.startswith("max_"):
            totals[key] = torch.maximum(totals[key], value)
        else:
            totals[key] = totals[key] + value
    return totals


def error_stats(totals: dict) -> dict:
    """What a lossy codec's ``error_squares`` and ``max_token_relative_error`` say, as shard attributes: per layer
    the relative error sqrt(sum |x_k - x^_k|^2 / sum |x_k|^2), and the largest per-token relative error."""
    if "error_squares" not in totals:
        return {}
    relative = (totals["error_squares"] / totals["sum_squares"].clamp(min=1e-300)).sqrt()
    return {"relative_error": relative.tolist(), "max_token_relative_error": float(totals["max_token_relative_error"])}


class RowWriter:
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
    encodes and counts statistics here), or ``write_encoded(rows)`` with rows already encoded by
    ``codec.encode`` plus ``add_stats`` (what ``extract`` does: it encodes and counts on the GPU).
    ``flush_early``: fsync each chunk file in a background thread as soon as it is written. ``path``: a local
    directory, or a zarr store (a shard in a bucket: ``store.remote.bucket_shard``).
    """

    def __init__(self, path, *, num_tokens: int, num_layers: int, hidden_size: int, codec: FeatureCodec,
                 chunk_tokens: int = 256, compression: str = "zstd", flush_early: bool = True):
        self.group = zarr.open_group(path if isinstance(path, Store) else str(path), mode="w", zarr_format=3)
        self.codec = codec
        self.flusher = BackgroundFsync() if flush_early else None
        self.row_writers: dict[str, RowWriter] = {}  # one per codec array, ``features`` first
        for name, (row_shape, dtype) in codec.row_arrays(num_layers, hidden_size).items():
            array = self.group.create_array(
                name, shape=(num_tokens, *row_shape), chunks=(chunk_tokens, *row_shape),
                dtype=torch.empty(0, dtype=dtype).numpy().dtype, compressors=compressors(compression), fill_value=0,
            )
            if name == "features":
                array.attrs.update(codec.attrs())
            self.row_writers[name] = RowWriter(array, chunk_tokens, self.flusher)
        self.features = self.row_writers["features"].array
        self.num_tokens, self.hidden_size = num_tokens, hidden_size
        self.chunk_tokens, self.compression = chunk_tokens, compression
        self.stats = {
            "nonfinite": torch.zeros(num_layers, dtype=torch.int64),
            "zero_tokens": torch.zeros(num_layers, dtype=torch.int64),
            "absmax": torch.zeros(num_layers, dtype=torch.float64),
            "sum_squares": torch.zeros(num_layers, dtype=torch.float64),
        }

    @property
    def written(self) -> int:
        rows = self.row_writers["features"]
        return rows.written + rows.buffered

    def add_stats(self, stats: dict) -> None:
        """Fold per-layer statistics (``feature_stats`` of some rows, or sums of them) into the shard's, and the
        codec's own (``fold_stats``: ``absmax`` and ``max_*`` by maximum, the others summed)."""
        fold_stats(self.stats, {k: v.cpu() for k, v in stats.items() if k != "token_absmax"})

    def write(self, features: torch.Tensor) -> None:
        """Append the features [t, K, D] of the next sample(s) (a CPU tensor)."""
        rows, stats = self.codec.encode(features)
        self.add_stats(stats)
        self.write_encoded({name: values.numpy() for name, values in rows.items()})

    def write_encoded(self, rows: dict[str, np.ndarray]) -> None:
        """Append rows already encoded: codec array name -> rows [n, ...] in the stored element type. Statistics
        come separately (``add_stats``). The arrays are no longer read when this returns (the caller may reuse
        them)."""
        if set(rows) != set(self.row_writers):
            raise StoreError(f"{self.codec.name} features are stored as {sorted(self.row_writers)}, "
                             f"given {sorted(rows)}")
        n = len(rows["features"])
        if self.written + n > self.num_tokens:
            raise StoreError(f"shard of {self.num_tokens} tokens given {self.written + n} feature rows")
        for name, writer in self.row_writers.items():
            writer.append(rows[name])

    def close(self, input_ids: np.ndarray, loss_mask: np.ndarray, sample_lengths, sample_ids, attrs: dict) -> dict:
        """Flush the last chunk, write the token arrays and the shard attributes; returns the attributes."""
        for writer in self.row_writers.values():
            writer.flush()
        if self.flusher is not None:
            self.flusher.close()
        if self.row_writers["features"].written != self.num_tokens or len(input_ids) != self.num_tokens:
            raise StoreError(f"shard wrote {self.row_writers['features'].written} feature rows for "
                             f"{len(input_ids)} tokens")
        offsets = np.concatenate([[0], np.cumsum(sample_lengths, dtype=np.int64)])
        chunk = max(1, min(self.num_tokens, 1 << 20))
        crcs = {name: writer.crcs for name, writer in self.row_writers.items()}
        for name, values in (("input_ids", input_ids.astype(np.int32)), ("loss_mask", loss_mask.astype(np.uint8)),
                             ("sample_offsets", offsets)):
            array = self.group.create_array(name, data=values, chunks=(min(len(values), chunk) or 1,),
                                            compressors=compressors(self.compression))
            crcs[name] = chunk_crc32c(values, array.chunks[0])
        for name, values in crcs.items():
            values = np.asarray(values, dtype=np.uint32)
            self.group.create_array(name + CRC_SUFFIX, data=values, chunks=(max(1, len(values)),), compressors=[])
        digested = [*self.row_writers, "input_ids"]
        layers = self.stats["nonfinite"].numel()
        rms = (self.stats["sum_squares"] / max(1, self.num_tokens * self.hidden_size)).sqrt()
        meta = {
            **attrs,
            "format_version": FORMAT_VERSION,
            **self.codec.attrs(),
            "compression": self.compression,
            "num_samples": len(sample_ids),
            "num_tokens": self.num_tokens,
            "sample_ids": list(sample_ids),
            **{name + DIGEST_SUFFIX: crc_digest(values) for name, values in crcs.items() if name in digested},
            "chunk_checksums": "crc32c of each chunk's stored rows, in <array>" + CRC_SUFFIX,
            "stats": {
                "nonfinite": self.stats["nonfinite"].tolist(),
                "zero_tokens": self.stats["zero_tokens"].tolist(),
                "absmax": self.stats["absmax"].tolist(),
                "rms": rms.tolist(),
                **error_stats(self.stats),
            },
        }
        assert layers == len(meta["stats"]["rms"])
        self.group.attrs.update(meta)
        return meta
