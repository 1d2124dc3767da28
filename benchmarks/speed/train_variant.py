"""A second training on a workflow run's store with some ``train`` keys changed, beside the workflow's own (e.g.
on the second GPU of the quality run): the two training logs compare the settings at equal trained tokens.

    CUDA_VISIBLE_DEVICES=1 python benchmarks/speed/train_variant.py --run ~/quality_run \\
        --configfile config/config.yaml config/examples/smollm2-quality.yaml results/device_overlay.yaml \\
        --set tokens_per_batch=4096 --out results/variant_tpb4096

The config files are merged in order as Snakemake merges them and validated against config/schema.yaml (its
defaults filled in), then ``--set`` changes train keys (YAML values) and the snapshots are dropped. Waits until
the workflow's store exists (merge writes it under a temporary name, then renames it), then trains in this process
on the first visible GPU: drafter/, log.csv, curves.png, timing.json and state/ under ``--out`` (relative to
``--run``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

import yaml

from dflash_pipeline.config import load_config
from dflash_pipeline.train import train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="the workflow's directory")
    parser.add_argument("--configfile", nargs="+", required=True, help="relative to --run, merged in order")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="train keys to change")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    os.chdir(args.run)
    changed = {key: yaml.safe_load(value) for key, value in (item.split("=", 1) for item in args.set)}
    config = load_config(args.configfile, {"train": {"gpus": 1, "snapshots": [], **changed}}, "config/schema.yaml")
    cfg = config["train"]
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    while not Path("results/store.zarr").exists():
        time.sleep(5)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_config.yaml").write_text(yaml.safe_dump(cfg))
    target = "results/target" if config["target"]["path"].endswith(".gguf") else config["target"]["path"]
    train(cfg, store="results/store.zarr", target=target, drafter_dir=str(out / "drafter"),
          log_csv=str(out / "log.csv"), curves_png=str(out / "curves.png"), state_dir=str(out / "state"),
          timing_json=str(out / "timing.json"))


if __name__ == "__main__":
    main()
