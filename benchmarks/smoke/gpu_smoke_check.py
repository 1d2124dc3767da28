#!/usr/bin/env python3
"""What the GPU smoke run (benchmarks/smoke/gpu_smoke.sh) checks in its results folder, and its stage times: exits 1 with
the failed checks named, else 0. Works on any results folder of the workflow (a CPU run of the default config too).

    python3 benchmarks/smoke/gpu_smoke_check.py RESULTS_DIR OUT_DIR [--wall-s S] [--workflow-status N]
"""

import argparse
import json
import sys
from pathlib import Path

import pandas as pd

CAPTURE_FAILED = "CUDA graph capture of the decode step failed"


def stage_seconds(results: Path) -> dict[str, float]:
    """Per rule, the summed wall seconds of its jobs (Snakemake's benchmark files)."""
    seconds: dict[str, float] = {}
    for tsv in sorted((results / "benchmarks").rglob("*.tsv")):
        rule = tsv.relative_to(results / "benchmarks").parts[0]
        seconds[rule] = seconds.get(rule, 0.0) + float(pd.read_csv(tsv, sep="\t")["s"].sum())
    return seconds


def checks(results: Path, out: Path, workflow_status: int) -> list[tuple[str, bool, str]]:
    found = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        found.append((name, bool(ok), detail))

    check("the workflow exited 0", workflow_status == 0, f"status {workflow_status}")
    check("the report was written", (out / "report.zip").is_file() and (out / "report.zip").stat().st_size > 0)
    counts = [pd.read_csv(tsv, sep="\t", index_col=0)["count"] for tsv in
              sorted((results / "regenerate").glob("shard_*.counts.tsv"))]
    check("every regenerate shard answered prompts", counts and all(c["succeeded"] > 0 for c in counts),
          ", ".join(f"{c['succeeded']}/{c['input']}" for c in counts))
    logs = sorted((results / "logs" / "regenerate").glob("*.log"))
    failed = [log.name for log in logs if CAPTURE_FAILED in log.read_text(errors="replace")]
    check("regeneration's decode graphs were captured (no fallback)", logs and not failed, ", ".join(failed))
    manifest = results / "store.zarr" / "zarr.json"
    check("the store was merged", manifest.is_file())
    drafter = results / "drafter"
    check("the drafter was exported", (drafter / "model.safetensors").is_file() and (drafter / "config.json").is_file())
    if (results / "train" / "snapshots").is_dir():
        curve = results / "evaluate" / "mt_bench" / "tau_vs_training_tokens.tsv"
        check("the training snapshots were evaluated", curve.is_file(), curve.name)
    result_json = results / "evaluate" / "mt_bench" / "result.json"
    if result_json.is_file():
        result = json.loads(result_json.read_text())
        check("speculative decoding is lossless", result["lossless"] is True, f"{result['num_prompts']} prompts")
        check("tau was measured", (result["tau_mean"] or 0) >= 1,
              f"tau {result['tau_mean']} mean / {result['tau_pooled']} pooled; prompt lookup "
              f"{result['prompt_lookup_tau_mean']}")
        for budget, tree in result.get("trees", {}).items():  # evaluate.tree_budgets (gpu_smoke_trees.yaml)
            check(f"tree verification at budget {budget} is lossless", tree["lossless"] is True,
                  f"tau {tree['tau_mean']} mean / {tree['tau_pooled']} pooled, {tree['verified_per_step']:.1f} "
                  f"tokens verified per step, {tree['mode']}, {tree['tokens_per_s']['speculative']:.1f} tok/s")
    else:
        check("the evaluation wrote its result", False, str(result_json))
    return found


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--wall-s", type=float)
    p.add_argument("--workflow-status", type=int, default=0)
    args = p.parse_args()
    print("stage seconds (sum over its jobs):")
    for rule, seconds in stage_seconds(args.results).items():
        print(f"  {rule:<16} {seconds:8.1f}")
    if args.wall_s is not None:
        print(f"wall: {args.wall_s:.0f} s ({args.wall_s / 60:.1f} min)")
    failed = 0
    for name, ok, detail in checks(args.results, args.out, args.workflow_status):
        print(f"{'PASS' if ok else 'FAIL'}  {name}{f' ({detail})' if detail else ''}")
        failed += not ok
    print("GPU smoke run: " + ("passed" if not failed else f"{failed} check(s) failed"))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
