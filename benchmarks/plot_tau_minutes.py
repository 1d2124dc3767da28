"""τ on the 80 MT-Bench first turns against minutes of training on one H200, for the quality recipe before the
learning-efficiency study (AdamW, 16,384 tokens per step) and after it (Muon, 4,096 tokens per step, γ 3), from the
runs' own logs (issue #20), and the workflow run of the chosen recipe (4 epochs, snapshots at 25 % and 50 %):

    python benchmarks/plot_tau_minutes.py [--out benchmarks/logs/quality_2026-12-01_muon_4ep/tau_vs_gpu_minutes.png]

Minutes: the training loop's seconds as its train log reports them ("training speed ... (N s"), for the study's
arms the loop's steps times its mean step. τ: the mean of per-response τ, measured by speculative decoding
(result.json) or by the teacher-forced replay of the same greedy loop (the study's score; equal to it per prompt,
benchmarks/RESULTS.md). Prompt lookup's τ on the same prompts is the horizontal line.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pandas as pd

from dflash_pipeline.plots import plt

LOGS = Path(__file__).resolve().parent / "logs"
STUDY = LOGS / "study_2026-12-01"
WORKFLOW = LOGS / "quality_2026-12-01_muon_4ep"


def loop_minutes(train_log: Path) -> float:
    return float(re.search(r"training speed \(rank 0\): \d+ tokens/s over \d+ steps \((\d+) s", train_log.read_text())[1]) / 60


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(WORKFLOW / "tau_vs_gpu_minutes.png"))
    args = parser.parse_args()
    before = [(loop_minutes(LOGS / run / "train.log"), json.loads((LOGS / result / "result.json").read_text()))
              for run, result in (("quality_2026-11-30_one_h200", "quality_2026-11-30_one_h200"),
                                  ("quality_2026-11-29_second", "quality_2026-11-29_gpu_eval"))]
    arms = pd.read_csv(STUDY / "study.tsv", sep="\t").set_index("arm")
    final = json.loads((STUDY / "final_score.json").read_text())
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.plot([m for m, _ in before], [r["tau_mean"] for _, r in before], "o-", label="before: AdamW, 16K tokens/step")
    base = arms.loc["base"]
    ax.plot([base.steps * base.step_s / 60], [base.tau_mean_all], "s", color="C0", mfc="none",
            label="AdamW, 4K tokens/step (study arm, 1.8 M tokens)")
    muon = arms.loc["muon"]
    after = [(muon.steps * muon.step_s / 60, muon.tau_mean_all), (loop_minutes(STUDY / "train.log"), final["tau_mean_all"])]
    ax.plot(*zip(*after), "o-", color="C3", label="after: Muon, 4K tokens/step, γ 3")
    curve = pd.read_csv(WORKFLOW / "tau_vs_training_tokens.tsv", sep="\t")  # first 20 prompts, at 25/50/100 %
    per_step = loop_minutes(WORKFLOW / "train.log") / curve.steps.max()
    ax.plot(curve.steps * per_step, curve.tau_mean, "^-", color="C2",
            label="workflow run, 4 epochs: 25 / 50 / 100 % (first 20 prompts)")
    workflow = json.loads((WORKFLOW / "result.json").read_text())
    after.append((curve.steps.max() * per_step, workflow["tau_mean"]))
    ax.plot(*after[-1], "*", color="C2", ms=12, label="workflow run, final drafter (all 80)")
    lookup = next(r["prompt_lookup_tau_mean"] for _, r in before if r.get("prompt_lookup_tau_mean"))
    ax.axhline(lookup, color="grey", ls="--",
               label=f"prompt lookup ({lookup:.2f})")
    for minutes, tau in [(m, r["tau_mean"]) for m, r in before] + after:
        ax.annotate(f"{tau:.2f}", (minutes, tau), textcoords="offset points", xytext=(4, -12), fontsize=8)
    ax.set(xlabel="training minutes on one H200 (the loop)", ylabel="τ, 80 MT-Bench first turns (mean)",
           title="SmolLM2-135M drafter: τ against training time")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(args.out)


if __name__ == "__main__":
    main()
