"""The train job's start-up, one trainer against another, in one run on the same store (issue #21).

Each ``--tree NAME=SRC[,KEY=VALUE...]`` (a ``dflash_pipeline`` source directory, e.g. an older commit's unpacked
with ``git archive COMMIT src | tar x -C /tmp/old``, then train-config settings for that tree's runs, as YAML
values, e.g. ``--tree eager=src,compile=false``; the config files and ``config/schema.yaml``, relative paths, are
the tree's own where ``SRC/..`` has them, so an older tree runs its own defaults and gets none of the newer keys)
trains in its own process (``python -m dflash_pipeline.train --spec``, as a multi-GPU job's ranks do) the merged
config's recipe for one epoch over a seeded subset of ``--samples`` samples (the whole store is still preloaded),
without snapshots or checkpoints; twice: with an empty compile cache (cold), then with the cache the first run
left (warm); or ``--states warm --cache DIR``: only warm, with a cache an earlier run filled. Trees run one after
another, alone on the GPU. From each train log: process start → trainer (interpreter, imports), the preload, the
first step, the step time against the host's time in ``train_step``, the data wait, and the share of the job in
steps; a markdown table to stdout and OUT/startup.md, the logs in OUT.

    python benchmarks/train_startup.py --configfile config/config.yaml config/examples/smollm2-quality.yaml \\
        --store results/store.zarr --target results/target --tree old=/tmp/old/src --tree new=src --out startup
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import yaml

from recipe_study import merged_train_config

PATTERNS = {
    "to trainer s": r"train job: ([\d.]+) s from the process start to the trainer",
    "preload s": r"preloaded .* in ([\d.]+) s \(",
    "preload GiB/s": r"preloaded .* \(([\d.]+) GiB/s",
    "warm-up s": r"compiled on the first step's shapes in ([\d.]+) s",
    "waited for preload s": r"the trainer waited ([\d.]+) s for it",
    "first step after loop start s": r"first step done: ([\d.]+) s after the loop started",
    "first step s": r"first step done: .*, ([\d.]+) s from the process start",
    "step s": r"([\d.]+) s per step after the first",
    "host in train_step s": r"\(([\d.]+) s of it the host's in train_step\)",
    "host data wait %": r"data wait ([\d.]+) % of the time",
    "GPU gaps %": r"the GPU's gaps between steps ([\d.]+) %",
    "job s": r"train job: ([\d.]+) s from the process start, ",
    "in steps %": r"train job: .* \(([\d.]+) %\) of it in the training steps",
}


def parse(log: str) -> dict:
    found = {}
    for key, pattern in PATTERNS.items():
        match = re.search(pattern, log)
        found[key] = float(match[1]) if match else None
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configfile", nargs="+", required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--tree", action="append", required=True, metavar="NAME=SRC[,KEY=VALUE...]")
    parser.add_argument("--samples", type=int, default=1300, help="training samples (~100 steps of 4K tokens)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--states", nargs="+", choices=["cold", "warm"], default=["cold", "warm"],
                        help="warm alone: with --cache, the trees' kernels compiled by an earlier run")
    parser.add_argument("--cache", type=Path, help="one compile cache for every tree (default: one per tree)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    columns = ["tree", "cache", "wall s", *PATTERNS]
    lines = [f"# train_startup {datetime.datetime.now().isoformat(timespec='seconds')}: {args.store}, "
             f"{args.samples} samples, config {' '.join(args.configfile)}", "",
             "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    print("\n".join(lines), flush=True)
    for tree in args.tree:
        name, rest = tree.split("=", 1)
        src, *pairs = rest.split(",")
        settings = {key: yaml.safe_load(value) for key, value in (pair.split("=", 1) for pair in pairs)}
        root = Path(src).resolve().parent
        files = [str(root / f) if (root / f).is_file() else f for f in [*args.configfile, "config/schema.yaml"]]
        cfg = dict(merged_train_config(files[:-1], {"train": settings}, files[-1])["train"], gpus=1, epochs=1,
                   max_samples=args.samples, snapshots=[], checkpoint_every=10**9)
        cache = (args.cache or args.out / f"{name}_compile_cache").resolve()
        for state in args.states:
            run = (args.out / f"{name}_{state}").resolve()
            spec = {"config": dict(cfg, compile_cache=str(cache)), "store": args.store, "target": args.target,
                    "drafter_dir": str(run / "drafter"), "log_csv": str(run / "log.csv"),
                    "curves_png": str(run / "curves.png"), "state_dir": str(run / "state")}
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(src).resolve()),
                                                               os.environ.get("PYTHONPATH", "")]),
                       OMP_NUM_THREADS=str(cfg["threads"]))
            run.mkdir(parents=True, exist_ok=True)
            started = time.perf_counter()
            with open(run / "train.log", "w") as log:
                code = subprocess.run([sys.executable, "-m", "dflash_pipeline.train", "--spec", json.dumps(spec)],
                                      stdout=log, stderr=subprocess.STDOUT, env=env).returncode
            wall = time.perf_counter() - started
            if code:
                raise SystemExit(f"{name} ({state}) exited with {code}: see {run / 'train.log'}")
            found = parse((run / "train.log").read_text())
            cells = [name, state, f"{wall:.1f}"] + ["" if found[k] is None else f"{found[k]:g}" for k in PATTERNS]
            lines.append("| " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
            (args.out / "startup.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
