"""The S3 server harness and the bucket access layer, against a real SeaweedFS server on 127.0.0.1."""

from __future__ import annotations

import ipaddress
import json
import os
from pathlib import Path

import botocore
import numpy as np
import pytest
import torch
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
    written = bucket.Checksummed()
    group = bucket.open_group(url, bucket.Bucket(), mode="w", checksums=written)
    array = group.create_array("rows", shape=(1000, 4), chunks=(256, 4), dtype="float32")
    array[:] = np.arange(4000, dtype="float32").reshape(1000, 4)
    group.attrs["note"] = "kept"
    assert sorted(written.written) == ["rows/c/0/0", "rows/c/1/0", "rows/c/2/0", "rows/c/3/0", "rows/zarr.json",
                                       "zarr.json"]
    # only the group's own objects: zarr wrote no parent group above it
    assert sorted(item["Key"] for item in server.client().list_objects_v2(Bucket=name)["Contents"]) == sorted(
        f"{root}/{key}" for key in written.written)
    client = server.client()
    client.put_object(Bucket=name, Key=f"{root}/left-over", Body=b"x")  # by an earlier, killed writer
    client.put_object(Bucket=name, Key=f"{root}.json", Body=b"x")  # beside the group, not in it
    bucket.open_group(url, bucket.Bucket(), mode="w")
    assert sorted(item["Key"] for item in client.list_objects_v2(Bucket=name)["Contents"]) == [
        f"{root}.json", f"{root}/zarr.json"]
    group = bucket.open_group(url, bucket.Bucket(), mode="w", checksums=written)
    array = group.create_array("rows", shape=(1000, 4), chunks=(256, 4), dtype="float32")
    array[:] = np.arange(4000, dtype="float32").reshape(1000, 4)
    group.attrs["note"] = "kept"

    def read():
        checked = bucket.Checksummed(expected=written.written, label=url)
        return bucket.open_group(url, bucket.Bucket(), mode="r", checksums=checked)["rows"][:]

    assert np.array_equal(read(), array[:])
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


def test_shards_in_a_bucket_merge_by_reference_and_read_back_like_local_ones(s3_env, tmp_path):
    from store_helpers import make_shard

    from dflash_pipeline.store import HiddenStateStore, merge_shards, verify
    from dflash_pipeline.store.merge import merge_bucket_shards
    from dflash_pipeline.store.remote import bucket_shard

    server, name = s3_env
    run = f"s3://{name}/run"
    shards = [([3, 5, 9], 0), ([1, 4], 1)]
    frames, urls, records = [], [], []
    for i, (lengths, seed) in enumerate(shards):
        url, record = bucket.data_url(run, f"extract/shard_{i:05d}"), tmp_path / f"shard_{i}.json"
        with bucket_shard(url, record) as store:
            _, frame = make_shard(store, lengths, dtype="bfloat16", seed=seed, name=f"s{i}.zarr")
        make_shard(tmp_path / f"s{i}.zarr", lengths, dtype="bfloat16", seed=seed)  # the same shard on disk
        frames.append(frame)
        urls.append(url)
        records.append(record)
    assert json.loads(records[0].read_text())["url"] == urls[0]
    merge_bucket_shards(urls, records, frames, bucket.data_url(run, "store"), tmp_path / "store.json", {"target": "x"})
    merge_shards([tmp_path / f"s{i}.zarr" for i in range(2)], frames, tmp_path / "store.zarr", {"target": "x"})
    # merge wrote metadata only: its objects are the index arrays and zarr.json files
    client = server.client()
    merged = [item["Key"] for item in client.list_objects_v2(Bucket=name, Prefix="run/data/store.zarr/")["Contents"]]
    assert sorted(key.split("/", 3)[3] for key in merged) == [
        "sample_offsets/c/0", "sample_offsets/zarr.json", "shard_token_offsets/c/0", "shard_token_offsets/zarr.json",
        "zarr.json"]
    # what Snakemake's S3 plugin does after each job: the records go up last
    client.upload_file(str(tmp_path / "store.json"), name, "run/complete/store.json")
    for i, record in enumerate(records):
        client.upload_file(str(record), name, f"run/complete/extract/shard_{i:05d}.json")
    local = HiddenStateStore(tmp_path / "store.zarr")
    for opened_by in (tmp_path / "store.json", bucket.data_url(run, "store")):  # the record, or the arrays' URL
        remote = HiddenStateStore(opened_by)
        assert len(remote) == len(local) == 5 and remote.manifest == {"target": "x"}
        for i in range(len(local)):
            for a, b in zip(remote[i], local[i]):
                assert torch.equal(a, b)
    assert verify(f"{run}/complete/store.json") == []
    from dflash_pipeline.cli import main as cli

    assert cli(["verify", f"{run}/complete/store.json"]) == 0
    # a spawn worker opens its own client from the same environment
    remote = HiddenStateStore(f"{run}/complete/store.json")
    loader = torch.utils.data.DataLoader(remote, batch_size=None, num_workers=1, multiprocessing_context="spawn")
    for i, (ids, mask, feats) in enumerate(loader):
        assert torch.equal(feats, local[i][2]) and torch.equal(ids, local[i][0])
    # a shard extracted again (other values) after the merge is not the one the store pinned
    with bucket_shard(urls[1], records[1]) as store:
        make_shard(store, [1, 4], dtype="bfloat16", seed=7, name="s1.zarr")
    client.upload_file(str(records[1]), name, "run/complete/extract/shard_00001.json")
    with pytest.raises(StoreError, match="is not the shard merged into this store"):
        HiddenStateStore(f"{run}/complete/store.json")[4]
    # a half-written shard has no record: it is not complete
    client.delete_object(Bucket=name, Key="run/complete/extract/shard_00000.json")
    with pytest.raises(StoreError, match="no completion record: not complete"):
        HiddenStateStore(f"{run}/complete/store.json")[0]
    assert any("shard 00000" in p and "(check: record)" in p for p in verify(f"{run}/complete/store.json"))
    assert cli(["verify", f"{run}/complete/store.json"]) == 1
