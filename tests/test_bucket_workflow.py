"""The default workflow with its store in an S3 bucket (store.url), against a real SeaweedFS server on 127.0.0.1.

One small run (the SmolLM2 target, 12 conversations with their own answers (regenerate is tested in
tests/test_workflow.py), 2 shards, one short epoch streamed by a DataLoader worker, 2 MT-Bench prompts) is shared by
the tests of this module; later tests change it the way a user or a crash would (a killed extract job, a flipped
byte in an object, a deleted completion record, wrong credentials, a deleted or resized feature object, a second
workflow on the same prefix, a killed lease holder) and check what the same command does.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest
import yaml

from dflash_pipeline import bucket
from dflash_pipeline.store import HiddenStateStore, StoreError, verify
from workflow_helpers import (default_config, kill_job_when, scheduled_jobs, snakemake, snakemake_command,
                              snakemake_env, start_snakemake, write_config)

SHARDS = 2
LEASE_SECONDS = 20  # short, so that a killed holder's lease expires within the test


@pytest.fixture(scope="module")
def s3_run(s3_server, smollm2_dir, tmp_path_factory):
    """(workdir, server, bucket, run URL, environment) after the default target ran with the store in the bucket."""
    name = "workflow-" + tmp_path_factory.getbasetemp().name.replace("_", "-").lower()[-20:]
    s3_server.create_bucket(name)
    workdir = tmp_path_factory.mktemp("bucket_workflow")
    config = default_config()
    config["data"]["max_conversations"] = 12
    config["target"]["path"] = str(smollm2_dir)
    config["tokenize"].update(num_shards=SHARDS, max_length=96)
    config["extract"].update(tokens_per_batch=192, chunk_tokens=64)  # several chunk objects per shard
    config["regenerate"]["enabled"] = False
    config["gpu"] = {"count": 2}  # a fake device count: the lease hands out "GPUs" 0 and 1 on this CPU machine
    config["train"].update(epochs=1, num_layers=1, max_anchors=4, val_max_anchors=4, tokens_per_batch=192,
                           checkpoint_every=1000, preload=False, num_workers=1, compile=False)
    config["evaluate"]["benchmarks"]["mt_bench"].update(limit=2, max_new_tokens=8)
    config["evaluate"]["untrained_baseline"] = False
    url = f"s3://{name}/runs/one"
    config["store"] = {"url": url, "endpoint_url": s3_server.endpoint_url, "region": None,
                       "lease_seconds": LEASE_SECONDS}
    write_config(workdir, config)
    env = {**s3_server.env(), "AWS_EC2_METADATA_DISABLED": "true"}
    env.pop("AWS_ENDPOINT_URL")  # the endpoint comes from the config (store.endpoint_url)
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        patch.delenv("AWS_ENDPOINT_URL", raising=False)
        bucket.forget_clients()
        snakemake(workdir)  # the default target: store, drafter, evaluation
        patch.setenv("AWS_ENDPOINT_URL_S3", s3_server.endpoint_url)  # for this process's reads
        yield {"workdir": workdir, "server": s3_server, "bucket": name, "url": url, "env": env}
    bucket.forget_clients()


def keys(run, prefix: str) -> list[str]:
    client, found, token = run["server"].client(), [], None
    while True:
        page = client.list_objects_v2(Bucket=run["bucket"], Prefix=prefix, **({"ContinuationToken": token} if token else {}))
        found += [item["Key"] for item in page.get("Contents", [])]
        if not page.get("IsTruncated"):
            return found
        token = page["NextContinuationToken"]


def store_arrays(store: HiddenStateStore) -> list:
    return [tuple(np.asarray(part).copy() for part in store[i]) for i in range(len(store))]


def test_the_store_lives_in_the_bucket_and_nothing_of_it_on_disk(s3_run):
    workdir, run = s3_run["workdir"], s3_run
    assert scheduled_jobs(workdir, "all") == {}
    assert not (workdir / "results/store.zarr").exists() and not (workdir / "results/extract").exists()
    root = "runs/one"
    records = sorted(keys(run, f"{root}/complete/"))
    assert records == [f"{root}/complete/extract/shard_{i:05d}.json" for i in range(SHARDS)] + [f"{root}/complete/store.json"]
    shard_objects = keys(run, f"{root}/data/extract/shard_00000.zarr/")
    assert sum("/features/c/" in key for key in shard_objects) >= 2
    # merge wrote only metadata: no chunk of features under the merged store's prefix
    assert not [key for key in keys(run, f"{root}/data/store.zarr/") if "features" in key]
    store = HiddenStateStore(f"s3://{run['bucket']}/{root}/complete/store.json")
    assert len(store) >= 6 and store.attrs["layer_ids"] == [1, 8, 14, 20, 27]
    input_ids, loss_mask, features = store[0]
    assert features.shape == (len(input_ids), 5, 576) and loss_mask.any()
    assert verify(f"s3://{run['bucket']}/{root}/complete/store.json") == []
    train_log = (workdir / "results/logs/train.log").read_text()
    assert "streamed by 1 workers" in train_log
    result = json.loads((workdir / "results/evaluate/mt_bench/result.json").read_text())
    assert result["lossless"] is True and result["num_prompts"] == 2


def test_a_flipped_byte_in_any_object_of_the_store_is_caught(s3_run):
    run, client = s3_run, s3_run["server"].client()
    url = f"s3://{run['bucket']}/runs/one/complete/store.json"
    objects = [key for key in keys(run, "runs/one/") if not key.endswith("/")]
    # one of each kind: a feature chunk, a shard's zarr.json, a checksum array, the merged index, a record
    chosen = [next(k for k in objects if "/features/c/" in k), "runs/one/data/extract/shard_00001.zarr/zarr.json",
              next(k for k in objects if "features_crc32c/c/" in k), next(k for k in objects if "store.zarr/sample_offsets/c/" in k),
              "runs/one/complete/extract/shard_00000.json"]
    for key in chosen:
        original = client.get_object(Bucket=run["bucket"], Key=key)["Body"].read()
        flipped = bytearray(original)
        flipped[len(flipped) // 2] ^= 0x10
        client.put_object(Bucket=run["bucket"], Key=key, Body=bytes(flipped))
        try:
            with pytest.raises(StoreError):
                store = HiddenStateStore(url)
                for i in range(len(store)):
                    store[i]
            problems = verify(url)
            assert problems and all("(check:" in p for p in problems), (key, problems)
        finally:
            client.put_object(Bucket=run["bucket"], Key=key, Body=original)
    assert verify(url) == []


def test_sigkill_of_an_extract_job_mid_upload_then_the_same_command_recomputes_only_that_shard(s3_run):
    run, workdir = s3_run, s3_run["workdir"]
    url = f"s3://{run['bucket']}/runs/one/complete/store.json"
    before = store_arrays(HiddenStateStore(url))
    untouched = {item["Key"]: item["ETag"] for item in run["server"].client().list_objects_v2(
        Bucket=run["bucket"], Prefix="runs/one/data/extract/shard_00000.zarr/")["Contents"]}
    record = "runs/one/complete/extract/shard_00001.json"
    run["server"].client().delete_object(Bucket=run["bucket"], Key=record)  # as if shard 1 had never finished
    assert scheduled_jobs(workdir) == {"extract": 1, "merge": 1, "store": 1}
    command = start_snakemake(workdir, "store")
    prefix = "runs/one/data/extract/shard_00001.zarr/features/c/"
    killed = kill_job_when(command, workdir, "extract", lambda: bool(keys(run, prefix)))
    assert killed, "the extract job was never seen uploading"
    assert command.wait(timeout=300) != 0
    # half uploaded: some of the shard's objects are there, its completion record is not
    assert keys(run, "runs/one/data/extract/shard_00001.zarr/") and not keys(run, record)
    assert scheduled_jobs(workdir) == {"extract": 1, "merge": 1, "store": 1}  # it does not look complete
    snakemake(workdir, "store")
    assert scheduled_jobs(workdir) == {}
    after = HiddenStateStore(url)
    for (a_ids, a_mask, a_features), (b_ids, b_mask, b_features) in zip(before, store_arrays(after), strict=True):
        assert np.array_equal(a_ids, b_ids) and np.array_equal(a_mask, b_mask)
        assert np.array_equal(a_features.view(np.uint16) if a_features.dtype != np.float32 else a_features,
                              b_features.view(np.uint16) if b_features.dtype != np.float32 else b_features)
    now = {item["Key"]: item["ETag"] for item in run["server"].client().list_objects_v2(
        Bucket=run["bucket"], Prefix="runs/one/data/extract/shard_00000.zarr/")["Contents"]}
    assert now == untouched  # the other shard was not written again


def test_wrong_or_missing_credentials_stop_the_run_with_one_sentence(s3_run, monkeypatch):
    workdir = s3_run["workdir"]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    result = snakemake(workdir, "-n", check=False)
    assert result.returncode != 0
    message = [line for line in (result.stdout + result.stderr).splitlines() if "refused the S3 credentials" in line]
    assert message == [f"store.url: {s3_run['server'].endpoint_url} refused the S3 credentials (from env) for "
                       f"{s3_run['url']} (SignatureDoesNotMatch): check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or "
                       "AWS_PROFILE (docs/storage.md)"], result.stderr[-3000:]
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    result = snakemake(workdir, "-n", check=False)
    assert result.returncode != 0
    assert f"store.url: no S3 credentials for {s3_run['url']}" in result.stdout + result.stderr


# ---- one writer per prefix (the lease object <store.url>/lease.json) ----
def start_detached(workdir, *args) -> subprocess.Popen:
    """The workflow in the background in a session of its own (so that kill -9 can take all of it), its output in
    workdir/run.log."""
    with open(workdir / "run.log", "wb") as out:
        return subprocess.Popen(snakemake_command(workdir, *args), cwd=workdir, env=snakemake_env(workdir),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_for_lease(run, prefix: str, command: subprocess.Popen) -> dict:
    """The lease object under ``prefix`` once the running ``command`` has taken it."""
    deadline = time.time() + 300
    while time.time() < deadline and command.poll() is None:
        if keys(run, f"{prefix}/lease.json"):
            body = run["server"].client().get_object(Bucket=run["bucket"], Key=f"{prefix}/lease.json")["Body"].read()
            return json.loads(body)
        time.sleep(0.2)
    raise AssertionError(f"no lease under {prefix}: {(command.args, command.poll())}")


def refusal(run, url: str, holder: dict, started: str) -> str:
    return (f"store.url: {url} is being written by run {holder['run_id']} (host {holder['host']}, pid {holder['pid']}, "
            f"started {started}, its lease expires ")


def shard_tables(run, prefix: str) -> list[dict]:
    """Every shard's objects as its completion record lists them: key -> [size, CRC-32C]."""
    client = run["server"].client()
    return [json.loads(client.get_object(Bucket=run["bucket"], Key=f"{prefix}/complete/extract/shard_{i:05d}.json")
                       ["Body"].read())["objects"] for i in range(SHARDS)]


@pytest.fixture(scope="module")
def prefix_two(s3_run, tmp_path_factory):
    """Two work directories with the module's config on another prefix of the bucket, runs/two."""
    config = yaml.safe_load((s3_run["workdir"] / "config.yaml").read_text())
    config["store"]["url"] = url = f"s3://{s3_run['bucket']}/runs/two"
    workdirs = [tmp_path_factory.mktemp(name) for name in ("prefix_two_first", "prefix_two_second")]
    for workdir in workdirs:
        write_config(workdir, config)
    return {"first": workdirs[0], "second": workdirs[1], "url": url, "prefix": "runs/two"}


def test_a_second_workflow_on_the_same_prefix_refuses_at_start_and_the_first_finishes_identical(s3_run, prefix_two):
    from dflash_pipeline.store.lease import when

    run, url = s3_run, prefix_two["url"]
    first = start_detached(prefix_two["first"], "store")
    holder = wait_for_lease(run, prefix_two["prefix"], first)
    assert holder["pid"] == first.pid and holder["expires"] > time.time()
    second = snakemake(prefix_two["second"], "store", check=False)
    assert first.poll() is None, "the first run ended before the second started: nothing was shown"
    assert second.returncode != 0
    lines = [line for line in (second.stdout + second.stderr).splitlines() if "is being written by" in line]
    assert len(lines) == 1 and lines[0].startswith(refusal(run, url, holder, when(holder["started"]))), lines
    assert lines[0].endswith("unless renewed): one run writes a store.url at a time; wait for it to end, or if it is "
                             "dead (killed, its node lost) run again once its lease has expired (this run then takes "
                             f"it over) or clear it now with `dflash-pipeline lease {url} --break` (docs/storage.md)")
    assert not (prefix_two["second"] / "results").exists()  # it ran no job
    assert first.wait(timeout=600) == 0, (prefix_two["first"] / "run.log").read_text()[-3000:]
    assert not keys(run, f"{prefix_two['prefix']}/lease.json")  # released at the end
    # every object of every shard is byte for byte the one the module's run alone wrote on runs/one
    assert shard_tables(run, prefix_two["prefix"]) == shard_tables(run, "runs/one")
    for a, b in zip(store_arrays(HiddenStateStore(f"{url}/complete/store.json")),
                    store_arrays(HiddenStateStore(f"s3://{run['bucket']}/runs/one/complete/store.json")), strict=True):
        assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_kill_9_of_the_holder_leaves_a_stale_lease_that_the_next_run_takes_over_after_it_expires(s3_run, prefix_two):
    from dflash_pipeline.store.lease import when

    run, url, workdir = s3_run, prefix_two["url"], prefix_two["first"]
    tables = shard_tables(run, prefix_two["prefix"])
    for _ in range(3):
        killed = start_detached(workdir, "--forcerun", "merge", "store")
        holder = wait_for_lease(run, prefix_two["prefix"], killed)
        os.killpg(killed.pid, signal.SIGKILL)  # Snakemake and its jobs: nobody releases the lease
        killed.wait()
        if keys(run, f"{prefix_two['prefix']}/lease.json"):
            break  # killed while holding it (a run that ended before the kill released it: again)
    else:
        pytest.fail("the run ended before the kill three times: no stale lease to take over")
    snakemake(workdir, "--unlock")
    # merge forced again: the killed run may have finished it before the kill, and a run with no job takes no lease
    refused = snakemake(workdir, "--rerun-incomplete", "--forcerun", "merge", "store", check=False)
    assert refused.returncode != 0
    assert refusal(run, url, holder, when(holder["started"])) in refused.stdout + refused.stderr
    time.sleep(max(0.0, holder["expires"] - time.time()) + 1)  # not renewed since the kill: it expires
    result = snakemake(workdir, "--rerun-incomplete", "--forcerun", "merge", "store")
    taken = [line for line in (result.stdout + result.stderr).splitlines() if "took over the stale lease" in line]
    assert len(taken) == 1 and f"took over the stale lease {url}/lease.json of run {holder['run_id']} (host " in taken[0]
    assert scheduled_jobs(workdir) == {}
    assert not keys(run, f"{prefix_two['prefix']}/lease.json")
    assert shard_tables(run, prefix_two["prefix"]) == tables
    assert verify(f"{url}/complete/store.json") == []


def test_a_missing_or_resized_feature_object_stops_a_resumed_train_and_merge_naming_it(s3_run):
    """Last in the module: it leaves the store rebuilt but the drafter's outputs removed."""
    run, workdir, client = s3_run, s3_run["workdir"], s3_run["server"].client()
    prefix = "runs/one/data/extract/shard_00000.zarr"
    key = sorted(k for k in keys(run, f"{prefix}/features/c/"))[-1]
    original = client.get_object(Bucket=run["bucket"], Key=key)["Body"].read()
    record = f"s3://{run['bucket']}/runs/one/complete/extract/shard_00000.json"
    changes = [(lambda: client.delete_object(Bucket=run["bucket"], Key=key), "missing"),
               (lambda: client.put_object(Bucket=run["bucket"], Key=key, Body=original + b"\0"),
                f"{len(original) + 1} bytes, written as {len(original)}")]
    for rule, target in (("train", "results/drafter"), ("merge", "store")):
        for change, problem in changes:
            change()
            result = snakemake(workdir, "--forcerun", rule, target, check=False)
            assert result.returncode != 0
            expected = (f"s3://{run['bucket']}/{key}: {problem}: its completion record {record} lists it; delete that "
                        "record and run the workflow again to write it anew (check: listing)")
            log = (workdir / f"results/logs/{rule}.log").read_text()
            assert expected in log, log[-3000:]
            if rule == "train":
                assert "resuming from step" not in log  # stopped before it resumed
        client.put_object(Bucket=run["bucket"], Key=key, Body=original)
    snakemake(workdir, "store")
    assert verify(f"s3://{run['bucket']}/runs/one/complete/store.json") == []
