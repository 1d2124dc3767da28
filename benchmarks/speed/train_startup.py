"""The train job's start-up, one trainer against another, in one run on the same store (issue #21).

Each ``--tree NAME=SRC[,KEY=VALUE...]`` (a ``dflash_pipeline`` source directory, e.g. an older commit's unpacked
with ``git archive COMMIT src | tar x -C /tmp/old``, then train-config settings for that tree's runs, as YAML
values, e.g. ``--tree eager=src,compile=false``; the config files and ``config/schema.yaml``, relative paths, are
the tree's own where ``SRC/..`` has them, so an older tree runs its own defaults and gets none of the newer keys)
trains in its own process (``python -m dflash_pipeline.train --spec``, as a multi-GPU job's ranks do) the merged
config's recipe for one epoch over a seeded subset of ``--samples`` samples (the whole store is still preloaded),
without snapshots or checkpoints; twice: with an empty compile cache (cold), then with the cache the first run
left (warm); or ``--states warm --cache DIR``: only warm, with a cache an earlier run filled. Trees run one after
another, alone on the GPU. From each run's timing.json (trees from before it was written leave their cells empty):
process start → trainer (interpreter, imports), the preload, the first step, the step time against the host's time
in ``train_step``, the data wait, and the share of the job in steps; a markdown table to stdout and OUT/startup.md,
the logs in OUT.

    python benchmarks/speed/train_startup.py --configfile config/config.yaml config/examples/smollm2-quality.yaml \\
        --store results/store.zarr --target results/target --tree old=/tmp/old/src --tree new=src --out startup
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common.py
from common import read_timing  # noqa: E402

from dflash_pipeline.config import load_config

COLUMNS = {  # from the run's timing.json (dflash_pipeline.train.timing)
    "to trainer s": lambda t: t["process_to_trainer_s"],
    "preload s": lambda t: t["preload_s"],
    "preload GiB/s": lambda t: t["preload_gib"] / t["preload_s"],
    "warm-up s": lambda t: t["warm_up_s"],
    "waited for preload s": lambda t: t["data_s"],
    "first step after loop start s": lambda t: t["first_step_s"],
    "first step s": lambda t: t["first_step_since_process_start_s"],
    "step s": lambda t: t["step_s"],
    "host in train_step s": lambda t: t["launch_s"] / max(1, t["steps"] - 1),
    "host data wait %": lambda t: 100 * t["data_wait_s"] / t["loop_s"],
    "GPU gaps %": lambda t: 100 * t["data_gaps_s"] / t["loop_s"],
    "job s": lambda t: t["job_s"],
    "in steps %": lambda t: 100 * t["steps_s"] / t["job_s"],
}


def cells(timing: dict | None) -> list[str]:
    """The table's cells of one run; empty where the run's tree did not measure it (or wrote no timing.json)."""
    found = []
    for column in COLUMNS.values():
        try:
            found.append(f"{column(timing):.4g}")
        except (KeyError, TypeError, ZeroDivisionError):
            found.append("")
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
    columns = ["tree", "cache", "wall s", *COLUMNS]
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
        cfg = dict(load_config(files[:-1], {"train": settings}, files[-1])["train"], gpus=1, epochs=1,
                   max_samples=args.samples, snapshots=[], checkpoint_every=10**9)
        timed = (Path(src) / "dflash_pipeline" / "train" / "timing.py").is_file()  # older trees write no timing.json
        cache = (args.cache or args.out / f"{name}_compile_cache").resolve()
        for state in args.states:
            run = (args.out / f"{name}_{state}").resolve()
            spec = {"config": dict(cfg, compile_cache=str(cache)), "store": args.store, "target": args.target,
                    "drafter_dir": str(run / "drafter"), "log_csv": str(run / "log.csv"),
                    "curves_png": str(run / "curves.png"), "state_dir": str(run / "state"),
                    **({"timing_json": str(run / "timing.json")} if timed else {})}
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
            row = [name, state, f"{wall:.1f}", *cells(read_timing(run) if timed else None)]
            lines.append("| " + " | ".join(row) + " |")
            print(lines[-1], flush=True)
            (args.out / "startup.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
