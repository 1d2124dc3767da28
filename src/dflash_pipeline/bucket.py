"""The store in an S3-compatible bucket (AWS S3, MinIO, SeaweedFS, ...): where a ``s3://bucket/prefix`` URL leads,
how its objects are reached through zarr, and how every object is checksummed.

- Arrays go through zarr's own ``ObjectStore`` on obstore's ``S3Store`` rather than fsspec's s3fs: a Rust client
  without aiobotocore, whose narrow botocore pin would have to agree with boto3's (Snakemake's S3 plugin needs
  boto3), and in one trial here it read a 23 MB array in half s3fs's time. One S3 client per bucket and process;
  spawn workers make their own from the same environment.
- Credentials: boto3's chain (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``/``AWS_SESSION_TOKEN``,
  ``AWS_PROFILE`` and ~/.aws, SSO, instance roles), the same chain as Snakemake's S3 plugin; never the config file.
  ``Bucket.check`` turns a missing, refused or unreachable one into one ``BucketError`` sentence.
- ``GroupStore``: the objects under one prefix as a zarr store of their own (no parent groups written above a
  shard; one client for all). Its ``Checksummed`` records the size and CRC-32C of every object as the bytes go out
  (no re-read), or checks every object read against such a record: a flipped byte in any object (chunk,
  ``zarr.json``, checksum array) and a missing object are errors (``ObjectError``, or the error type the caller
  gives), never other values. ``first_unlisted``: the same record against one listing of the prefix (sizes only).
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
from zarr.storage import WrapperStore


class BucketError(RuntimeError):
    """The bucket cannot be used: the message is one sentence that says why and what to set."""


class ObjectError(ValueError):
    """An object, or a completion record, is missing or differs from what was recorded when it was written. The
    store (``store.remote``) has its readers raise its own ``StoreError`` instead (``Checksummed``'s ``error``)."""


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


# A run's layout under store.url: the arrays under data/ (zarr writes them), the completion records under complete/
# (Snakemake tracks them; its S3 plugin lists a record's parent prefix, which holds no array objects then).
def data_url(run_url: str, name: str) -> str:
    """``("s3://b/run", "extract/shard_00000")`` -> ``s3://b/run/data/extract/shard_00000.zarr``."""
    return f"{run_url.rstrip('/')}/data/{name}.zarr"


def record_url(run_url: str, name: str) -> str:
    """``("s3://b/run", "store")`` -> ``s3://b/run/complete/store.json``: the completion record of ``name``."""
    return f"{run_url.rstrip('/')}/complete/{name}.json"


def record_of(url: str) -> str:
    """The completion record of the arrays at ``url``: ``s3://b/run/data/x/y.zarr`` -> ``s3://b/run/complete/x/y.json``."""
    run, separator, name = url.rstrip("/").rpartition("/data/")
    if not separator or not name.endswith(".zarr"):
        raise ValueError(f"{url}: not <store.url>/data/<name>.zarr")
    return record_url(run, name.removesuffix(".zarr"))


_STORES: dict = {}  # (bucket settings) -> obstore S3Store, one client per process
_LOCK = threading.Lock()


def forget_clients() -> None:
    """Drop this process's S3 clients (the next use makes new ones, with the credentials then in force)."""
    with _LOCK:
        _STORES.clear()


def use_settings(settings: dict) -> None:
    """A job's ``store`` config section as the standard environment of this process and those it starts (torchrun
    ranks, DataLoader workers): ``endpoint_url`` -> ``AWS_ENDPOINT_URL_S3``, ``region`` -> ``AWS_REGION``."""
    for key, variable in (("endpoint_url", "AWS_ENDPOINT_URL_S3"), ("region", "AWS_REGION")):
        if settings.get(key):
            os.environ[variable] = settings[key]


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Where an S3 API is: ``endpoint_url`` (null: ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``, else AWS) and
    ``region`` (null: ``AWS_REGION``/``AWS_DEFAULT_REGION``/the profile's, else us-east-1)."""

    endpoint_url: str | None = None
    region: str | None = None

    def endpoint(self) -> str | None:
        return self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")

    def region_name(self) -> str:
        return (self.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
                or self.session().region_name or "us-east-1")

    def where(self) -> str:
        return self.endpoint() or "AWS S3"

    def session(self):
        import boto3

        return boto3.Session(region_name=self.region or os.environ.get("AWS_REGION") or None)

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
        key = (bucket, self.endpoint(), self.region_name())
        with _LOCK:
            if key not in _STORES:
                self.credentials(url)
                session = self.session()
                config = {"region": self.region_name()}
                if self.endpoint():
                    config["endpoint"] = self.endpoint()
                _STORES[key] = S3Store(bucket, config=config, credential_provider=Boto3CredentialProvider(session),
                                       client_options={"allow_http": str(self.endpoint()).startswith("http://")})
            return _STORES[key]

    def group_store(self, url: str, *, read_only: bool, checksums: Checksummed | None = None) -> GroupStore:
        """A zarr store of the objects under ``url`` (``checksums``: a ``Checksummed`` to record or check them)."""
        from zarr.storage import ObjectStore

        store = ObjectStore(self.object_store(url), read_only=read_only)
        return GroupStore(store, split_url(url)[1], checksums)

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
        status = re.search(r"status code: (\d{3})", text)
        if status and not code:
            return BucketError(f"{self.where()} answered a request for {url} with HTTP {status[1]} and no S3 error "
                               "code: it is an HTTP server but not an S3 API; check store.endpoint_url or "
                               "AWS_ENDPOINT_URL (the S3 gateway's address and port)")
        if "error sending request" in text or "connect" in text.lower():
            return BucketError(f"no S3 endpoint answers at {self.where()} for {url}: check store.endpoint_url or "
                               "AWS_ENDPOINT_URL")
        return BucketError(f"S3 request for {url} at {self.where()} failed: {text.splitlines()[0][:300]}")


# ---- a group's objects, checksummed ----
def object_crc(data) -> int:
    return crc32c.crc32c(memoryview(data).cast("B"))


class Checksummed:
    """Records of a group's objects, ``{key: [size, CRC-32C]}`` (keys below the group). ``expected`` given: every
    object read is checked against it (``label`` names the group in errors, raised as ``error``); else every write
    is recorded in ``written``."""

    def __init__(self, expected: dict | None = None, label: str = "", error: type[Exception] = ObjectError):
        self.expected, self.label, self.error = expected, label, error
        self.written: dict[str, list[int]] = {}

    def record(self, key: str, value) -> None:
        if self.expected is None:
            data = value.as_numpy_array()
            self.written[key] = [int(data.nbytes), object_crc(data)]

    def check(self, key: str, value) -> None:
        if self.expected is None:
            return
        expected = self.expected.get(key)
        if value is None:
            if expected is not None:
                raise self.error(f"{self.label}: object {key} is missing (check: objects)")
            return
        data = value.as_numpy_array()
        if expected is None:
            raise self.error(f"{self.label}: object {key} was not written with the store (check: objects)")
        if [int(data.nbytes), object_crc(data)] != list(expected):
            raise self.error(f"{self.label}: object {key} does not match its CRC-32C: its bytes changed after "
                             "they were written (check: object crc32c)")


class GroupStore(WrapperStore):
    """The objects under one ``prefix`` of a bucket-wide zarr store, as a store of their own: zarr then
    writes no parent groups above a shard, and every shard shares the bucket's one S3 client. ``checksums``:
    a ``Checksummed`` that records every write or checks every whole-object read."""

    def __init__(self, store, prefix: str, checksums: Checksummed | None = None):
        super().__init__(store)
        self.prefix, self.checksums = prefix.strip("/"), checksums or Checksummed()

    def _with_store(self, store):
        return type(self)(store, self.prefix, self.checksums)

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if key else self.prefix + "/"

    def __eq__(self, other):
        return type(self) is type(other) and (self._store, self.prefix) == (other._store, other.prefix)

    def __str__(self):
        return f"{self._store}/{self.prefix}"

    async def get(self, key, prototype, byte_range=None):
        value = await self._store.get(self._key(key), prototype, byte_range)
        if byte_range is None:
            self.checksums.check(key, value)
        return value

    async def get_partial_values(self, prototype, key_ranges):
        key_ranges = list(key_ranges)
        values = await self._store.get_partial_values(prototype, [(self._key(k), r) for k, r in key_ranges])
        for (key, byte_range), value in zip(key_ranges, values):
            if byte_range is None:
                self.checksums.check(key, value)
        return values

    async def exists(self, key):
        return await self._store.exists(self._key(key))

    async def set(self, key, value):
        self.checksums.record(key, value)
        await self._store.set(self._key(key), value)

    async def set_if_not_exists(self, key, value):
        self.checksums.record(key, value)
        await self._store.set_if_not_exists(self._key(key), value)

    async def _set_many(self, values):
        for key, value in values:
            await self.set(key, value)

    async def delete(self, key):
        await self._store.delete(self._key(key))

    async def delete_dir(self, prefix):
        await self._store.delete_dir(self._key(prefix))

    async def is_empty(self, prefix):
        return await self._store.is_empty(self._key(prefix))

    async def getsize(self, key):
        return await self._store.getsize(self._key(key))

    async def getsize_prefix(self, prefix):
        return await self._store.getsize_prefix(self._key(prefix))

    def list(self):
        return self.list_prefix("")

    async def list_prefix(self, prefix):
        async for key in self._store.list_prefix(self._key(prefix)):
            yield key[len(self.prefix) + 1 :]

    def list_dir(self, prefix):
        return self._store.list_dir(self._key(prefix))


# ---- completion records ----
def sealed(record: dict) -> dict:
    """``record`` with ``sha256`` of its canonical JSON: a changed byte of the record itself is caught too."""
    body = {k: v for k, v in record.items() if k != "sha256"}
    return {**body, "sha256": hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()}


def unsealed(record: dict, label: str) -> dict:
    """A record read back: checked against its ``sha256`` (``ObjectError`` naming ``label`` when it differs)."""
    if not isinstance(record, dict) or sealed(record).get("sha256") != record.get("sha256"):
        raise ObjectError(f"{label}: the completion record does not match its sha256 (check: record)")
    return record


def read_bytes(url: str, bucket: Bucket) -> bytes:
    """The object at ``url`` (``FileNotFoundError`` when there is none)."""
    import obstore

    _, key = split_url(url)
    try:
        return bytes(obstore.get(bucket.object_store(url), key).bytes())
    except FileNotFoundError:
        raise
    except Exception as error:
        raise bucket.explain(url, error) from error


def listed_sizes(url: str, bucket: Bucket) -> dict[str, int]:
    """The size of every object under ``url``, by key below it: a listing, no object read."""
    import obstore

    _, prefix = split_url(url)
    try:
        return {meta["path"][len(prefix) + 1 :]: meta["size"]
                for batch in obstore.list(bucket.object_store(url), prefix + "/", chunk_size=1000) for meta in batch}
    except Exception as error:
        raise bucket.explain(url, error) from error


def first_unlisted(url: str, objects: dict, bucket: Bucket) -> str | None:
    """The first object of ``objects`` (``{key: [size, CRC-32C]}``, keys below ``url``) that is not under ``url``
    with its recorded size, as "<its s3:// URL>: <what is wrong>"; None when every one is there."""
    sizes = listed_sizes(url, bucket)
    for key, (size, _) in sorted(objects.items()):
        if key not in sizes:
            return f"{url}/{key}: missing"
        if sizes[key] != size:
            return f"{url}/{key}: {sizes[key]} bytes, written as {size}"
    return None


def open_group(url: str, bucket: Bucket, *, mode: str, checksums: Checksummed | None = None):
    """``zarr.open_group`` of ``url`` in the bucket (``mode`` "w": the prefix is emptied first)."""
    return zarr.open_group(bucket.group_store(url, read_only=mode == "r", checksums=checksums), mode=mode,
                           zarr_format=3)
