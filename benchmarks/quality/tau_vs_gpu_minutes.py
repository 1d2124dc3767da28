"""τ against the GPU-minutes a recipe spent to get there (issue #36): one curve per recipe on one plot.

Each --curve is LABEL, a ``tau_vs_training_tokens.tsv`` (the workflow's evaluate output, or one written by hand from
standalone evaluations: columns drafter, steps, trained_tokens, tau_mean, tau_pooled) and the minutes of its GPU
stages: regeneration, extraction (the extract jobs; merge runs on the host) and training (the train job). A drafter
after s of the run's S steps is placed at  regeneration + extraction + training · s / S  minutes: the train job's
time grows with its steps. The workflow's curve scores every drafter on ``evaluate.curve_prompts`` prompts (the
first 20), so its final point is not the final drafter's τ on all of them. --baseline LABEL TAU draws a horizontal
line (prompt lookup). Prints the points; writes --out (PNG).

  python benchmarks/quality/tau_vs_gpu_minutes.py --out tau_vs_gpu_minutes.png \\
      --curve "ShareGPT first turns" quality_2026-12-01_muon_4ep/tau_vs_training_tokens.tsv 2.8 1.43 8.4 \\
      --curve "varied, every turn" quality_2026-12-03_varied/stage3/tau_vs_training_tokens.tsv 7.68 3.28 15.37 \\
      --baseline "prompt lookup" 2.342
"""

from __future__ import annotations

import argparse

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402


def points(tsv: str, regenerate: float, extract: float, train: float) -> pd.DataFrame:
    table = pd.read_csv(tsv, sep="\t").sort_values("steps")
    table["gpu_minutes"] = regenerate + extract + train * table["steps"] / table["steps"].max()
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--curve", nargs=5, action="append", required=True,
                        metavar=("LABEL", "TSV", "REGENERATE_MIN", "EXTRACT_MIN", "TRAIN_MIN"))
    parser.add_argument("--baseline", nargs=2, action="append", default=[], metavar=("LABEL", "TAU"))
    parser.add_argument("--title", default="τ on MT-Bench first turns against GPU-minutes, one H200")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    figure, axes = plt.subplots(figsize=(9, 5.5))
    for label, tsv, *minutes in args.curve:
        table = points(tsv, *map(float, minutes))
        print(f"{label}:\n{table[['drafter', 'steps', 'trained_tokens', 'gpu_minutes', 'tau_mean', 'tau_pooled']]}")
        axes.plot(table["gpu_minutes"], table["tau_mean"], marker="o", label=label)
        last = table.iloc[-1]
        axes.annotate(f"{last['tau_mean']:.2f}", (last["gpu_minutes"], last["tau_mean"]), textcoords="offset points",
                      xytext=(6, -12))
    for label, tau in args.baseline:
        axes.axhline(float(tau), linestyle="--", color="gray", label=f"{label} ({float(tau):.2f})")
    axes.set_xlabel("GPU-minutes: regeneration + extraction + training so far")
    axes.set_ylabel("τ, mean over prompts")
    axes.set_title(args.title)
    axes.grid(alpha=0.3)
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(args.out, dpi=120)


if __name__ == "__main__":
    main()
