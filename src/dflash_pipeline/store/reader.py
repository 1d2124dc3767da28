"""Reading a merged store (``HiddenStateStore``) or one shard (``read_shard_features``); every chunk read is
checked against its CRC-32C."""

from __future__ import annotations

import sys

import numcodecs
import numpy as np
import torch
import zarr
from zarr.codecs import BloscCodec, BytesCodec

from .codec import codec_from_attrs
from .integrity import chunk_crc32c, stored_crcs
from .layout import StoreError, chunk_file, feature_layers
from .remote import BucketSource, is_bucket_store

TOKEN_ARRAYS = ("input_ids", "loss_mask")


def read_shard_features(group, rows: slice, attrs: dict | None = None, codec=None) -> torch.Tensor:
    """Decoded feature rows of one shard group (``attrs``: the shard's attributes, read if not given; ``codec``: the
    one it was written with, for codecs that keep data beside the shard, e.g. a compact shard's basis)."""
    codec = codec or codec_from_attrs(dict(group.attrs) if attrs is None else attrs)
    return codec.decode({name: group[name][rows] for name in codec.array_names})


def read_chunks(array, first: int, last: int) -> np.ndarray:
    """The rows of chunks ``first``..``last - 1`` of an array as this package writes them (a local store, bytes then
    at most one blosc codec), each chunk file read and decoded in the calling thread. Reads through zarr share its
    one event loop, which holds them to ~1 GiB/s whatever the number of threads (benchmarks/journal/2026-12-01_s09.md,
    "Where the train job's time went"); these scale with the threads (one thread alone decodes slower than zarr's pool).
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


class HiddenStateStore:
    """Read access to a merged store: ``store[i]`` → ``(input_ids, loss_mask, features)`` of sample i.

    ``path``: a local store directory, or a store in a bucket by its completion record (an s3:// URL, or a local
    copy of it) or its ``…/data/store.zarr`` URL (``store.remote``; every object read is checked).
    It pickles as its path and options (a few hundred bytes, whatever the store's size), so it can be handed to
    DataLoader workers started with ``spawn``: each process opens the store itself. A spawn worker's process object
    larger than the pipe's 64 KiB would make each worker's start wait for the previous one's imports
    (benchmarks/speed/loader_start.py). A read error is raised, never replaced by another sample.
    ``coefficients``: a compact store read as its stored coefficients, [n, 1, r] per sample, not decoded.
    """

    # How the rows of whole chunks are read: ``read_chunks`` (each chunk file decoded in the reading thread). A seam
    # for measurements: benchmarks/speed/preload_speed.py subclasses the store to read through zarr instead.
    read_chunks = staticmethod(read_chunks)

    def __init__(self, path, *, coefficients: bool = False):
        self.path, self.coefficients = str(path), coefficients
        self.source = BucketSource(self.path) if is_bucket_store(self.path) else None
        root = self._root()
        self.attrs = dict(root.attrs)
        self.sample_offsets = root["sample_offsets"][:]
        self.shard_token_offsets = root["shard_token_offsets"][:]
        self.logical_dtype = self.attrs["logical_dtype"]
        self.stored_codec = codec_from_attrs(self.attrs).bind(self.path)
        self.codec = self.stored_codec.coefficient_view() if coefficients else self.stored_codec
        self._shards = None
        self._arrays: dict = {}  # (shard, array name) -> (zarr array, CRC-32C per chunk or None)
        self._verified: set = set()  # (shard, array name): token arrays whose chunks were all checked once

    def __reduce__(self):
        return _open_store, (type(self), self.path, self.coefficients)

    def _root(self):
        return self.source.root() if self.source else zarr.open_group(self.path, mode="r")

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
        state where the store holds it (``final_hidden``); (1, r) for a compact store's coefficients."""
        return self.codec.decoded_shape(len(feature_layers(self.attrs)), int(self.attrs["hidden_size"]))

    @property
    def feature_dtype(self) -> torch.dtype:
        """The dtype ``store[i]`` returns features in (fp8 stores: the dtype they are dequantised to)."""
        return self.codec.feature_dtype

    def token_array(self, name: str) -> np.ndarray:
        """``input_ids`` (int64) or ``loss_mask`` (bool) of every token, all shards concatenated (CRC-checked)."""
        sizes = np.diff(self.shard_token_offsets)
        rows = [self._rows(s, name, slice(0, int(size)), f"shard {s}") for s, size in enumerate(sizes)]
        return np.concatenate(rows or [np.zeros(0, np.int64)]).astype(bool if name == "loss_mask" else np.int64)

    def feature_pieces(self, rows_per_piece: int):
        """(shard, rows) pieces that cover every shard's feature rows, each a whole number of chunks."""
        for shard in range(len(self.shard_token_offsets) - 1):
            size = int(self.shard_token_offsets[shard + 1] - self.shard_token_offsets[shard])
            chunk = self.shard(shard)["features"].chunks[0]
            step = max(chunk, rows_per_piece // chunk * chunk)
            yield from ((shard, slice(a, min(a + step, size))) for a in range(0, size, step))

    def read_features(self, shard: int, rows: slice, label: str | None = None) -> torch.Tensor:
        """Decoded feature rows of one shard (CRC-checked), as ``store[i]`` returns them."""
        return self.codec.decode(self.stored_rows(shard, rows, label))

    def stored_rows(self, shard: int, rows: slice, label: str | None = None) -> dict[str, np.ndarray]:
        """Feature rows of one shard as stored (CRC-checked), one array per name of the codec's ``array_names``;
        ``codec.decode`` turns them into features."""
        label = label or f"rows {rows.start}..{rows.stop}"
        return {name: self._rows(shard, name, rows, label) for name in self.codec.array_names}

    def shard(self, index: int):
        """The Zarr group of shard ``index`` (``shards/<index>``; in a bucket, opened with its own record when first
        read)."""
        if self.source:
            self._shards = self._shards or {}
            if index not in self._shards:
                self._shards[index] = self.source.shard(index)
        elif self._shards is None:
            root = self._root()
            self._shards = [root[f"shards/{s:05d}"] for s in range(len(self.shard_token_offsets) - 1)]
        return self._shards[index]

    def check_listed(self) -> None:
        """In a bucket: every object the records of the store and its shards list is there with its recorded size
        (``BucketSource.check_listed``: a listing per shard, no read), else a ``StoreError`` naming the first that is
        not. A local store keeps no such table: its chunks are checked as they are read (and by ``verify``)."""
        if self.source:
            self.source.check_listed()

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        input_ids, loss_mask, stored = self.stored_sample(i)
        return input_ids, loss_mask, self.codec.decode(stored)

    def stored_sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, np.ndarray]]:
        """``store[i]`` with its features as stored (``stored_rows``), not decoded."""
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} out of range for a store of {len(self)} samples")
        start, end = int(self.sample_offsets[i]), int(self.sample_offsets[i + 1])
        shard = int(np.searchsorted(self.shard_token_offsets, start, side="right")) - 1
        begin = start - int(self.shard_token_offsets[shard])
        rows = slice(begin, begin + end - start)
        input_ids = torch.from_numpy(self._rows(shard, "input_ids", rows, f"sample {i}").astype(np.int64))
        loss_mask = torch.from_numpy(self._rows(shard, "loss_mask", rows, f"sample {i}").astype(bool))
        return input_ids, loss_mask, self.stored_rows(shard, rows, f"sample {i}")

    def _rows(self, shard: int, name: str, rows: slice, what: str) -> np.ndarray:
        """Rows of one array of a shard; every chunk they touch is checked against its CRC-32C (stores written
        before checksums: not checked). Raises ``StoreError`` naming the shard, never returns other rows.
        The token arrays (chunks of up to 2^20 tokens, also checked against the tokenized shards by merge) are
        checked on their first read in each process; features on every read."""
        if (shard, name) not in self._arrays:
            group = self.shard(shard)
            self._arrays[shard, name] = group[name], stored_crcs(group, name)
        array, crcs = self._arrays[shard, name]
        where = f"{self.path}: {what}: shard {shard:05d} {name}"
        size = array.chunks[0]
        first, last = rows.start // size, -(-rows.stop // size)
        try:
            if crcs is None or (shard, name) in self._verified:
                return array[rows]
            if name in TOKEN_ARRAYS:
                first, last = 0, len(crcs)
            block = self.read_chunks(array, first, last)
        except Exception as error:  # an undecodable chunk, a truncated file, ...
            raise StoreError(f"{where} rows {rows.start}..{rows.stop}: unreadable: {error} (check: read)") from error
        bad = np.flatnonzero(chunk_crc32c(block, size) != crcs[first:last])
        if bad.size:
            chunk = first + int(bad[0])
            end = min((chunk + 1) * size, array.shape[0])
            raise StoreError(f"{where} chunk {chunk} (rows {chunk * size}..{end}) does not match its CRC-32C: the "
                             "stored bytes changed after they were written (check: crc32c); "
                             f"`dflash-pipeline verify {self.path}` checks the whole store")
        if name in TOKEN_ARRAYS:
            self._verified.add((shard, name))
        return block[rows.start - first * size : rows.stop - first * size]


def _open_store(cls, path: str, coefficients: bool) -> HiddenStateStore:
    """What an unpickled store is: the store at ``path``, opened anew."""
    return cls(path, coefficients=coefficients)
