"""benchmarks/quality/compare_arms.py on real arms: session 26's DFlash arm (its logs folder), the same files as
`quality_run_h200.sh` packs them with a DFlash2 drafter's backbone figures, and the unfinished DFlash2 arm (no τ)."""

from __future__ import annotations

import gzip
import json
import shutil
import tarfile

from compare_arms_helpers import ROOT, compare_arms, table_rows

ARMS = ROOT / "benchmarks" / "logs" / "arms_2026-12-05"


def run(capsys, *arms: str) -> str:
    assert compare_arms.main(list(arms)) == 0
    return capsys.readouterr().out


def test_the_dflash_arms_row_holds_its_real_figures_and_a_second_name_shows_no_backbone(capsys):
    result = json.loads((ARMS / "dflash" / "result.json").read_text())
    timing = json.loads((ARMS / "dflash" / "timing.json").read_text())
    out = run(capsys, f"dflash={ARMS / 'dflash'}", f"dflash2={ARMS / 'dflash'}")
    rows = table_rows(out)
    assert list(rows) == ["dflash", "dflash2"]
    row = rows["dflash"]
    assert row["τ loop-aware mean / pooled"] == "1.898 / 1.843"
    assert row["τ loop-aware mean / pooled"] == (f"{result['tau_loop_aware_mean']:.3f} / "
                                                 f"{result['tau_loop_aware_pooled']:.3f}")
    assert row["τ all steps mean / pooled"] == f"{result['tau_mean']:.3f} / {result['tau_pooled']:.3f}"
    assert row["steps"] == f"{result['training']['steps']:,}" == "2,175"
    assert row["trained tokens"] == "8.49 M"
    assert row["step s"] == f"{timing['step_s']:.3f}" and row["peak GPU GiB"] == f"{timing['peak_gpu_gib']:.2f}"
    # extract: two shards of 93.62 s and 95.08 s; train: 283.82 s on one GPU
    assert row["GPU-min extract + train"] == f"{(93.62 + 95.08) / 60:.1f} + {283.82 / 60:.1f}"
    with gzip.open(ARMS / "dflash" / "train_log.csv.gz", "rt") as f:
        proxy = float(f.read().splitlines()[-1].split(",")[7])
    assert row["validation proxy"] == f"{proxy:.3f}" == "2.264"
    assert row["architecture"] == "—"  # the logs folder keeps neither training.json nor the drafter's config.json
    assert rows["dflash2"]["backbone τ loop-aware mean / pooled"] == "—"
    assert rows["dflash2"]["selector's share of τ − 1"] == "—"
    categories = out.split("\n\n")[1]
    coding = result["by_category"]["coding"]["tau_loop_aware_mean"]
    assert f"| dflash | {coding:.3f} |" in categories and "| arm | coding | extraction |" in categories


def test_a_packed_dflash2_arm_shows_its_architecture_backbone_and_selector_share(tmp_path, capsys):
    """The DFlash arm's files laid out as quality.tgz holds them, given a DFlash2 drafter's training.json and a
    result.json with backbone_drafts, then packed into NAME.out/quality.tgz as quality_run_h200.sh leaves it; then a
CPU evaluation's result.json beside it."""
    packed = tmp_path / "unpacked"
    (packed / "results/evaluate/mt_bench").mkdir(parents=True)
    (packed / "results/train").mkdir()
    (packed / "results/drafter").mkdir()
    result = json.loads((ARMS / "dflash" / "result.json").read_text())
    result["backbone_drafts"] = {"tau_mean": 1.9, "tau_pooled": 1.8, "tokens_per_s": 20.0,
                                 "tau_loop_aware_mean": 1.7, "tau_loop_aware_pooled": 1.6}
    (packed / "results/evaluate/mt_bench/result.json").write_text(json.dumps(result))
    shutil.copy(ARMS / "dflash" / "timing.json", packed / "results/train/timing.json")
    (packed / "results/drafter/training.json").write_text(json.dumps(
        {"steps": 2175, "train_config": {"architecture": "dflash2", "gpus": 1}, "final": {"val_proxy": 2.5}}))
    shutil.copytree(ARMS / "dflash" / "job_benchmarks", packed / "results/benchmarks")
    out_dir = tmp_path / "dflash2.out"
    out_dir.mkdir()
    with tarfile.open(out_dir / "quality.tgz", "w:gz") as tar:
        tar.add(packed / "results", arcname="results")

    row = table_rows(run(capsys, f"dflash2={out_dir}"))["dflash2"]
    assert row["architecture"] == "dflash2"
    assert row["τ loop-aware mean / pooled"] == "1.898 / 1.843"
    assert row["backbone τ loop-aware mean / pooled"] == "1.700 / 1.600"
    share = (result["tau_loop_aware_mean"] - 1.7) / (result["tau_loop_aware_mean"] - 1)
    assert row["selector's share of τ − 1"] == f"{100 * share:.0f} %" == "22 %"
    assert row["validation proxy"] == "2.500"  # training.json's final proxy before the log's
    assert row["GPU-min extract + train"] == f"{(93.62 + 95.08) / 60:.1f} + {283.82 / 60:.1f}"

    # evaluated on the CPU from its bf16 parts: that result.json beside quality.tgz is the one read
    beside = dict(result, tau_loop_aware_mean=2.25, tau_loop_aware_pooled=2.125,
                  backbone_drafts=dict(result["backbone_drafts"], tau_loop_aware_mean=2.0))
    (out_dir / "result.json").write_text(json.dumps(beside))
    row = table_rows(run(capsys, f"dflash2={out_dir}"))["dflash2"]
    assert row["τ loop-aware mean / pooled"] == "2.250 / 2.125"
    assert row["selector's share of τ − 1"] == f"{100 * 0.25 / 1.25:.0f} %" == "20 %"
    assert row["architecture"] == "dflash2" and row["steps"] == "2,175"  # the packed files still read


def test_an_arm_without_results_prints_dashes(capsys):
    row = table_rows(run(capsys, f"unfinished={ARMS / 'dflash2_unfinished'}"))["unfinished"]
    assert set(row.values()) == {"unfinished", "—"}
