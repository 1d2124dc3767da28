"""Chunk checksums and the whole-store check (``dflash-pipeline verify``).

Every row-chunked array X of a shard (the codec's arrays, ``input_ids``, ``loss_mask``, ``sample_offsets``) has a
companion array X_crc32c: uint32 [number of chunks], the CRC-32C of each chunk's rows as stored (the decoded
bytes, C order). blosc keeps no checksum: a flipped byte in a compressed chunk mostly decodes, without an error,
to other values; a deleted chunk file reads as the fill value; a chunk rewritten through zarr is valid zarr. A
CRC of the decoded rows catches all three. ``HiddenStateStore`` checks every chunk a sample touches (CRC-32C runs
at ~12 GB/s on one core; reads cost 7-20 % more CPU); ``verify`` checks every chunk and the per-shard digests
(``crc_digest``), recorded as ``<array>_digest`` for the codec's arrays and ``input_ids``.
"""

from __future__ import annotations

import hashlib
import warnings
from concurrent.futures import ThreadPoolExecutor

import crc32c
import numpy as np
import zarr

CRC_SUFFIX = "_crc32c"
DIGEST_SUFFIX = "_digest"


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


def stored_crcs(group, name: str) -> np.ndarray | None:
    """The recorded CRC-32C per chunk of array ``name`` of a shard (None: written before checksums)."""
    try:
        return group[name + CRC_SUFFIX][:]
    except KeyError:
        return None


def _verify_array(label: str, group, name: str, digest: str | None, read_bytes: int) -> list[str]:
    """Every chunk of one array against its CRC-32C, and (``digest``) the recorded digest of those CRCs."""
    array, crcs, problems = group[name], stored_crcs(group, name), []
    computed, bad = [], []  # the CRC-32C of each chunk as read now; the chunks that differ
    size = array.chunks[0]
    row_bytes = max(1, int(np.prod(array.shape[1:], dtype=np.int64)) * array.dtype.itemsize)
    step = size * max(1, read_bytes // (size * row_bytes))
    for start in range(0, array.shape[0], step):
        try:
            block = np.ascontiguousarray(array[start : start + step])
        except Exception as error:
            problems.append(f"{label}: {name} rows {start}..{min(start + step, array.shape[0])}: unreadable: {error} "
                            "(check: read)")
            digest = None
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
    if digest is not None and crc_digest(computed) != digest:
        problems.append(f"{label}: {name}: the bytes do not match the shard's {name}{DIGEST_SUFFIX} (check: digest)")
    return problems


def verify_shard(label: str, group, recorded: dict | None, read_bytes: int = 64 << 20) -> list[str]:
    """Every array of one shard (``verify``); ``recorded``: the store's record of the shard, if merged."""
    attrs, problems = dict(group.attrs), []
    if recorded is not None and recorded.get("features_digest") != attrs.get("features_digest"):
        problems.append(f"{label}: features_digest {attrs.get('features_digest')} differs from the store's record "
                        f"{recorded.get('features_digest')} (check: manifest)")
    with warnings.catch_warnings():  # Snakemake's .snakemake_timestamp in a directory output is not zarr
        warnings.filterwarnings("ignore", message=".*not recognized as a component of a Zarr hierarchy")
        names = sorted(name for name in group.array_keys() if not name.endswith(CRC_SUFFIX))
    for name in names:
        problems += _verify_array(label, group, name, attrs.get(name + DIGEST_SUFFIX), read_bytes)
    if "features" not in names:
        problems.append(f"{label}: no features array (check: arrays)")
    return problems


def _shard_problems(label: str, group, recorded: dict | None) -> list[str]:
    """``verify_shard``, with a failed check of an array's own metadata (in a bucket) as one problem."""
    from .layout import StoreError

    try:
        return verify_shard(label, group, recorded)
    except StoreError as error:
        return [f"{label}: {error}"]


def _verify_index(path, root, groups, labels) -> list[str]:
    """The store's global index (sample and shard offsets) against the shards' own."""
    offsets, problems, lengths = root["shard_token_offsets"][:], [], []
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
    except Exception as error:  # an undecodable offsets chunk: the shard checks name it
        problems.append(f"{path}: the sample index cannot be read: {error} (check: index)")
    return problems


def verify(path, *, jobs: int = 1) -> list[str]:
    """Re-read every byte of a merged store (or of one ``extract`` shard) and compare it with what was
    recorded when it was written: the CRC-32C of every chunk of every array, each shard's digests
    (``features_digest``, ``feature_scales_digest``, ``input_ids_digest``), the store's copy of them and
    the global index; in a bucket also every object against its completion record (``store.remote``). Returns the
    problems, one line each, starting with the shard (empty: intact). ``jobs`` shards are read at once (threads)."""
    from .layout import StoreError
    from .remote import BucketSource, is_bucket_store

    source = None
    try:
        if is_bucket_store(path):
            source = BucketSource(path)
            root = source.root()
        else:
            root = zarr.open_group(str(path), mode="r")
        if (source.is_shard if source else "shards" not in root):  # one extract shard
            return verify_shard(str(path), root, None)
        offsets = root["shard_token_offsets"]
        records = dict(root.attrs).get("shards") or []
    except StoreError as error:
        return [f"{path}: {error}"]
    labels = [f"{path}: shard {index:05d}" for index in range(offsets.shape[0] - 1)]
    groups, problems = [], []
    for index, label in enumerate(labels):
        try:
            groups.append(source.shard(index) if source else root[f"shards/{index:05d}"])
        except StoreError as error:
            groups.append(None)
            problems.append(f"{label}: {error}")
    if len(records) != len(groups):
        problems.append(f"{path}: {len(groups)} shards, the store attributes describe {len(records)} (check: index)")
    opened = [(label, group, record) for label, group, record in zip(labels, groups, [*records, *[None] * len(groups)])
              if group is not None]
    if len(opened) == len(groups):
        problems += _verify_index(path, root, groups, labels)
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        for found in pool.map(lambda item: _shard_problems(*item), opened):
            problems += found
    return problems
