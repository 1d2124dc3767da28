"""The default workflow with its store in an S3 bucket (store.url), against a real SeaweedFS server on 127.0.0.1.

One small run (the SmolLM2 target, 12 conversations with their own answers (regenerate is tested in
tests/test_workflow.py), 2 shards, one short epoch streamed by a DataLoader worker, 2 MT-Bench prompts) is shared by
the tests of this module; later tests change it the way a user or a crash would (a killed extract job, a flipped
byte in an object, a deleted completion record, wrong credentials) and check what the same command does.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflash_pipeline import bucket
from dflash_pipeline.store import HiddenStateStore, StoreError, verify
from workflow_helpers import default_config, kill_job_when, scheduled_jobs, snakemake, start_snakemake, write_config

SHARDS = 2


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
    config["store"] = {"url": url, "endpoint_url": s3_server.endpoint_url, "region": None}
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
