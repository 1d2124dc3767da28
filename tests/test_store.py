"""The store: shard writing, merge checks, hard-link merge, reader (incl. spawn workers), batching."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from dflash_pipeline.extract import length_batches
from dflash_pipeline.store import HiddenStateStore, ShardWriter, StoreError, merge_shards, store_codec
from store_helpers import D, K, make_shard


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merge_and_read_back_exactly(tmp_path, dtype):
    shards = [([3, 5, 9], 0), ([1, 4], 1), ([7], 2)]
    expected, frames, paths = [], [], []
    for i, (lengths, seed) in enumerate(shards):
        feats, frame = make_shard(tmp_path / f"s{i}.zarr", lengths, dtype=dtype, seed=seed)
        expected += list(zip(frame["input_ids"], frame["loss_mask"], feats))
        frames.append(frame)
        paths.append(tmp_path / f"s{i}.zarr")
    summary = merge_shards(paths, frames, tmp_path / "store.zarr", {"target": "x"})
    store = HiddenStateStore(tmp_path / "store.zarr")
    assert len(store) == summary["num_samples"] == 6
    assert store.manifest == {"target": "x"} and store.attrs["layer_ids"] == [1, 2, 3]
    for i, (ids, mask, feats) in enumerate(expected):
        got_ids, got_mask, got_feats = store[i]
        assert torch.equal(got_ids, torch.from_numpy(ids).long())
        assert torch.equal(got_mask, torch.from_numpy(mask).bool())
        assert got_feats.dtype == feats.dtype and torch.equal(got_feats, feats)
    with pytest.raises(IndexError):
        store[len(store)]


def test_merge_hard_links_instead_of_copying(tmp_path):
    _, frame = make_shard(tmp_path / "s0.zarr", [50, 30])
    merge_shards([tmp_path / "s0.zarr"], [frame], tmp_path / "store.zarr", {})
    chunks = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path / "s0.zarr" / "features") for f in fs]
    assert chunks
    for chunk in chunks:
        merged = tmp_path / "store.zarr" / "shards" / "00000" / os.path.relpath(chunk, tmp_path / "s0.zarr")
        assert os.stat(chunk).st_ino == os.stat(merged).st_ino


@pytest.mark.parametrize("corrupt, message", [("nan", "layer 2: 2 non-finite values (check: finite)"),
                                              ("zero", "layer 3: 2 all-zero token vectors (check: no zero features)")])
def test_merge_refuses_bad_features_naming_shard_layer_and_check(tmp_path, corrupt, message):
    _, bad = make_shard(tmp_path / "bad.zarr", [5, 2], corrupt=corrupt)
    _, good = make_shard(tmp_path / "good.zarr", [4])
    with pytest.raises(StoreError, match="bad.zarr") as error:
        merge_shards([tmp_path / "good.zarr", tmp_path / "bad.zarr"], [good, bad], tmp_path / "store.zarr", {})
    assert message in str(error.value)
    assert not (tmp_path / "store.zarr").exists()


def test_merge_refuses_tokens_that_differ_from_the_tokenized_shard(tmp_path):
    _, frame = make_shard(tmp_path / "s0.zarr", [4, 6])
    frame.at[1, "input_ids"] = frame.at[1, "input_ids"] + 1
    with pytest.raises(StoreError, match="s0.zarr: token ids differ"):
        merge_shards([tmp_path / "s0.zarr"], [frame], tmp_path / "store.zarr", {})


def test_reader_in_spawn_workers_matches_direct_reads(tmp_path):
    """Every sample, read by two spawn workers, in order: the shard's written features, token ids and loss mask."""
    lengths = [3, 6, 2, 8]
    features, frame = make_shard(tmp_path / "s0.zarr", lengths)
    merge_shards([tmp_path / "s0.zarr"], [frame], tmp_path / "store.zarr", {})
    store = HiddenStateStore(tmp_path / "store.zarr")
    loader = torch.utils.data.DataLoader(store, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    samples = list(loader)
    assert len(samples) == len(lengths)
    for (ids, mask, feats), written, (_, row) in zip(samples, features, frame.iterrows()):
        assert feats.shape == (len(row["input_ids"]), K, D) and torch.equal(feats, written)
        assert ids.tolist() == row["input_ids"].tolist() and mask.tolist() == row["loss_mask"].tolist()


def test_length_batches_bound_padded_tokens_and_cover_every_sample():
    lengths = np.array([2, 3, 3, 5, 8, 8, 20, 40])
    batches = length_batches(lengths, 16)
    assert [i for s, e in batches for i in range(s, e)] == list(range(len(lengths)))
    for start, end in batches:
        assert (end - start) * lengths[end - 1] <= 16 or end - start == 1


def test_early_flush_fsyncs_every_chunk_file_and_changes_no_byte(tmp_path):
    lengths = [5, 9, 2]
    features = torch.randn(sum(lengths), K, D, generator=torch.Generator().manual_seed(3))
    stores = {}
    for flush_early in (True, False):
        path = tmp_path / f"flush_{flush_early}.zarr"
        writer = ShardWriter(path, num_tokens=sum(lengths), num_layers=K, hidden_size=D,
                             codec=store_codec("fp8_e4m3", "bfloat16"), chunk_tokens=4, flush_early=flush_early)
        for part in features.split(lengths):
            writer.write(part)
        writer.close(np.zeros(sum(lengths), np.int32), np.ones(sum(lengths), np.uint8), lengths,
                     ["a", "b", "c"], {"layer_ids": [1, 2, 3], "hidden_size": D})
        if flush_early:  # 16 rows in chunks of 4: 4 feature chunks + 4 scale chunks, each fsynced once
            chunk_files = [p for name in ("features", "feature_scales") for p in (path / name / "c").rglob("*")
                           if p.is_file()]
            assert writer.flusher.files == len(chunk_files) == 8
        else:
            assert writer.flusher is None
        stores[flush_early] = {p.relative_to(path): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
    assert stores[True] == stores[False]


def test_chunk_crcs_are_the_ones_google_crc32c_wrote():
    """crc32c (sums without the GIL) gives the CRC-32C google_crc32c gave: stores written before keep verifying."""
    import google_crc32c

    from dflash_pipeline.store import chunk_crc32c

    rows = np.random.default_rng(0).integers(0, 255, (37, 3, 5), dtype=np.uint8)
    expected = [google_crc32c.value(np.ascontiguousarray(rows[i : i + 8])) for i in range(0, 37, 8)]
    assert chunk_crc32c(rows, 8).tolist() == expected and len(expected) == 5


@pytest.mark.parametrize("dtype, compression", [("bfloat16", "zstd"), ("float32", "none")])
def test_chunk_files_decoded_here_equal_zarr_reads(tmp_path, dtype, compression):
    """read_chunks (each chunk file decoded in the calling thread) returns zarr's rows: whole chunks, the short
    last chunk, an all-zero chunk zarr did not write, and the 1-D token arrays."""
    import zarr

    from dflash_pipeline.store import read_chunks

    writer = ShardWriter(tmp_path / "s.zarr", num_tokens=23, num_layers=K, hidden_size=D,
                         codec=store_codec(dtype, "bfloat16"), chunk_tokens=4, compression=compression)
    features = torch.randn(23, K, D) * 3
    features[8:12] = 0  # one chunk equal to the fill value
    writer.write(features.to(torch.float32 if dtype == "float32" else torch.bfloat16))
    writer.close(np.arange(23, dtype=np.int32), np.ones(23, np.uint8), [23], ["a"], {"layer_ids": [1, 2, 3],
                                                                                  "hidden_size": D})
    group = zarr.open_group(tmp_path / "s.zarr", mode="r")
    assert not (tmp_path / "s.zarr/features/c/2/0/0").exists()
    for name in ("features", "input_ids", "loss_mask"):
        array = group[name]
        chunks = -(-array.shape[0] // array.chunks[0])
        for first, last in {(0, chunks), (min(1, chunks - 1), min(3, chunks)), (chunks - 1, chunks)}:
            expected = array[first * array.chunks[0] : min(last * array.chunks[0], array.shape[0])]
            got = read_chunks(array, first, last)
            assert got.dtype == expected.dtype and np.array_equal(got, expected), (name, first, last)
