"""The store in an S3-compatible bucket (AWS S3, MinIO, SeaweedFS, ...): where a ``s3://bucket/prefix`` URL leads,
how its objects are reached through zarr, and how every object is checksummed.

- Arrays go through zarr's own ``ObjectStore`` on obstore's ``S3Store`` (Rust, no botocore pin to fight with
  Snakemake's S3 plugin, which uses boto3; obstore reads ~2x faster than s3fs here). One S3 client per bucket and
  process; a store pickles as its ``Bucket`` settings only, so spawn workers open their own.
- Credentials: boto3's chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``,
  ``AWS_PROFILE`` and ~/.aws, SSO, instance roles), the same chain as Snakemake's S3 plugin; never the config file.
  ``Bucket.check`` turns a missing, refused or unreachable one into one ``BucketError`` sentence.
- ``Checksummed`` wraps a zarr store: the size and CRC-32C of every object written under a root are recorded as the
  bytes go out (no re-read), and every object read under a root is checked against such a record, so a flipped
  byte in any object (chunk, ``zarr.json``, checksum array) and a missing object are errors, never other values.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import posixpath
import re
import threading
from urllib.parse import urlparse

import crc32c
import zarr
from zarr.storage import StorePath, WrapperStore


class BucketError(RuntimeError):
    """The bucket cannot be used: the message is one sentence that says why and what to set."""


def is_bucket_url(path) -> bool:
    return isinstance(path, str) and path.startswith("s3://")


def split_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b/`` -> ("bucket", "a/b"), the prefix normalised (no leading, trailing or double slash)."""
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"{url!r} is not an s3://bucket/prefix URL")
    prefix = posixpath.normpath(parsed.path.strip("/")) if parsed.path.strip("/") else ""
    if prefix.startswith(".."):
        raise ValueError(f"{url!r}: the prefix leaves the bucket")
    return parsed.netloc, prefix


def join_url(url: str, *parts: str) -> str:
    """``join_url("s3://b/run/store.zarr", "../extract/x")`` -> ``s3://b/run/extract/x``."""
    bucket, prefix = split_url(url)
    return f"s3://{bucket}/" + posixpath.normpath(posixpath.join(prefix or ".", *parts)).lstrip("./")


_STORES: dict = {}  # (bucket settings) -> obstore S3Store, one client per process
_LOCK = threading.Lock()


def forget_clients() -> None:
    """Drop this process's S3 clients (the next use makes new ones, with the credentials then in force)."""
    with _LOCK:
        _STORES.clear()


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Where an S3 API is: ``endpoint_url`` (null: ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``, else AWS) and
    ``region`` (null: ``AWS_REGION``/``AWS_DEFAULT_REGION``/the profile's, else us-east-1)."""

    endpoint_url: str | None = None
    region: str | None = None

    def endpoint(self) -> str | None:
        return self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")

    def where(self) -> str:
        return self.endpoint() or "AWS S3"

    def session(self):
        import boto3

        return boto3.Session(region_name=self.region or None)

    def credentials(self, url: str):
        """boto3's credentials, or a ``BucketError`` naming what to set."""
        credentials = self.session().get_credentials()
        if credentials is None:
            raise BucketError(f"no S3 credentials for {url} at {self.where()}: set AWS_ACCESS_KEY_ID and "
                              "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE to a profile in ~/.aws (docs/storage.md)")
        return credentials

    def object_store(self, url: str):
        """obstore's ``S3Store`` of the bucket of ``url`` (its whole bucket: keys carry the prefix)."""
        from obstore.auth.boto3 import Boto3CredentialProvider
        from obstore.store import S3Store

        bucket, _ = split_url(url)
        key = (bucket, self.endpoint(), self.region)
        with _LOCK:
            if key not in _STORES:
                self.credentials(url)
                session = self.session()
                config = {"region": self.region or session.region_name or "us-east-1"}
                if self.endpoint():
                    config["endpoint"] = self.endpoint()
                _STORES[key] = S3Store(bucket, config=config, credential_provider=Boto3CredentialProvider(session),
                                       client_options={"allow_http": str(self.endpoint()).startswith("http://")})
            return _STORES[key]

    def store_path(self, url: str, *, read_only: bool, checksums: Checksummed | None = None) -> StorePath:
        """A zarr ``StorePath`` of ``url`` (``checksums``: a ``Checksummed`` to record or check its objects)."""
        from zarr.storage import ObjectStore

        _, prefix = split_url(url)
        store = ObjectStore(self.object_store(url), read_only=read_only)
        if checksums is not None:
            store = checksums.wrapping(store)
        return StorePath(store, prefix)

    def check(self, url: str) -> None:
        """One authenticated request under ``url``; a ``BucketError`` sentence when it cannot be made."""
        import obstore

        try:
            next(iter(obstore.list(self.object_store(url), split_url(url)[1] + "/", chunk_size=1)), None)
        except BucketError:
            raise
        except Exception as error:
            raise self.explain(url, error) from error

    def explain(self, url: str, error: Exception) -> BucketError:
        """An S3 failure as one sentence: refused credentials, no such bucket, no answer, or the server's words."""
        text = str(error)
        code = re.search(r"<Code>([^<]+)</Code>", text)
        code = code[1] if code else ""
        if code in ("SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied", "InvalidToken",
                    "ExpiredToken", "Forbidden") or " 403 " in text:
            source = getattr(self.session().get_credentials(), "method", "unknown")
            return BucketError(f"{self.where()} refused the S3 credentials (from {source}) for {url} ({code or 403}): "
                               "check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE (docs/storage.md)")
        if code == "NoSuchBucket":
            return BucketError(f"the bucket of {url} does not exist at {self.where()}: create it first")
        if "error sending request" in text or "connect" in text.lower():
            return BucketError(f"no S3 endpoint answers at {self.where()} for {url}: check store.endpoint_url or "
                               "AWS_ENDPOINT_URL")
        return BucketError(f"S3 request for {url} at {self.where()} failed: {text.splitlines()[0][:300]}")


# ---- object checksums ----
def object_crc(data) -> int:
    return crc32c.crc32c(memoryview(data).cast("B"))


class Checksummed:
    """Records of the objects under ``root`` (a key prefix, no trailing slash): ``{key below root: [size,
    CRC-32C]}``. ``expected`` given: every read under the root is checked against it (``label`` names the store in
    errors); else every write under the root is recorded in ``written``."""

    def __init__(self, root: str, expected: dict | None = None, label: str = ""):
        self.root, self.expected, self.label = root.strip("/"), expected, label or root
        self.written: dict[str, list[int]] = {}

    def wrapping(self, store) -> _ChecksumStore:
        return _ChecksumStore(store, self)

    def relative(self, key: str) -> str | None:
        if not self.root:
            return key
        return key[len(self.root) + 1 :] if key.startswith(self.root + "/") else None

    def record(self, key: str, value) -> None:
        relative = self.relative(key)
        if relative is not None and self.expected is None:
            data = value.as_numpy_array()
            self.written[relative] = [int(data.nbytes), object_crc(data)]

    def check(self, key: str, value) -> None:
        from .store import StoreError  # the error every reader of the store already handles

        relative = None if self.expected is None else self.relative(key)
        if relative is None:
            return
        expected = self.expected.get(relative)
        if value is None:
            if expected is not None:
                raise StoreError(f"{self.label}: object {relative} is missing (check: objects)")
            return
        data = value.as_numpy_array()
        if expected is None:
            raise StoreError(f"{self.label}: object {relative} was not written with the store (check: objects)")
        if [int(data.nbytes), object_crc(data)] != list(expected):
            raise StoreError(f"{self.label}: object {relative} does not match its CRC-32C: its bytes changed after "
                             "they were written (check: object crc32c)")


class _ChecksumStore(WrapperStore):
    def __init__(self, store, checksums: Checksummed):
        super().__init__(store)
        self.checksums = checksums

    def _with_store(self, store):
        return type(self)(store, self.checksums)

    async def set(self, key, value):
        self.checksums.record(key, value)
        await self._store.set(key, value)

    async def set_if_not_exists(self, key, value):
        self.checksums.record(key, value)
        await self._store.set_if_not_exists(key, value)

    async def _set_many(self, values):
        for key, value in values:
            await self.set(key, value)

    async def get(self, key, prototype, byte_range=None):
        value = await self._store.get(key, prototype, byte_range)
        if byte_range is None:
            self.checksums.check(key, value)
        return value

    async def get_partial_values(self, prototype, key_ranges):
        key_ranges = list(key_ranges)
        values = await self._store.get_partial_values(prototype, key_ranges)
        for (key, byte_range), value in zip(key_ranges, values):
            if byte_range is None:
                self.checksums.check(key, value)
        return values


# ---- completion records ----
def sealed(record: dict) -> dict:
    """``record`` with ``sha256`` of its canonical JSON: a changed byte of the record itself is caught too."""
    body = {k: v for k, v in record.items() if k != "sha256"}
    return {**body, "sha256": hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()}


def unsealed(record: dict, label: str) -> dict:
    """A record read back: checked against its ``sha256`` (``StoreError`` naming ``label`` when it differs)."""
    from .store import StoreError

    if not isinstance(record, dict) or sealed(record).get("sha256") != record.get("sha256"):
        raise StoreError(f"{label}: the completion record does not match its sha256 (check: record)")
    return record


def read_json(url: str, bucket: Bucket):
    """The JSON object at ``url`` (``FileNotFoundError`` when there is none)."""
    import obstore

    _, key = split_url(url)
    try:
        return json.loads(bytes(obstore.get(bucket.object_store(url), key).bytes()))
    except FileNotFoundError:
        raise
    except Exception as error:
        raise bucket.explain(url, error) from error


def open_group(url: str, bucket: Bucket, *, mode: str, checksums: Checksummed | None = None):
    """``zarr.open_group`` of ``url`` in the bucket (``mode`` "w": the prefix is emptied first)."""
    path = bucket.store_path(url, read_only=mode == "r", checksums=checksums)
    return zarr.open_group(path, mode=mode, zarr_format=3)
