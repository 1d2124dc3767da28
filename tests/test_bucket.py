"""The S3 server harness and the bucket access layer, against a real SeaweedFS server on 127.0.0.1."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

import botocore
import numpy as np
import pytest
from botocore.config import Config

from dflash_pipeline import bucket
from dflash_pipeline.store import StoreError


def _sockets_of(pid: int) -> list[tuple[str, str, str, int]]:
    """(protocol, local address, remote address, TCP state) of every inet socket process ``pid`` holds, read from
    /proc (no ss/netstat needed)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])

    def address(text: str) -> str:
        host = bytes.fromhex(text.split(":")[0])
        # /proc/net prints each 32-bit word of the address in host (little-endian) order
        words = b"".join(host[i : i + 4][::-1] for i in range(0, len(host), 4))
        return str(ipaddress.ip_address(words))

    found = []
    for protocol in ("tcp", "tcp6", "udp", "udp6"):
        for line in Path(f"/proc/{pid}/net/{protocol}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[9] in inodes:
                found.append((protocol, address(fields[1]), address(fields[2]), int(fields[3], 16)))
    return found


def test_every_socket_of_the_server_is_on_loopback(s3_server):
    sockets = _sockets_of(s3_server.pid)
    listening = [s for s in sockets if s[0].startswith("tcp") and s[3] == 0x0A]
    # master, volume, filer and s3: an HTTP and a gRPC port each
    assert len(listening) >= 8, sockets
    for protocol, local, remote, _ in sockets:
        assert ipaddress.ip_address(local).is_loopback, (protocol, local)
        assert remote in ("0.0.0.0", "::") or ipaddress.ip_address(remote).is_loopback, (protocol, remote)


def test_anonymous_requests_are_refused(s3_env):
    server, name = s3_env
    server.client().put_object(Bucket=name, Key="a", Body=b"secret")
    anonymous = server.client(config=Config(signature_version=botocore.UNSIGNED))
    for request in (lambda: anonymous.list_buckets(), lambda: anonymous.get_object(Bucket=name, Key="a"),
                    lambda: anonymous.put_object(Bucket=name, Key="b", Body=b"x"),
                    lambda: anonymous.list_objects_v2(Bucket=name)):
        with pytest.raises(botocore.exceptions.ClientError, match="AccessDenied"):
            request()


def test_wrong_or_missing_credentials_and_a_missing_bucket_are_one_sentence(s3_env, monkeypatch):
    server, name = s3_env
    url = f"s3://{name}/run"
    bucket.Bucket().check(url)  # the right ones pass
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    bucket.forget_clients()
    with pytest.raises(bucket.BucketError) as refused:
        bucket.Bucket().check(url)
    assert str(refused.value).startswith(f"{server.endpoint_url} refused the S3 credentials (from env) for {url}")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    bucket.forget_clients()
    with pytest.raises(bucket.BucketError, match=f"^no S3 credentials for {url} at {server.endpoint_url}: set "):
        bucket.Bucket().check(url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
    bucket.forget_clients()
    with pytest.raises(bucket.BucketError, match="^the bucket of s3://no-such-bucket/run does not exist at "):
        bucket.Bucket().check("s3://no-such-bucket/run")
    for error in (refused.value,):
        assert "\n" not in str(error)


def test_a_flipped_byte_or_a_missing_object_under_a_checksummed_root_is_an_error(s3_env):
    server, name = s3_env
    url, root = f"s3://{name}/run/group.zarr", "run/group.zarr"
    written = bucket.Checksummed(root)
    group = bucket.open_group(url, bucket.Bucket(), mode="w", checksums=written)
    array = group.create_array("rows", shape=(1000, 4), chunks=(256, 4), dtype="float32")
    array[:] = np.arange(4000, dtype="float32").reshape(1000, 4)
    group.attrs["note"] = "kept"
    assert sorted(written.written) == ["rows/c/0/0", "rows/c/1/0", "rows/c/2/0", "rows/c/3/0", "rows/zarr.json",
                                       "zarr.json"]

    def read():
        checked = bucket.Checksummed(root, expected=written.written, label=url)
        return bucket.open_group(url, bucket.Bucket(), mode="r", checksums=checked)["rows"][:]

    assert np.array_equal(read(), array[:])
    client = server.client()
    for key in sorted(written.written):
        original = client.get_object(Bucket=name, Key=f"{root}/{key}")["Body"].read()
        flipped = bytearray(original)
        flipped[len(flipped) // 2] ^= 0x01
        client.put_object(Bucket=name, Key=f"{root}/{key}", Body=bytes(flipped))
        with pytest.raises(StoreError, match=f"object {key} does not match its CRC-32C"):
            read()
        client.put_object(Bucket=name, Key=f"{root}/{key}", Body=original)
    client.delete_object(Bucket=name, Key=f"{root}/rows/c/2/0")  # zarr alone would read the fill value
    with pytest.raises(StoreError, match="object rows/c/2/0 is missing"):
        read()


def test_a_record_changed_after_sealing_is_caught():
    record = bucket.sealed({"objects": {"zarr.json": [80, 1234]}, "num_tokens": 12})
    assert bucket.unsealed(dict(record), "x") == record
    with pytest.raises(StoreError, match="does not match its sha256"):
        bucket.unsealed({**record, "num_tokens": 13}, "x")


def test_join_and_split_urls():
    assert bucket.split_url("s3://b/a//b/") == ("b", "a/b")
    assert bucket.join_url("s3://b/run/store.zarr", "../extract/shard_00000.zarr") == "s3://b/run/extract/shard_00000.zarr"
    with pytest.raises(ValueError):
        bucket.split_url("s3://b/../x")
