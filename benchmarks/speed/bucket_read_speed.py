"""Training batches read from a store in an S3 bucket against the same store on the local disk, in one run (issue #37).

Writes one store of random bf16 features twice, with the same bytes: under --dir on the local disk, and in a bucket
(a SeaweedFS server started here on 127.0.0.1, or --endpoint with AWS_* credentials in the environment and --bucket),
both through the library (``ShardWriter``; ``store.remote.bucket_shard`` and ``merge_bucket_shards`` for the bucket).
Then, for each store:

  read       one reader, one batch after another: each batch is --tokens-per-batch tokens of random samples read
             with ``store[i]`` (what one DataLoader worker does): MB/s of decoded features, batches/s, and the
             per-batch latency (median, p95)
  read-ahead the trainer's streamed source (``train_data.StreamedSteps``: --workers spawn workers, each
             --prefetch steps ahead, pinned on a machine with CUDA as the trainer's) consumed by a loop that
             spends --step-s per step (the GPU's step; 0.07 s is the H200's 4K-token step): the share of the loop
             spent waiting for data, in all and after the first batch (which waits for a whole read, as the
             trainer's first step does), and the per-step wait

Read-ahead keeps the loop fed when  workers / latency >= 1 / step_s  (the readers together produce a batch per
step) and  workers x prefetch >= p95 latency / step_s + 1  (enough batches in flight to cover a slow read). The
script prints the smallest such numbers from the measured latency. A markdown table goes to stdout and --report.

  python benchmarks/speed/bucket_read_speed.py --dir /tmp/bucket_bench --tokens 400000 --report bucket.md
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from dflash_pipeline import bucket, s3_server
from dflash_pipeline.store import HiddenStateStore, ShardWriter, merge_shards, store_codec
from dflash_pipeline.store.merge import merge_bucket_shards
from dflash_pipeline.store.remote import bucket_shard
from dflash_pipeline.train_data import AnchorRule, StreamedSteps

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common.py
from common import Report  # noqa: E402


def write_stores(directory: Path, run_url: str, *, tokens: int, shards: int, layers: int, hidden: int,
                 chunk_tokens: int, seed: int = 0) -> tuple[Path, Path]:
    """The same random store on disk and in the bucket -> (local store, local copy of the bucket store's record)."""
    generator = torch.Generator().manual_seed(seed)
    codec, frames, local_paths, urls, records = store_codec("bfloat16", "bfloat16"), [], [], [], []
    for shard in range(shards):
        lengths = []
        while sum(lengths) < tokens // shards:
            lengths.append(int(torch.randint(100, 1500, (1,), generator=generator)))
        lengths.sort()
        features = [(torch.randn(n, layers, hidden, generator=generator) * 3).bfloat16() for n in lengths]
        ids = [torch.randint(0, 49152, (n,), generator=generator).numpy().astype(np.int32) for n in lengths]
        masks = [np.ones(n, np.uint8) for n in lengths]
        names = [f"{shard}-{i}" for i in range(len(lengths))]
        url = bucket.data_url(run_url, f"extract/shard_{shard:05d}")
        record = directory / f"shard_{shard:05d}.json"
        with bucket_shard(url, record) as remote_target:
            for target in (directory / f"shard_{shard:05d}.zarr", remote_target):
                writer = ShardWriter(target, num_tokens=sum(lengths), num_layers=layers, hidden_size=hidden,
                                     codec=codec, chunk_tokens=chunk_tokens)
                for values in features:
                    writer.write(values)
                writer.close(np.concatenate(ids), np.concatenate(masks), lengths, names,
                             {"layer_ids": list(range(1, layers + 1)), "hidden_size": hidden})
        upload(record, bucket.record_url(run_url, f"extract/shard_{shard:05d}"))  # Snakemake's job, after extract
        frames.append(pd.DataFrame({"id": names, "num_tokens": lengths, "input_ids": ids, "loss_mask": masks}))
        local_paths.append(directory / f"shard_{shard:05d}.zarr")
        urls.append(url)
        records.append(record)
    merge_shards(local_paths, frames, directory / "store.zarr", {"target": "random"})
    merge_bucket_shards(urls, records, frames, bucket.data_url(run_url, "store"), directory / "store.json",
                        {"target": "random"})
    upload(directory / "store.json", bucket.record_url(run_url, "store"))
    return directory / "store.zarr", directory / "store.json"


def upload(path: Path, url: str) -> None:
    import obstore

    obstore.put(bucket.Bucket().object_store(url), bucket.split_url(url)[1], path.read_bytes())


def batches(store: HiddenStateStore, tokens_per_batch: int, count: int, seed: int) -> list[list[int]]:
    """``count`` batches of random samples, each about ``tokens_per_batch`` tokens."""
    rng, lengths, out = np.random.default_rng(seed), store.lengths, []
    order = rng.permutation(len(store))
    position = 0
    for _ in range(count):
        batch, total = [], 0
        while total < tokens_per_batch:
            sample = int(order[position % len(order)])
            position += 1
            batch.append(sample)
            total += int(lengths[sample])
        out.append(batch)
    return out


def read_pass(store: HiddenStateStore, plan: list[list[int]]) -> dict:
    latencies, feature_bytes = [], 0
    for batch in plan:
        began = time.perf_counter()
        for i in batch:
            feature_bytes += store[i][2].numel() * 2
        latencies.append(time.perf_counter() - began)
    seconds = sum(latencies)
    return {"MB/s": feature_bytes / seconds / 1e6, "batches/s": len(plan) / seconds,
            "latency p50 ms": 1e3 * float(np.median(latencies)), "latency p95 ms": 1e3 * float(np.quantile(latencies, 0.95))}


def read_ahead_pass(store: HiddenStateStore, plan: list[list[int]], workers: int, prefetch: int, step_s: float,
                    hidden: int) -> dict:
    """The loop's wait for data with the trainer's streamed source, its workers started (and warm) beforehand."""
    source = StreamedSteps(store, hidden, workers, prefetch, pin_memory=torch.cuda.is_available())  # as the trainer
    rule = AnchorRule(block_size=16, gamma=7.0, max_anchors=64)
    warm = iter(source.loader([(rule, 0, plan[0])] * max(1, workers), "train"))
    for _ in warm:  # the workers start and open the store before the measured pass
        pass
    loader = source.loader([(rule, 1, samples) for samples in plan], "train")
    waits, began = [], time.perf_counter()
    iterator = iter(loader)
    while True:
        mark = time.perf_counter()
        try:
            next(iterator)
        except StopIteration:
            break
        waits.append(time.perf_counter() - mark)
        time.sleep(step_s)  # the GPU's step
    total = time.perf_counter() - began
    source.close()
    later = np.array(waits[1:])  # the first batch waits for a whole read: the pipeline starts empty
    return {"data wait %": 100 * sum(waits) / total, "after the first %": 100 * later.sum() / (total - waits[0]),
            "first ms": 1e3 * waits[0], "wait p50 / p95 ms": f"{1e3 * np.median(later):.1f} / "
            f"{1e3 * np.quantile(later, 0.95):.1f}", "steps": len(plan), "loop s": total}


def markdown(table: pd.DataFrame) -> str:
    rows = [[str(index), *(f"{value:.1f}" if isinstance(value, float) else str(value) for value in row)]
            for index, row in zip(table.index, table.itertuples(index=False))]
    header = [table.index.name or "", *table.columns]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in [header, ["---"] * len(header), *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, required=True, help="scratch directory for the local store (emptied)")
    parser.add_argument("--tokens", type=int, default=400_000)
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=576, help="576: SmolLM2-135M; 5120: Qwen3.6-27B")
    parser.add_argument("--chunk-tokens", type=int, default=256)
    parser.add_argument("--tokens-per-batch", type=int, default=4096)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--step-s", type=float, default=0.07, help="simulated GPU step (H200, 4K tokens: 0.07 s)")
    parser.add_argument("--endpoint", help="an S3 endpoint to use instead of a SeaweedFS server started here")
    parser.add_argument("--bucket", default="bench", help="with --endpoint: an existing bucket")
    parser.add_argument("--report", type=Path)
    args = parser.parse_args()

    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    server = None
    if args.endpoint is None:
        server = s3_server.start(args.dir / "seaweedfs")
        server.create_bucket(args.bucket)
        os.environ.update(server.env())
    else:
        os.environ["AWS_ENDPOINT_URL_S3"] = args.endpoint
    try:
        run_url = f"s3://{args.bucket}/bench-{os.getpid()}"
        started = time.perf_counter()
        local, remote = write_stores(args.dir, run_url, tokens=args.tokens, shards=args.shards, layers=args.layers,
                                     hidden=args.hidden, chunk_tokens=args.chunk_tokens)
        print(f"wrote both stores in {time.perf_counter() - started:.1f} s", flush=True)
        rows = []
        for name, path in (("local disk", local), ("bucket", remote)):
            store = HiddenStateStore(path)
            plan = batches(store, args.tokens_per_batch, args.batches, seed=1)
            read_pass(store, plan[:3])  # open the shards and the client once
            row = {"store": name, **read_pass(store, plan)}
            row.update(read_ahead_pass(store, plan, args.workers, args.prefetch, args.step_s, args.hidden))
            rows.append(row)
            print(row, flush=True)
    finally:
        if server is not None:
            server.stop()
    table = pd.DataFrame(rows).set_index("store")
    bucket_row = table.loc["bucket"]
    latency_s, p95_s = bucket_row["latency p50 ms"] / 1e3, bucket_row["latency p95 ms"] / 1e3
    workers = math.ceil(latency_s / args.step_s)
    depth = math.ceil(p95_s / args.step_s) + 1
    text = "\n".join([
        f"# Bucket vs local disk: training batches ({datetime.date.today()}, {platform.node()}, "
        f"{os.cpu_count()} CPUs, {'SeaweedFS on 127.0.0.1' if server else args.endpoint})",
        "",
        f"{args.tokens} tokens x {args.layers} layers x {args.hidden} (bf16) in {args.shards} shards, "
        f"{args.chunk_tokens}-token chunks; batches of {args.tokens_per_batch} tokens of random samples; read-ahead: "
        f"{args.workers} workers x {args.prefetch} prefetched, a {args.step_s} s step",
        "",
        markdown(table),
        "",
        f"From the bucket's latency (median {1e3 * latency_s:.0f} ms, p95 {1e3 * p95_s:.0f} ms per batch) and a "
        f"{args.step_s} s step: at least {workers} worker(s) (workers >= latency / step) and {depth} batches in "
        f"flight (workers x prefetch >= p95 latency / step + 1).",
    ])
    Report(args.report)(text)


if __name__ == "__main__":
    main()
