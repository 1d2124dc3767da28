"""The ``train`` job's entry points: ``launch`` (the rule's: here on CPU or one GPU, else torchrun over
``python -m dflash_pipeline.train``, one rank per GPU), ``train`` (one process or one rank), ``main`` (a rank's
command line). The process-wide state a run needs is set here, once (``set_up_process``), never by the trainer."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from ..atomic import atomic_path
from ..gpu_lease import lease_gpus, set_device_count
from ..jobs import seconds_since_process_start
from .checkpoint import val_metrics, write_log
from .config import TrainConfig
from .timing import write_timing
from .trainer import Placement, Trainer

log = logging.getLogger(__name__)


def set_up_process(cfg: TrainConfig) -> Placement:
    """This process's device (made current), the process group of a multi-rank run with the CPU threads split
    between its ranks, and torch.compile's on-disk caches (``train.compile_cache``) -> its ``Placement``."""
    placement = Placement.of_this_process(cfg)
    if placement.device.type == "cuda":
        torch.cuda.set_device(placement.device)
    if placement.world > 1:
        dist.init_process_group("nccl" if placement.device.type == "cuda" else "gloo")
        torch.set_num_threads(max(1, cfg.threads // placement.world))
    if cfg.compile_cache:  # a later run of the same shapes compiles less
        for name, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
            os.environ.setdefault(name, str(Path(cfg.compile_cache).resolve() / sub))
    return placement


def train(config: dict, *, store: str, target: str, drafter_dir: str, log_csv: str, curves_png: str,
          state_dir: str, init_dir: str | None = None, snapshot_dirs: dict | None = None,
          timing_json: str | None = None) -> dict:
    """The ``train`` job (one process, or one rank under torchrun); returns the final validation metrics.
    ``init_dir``: where to export the untrained drafter too (the same seed always gives the same one), as a
    baseline for the evaluation. ``snapshot_dirs``: percent -> where the drafter exported after that share of
    the steps (``train.snapshots``) goes; snapshots are kept in the state directory until the end, so a
    resumed run still has those it passed before it was killed. ``timing_json``: where rank 0 writes the run's
    timings (``timing.write_timing``)."""
    to_trainer = seconds_since_process_start()
    log.info("train job: %.1f s from the process start to the trainer (interpreter, imports, launch)", to_trainer)
    cfg = TrainConfig(**config)
    trainer = Trainer(cfg, store, target, state_dir, placement=set_up_process(cfg))
    if init_dir and trainer.rank == 0:
        trainer.export(init_dir, steps=0)
    rows = trainer.run()
    trainer.stop_workers()
    if trainer.rank == 0:
        trainer.export(drafter_dir, steps=rows[-1]["step"], trained_tokens=trainer.tokens,
               baseline=val_metrics(rows[0]), final=val_metrics(rows[-1]))
        for percent, directory in (snapshot_dirs or {}).items():
            if not (trainer.snapshot_dir / f"{int(percent)}pct").is_dir():
                raise FileNotFoundError(f"the {percent} % snapshot is missing from {trainer.snapshot_dir} (a run "
                                        f"resumed from a checkpoint written without it): delete {state_dir} to retrain")
            with atomic_path(directory) as tmp:
                shutil.copytree(trainer.snapshot_dir / f"{int(percent)}pct", tmp, dirs_exist_ok=True)
        write_log(rows, log_csv, curves_png, cfg.block_size)
        log.info("exported the drafter to %s: validation loss %.4f -> %.4f, acceptance proxy %.3f -> %.3f",
                 drafter_dir, rows[0]["val_loss"], rows[-1]["val_loss"], rows[0]["val_proxy"], rows[-1]["val_proxy"])
    if trainer.world > 1:
        dist.barrier()
        dist.destroy_process_group()
    job = seconds_since_process_start()
    if "steps_s" in trainer.timing:
        log.info("train job: %.1f s from the process start, %.1f s (%.1f %%) of it in the training steps (the loop "
                 "less validations and checkpoints)", job, trainer.timing["steps_s"],
                 100 * trainer.timing["steps_s"] / job)
    if timing_json and trainer.rank == 0:
        write_timing(timing_json, {"process_to_trainer_s": to_trainer, **trainer.timing, "job_s": job})
    return val_metrics(rows[-1])


def launch(config: dict, *, gpu_count: int | None = None, **paths) -> None:
    """Run training here on CPU (``gpus: 0``) or on one leased GPU; with more, lease them and exec torchrun over
    this package (one rank per GPU)."""
    log.info("train job: its modules imported %.1f s after the process start", seconds_since_process_start())
    gpus = config["gpus"]
    if gpus <= 1:
        if gpus == 1:
            lease_gpus(1, count=gpu_count)  # before CUDA starts
        train(config, **paths)
        return
    set_device_count(gpu_count)  # for the gpu_lease process below
    spec = json.dumps({"config": config, **paths})
    cmd = [sys.executable, "-m", "dflash_pipeline.gpu_lease", "--n", str(gpus), "--",
           sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}",
           "-m", "dflash_pipeline.train", "--spec", spec]
    log.info("launching: %s", " ".join(cmd[:-1] + ["'<spec>'"]))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(cmd[0], cmd)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dflash_pipeline.train", description="One rank of DFlash training.")
    parser.add_argument("--spec", required=True, help="JSON: {config, store, target, drafter_dir, log_csv, ...}")
    spec = json.loads(parser.parse_args(argv).spec)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s rank {os.environ.get('RANK', 0)} %(levelname)s %(name)s: %(message)s")
    train(spec.pop("config"), **spec)
