"""Drafter snapshots during training (``train.snapshots``): the tau-vs-training-tokens curve's drafters."""

from __future__ import annotations

import json

import pandas as pd
import torch
from safetensors.torch import load_file
from train_helpers import BASE, make_store, make_tiny_target, paths

from dflash_pipeline.train import train


def test_snapshots_are_exported_with_their_steps_and_tokens_and_change_nothing(tmp_path):
    tiny = {"target": make_tiny_target(tmp_path / "target")}
    tiny["store"] = make_store(tmp_path, tiny["target"])
    plain, with_snapshots = tmp_path / "plain", tmp_path / "snapshots"
    train(dict(BASE), **paths(tiny, plain))
    snapshot_dirs = {25: with_snapshots / "25pct", 50: with_snapshots / "50pct"}
    train(dict(BASE, snapshots=[25, 50]), **paths(tiny, with_snapshots), snapshot_dirs=snapshot_dirs)

    log = pd.read_csv(with_snapshots / "log.csv")
    total = int(log.step.max())
    assert log.tokens.is_monotonic_increasing and log.tokens.iloc[0] == 0
    records = {p: json.loads((d / "training.json").read_text()) for p, d in snapshot_dirs.items()}
    final = json.loads((with_snapshots / "drafter" / "training.json").read_text())
    for percent, record in records.items():
        assert record["steps"] == round(percent * total / 100)
        assert record["trained_tokens"] == log.set_index("step").tokens[record["steps"]]
    assert 0 < records[25]["trained_tokens"] < records[50]["trained_tokens"] < final["trained_tokens"]
    assert final["steps"] == total and final["trained_tokens"] == log.tokens.iloc[-1]
    # a snapshot is a loadable drafter that differs from the final one; exporting it changed no training step
    early, last = load_file(str(snapshot_dirs[25] / "model.safetensors")), load_file(
        str(with_snapshots / "drafter" / "model.safetensors"))
    assert early.keys() == last.keys() and any(not torch.equal(early[k], last[k]) for k in early)
    reference = load_file(str(plain / "drafter" / "model.safetensors"))
    assert all(torch.equal(reference[k], last[k]) for k in reference)
    assert pd.read_csv(plain / "log.csv").equals(log)
