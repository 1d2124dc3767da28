"""The hidden-state store (Zarr v3).

Each ``extract`` job writes one *shard*: a Zarr group with token-major arrays of the samples it owns
(``input_ids`` int32 [T], ``loss_mask`` uint8 [T], ``sample_offsets`` int64 [n+1] and ``features``
[T, K, D]). ``merge`` makes one store of them by hard-linking every shard under ``shards/<index>/``
(no feature byte is copied) and adding a global index (``sample_offsets`` [N+1] over the concatenated
token space, ``shard_token_offsets`` [S+1]) and a manifest. bfloat16 is stored as its uint16 bit
pattern with ``logical_dtype: bfloat16`` in the array attributes and viewed back without a copy.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch
import zarr
from zarr.codecs import BloscCodec

from .atomic import atomic_path

FORMAT_VERSION = 1
INDEX_CONVENTION = "layer id x = output of decoder layer x = transformers output_hidden_states[x + 1]"
STORED = {"float32": (torch.float32, "float32"), "bfloat16": (torch.uint16, "uint16")}


class StoreError(ValueError):
    """A shard or store failed a check; the message names the shard and the check."""


def compressors(compression: str, level: int = 3) -> list:
    """``zstd``: blosc byte-shuffle + zstd (≈1.4× on bf16 activations); ``none``: raw bytes."""
    if compression == "none":
        return []
    if compression == "zstd":
        return [BloscCodec(cname="zstd", clevel=level, shuffle="shuffle")]
    raise ValueError(f"unknown compression {compression!r} (expected 'zstd' or 'none')")


class ShardWriter:
    """Writes one shard sequentially, sample by sample, in whole chunks, and keeps its statistics."""

    def __init__(self, path, *, num_tokens: int, num_layers: int, hidden_size: int, logical_dtype: str,
                 chunk_tokens: int = 256, compression: str = "zstd"):
        if logical_dtype not in STORED:
            raise ValueError(f"store dtype must be one of {sorted(STORED)}, not {logical_dtype!r}")
        self.group = zarr.open_group(str(path), mode="w", zarr_format=3)
        self.logical_dtype = logical_dtype
        self.view_dtype, numpy_dtype = STORED[logical_dtype]
        self.features = self.group.create_array(
            "features", shape=(num_tokens, num_layers, hidden_size), chunks=(chunk_tokens, num_layers, hidden_size),
            dtype=numpy_dtype, compressors=compressors(compression), fill_value=0,
        )
        self.features.attrs["logical_dtype"] = logical_dtype
        self.buffer = np.empty((chunk_tokens, num_layers, hidden_size), dtype=numpy_dtype)
        self.num_tokens, self.chunk_tokens, self.compression = num_tokens, chunk_tokens, compression
        self.written = self.buffered = 0
        self.digest = hashlib.blake2b(digest_size=16)
        self.stats = {
            "nonfinite": torch.zeros(num_layers, dtype=torch.int64),
            "zero_tokens": torch.zeros(num_layers, dtype=torch.int64),
            "absmax": torch.zeros(num_layers, dtype=torch.float64),
            "sum_squares": torch.zeros(num_layers, dtype=torch.float64),
        }

    def write(self, features: torch.Tensor) -> None:
        """Append the features [t, K, D] of the next sample (a CPU tensor in the logical dtype)."""
        values = features.float()
        finite = torch.isfinite(values)
        self.stats["nonfinite"] += (~finite).sum(dim=(0, 2))
        self.stats["zero_tokens"] += (values == 0).all(dim=2).sum(dim=0)
        clean = torch.where(finite, values, 0.0).double()
        self.stats["absmax"] = torch.maximum(self.stats["absmax"], clean.abs().amax(dim=(0, 2)))
        self.stats["sum_squares"] += clean.square().sum(dim=(0, 2))
        data = features.contiguous().view(self.view_dtype).numpy()
        while len(data):
            take = min(len(data), self.chunk_tokens - self.buffered)
            self.buffer[self.buffered : self.buffered + take] = data[:take]
            self.buffered += take
            data = data[take:]
            if self.buffered == self.chunk_tokens:
                self._flush()

    def _flush(self) -> None:
        block = self.buffer[: self.buffered]
        self.features[self.written : self.written + self.buffered] = block
        self.digest.update(block.tobytes())
        self.written += self.buffered
        self.buffered = 0

    def close(self, input_ids: np.ndarray, loss_mask: np.ndarray, sample_lengths, sample_ids, attrs: dict) -> dict:
        """Flush the last chunk, write the token arrays and the shard attributes; returns the attributes."""
        if self.buffered:
            self._flush()
        if self.written != self.num_tokens or len(input_ids) != self.num_tokens:
            raise StoreError(f"shard wrote {self.written} feature rows for {len(input_ids)} tokens")
        offsets = np.concatenate([[0], np.cumsum(sample_lengths, dtype=np.int64)])
        chunk = max(1, min(self.num_tokens, 1 << 20))
        for name, values in (("input_ids", input_ids.astype(np.int32)), ("loss_mask", loss_mask.astype(np.uint8)),
                             ("sample_offsets", offsets)):
            self.group.create_array(name, data=values, chunks=(min(len(values), chunk) or 1,),
                                    compressors=compressors(self.compression))
        layers = self.stats["nonfinite"].numel()
        rms = (self.stats["sum_squares"] / max(1, self.num_tokens * self.features.shape[2])).sqrt()
        meta = {
            **attrs,
            "format_version": FORMAT_VERSION,
            "logical_dtype": self.logical_dtype,
            "compression": self.compression,
            "num_samples": len(sample_ids),
            "num_tokens": self.num_tokens,
            "sample_ids": list(sample_ids),
            "features_blake2b": self.digest.hexdigest(),
            "input_ids_blake2b": hashlib.blake2b(input_ids.astype(np.int32).tobytes(), digest_size=16).hexdigest(),
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


def check_shard(name: str, attrs: dict, input_ids: np.ndarray, sample_offsets: np.ndarray, tokenized) -> None:
    """The merge-time checks of one shard against its tokenised shard; raises ``StoreError`` naming both."""
    layer_ids = attrs.get("layer_ids", [])
    for k, layer in enumerate(layer_ids):
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
        if shard_attrs and attrs["layer_ids"] != shard_attrs[0]["layer_ids"]:
            raise StoreError(f"{path}: layer ids {attrs['layer_ids']} differ from shard 0's (check: layers)")
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
        "hidden_size": first.get("hidden_size"),
        "logical_dtype": first.get("logical_dtype"),
        "compression": first.get("compression"),
        "index_convention": INDEX_CONVENTION,
        "shards": [{k: a[k] for k in ("num_samples", "num_tokens", "features_blake2b", "stats")} for a in shard_attrs],
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

    def __getstate__(self):
        return {**self.__dict__, "_shards": None}

    def __len__(self) -> int:
        return len(self.sample_offsets) - 1

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.sample_offsets)

    @property
    def manifest(self) -> dict:
        return self.attrs["manifest"]

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
        group = self._shard(shard)
        rows = slice(begin, begin + end - start)
        input_ids = torch.from_numpy(group["input_ids"][rows].astype(np.int64))
        loss_mask = torch.from_numpy(group["loss_mask"][rows].astype(bool))
        features = torch.from_numpy(np.ascontiguousarray(group["features"][rows]))
        if self.logical_dtype == "bfloat16":
            features = features.view(torch.bfloat16)
        return input_ids, loss_mask, features


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

    from .target import load_tokenizer, tokenizer_hashes
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
    }
    summary = merge_shards(shard_paths, [read_tokenized(p) for p in tokenized_paths], out_path, manifest)
    rows = []
    for index, shard in enumerate(summary["shards"]):
        for k, layer in enumerate(summary["layer_ids"]):
            rows.append({"shard": index, "samples": shard["num_samples"], "tokens": shard["num_tokens"], "layer": layer,
                         "rms": shard["stats"]["rms"][k], "absmax": shard["stats"]["absmax"][k],
                         "nonfinite": shard["stats"]["nonfinite"][k], "zero_tokens": shard["stats"]["zero_tokens"][k]})
    with atomic_path(stats_tsv) as tmp:
        pd.DataFrame(rows).to_csv(tmp, sep="\t", index=False, float_format="%.6g")
    return summary
