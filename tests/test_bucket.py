"""The S3 server harness and the bucket access layer, against a real SeaweedFS server on 127.0.0.1."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys
import time
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


def test_many_buckets_take_writes_whatever_the_disk_has_free(s3_server):
    # Each bucket's first write takes 7 volumes. With weed's "free disk / volume size" count (1 GiB volumes), a disk
    # with 35 GB free refused the 5th bucket's first put (500 InternalError), as CI's did in a whole test session.
    client = s3_server.client()
    for i in range(40):
        name = f"many-buckets-{i:02d}-{os.urandom(3).hex()}"
        client.create_bucket(Bucket=name)
        client.put_object(Bucket=name, Key="k", Body=b"x")
        assert client.get_object(Bucket=name, Key="k")["Body"].read() == b"x"


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
        with pytest.raises(bucket.ObjectError, match=f"object {key} does not match its CRC-32C"):
            read()
        client.put_object(Bucket=name, Key=f"{root}/{key}", Body=original)
    client.delete_object(Bucket=name, Key=f"{root}/rows/c/2/0")  # zarr alone would read the fill value
    with pytest.raises(bucket.ObjectError, match="object rows/c/2/0 is missing"):
        read()


def test_a_record_changed_after_sealing_is_caught():
    record = bucket.sealed({"objects": {"zarr.json": [80, 1234]}, "num_tokens": 12})
    assert bucket.unsealed(dict(record), "x") == record
    with pytest.raises(bucket.ObjectError, match="does not match its sha256"):
        bucket.unsealed({**record, "num_tokens": 13}, "x")


def test_join_and_split_urls():
    assert bucket.split_url("s3://b/a//b/") == ("b", "a/b")
    assert bucket.join_url("s3://b/run/store.zarr", "../extract/shard_00000.zarr") == "s3://b/run/extract/shard_00000.zarr"
    with pytest.raises(ValueError):
        bucket.split_url("s3://b/../x")


def test_shards_in_a_bucket_merge_by_reference_and_read_back_like_local_ones(s3_env, tmp_path, capsys):
    from store_helpers import make_shard

    from dflash_pipeline.store import HiddenStateStore, merge_shards, verify
    from dflash_pipeline.store.merge import merge_bucket_shards
    from dflash_pipeline.store.remote import bucket_shard, load_record

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
    client = server.client()
    # merge lists every shard's objects first: one missing, or of another size, stops it naming its s3:// URL
    chunk = "run/data/extract/shard_00001.zarr/features/c/1/0/0"
    original = client.get_object(Bucket=name, Key=chunk)["Body"].read()
    for changed, problem in ((None, "missing"), (original + b"x", f"{len(original) + 1} bytes, written as {len(original)}")):
        if changed is None:
            client.delete_object(Bucket=name, Key=chunk)
        else:
            client.put_object(Bucket=name, Key=chunk, Body=changed)
        with pytest.raises(StoreError) as stopped:
            merge_bucket_shards(urls, records, frames, bucket.data_url(run, "store"), tmp_path / "store.json", {})
        assert str(stopped.value) == (
            f"s3://{name}/{chunk}: {problem}: its completion record s3://{name}/run/complete/extract/shard_00001.json "
            "lists it; delete that record and run the workflow again to write it anew (check: listing)")
    client.put_object(Bucket=name, Key=chunk, Body=original)
    merge_bucket_shards(urls, records, frames, bucket.data_url(run, "store"), tmp_path / "store.json", {"target": "x"})
    merge_shards([tmp_path / f"s{i}.zarr" for i in range(2)], frames, tmp_path / "store.zarr", {"target": "x"})
    # merge wrote metadata only: its objects are the index arrays and zarr.json files
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
    assert cli(["verify", run]) == 0  # the store.url itself
    # a bad local copy of a record is named by its s3:// URL; a missing object by its rows within the shard
    (tmp_path / "bad.json").write_text(records[0].read_text().replace('"kind": "shard"', '"kind": "store"'))
    with pytest.raises(StoreError, match=f"^s3://{name}/run/complete/extract/shard_00000.json: the completion record "
                                         "does not match its sha256"):
        load_record(tmp_path / "bad.json")
    client.delete_object(Bucket=name, Key="run/data/extract/shard_00000.zarr/input_ids/c/0")
    assert [p for p in verify(f"{run}/complete/store.json") if "input_ids rows" in p] == [
        f"{run}/complete/store.json: shard 00000: input_ids rows 0..17: unreadable: s3://{name}/run/data/extract/"
        "shard_00000.zarr: object input_ids/c/0 is missing (check: objects) (check: read)"]
    client.upload_file(str(tmp_path / "s0.zarr/input_ids/c/0"), name, "run/data/extract/shard_00000.zarr/input_ids/c/0")
    assert verify(f"{run}/complete/store.json") == []
    capsys.readouterr()
    assert cli(["verify", f"s3://{name}/elsewhere"]) == 1
    assert capsys.readouterr().err == (f"verify: no store at s3://{name}/elsewhere (no completion record "
                                       f"s3://{name}/elsewhere/complete/store.json)\n")
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


def test_an_http_server_that_is_not_s3_is_one_sentence(s3_env):
    import http.server
    import threading

    class NotFound(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_error(404)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(bucket.BucketError) as error:
            bucket.Bucket(endpoint_url=endpoint).check("s3://some-bucket/run")
    finally:
        server.shutdown()
    assert str(error.value) == (f"{endpoint} answered a request for s3://some-bucket/run with HTTP 404 and no S3 error "
                                "code: it is an HTTP server but not an S3 API; check store.endpoint_url or "
                                "AWS_ENDPOINT_URL (the S3 gateway's address and port)")


def test_one_lease_per_prefix_renewed_refused_checked_and_taken_over_when_stale(s3_env, monkeypatch, caplog):
    from dflash_pipeline.store import lease as leases

    server, name = s3_env
    url = f"s3://{name}/run"
    first = leases.Lease(url, bucket.Bucket(), seconds=2.5, run_id="first")
    first.take()
    (held, _), renewed = leases.read_holder(url, bucket.Bucket()), None
    assert held.run_id == "first" and held.pid == os.getpid()
    monkeypatch.setenv(leases.RUN_ID_VARIABLE, "first")
    leases.check_held({"url": url})  # a job of the run that holds it may write
    time.sleep(4)  # longer than the lease: renewed meanwhile
    renewed = leases.read_holder(url, bucket.Bucket())[0]
    assert renewed.expires > held.expires and renewed.run_id == "first"
    second = leases.Lease(url, bucket.Bucket(), seconds=2.5, run_id="second")
    with pytest.raises(leases.LeaseError) as refused:
        second.take()
    assert str(refused.value).startswith(f"{url} is being written by run first (host {held.host}, pid {os.getpid()}, "
                                         "started ")
    assert str(refused.value).endswith(": one run writes a store.url at a time; wait for it to end, or if it is dead "
                                       "(killed, its node lost) run again once its lease has expired (this run then "
                                       f"takes it over) or clear it now with `dflash-pipeline lease {url} --break` "
                                       "(docs/storage.md)")
    monkeypatch.setenv(leases.RUN_ID_VARIABLE, "second")
    with pytest.raises(leases.LeaseError, match=f"^this job's run \\(second\\) does not hold the lease of {url}, run "
                                                "first .* does: the job writes nothing there$"):
        leases.check_held({"url": url})
    first._stop.set()  # no more renewals, no release: what kill -9 of its holder leaves
    first._thread.join()
    time.sleep(3)
    with caplog.at_level("WARNING", logger=leases.__name__):
        second.take()
    assert f"took over the stale lease {url}/lease.json of run first" in caplog.text
    first.release()  # not its lease any more: nothing deleted
    assert leases.read_holder(url, bucket.Bucket())[0].run_id == "second"
    # `dflash-pipeline lease URL --break`: refused while the holder's process runs on this host, done once it is dead
    from dflash_pipeline.cli import main as cli

    with pytest.raises(leases.LeaseError, match=f"run second still runs on this host \\(pid {os.getpid()}\\)"):
        cli(["lease", url, "--break"])
    second._stop.set()
    second._thread.join()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    second.holder.pid = int(dead.stdout)
    client = server.client()
    client.put_object(Bucket=name, Key="run/lease.json", Body=second.holder.body())
    assert cli(["lease", url, "--break"]) == 0
    assert leases.read_holder(url, bucket.Bucket()) is None
    second.release()  # nothing left to delete
