"""What a run keeps: the resume checkpoint (``state_dir/checkpoint.pt``: model, optimisers, schedulers, RNG states,
data position, log; written atomically, read with ``weights_only=True``, used only when its fingerprint matches),
and what it hands on: the exported drafter with its ``training.json``, the training log and its curves."""

from __future__ import annotations

import dataclasses
import json
import logging
import random
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist
from torch import nn

from ..atomic import atomic_path
from .compact_fc import exported_fc
from ..drafter import save_dflash
from ..store import HiddenStateStore, config_hash
from ..store.compact import Basis
from .config import RUNTIME_KEYS, TrainConfig

log = logging.getLogger(__name__)


def rng_state() -> dict:
    np_state = np.random.get_state()
    return {"python": random.getstate(), "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)),
                                                   *np_state[2:]],
            "torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def fingerprint(cfg: TrainConfig, store: HiddenStateStore, drafter_config: dict) -> dict:
    """What a checkpoint must match to be resumed: hashes of the train config, the store and the drafter shape."""
    train = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in RUNTIME_KEYS}
    return {"train_config": config_hash(train), "store": config_hash(store.attrs),
            "drafter": config_hash(drafter_config)}


@dataclasses.dataclass
class Position:
    """Where a run is: optimiser steps taken, the epoch and the batch within it, tokens trained so far (all ranks),
    and the training log's rows."""

    step: int = 0
    epoch: int = 0
    batch: int = 0
    tokens: int = 0
    rows: list[dict] = dataclasses.field(default_factory=list)


def resume(path: Path, fingerprint: dict, drafter: nn.Module, optimizers: list, schedulers: list) -> Position | None:
    """Load the checkpoint at ``path`` into the drafter, optimisers, schedulers and this process's RNGs -> the
    position to continue from; None (nothing loaded) if there is none or its fingerprint differs."""
    if not path.exists():
        return None
    state = torch.load(path, map_location="cpu", weights_only=True)
    stale = [k for k in fingerprint if state["fingerprint"].get(k) != fingerprint[k]]
    if stale:
        log.info("not resuming from %s: its %s differ(s) from this run's; starting fresh", path, ", ".join(stale))
        return None
    drafter.load_state_dict(state["model"])
    for optimizer, saved in zip(optimizers, state["optimizers"]):
        optimizer.load_state_dict(saved)
    for scheduler, saved in zip(schedulers, state["schedulers"]):
        scheduler.load_state_dict(saved)
    set_rng_state(state["rng"])
    position = Position(state["step"], state["epoch"], state["batch"], state.get("tokens", 0), state["rows"])
    log.info("resuming from step %d (epoch %d, batch %d) of %s", position.step, position.epoch, position.batch, path)
    return position


def save(path: Path, fingerprint: dict, position: Position, drafter: nn.Module, optimizers: list, schedulers: list,
         *, rank: int = 0, world: int = 1) -> float:
    """Write the checkpoint (rank 0; every rank of ``world`` waits for it) -> the seconds it took."""
    began = time.perf_counter()
    if rank == 0:
        with atomic_path(path) as tmp:
            torch.save({"fingerprint": fingerprint, "step": position.step, "epoch": position.epoch,
                        "batch": position.batch, "tokens": position.tokens, "rows": position.rows,
                        "model": drafter.state_dict(), "optimizers": [o.state_dict() for o in optimizers],
                        "schedulers": [s.state_dict() for s in schedulers], "rng": rng_state()}, tmp)
        log.info("saved checkpoint at step %d (epoch %d, batch %d)", position.step, position.epoch, position.batch)
    if world > 1:
        dist.barrier()
    return time.perf_counter() - began


def snapshot_steps(percents, total_steps: int) -> dict[int, list[int]]:
    """Step -> the percentages of all steps whose snapshot is exported after it (``train.snapshots``)."""
    steps: dict[int, list[int]] = {}
    for percent in percents or ():
        steps.setdefault(max(1, round(percent * total_steps / 100)), []).append(percent)
    return steps


def val_metrics(row: dict) -> dict:
    return {k: v for k, v in row.items() if k.startswith("val_")}


def export(directory, drafter: nn.Module, *, store: HiddenStateStore, fingerprint: dict, train_config: TrainConfig,
           basis: Basis | None = None, **extra) -> None:
    """The drafter in the DFlash format, plus ``training.json``: what it was trained on (the store manifest's
    target and tokenizer/chat-template hashes, so that it is only evaluated with that target), atomically. ``basis``:
    a drafter trained over a compact store's coefficients is exported with fc = fc' U^T."""
    manifest = store.manifest
    record = {
        "target": manifest.get("target"), "target_revision": manifest.get("target_revision"),
        "tokenizer_sha256": manifest.get("tokenizer_sha256"),
        "chat_template_sha256": manifest.get("chat_template_sha256"),
        "target_config_sha256": manifest.get("target_config_sha256"),
        "store_config_sha256": manifest.get("config_sha256"),
        "index_convention": store.attrs.get("index_convention"),
        "target_layer_ids": list(drafter.config.target_layer_ids), "fingerprint": fingerprint,
        "train_config": dataclasses.asdict(train_config), **extra,
    }
    ordinary = exported_fc(drafter, basis) if basis is not None else nullcontext()
    with atomic_path(directory) as tmp, ordinary:
        save_dflash(drafter, tmp, dtype=getattr(torch, train_config.export_dtype))
        (Path(tmp) / "training.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")


def write_log(rows: list[dict], log_csv, curves_png, block_size: int) -> None:
    """The training log as CSV and its curves as PNG, each atomically."""
    from ..plots import plot_training_curves

    columns = ["step", "epoch", "tokens", "train_loss", "grad_norm", "lr", "val_loss", "val_proxy"]
    columns += [f"val_acc_{k}" for k in range(1, block_size)]
    with atomic_path(log_csv) as tmp:
        pd.DataFrame(rows, columns=columns).to_csv(tmp, index=False)
    with atomic_path(curves_png) as tmp:
        plot_training_curves(rows, tmp, block_size)
