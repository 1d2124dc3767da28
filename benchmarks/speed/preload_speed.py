"""How fast the train job's preload brings the store's features to the device, old against new (issue #21).

On the first --gib GiB of the store's features, in one process, alone on the machine:
  files   the chunk files read raw in the largest thread count (the first read: the disk's or the page cache's
          rate; later passes find the files cached)
  zarr    ``train_data.load_features`` from a store that reads its chunks through zarr (``array[a:b]``, the
          ``HiddenStateStore.read_chunks`` seam), as the preload read before issue #21
  direct  ``train_data.load_features`` as it is: each chunk file decoded in the reading thread
both at each --threads; every pass's rows are checked equal to the first's. Then "beside Python": the direct pass in
a background thread (as the trainer preloads while it builds and compiles) while the main thread runs a pure-Python
loop, under the interpreter's default 5 ms switch interval, 0.5 ms, and the loader's own (``PRELOAD_SWITCH_S``):
the preload's GiB/s and the main thread's Python speed as a share of its speed alone. (The CRCs by google_crc32c,
which holds the GIL, were measured against crc32c up to commit 3d7b32d.) A markdown table (GiB/s, direct against
zarr at the same thread count) goes to stdout and --report.
  python benchmarks/speed/preload_speed.py --store results/store.zarr --device cuda --gib 4 --threads 8 16 --report p.md
--make-store DIR first writes a store of random bf16 features there (3 shards of 120 samples, 50-900 tokens, 6 x 576
per token, 256-token chunks; seed 0) and measures that one.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import os
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common.py
from common import Report  # noqa: E402

from dflash_pipeline.store import HiddenStateStore, ShardWriter, chunk_file, merge_shards, store_codec
from dflash_pipeline.train_data import PRELOAD_SWITCH_S, load_features


class ZarrReadStore(HiddenStateStore):
    """The store read through zarr's own ``array[a:b]`` (its one event loop), as the preload read before issue #21."""

    @staticmethod
    def read_chunks(array, first: int, last: int):
        return array[first * array.chunks[0] : min(last * array.chunks[0], array.shape[0])]


def make_store(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    generator, paths, frames = torch.Generator().manual_seed(0), [], []
    for shard in range(3):
        lengths = torch.randint(50, 900, (120,), generator=generator).tolist()
        writer = ShardWriter(directory / f"s{shard}.zarr", num_tokens=sum(lengths), num_layers=6, hidden_size=576,
                             codec=store_codec("bfloat16", "bfloat16"), chunk_tokens=256)
        for n in lengths:
            writer.write((torch.randn(n, 6, 576, generator=generator) * 3).bfloat16())
        ids = [np.zeros(n, np.int32) for n in lengths]
        masks = [np.ones(n, np.uint8) for n in lengths]
        names = [f"{shard}-{i}" for i in range(len(lengths))]
        writer.close(np.concatenate(ids), np.concatenate(masks), lengths, names,
                     {"layer_ids": [1, 2, 3, 4, 5, 6], "hidden_size": 576})
        paths.append(directory / f"s{shard}.zarr")
        frames.append(pd.DataFrame({"id": names, "num_tokens": lengths, "input_ids": ids, "loss_mask": masks}))
    merge_shards(paths, frames, directory / "store.zarr", {"target": "random features"})
    return directory / "store.zarr"


def chunk_files(store: HiddenStateStore, pieces) -> list[Path]:
    files = []
    for shard, rows in pieces:
        array = store.shard(shard)["features"]
        size = array.chunks[0]
        files += [chunk_file(array, i) for i in range(rows.start // size, -(-rows.stop // size))]
    return [f for f in files if f.exists()]


def python_speed(seconds: float = 0.2) -> float:
    """Pure-Python loop iterations per second over about ``seconds``."""
    count, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        for _ in range(10_000):
            count += 1
    return count / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--store")
    source.add_argument("--make-store", type=Path, help="write a random bf16 store here and measure it")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--gib", type=float, default=4.0, help="features read per pass (the store's first rows)")
    parser.add_argument("--threads", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--rows-per-read", type=int, default=1 << 15)
    parser.add_argument("--report", default=None)
    args = parser.parse_args()
    if args.make_store:
        args.store = str(make_store(args.make_store))
    store = HiddenStateStore(args.store)
    row_bytes = store.feature_dtype.itemsize * store.feature_shape[0] * store.feature_shape[1]
    pieces, size = [], 0
    for piece in store.feature_pieces(args.rows_per_read):
        if size >= args.gib * 2**30:
            break
        pieces.append(piece)
        size += (piece[1].stop - piece[1].start) * row_bytes
    end = int(store.shard_token_offsets[pieces[-1][0]]) + pieces[-1][1].stop
    gib = size / 2**30
    device = torch.device(args.device)
    emit = Report(args.report)
    lines = [f"# preload_speed {datetime.datetime.now().isoformat(timespec='seconds')} "
             f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, {os.cpu_count()} cores, "
             f"torch {torch.__version__}", f"store {args.store}: {store.num_tokens} tokens, {store.logical_dtype} "
             f"{tuple(store.feature_shape)}; passes over its first {end} rows ({gib:.2f} GiB, {len(pieces)} reads "
             f"of <= {args.rows_per_read} rows)", "", "| pass | threads | seconds | GiB/s | direct vs zarr |",
             "|---|---|---|---|---|"]

    for line in lines:
        emit(line)
    files = chunk_files(store, pieces)
    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max(args.threads)) as pool:
        stored = sum(pool.map(lambda f: len(f.read_bytes()), files))
    seconds = time.perf_counter() - started
    emit(f"| files (first read: {stored / 2**30:.2f} GiB stored) | {max(args.threads)} | {seconds:.2f} | "
         f"{stored / 2**30 / seconds:.2f} stored | |")
    features = torch.empty((store.num_tokens, *store.feature_shape), dtype=store.feature_dtype, device=device)
    reference, problems = None, []
    for threads in args.threads:
        seconds = {}
        for name, reader in (("zarr", ZarrReadStore(args.store)), ("direct", store)):
            features[:end].fill_(float("nan"))
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            started = time.perf_counter()
            load_features(reader, features, pieces, threads)
            seconds[name] = time.perf_counter() - started
            if reference is None:
                reference = features[:end].clone()
            elif not torch.equal(features[:end], reference):
                problems.append(f"{name} at {threads} threads: rows differ from the first pass's")
            ratio = f"{seconds['zarr'] / seconds[name]:.2f}" if name == "direct" else ""
            emit(f"| {name} | {threads} | {seconds[name]:.2f} | {gib / seconds[name]:.2f} | {ratio} |")
    emit("")
    emit("| beside Python: switch interval | threads | seconds | GiB/s | main thread's Python speed vs alone |")
    emit("|---|---|---|---|---|")
    alone = python_speed(2.0)
    for threads in args.threads:
        for interval in (0.005, 0.0005, PRELOAD_SWITCH_S):
            features[:end].fill_(float("nan"))
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                started = time.perf_counter()
                loading, speeds = pool.submit(load_features, store, features, pieces, threads, interval), []
                while not loading.done():
                    speeds.append(python_speed())
                loading.result()
                seconds = time.perf_counter() - started
            if not torch.equal(features[:end], reference):
                problems.append(f"beside Python, {interval * 1000:g} ms at {threads} threads: rows differ from the "
                                "first pass's")
            emit(f"| {interval * 1000:g} ms | {threads} | {seconds:.2f} | {gib / seconds:.2f} | "
                 f"{np.median(speeds) / alone:.2f} |")
    emit("")
    emit("identity: every pass's rows equal the first pass's" if not problems
         else "IDENTITY FAILED: " + "; ".join(problems))
    if problems:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
