#!/usr/bin/env python3
"""Arms of one comparison (issue #53: DFlash against DFlash2 at equal data, steps and GPU-minutes) as markdown
tables, one row per arm: the drafter's architecture, τ loop-aware and on all steps (mean / pooled), steps, trained
tokens, the GPU-minutes of extract and train, step time and peak GPU memory (the train job's timing.json: speed
figures only where the arm trained alone, `benchmarks/device/arms_h200.sh turns`), the validation proxy and, for a
DFlash2 arm evaluated with `evaluate.backbone_drafts`, its backbone drafts' loop-aware τ and the selector's share
of the gain (τ − 1 less the backbone's τ − 1, over τ − 1; loop-aware means); then loop-aware τ (mean) per category.
A figure an arm lacks prints as —.

  python benchmarks/quality/compare_arms.py NAME=DIR [NAME=DIR ...] [--benchmark mt_bench]

DIR: an arm's files as `benchmarks/device/quality_run_h200.sh` packs them (`~/arms/NAME.out` holding quality.tgz,
or quality.tgz unpacked: results/...), or as a logs folder keeps them (result.json, timing.json, train_log.csv.gz,
job_benchmarks/; e.g. benchmarks/logs/arms_2026-12-05/dflash). An arm trained on the device without its evaluation
(TARGET=results/drafter) and evaluated on the CPU from its bf16 parts: DIR holds quality.tgz and that evaluation's
result.json (`dflash-pipeline evaluate ... --out DIR/result.json`); a result.json in DIR is read before the packed
one. GPU-minutes: the jobs' wall seconds in Snakemake's
benchmark files (extract: compact_basis and every shard, one GPU each; train: times training.json's train gpus,
else 1), so an arm that reused another's store shows that store's extraction.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import sys
import tarfile
import tempfile
from pathlib import Path

DASH = "—"
COLUMNS = ("arm", "architecture", "τ loop-aware mean / pooled", "τ all steps mean / pooled", "steps",
           "trained tokens", "GPU-min extract + train", "step s", "peak GPU GiB", "validation proxy",
           "backbone τ loop-aware mean / pooled", "selector's share of τ − 1")


def arm_files(folders: list[Path], benchmark: str) -> dict[str, Path | None]:
    """Where each file of an arm is, in the packed layout (results/...) or the logs folder's, the first folder
    first; None: absent."""
    def first(*names):
        return next((folder / name for folder in folders for name in names if (folder / name).exists()), None)

    return {"result": first("result.json", f"results/evaluate/{benchmark}/result.json"),
            "timing": first("results/train/timing.json", "timing.json"),
            "training": first("results/drafter/training.json", "training.json"),
            "drafter_config": first("results/drafter/config.json", "drafter_config.json"),
            "train_log": first("results/train/log.csv", "train_log.csv.gz", "train_log.csv", "log.csv"),
            "job_benchmarks": first("results/benchmarks", "job_benchmarks")}


def read_json(path: Path | None) -> dict:
    return json.loads(path.read_text()) if path else {}


def last_validation(path: Path | None) -> float | None:
    """The last val_proxy of a training log (log.csv, gzipped or not)."""
    if path is None:
        return None
    with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as f:
        proxies = [row["val_proxy"] for row in csv.DictReader(f) if row.get("val_proxy")]
    return float(proxies[-1]) if proxies else None


def job_seconds(folder: Path | None, pattern: str) -> float | None:
    """The summed wall seconds (column s) of the Snakemake benchmark files matching ``pattern``; None: none."""
    files = sorted(folder.glob(pattern)) if folder else []
    seconds = [float(row["s"]) for path in files
               for row in csv.DictReader(path.read_text().splitlines(), delimiter="\t")]
    return sum(seconds) if seconds else None


def architecture(training: dict, drafter_config: dict) -> str | None:
    if training.get("train_config", {}).get("architecture"):
        return training["train_config"]["architecture"]
    names = drafter_config.get("architectures") or []
    return {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash2"}.get(names[0]) if names else None


def arm_row(name: str, folders: Path | list[Path], benchmark: str = "mt_bench") -> dict:
    """One arm's figures (None where its files lack one) from its folder, or its folders (the first first)."""
    files = arm_files(folders if isinstance(folders, list) else [folders], benchmark)
    result, timing, training = read_json(files["result"]), read_json(files["timing"]), read_json(files["training"])
    trained = result.get("training") or {}
    extract_s = job_seconds(files["job_benchmarks"], "extract/*.tsv")
    basis_s = job_seconds(files["job_benchmarks"], "compact_basis.tsv")
    train_s = job_seconds(files["job_benchmarks"], "train.tsv")
    gpus = training.get("train_config", {}).get("gpus") or 1
    backbone = result.get("backbone_drafts") or {}
    tau, tau_backbone = result.get("tau_loop_aware_mean"), backbone.get("tau_loop_aware_mean")
    proxy = training.get("final", {}).get("val_proxy")
    return {
        "arm": name,
        "architecture": architecture(training, read_json(files["drafter_config"])),
        "tau_loop_aware": (result.get("tau_loop_aware_mean"), result.get("tau_loop_aware_pooled")),
        "tau_all_steps": (result.get("tau_mean"), result.get("tau_pooled")),
        "steps": trained.get("steps", training.get("steps", timing.get("steps"))),
        "trained_tokens": trained.get("trained_tokens", training.get("trained_tokens")),
        "gpu_minutes": (None if extract_s is None and basis_s is None else ((extract_s or 0) + (basis_s or 0)) / 60,
                        None if train_s is None else train_s * gpus / 60),
        "step_s": timing.get("step_s"),
        "peak_gpu_gib": timing.get("peak_gpu_gib"),
        "validation_proxy": proxy if proxy is not None else last_validation(files["train_log"]),
        "backbone_tau_loop_aware": (tau_backbone, backbone.get("tau_loop_aware_pooled")),
        "selector_share": (tau - tau_backbone) / (tau - 1) if tau and tau_backbone and tau != 1 else None,
        "tau_by_category": {category: figures.get("tau_loop_aware_mean")
                            for category, figures in (result.get("by_category") or {}).items()},
    }


def number(value, digits: int = 3) -> str:
    return DASH if value is None else f"{value:,.{digits}f}"


def pair(values, digits: int = 3, joint: str = " / ") -> str:
    return DASH if all(v is None for v in values) else joint.join(number(v, digits) for v in values)


def markdown(rows: list[dict]) -> str:
    """The arms' table, then their loop-aware τ (mean) per category."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        tokens = r["trained_tokens"]
        cells = [r["arm"], r["architecture"] or DASH, pair(r["tau_loop_aware"]), pair(r["tau_all_steps"]),
                 DASH if r["steps"] is None else f"{r['steps']:,}",
                 DASH if tokens is None else f"{tokens / 1e6:.2f} M", pair(r["gpu_minutes"], 1, " + "),
                 number(r["step_s"]), number(r["peak_gpu_gib"], 2), number(r["validation_proxy"]),
                 pair(r["backbone_tau_loop_aware"]),
                 DASH if r["selector_share"] is None else f"{100 * r['selector_share']:.0f} %"]
        lines.append("| " + " | ".join(cells) + " |")
    categories = sorted({category for r in rows for category in r["tau_by_category"]})
    if categories:
        lines += ["", "| arm | " + " | ".join(categories) + " |", "|" + "---|" * (len(categories) + 1)]
        lines += ["| " + " | ".join([r["arm"], *(number(r["tau_by_category"].get(c)) for c in categories)]) + " |"
                  for r in rows]
    return "\n".join(lines) + "\n"


def unpacked(folder: Path, scratch: Path) -> list[Path]:
    """The arm's folder, then its quality.tgz unpacked into ``scratch`` (a ~/arms/NAME.out as it was packed)."""
    if (folder / "quality.tgz").exists() and not (folder / "results").exists():
        with tarfile.open(folder / "quality.tgz") as tar:
            tar.extractall(scratch, filter="data")
        return [folder, scratch]
    return [folder]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("arms", nargs="+", metavar="NAME=DIR")
    p.add_argument("--benchmark", default="mt_bench", help="results/evaluate/<benchmark>/result.json of each arm")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, arm in enumerate(args.arms):
            name, _, folder = arm.partition("=")
            if not name or not folder or not Path(folder).is_dir():
                p.error(f"{arm!r}: expected NAME=DIR with DIR an arm's folder")
            rows.append(arm_row(name, unpacked(Path(folder), Path(tmp, str(i))), args.benchmark))
    sys.stdout.write(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
