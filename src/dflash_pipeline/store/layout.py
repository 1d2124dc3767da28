"""The on-disk layout every part of the store shares: the format version, the layer index convention, the
compressors, where a chunk's file lies, and the error a failed check raises."""

from __future__ import annotations

from pathlib import Path

from zarr.codecs import BloscCodec

FORMAT_VERSION = 1
INDEX_CONVENTION = "layer id x = output of decoder layer x = transformers output_hidden_states[x + 1]"


class StoreError(ValueError):
    """A shard or store failed a check; the message names the shard and the check."""


def compressors(compression: str, level: int = 3) -> list:
    """``zstd``: blosc byte-shuffle + zstd (≈1.4× on bf16 activations); ``none``: raw bytes."""
    if compression == "none":
        return []
    if compression == "zstd":
        return [BloscCodec(cname="zstd", clevel=level, shuffle="shuffle")]
    raise ValueError(f"unknown compression {compression!r} (expected 'zstd' or 'none')")


def chunk_file(array, index: int) -> Path:
    """The file of chunk ``index`` (counted along the rows) of an array in a local store."""
    return Path(array.store.root) / array.path / array.metadata.encode_chunk_key((index, *(0,) * (array.ndim - 1)))


def feature_layers(attrs: dict) -> list:
    """Names of the feature array's layers: the captured layer ids, then "final" where the final hidden is stored."""
    return list(attrs.get("layer_ids") or []) + (["final"] if attrs.get("final_hidden") else [])
