"""benchmarks/quality/compare_tau.py --loop-aware on two results built by hand: a prompt without a loop, one whose
loop starts at token 4 (steps that start there or later are left out), and one that loops from token 1 (no step
before the onset: left out and counted)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from dflash_pipeline.loops import loop_aware_figures

from compare_arms_helpers import ROOT

OUTPUTS = {"plain": [11, 12, 13, 14, 15, 16, 17], "loops_at_4": [7, 8, 9] + [5] * 40, "loops_at_1": [5] * 30}
COMMITTED = {  # per prompt its verify steps' committed tokens (at most B = 16 each); the prefill commits the first token
    "base": {"plain": [2, 3, 1], "loops_at_4": [2, 4, 8, 8, 8, 12], "loops_at_1": [16, 13]},
    "other": {"plain": [3, 3], "loops_at_4": [1, 1, 8, 8, 8, 16], "loops_at_1": [13, 16]},
}


def result(name: str, tmp_path) -> str:
    rows = [{"id": prompt, "output_ids": OUTPUTS[prompt], "committed": steps, "accepted": [c - 1 for c in steps],
             "tau": sum(steps) / len(steps)} for prompt, steps in COMMITTED[name].items()]
    figures = loop_aware_figures([r["committed"] for r in rows], [r["output_ids"] for r in rows])
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({"rows": rows, "block_size": 16, "loop_ngram": 16, **figures}))
    return str(path)


def compare(tmp_path, *options: str) -> str:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "quality" / "compare_tau.py"),
                           result("base", tmp_path), result("other", tmp_path), "--resamples", "200", *options],
                          capture_output=True, text=True, check=True,
                          env={"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}).stdout


def test_the_loop_aware_ratio_counts_only_the_steps_before_each_onset(tmp_path):
    out = compare(tmp_path, "--loop-aware")
    # before the onset: plain 2.0 against 3.0 (every step); loops_at_4: base's steps start at 1 and 3 (2, 4: 3.0),
    # other's at 1, 2 and 3 (1, 1, 8: 10/3); loops_at_1: none
    assert "loop-aware (n = 16): 2 prompts with a step before the onset, 1 left out" in out, out
    ratio = re.search(r"other / base \(loop-aware mean tau\): ([\d.]+)", out)
    assert ratio and float(ratio[1]) == round((3.0 + 10 / 3) / (2.0 + 3.0), 4), out
    assert "per prompt: other higher 2, lower 0, equal 0" in out, out
    assert "outputs identical: 3/3" in out
    # all steps: the rows' own τ, every prompt
    out = compare(tmp_path)
    base, other = (sum(sum(s) / len(s) for s in COMMITTED[n].values()) for n in ("base", "other"))
    assert f"other / base (mean tau): {other / base:.4f}" in out, out
