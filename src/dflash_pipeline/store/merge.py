"""Merging the shards into one store (the ``merge`` job): every shard checked against its tokenised shard, then
hard-linked under ``shards/<index>/`` (no feature byte is copied), plus a global index (``sample_offsets``
[N+1] over the concatenated token space, ``shard_token_offsets`` [S+1]) and the manifest (what the store was
built from: the target, its tokenizer and config hashes, the config sections, the package versions)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import zarr

from ..atomic import atomic_path
from ..bucket import is_bucket_url
from .codec import codec_from_attrs
from .compact_codec import BASIS_ARRAY, read_basis
from .layout import FORMAT_VERSION, INDEX_CONVENTION, StoreError, feature_layers


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
    return hashlib.sha256(json.dumps(sections, sort_keys=True).encode()).hexdigest()


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


def summarize_shards(labels: list[str], groups: list, tokenized_frames: list,
                     basis_sha256: str | None = None) -> tuple[dict, np.ndarray, np.ndarray]:
    """Check every shard group against its tokenized shard (and, compact shards, the sha256 of the basis they were
    encoded with: ``basis_sha256``) -> (the store's attributes, sample_offsets [N+1], shard_token_offsets [S+1])."""
    shard_attrs, lengths = [], []
    for label, group, tokenized in zip(labels, groups, tokenized_frames):
        attrs = dict(group.attrs)
        if attrs.get("format_version") != FORMAT_VERSION:
            raise StoreError(f"{label}: format version {attrs.get('format_version')} (check: format)")
        if shard_attrs and feature_layers(attrs) != feature_layers(shard_attrs[0]):
            raise StoreError(f"{label}: layers {feature_layers(attrs)} differ from shard 0's (check: layers)")
        if shard_attrs and attrs.get("logical_dtype") != shard_attrs[0].get("logical_dtype"):
            raise StoreError(f"{label}: feature dtype {attrs.get('logical_dtype')} differs from shard 0's "
                             f"{shard_attrs[0].get('logical_dtype')} (check: dtype)")
        recorded = (attrs.get("compact") or {}).get("basis_sha256")
        if recorded != basis_sha256:
            raise StoreError(f"{label}: encoded with the basis {recorded}, the store's is {basis_sha256} "
                             "(check: basis)")
        check_shard(label, attrs, group["input_ids"][:], group["sample_offsets"][:], tokenized)
        shard_attrs.append(attrs)
        lengths.append(np.diff(group["sample_offsets"][:]))
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    sample_offsets = np.concatenate([[0], np.cumsum(all_lengths, dtype=np.int64)])
    shard_token_offsets = np.concatenate([[0], np.cumsum([a["num_tokens"] for a in shard_attrs], dtype=np.int64)])
    first = shard_attrs[0] if shard_attrs else {}
    # the codec's attributes as the shards recorded them (logical_dtype first)
    encoding = {"logical_dtype": first.get("logical_dtype"),
                **({key: first[key] for key in codec_from_attrs(first).attrs() if key in first} if first else {})}
    summary = {
        "format_version": FORMAT_VERSION,
        "num_shards": len(groups),
        "num_samples": int(len(all_lengths)),
        "num_tokens": int(sample_offsets[-1]),
        "supervised_tokens": int(sum(int(t["loss_mask"].map(np.sum).sum()) for t in tokenized_frames)),
        "layer_ids": first.get("layer_ids"),
        "final_hidden": bool(first.get("final_hidden")),
        "hidden_size": first.get("hidden_size"),
        **encoding,
        **{key: first[key] for key in ("random_weights_seed",) if key in first},
        "compression": first.get("compression"),
        "index_convention": INDEX_CONVENTION,
        "shards": [{k: a[k] for k in ("num_samples", "num_tokens", "features_digest", "stats")} for a in shard_attrs],
    }
    return summary, sample_offsets, shard_token_offsets


def write_index(root, summary: dict, manifest: dict, sample_offsets: np.ndarray, shard_token_offsets: np.ndarray,
                extra: dict | None = None) -> None:
    """The merged store's own arrays and attributes into its (new) root group."""
    root.create_array("sample_offsets", data=sample_offsets, chunks=(max(1, len(sample_offsets)),))
    root.create_array("shard_token_offsets", data=shard_token_offsets, chunks=(len(shard_token_offsets),))
    root.attrs.update({"manifest": manifest, **summary, **(extra or {})})


def merge_shards(shard_paths: list, tokenized_frames: list, out_path, manifest: dict, basis=None) -> dict:
    """Check every shard, then build one store of them by hard links plus a global index. ``basis``: the basis
    file compact shards were encoded with (the ``compact_basis`` job's): each shard must record its sha256, and it
    is hard-linked into the store's root."""
    expected = read_basis(basis).sha256() if basis else None  # checked against its recorded sha256 as it is read
    groups = [zarr.open_group(str(path), mode="r") for path in shard_paths]
    summary, sample_offsets, shard_token_offsets = summarize_shards([str(p) for p in shard_paths], groups,
                                                                    tokenized_frames, expected)
    with atomic_path(out_path) as tmp:
        root = zarr.open_group(str(tmp), mode="w", zarr_format=3)
        root.create_group("shards")
        for index, path in enumerate(shard_paths):
            _hardlink_tree(Path(path), Path(tmp) / "shards" / f"{index:05d}")
        if basis:
            _hardlink_tree(Path(basis) / BASIS_ARRAY, Path(tmp) / BASIS_ARRAY)
        write_index(root, summary, manifest, sample_offsets, shard_token_offsets)
    return summary


def merge_bucket_shards(shard_urls: list[str], records: list, tokenized_frames: list, out_url: str, record_path,
                        manifest: dict) -> dict:
    """The same checks, then the store in the bucket as metadata only: the shards stay where extract wrote them
    (``store.remote``). ``records``: the shards' completion records (local copies). Every object a record lists
    must be in the bucket with its recorded size (a listing; ``verify`` reads every byte)."""
    from .remote import check_listed, load_record, open_checked, write_merged

    records = [load_record(path) for path in records]
    for url, record in zip(shard_urls, records):
        check_listed(url, record)
    groups = [open_checked(url, record, url) for url, record in zip(shard_urls, records)]
    summary, sample_offsets, shard_token_offsets = summarize_shards(shard_urls, groups, tokenized_frames)
    write_merged(shard_urls, records, out_url, record_path,
                 lambda root, extra: write_index(root, summary, manifest, sample_offsets, shard_token_offsets, extra))
    return summary


def run_merge(shard_paths: list, tokenized_paths: list, out_path, stats_tsv, *, tokenizer_source: str,
              config_sections: dict, records: list | None = None, record_path=None, basis=None) -> dict:
    """The ``merge`` job: check the shards, build the store and its manifest, write the statistics table. In a
    bucket (``out_path`` an s3:// URL): ``records`` are the shards' completion records, the store's goes to
    ``record_path``. ``basis``: a compact store's basis file (the ``compact_basis`` job's)."""
    import pandas as pd

    from ..target import load_tokenizer, target_config_hashes, tokenizer_hashes
    from ..tokenization import read_tokenized

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
    frames = [read_tokenized(p) for p in tokenized_paths]
    if is_bucket_url(str(out_path)):
        if basis:
            raise StoreError(f"{out_path}: a compact store (extract.store_dtype: compact) cannot be kept in a bucket "
                             "yet; use a local store.url or another store_dtype")
        summary = merge_bucket_shards(shard_paths, records, frames, out_path, record_path, manifest)
    else:
        summary = merge_shards(shard_paths, frames, out_path, manifest, basis)
    rows = []
    for index, shard in enumerate(summary["shards"]):
        for k, layer in enumerate(feature_layers(summary)):
            rows.append({"shard": index, "samples": shard["num_samples"], "tokens": shard["num_tokens"], "layer": layer,
                         "rms": shard["stats"]["rms"][k], "absmax": shard["stats"]["absmax"][k],
                         "nonfinite": shard["stats"]["nonfinite"][k], "zero_tokens": shard["stats"]["zero_tokens"][k],
                         **({"relative_error": shard["stats"]["relative_error"][k],
                             "max_token_relative_error": shard["stats"]["max_token_relative_error"]}
                            if "relative_error" in shard["stats"] else {})})
    with atomic_path(stats_tsv) as tmp:
        pd.DataFrame(rows).to_csv(tmp, sep="\t", index=False, float_format="%.6g")
    return summary
