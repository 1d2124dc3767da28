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
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch
import torch.distributed as dist

from ..atomic import atomic_path
from ..compact import exported_fc
from ..drafter import save_dflash
from ..store import HiddenStateStore, config_hash
from .config import RUNTIME_KEYS, TrainConfig

if TYPE_CHECKING:
    from .trainer import Trainer

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


def resume(trainer: Trainer) -> None:
    """Continue from the checkpoint in the state directory, unless there is none or it is stale."""
    path = trainer.state_path
    if not path.exists():
        return
    state = torch.load(path, map_location="cpu", weights_only=True)
    stale = [k for k in trainer.fingerprint if state["fingerprint"].get(k) != trainer.fingerprint[k]]
    if stale:
        log.info("not resuming from %s: its %s differ(s) from this run's; starting fresh", path, ", ".join(stale))
        return
    trainer.data.check_listed()  # in a bucket: the chunks of the skipped steps are not read again
    trainer.drafter.load_state_dict(state["model"])
    for optimizer, saved in zip(trainer.optimizers, state["optimizers"]):
        optimizer.load_state_dict(saved)
    for scheduler, saved in zip(trainer.schedulers, state["schedulers"]):
        scheduler.load_state_dict(saved)
    set_rng_state(state["rng"])
    trainer.step, trainer.epoch, trainer.batch_index = state["step"], state["epoch"], state["batch"]
    trainer.tokens = state.get("tokens", 0)
    trainer.rows = state["rows"]
    log.info("resuming from step %d (epoch %d, batch %d) of %s", trainer.step, trainer.epoch, trainer.batch_index,
             path)


def save(trainer: Trainer) -> float:
    """Write the checkpoint (rank 0; every rank waits for it) -> the seconds it took."""
    began = time.perf_counter()
    trainer.read_losses()
    if trainer.rank == 0:
        with atomic_path(trainer.state_path) as tmp:
            torch.save({"fingerprint": trainer.fingerprint, "step": trainer.step, "epoch": trainer.epoch,
                        "batch": trainer.batch_index, "tokens": trainer.tokens, "rows": trainer.rows,
                        "model": trainer.drafter.state_dict(), "optimizers": [o.state_dict() for o in trainer.optimizers],
                        "schedulers": [s.state_dict() for s in trainer.schedulers], "rng": rng_state()}, tmp)
        log.info("saved checkpoint at step %d (epoch %d, batch %d)", trainer.step, trainer.epoch, trainer.batch_index)
    if trainer.world > 1:
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


def export(trainer: Trainer, directory, **extra) -> None:
    """The drafter in the DFlash format, plus ``training.json``: what it was trained on (the store manifest's
    target and tokenizer/chat-template hashes, so that it is only evaluated with that target), atomically."""
    manifest, drafter = trainer.data.manifest, trainer.drafter
    record = {
        "target": manifest.get("target"), "target_revision": manifest.get("target_revision"),
        "tokenizer_sha256": manifest.get("tokenizer_sha256"),
        "chat_template_sha256": manifest.get("chat_template_sha256"),
        "target_config_sha256": manifest.get("target_config_sha256"),
        "store_config_sha256": manifest.get("config_sha256"),
        "index_convention": trainer.data.attrs.get("index_convention"),
        "target_layer_ids": list(drafter.config.target_layer_ids), "fingerprint": trainer.fingerprint,
        "train_config": dataclasses.asdict(trainer.cfg), **extra,
    }
    ordinary = exported_fc(drafter, trainer.basis) if trainer.basis is not None else nullcontext()  # fc = fc' U^T
    with atomic_path(directory) as tmp, ordinary:
        save_dflash(drafter, tmp, dtype=getattr(torch, trainer.cfg.export_dtype))
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
