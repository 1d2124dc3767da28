"""The hidden-state store (Zarr v3; docs/design.md, "The store").

Each ``extract`` job writes one *shard* (``writer``): token-major arrays of the samples it owns, its features
encoded by one ``FeatureCodec`` (``codec``: float32, bfloat16, fp8 e4m3 with per-token scales; ``compact_codec``:
coefficients of a fitted low-rank basis), every chunk
with its CRC-32C (``integrity``). ``merge`` makes one store of the shards by hard links plus a global index and
a manifest (``merge``); ``HiddenStateStore`` reads it back, checked (``reader``). ``layout`` holds what all of
them share.
"""

from .codec import (
    CODECS,
    FP8_SCALE,
    FeatureCodec,
    codec_from_attrs,
    dequantize_fp8,
    feature_stats,
    fp8_error_bound,
    quantize_fp8,
    register_codec,
    store_codec,
)
from .integrity import chunk_crc32c, crc_digest, verify
from .layout import FORMAT_VERSION, INDEX_CONVENTION, StoreError, chunk_file, feature_layers
from .merge import config_hash, merge_shards, package_versions, run_merge
from .reader import HiddenStateStore, read_chunks, read_shard_features
from .writer import ShardWriter
from .compact_codec import CompactCodec, compact_codec, read_basis, write_basis  # registers the compact codec

__all__ = [
    "CODECS", "CompactCodec", "FORMAT_VERSION", "FP8_SCALE", "INDEX_CONVENTION", "FeatureCodec", "HiddenStateStore",
    "ShardWriter", "StoreError", "chunk_crc32c", "chunk_file", "codec_from_attrs", "compact_codec", "config_hash",
    "crc_digest", "dequantize_fp8", "feature_layers", "feature_stats", "fp8_error_bound", "merge_shards",
    "package_versions", "quantize_fp8", "read_basis", "read_chunks", "read_shard_features", "register_codec",
    "run_merge", "store_codec", "verify", "write_basis",
]
