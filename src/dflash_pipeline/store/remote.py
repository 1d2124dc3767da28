"""The store in an S3-compatible bucket (docs/storage.md): what differs from the local disk.

- A shard is written straight to ``<store.url>/data/extract/shard_N.zarr`` through zarr (``bucket_shard``): its
  prefix is emptied first, the size and CRC-32C of every object are recorded as it goes out, and when the shard is
  complete its *completion record* (those checksums, sealed by a sha256 of the record) is written to a local file
  that Snakemake's S3 plugin uploads to ``<store.url>/complete/extract/shard_N.json`` after the job: the shard's
  last object. A half-uploaded shard has no record.
- ``merge`` writes only metadata (``write_merged``): the global index and manifest under ``data/store.zarr`` and
  each shard's place relative to it (``shard_locations``), plus the store's record, which pins every shard's record
  by its sha256. No feature byte moves; there are no hard links in a bucket.
- ``BucketSource`` opens such a store (by its record, a local copy of it, or its ``data/…zarr`` URL) for the reader
  and ``verify``: every object read is checked against its record (``bucket.Checksummed``). ``check_listed``: every
  object a record lists is in the bucket with its recorded size, by one listing and no read (merge does it for each
  shard, a train job that resumes before its first step).
"""

from __future__ import annotations

import contextlib
import json
import posixpath
from pathlib import Path

import zarr

from ..atomic import atomic_path
from ..bucket import (Bucket, Checksummed, ObjectError, first_unlisted, is_bucket_url, join_url, read_bytes, record_of,
                      record_url, sealed, unsealed)
from .layout import StoreError

RECORD_FORMAT = 1


def is_bucket_store(path) -> bool:
    """A store or shard in a bucket: an s3:// URL, or a local copy of a completion record (``.json``)."""
    return is_bucket_url(str(path)) or str(path).endswith(".json")


def write_record(path, record: dict) -> None:
    with atomic_path(path) as tmp:
        Path(tmp).write_text(json.dumps(sealed({"format": RECORD_FORMAT, **record}), sort_keys=True) + "\n")


@contextlib.contextmanager
def bucket_shard(url: str, record_path):
    """Where ``extract`` writes a shard in a bucket: yields a zarr store of ``url`` (emptied when the writer opens
    it with mode "w"); when the body succeeds, the completion record goes to ``record_path``."""
    checksums = Checksummed()
    yield Bucket().group_store(url, read_only=False, checksums=checksums)
    write_record(record_path, {"kind": "shard", "url": url, "objects": checksums.written})


def shard_destination(out, record_path=None):
    """Where a shard is written: a local directory (``atomic_path``: a temp name, renamed when complete) or, for an
    s3:// URL, ``bucket_shard`` with its completion record at ``record_path``."""
    if is_bucket_url(str(out)):
        if record_path is None:
            raise ValueError(f"{out}: a shard in a bucket needs the path of its completion record")
        return bucket_shard(str(out), record_path)
    return atomic_path(out)


def record_location(url: str) -> str:
    """The s3:// URL of the completion record of ``url``: a record itself, the arrays it marks
    (``…/data/<name>.zarr``), or a ``store.url`` (its merged store's record)."""
    if url.endswith(".json"):
        return url
    if "/data/" in url:
        return record_of(url)
    return record_url(url.rstrip("/"), "store")


def load_record(path, bucket: Bucket | None = None) -> dict:
    """A completion record, checked against its sha256: from a local file (Snakemake's copy of one), an s3:// URL of
    one, the s3:// URL of the arrays it marks, or a store.url. No record (the shard or store is not complete) or a changed one:
    ``StoreError`` naming the record by its s3:// URL (a local copy: by the URL of the arrays it says it marks)."""
    path = str(path)
    where = record_location(path) if is_bucket_url(path) else path
    try:
        data = read_bytes(where, bucket or Bucket()) if is_bucket_url(where) else Path(where).read_bytes()
    except FileNotFoundError:
        raise StoreError(f"{where}: no completion record: not complete (check: record)") from None
    try:
        record = json.loads(data)
    except ValueError:
        record = None
    if not is_bucket_url(where) and isinstance(record, dict) and is_bucket_url(str(record.get("url"))):
        with contextlib.suppress(ValueError):
            where = record_of(record["url"])
    try:
        return unsealed(record, where)
    except ObjectError as error:
        raise StoreError(str(error)) from None


def check_listed(url: str, record: dict) -> None:
    """Every object ``record`` lists is under ``url`` with its recorded size (one listing, no object read); else a
    ``StoreError`` naming the first one that is not by its s3:// URL, and the record to delete."""
    problem = first_unlisted(url, record["objects"], Bucket())
    if problem:
        raise StoreError(f"{problem}: its completion record {record_of(url)} lists it; delete that record and run "
                         "the workflow again to write it anew (check: listing)")


def open_checked(url: str, record: dict, label: str):
    """The zarr group at ``url``, every object read checked against ``record``'s table."""
    if record.get("url") != url:
        raise StoreError(f"{label}: the record is of {record.get('url')}, not of {url} (check: record)")
    checksums = Checksummed(expected=record["objects"], label=label, error=StoreError)
    return zarr.open_group(Bucket().group_store(url, read_only=True, checksums=checksums), mode="r")


def write_merged(shard_urls: list[str], shard_records: list[dict], out_url: str, record_path, write_index) -> None:
    """The merged store in the bucket: ``write_index(root)`` writes the global index and attributes into the new
    group at ``out_url``; each shard is referenced where it is (relative to ``out_url``) and pinned by its record."""
    checksums = Checksummed()
    root = zarr.open_group(Bucket().group_store(out_url, read_only=False, checksums=checksums), mode="w",
                           zarr_format=3)
    locations = [posixpath.relpath(url, out_url) for url in shard_urls]
    write_index(root, {"shard_locations": locations})
    write_record(record_path, {"kind": "store", "url": out_url, "objects": checksums.written,
                               "shards": [{"location": location, "sha256": record["sha256"]}
                                          for location, record in zip(locations, shard_records)]})


class BucketSource:
    """A store (or one shard) in a bucket, opened by its record: ``root()`` and ``shard(i)`` are zarr groups whose
    every object is checked. Pickles as its path and record; groups open on first use in each process."""

    def __init__(self, path):
        self.path = str(path)
        self.record = load_record(self.path)
        self.url = self.record["url"]
        self._root = None

    def __getstate__(self):
        return {**self.__dict__, "_root": None}

    @property
    def is_shard(self) -> bool:
        return self.record.get("kind") == "shard"

    def root(self):
        if self._root is None:
            self._root = open_checked(self.url, self.record, self.url)
        return self._root

    def shard_url(self, index: int) -> str:
        return join_url(self.url, self.record["shards"][index]["location"])

    def shard_record(self, index: int) -> dict:
        """Shard ``index``'s record; a ``StoreError`` when it is missing or is not the one merged."""
        url, pinned = self.shard_url(index), self.record["shards"][index]["sha256"]
        record = load_record(url)
        if record["sha256"] != pinned:
            raise StoreError(f"{self.url}: shard {index:05d} ({url}) is not the shard merged into this store: its "
                             "record changed since (re-extracted?); rerun merge (check: record)")
        return record

    def shard(self, index: int):
        """Shard ``index``'s group, every object read checked against its record."""
        url = self.shard_url(index)
        return open_checked(url, self.shard_record(index), url)

    def check_listed(self) -> None:
        """Every object of the store and of its shards is in the bucket with its recorded size (``check_listed``:
        one listing per shard, no object read); the first one that is not is a ``StoreError``."""
        check_listed(self.url, self.record)
        for index in range(len(self.record.get("shards", []))):
            check_listed(self.shard_url(index), self.shard_record(index))
