"""The compact store's τ table (issue #34) from quality-recipe workflow directories, one row per directory.

Per run: the store setting (its manifest), bytes per token as stored before compression (the feature arrays'
decoded size, ids and loss mask included) and on disk (the store directory; shards are hard links, counted once),
the store in GiB, build minutes (the compact_basis, extract and merge jobs' benchmark seconds), τ on the 80
MT-Bench first turns (mean / pooled), the final validation proxy and the steps trained.

    python benchmarks/quality/compact_table.py ~/run_bf16 ~/run_fp8 ~/run_compact_1152 ...
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pandas as pd
import zarr

from dflash_pipeline.store import HiddenStateStore


def disk_bytes(path: Path) -> int:
    seen, total = set(), 0
    for root, _, files in os.walk(path):
        for name in files:
            stat = os.stat(Path(root) / name)
            if (stat.st_dev, stat.st_ino) not in seen:
                seen.add((stat.st_dev, stat.st_ino))
                total += stat.st_size
    return total


def row(run: Path) -> dict:
    results = run / "results"
    store = HiddenStateStore(results / "store.zarr")
    attrs, root = store.attrs, zarr.open_group(str(results / "store.zarr"), mode="r")
    raw = sum(shard[name].nbytes for _, shard in root["shards"].groups()
              for name in (*store.stored_codec.array_names, "input_ids", "loss_mask"))
    setting = attrs["logical_dtype"]
    if setting == "compact":
        setting += f" rank {attrs['compact']['rank']}, {attrs['compact']['coefficients']} coefficients"
    build = sum(pd.read_csv(tsv, sep="\t")["s"].sum() for tsv in [*results.glob("benchmarks/extract/*.tsv"),
                                                                   *results.glob("benchmarks/merge.tsv"),
                                                                   *results.glob("benchmarks/compact_basis.tsv")])
    log = pd.read_csv(results / "train/log.csv")
    result = json.loads((results / "evaluate/mt_bench/result.json").read_text())
    on_disk = disk_bytes(results / "store.zarr")
    return {"setting": setting, "B/token": raw / store.num_tokens, "B/token on disk": on_disk / store.num_tokens,
            "store GiB": on_disk / 2**30, "build min": build / 60, "steps": int(log["step"].max()),
            "tau mean": result["tau_mean"], "tau pooled": result["tau_pooled"], "lossless": result["lossless"],
            "proxy": log["val_proxy"].dropna().iloc[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    rows = []
    for run in parser.parse_args().runs:
        try:
            rows.append(row(run))
        except (OSError, KeyError, ValueError) as error:
            print(f"{run}: {error}")
    if not rows:
        return
    table = pd.DataFrame(rows)
    base = table[table["setting"] == "bfloat16"]
    if len(base):
        table["× bf16 (disk)"] = base["B/token on disk"].iloc[0] / table["B/token on disk"]
        table["τ vs bf16"] = table["tau mean"] / base["tau mean"].iloc[0] - 1
    cell = lambda v: f"{v:,.3f}" if isinstance(v, float) else str(v)  # noqa: E731  (no tabulate on the device)
    print("| " + " | ".join(table.columns) + " |\n|" + "---|" * len(table.columns))
    for values in table.itertuples(index=False):
        print("| " + " | ".join(cell(v) for v in values) + " |")


if __name__ == "__main__":
    main()
