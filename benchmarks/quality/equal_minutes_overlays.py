#!/usr/bin/env python3
"""Issue #53's equal-GPU-minutes overlays from a step ratio measured alone on the card that trains the arms.

    python benchmarks/quality/equal_minutes_overlays.py STEP_LOG [--steps 2175] [--out benchmarks/overlays]

STEP_LOG: what ``benchmarks/speed/train_step_speed.py --device cuda --architectures dflash dflash2`` printed (its
line ``dflash2 / dflash: s/step R``). Session 28's seed-1 arms trained ``--steps`` optimizer steps each on the cut
answers; the same GPU-minutes buy DFlash2 ``steps / R`` steps (``equal_minutes_dflash2.yaml``, against the DFlash arm)
and DFlash ``steps * R`` (``equal_minutes_dflash.yaml``, against the DFlash2 arm). Each is the last overlay after
cut_equal_steps.yaml and seed_1.yaml (and dflash2.yaml for the first); benchmarks/device/equal_minutes_h200.sh measures
the ratio, writes these and trains both arms in one background job.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

RATIO = re.compile(r"^dflash2 / dflash: s/step ([0-9.]+)", re.MULTILINE)


def step_ratio(step_log: str) -> float:
    match = RATIO.search(step_log)
    if match is None:
        raise SystemExit("no 'dflash2 / dflash: s/step R' line: the log of train_step_speed.py --architectures "
                         "dflash dflash2 that ran to its end is needed")
    return float(match.group(1))


def equal_minutes_steps(steps: int, ratio: float) -> dict[str, int]:
    return {"dflash2": round(steps / ratio), "dflash": round(steps * ratio)}


ARMS = {  # architecture: its name, the other arm's, how its steps follow from the ratio, the overlays before it
    "dflash2": ("DFlash2", "DFlash", "/", ", seed_1.yaml and dflash2.yaml"),
    "dflash": ("DFlash", "DFlash2", "x", " and seed_1.yaml"),
}


def overlay(architecture: str, steps: int, arm_steps: int, ratio: float, source: str) -> str:
    name, other, op, after = ARMS[architecture]
    return (f"# Issue #53: {name} trained for the GPU-minutes that the seed-1 {other} arm of {arm_steps:,} steps "
            f"takes on\n"
            f"# the cut answers. DFlash2's step is {ratio}x DFlash's, measured alone on the card that trains the arms\n"
            f"# (train_step_speed.py --device cuda --architectures dflash dflash2):\n"
            f"#   {source}\n"
            f"# so the same minutes buy {arm_steps:,} {op} {ratio} = {steps:,} {name} steps. The last overlay after\n"
            f"# cut_equal_steps.yaml{after}; written by benchmarks/quality/equal_minutes_overlays.py.\n"
            f"train:\n  steps: {steps}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step_log")
    parser.add_argument("--steps", type=int, default=2175, help="the equal-steps arms' optimizer steps")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "overlays"))
    args = parser.parse_args()
    ratio = step_ratio(Path(args.step_log).read_text())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for architecture, steps in equal_minutes_steps(args.steps, ratio).items():
        path = out / f"equal_minutes_{architecture}.yaml"
        path.write_text(overlay(architecture, steps, args.steps, ratio, args.step_log))
        print(f"{path}: train.steps {steps} (ratio {ratio})")


if __name__ == "__main__":
    main()
