"""Where the host waits in a training step on the GPU (issue #21): the trainer's own steps, on the real store.

Builds the train job's ``Trainer`` from the merged config (one GPU, the store preloaded), then
1. runs ``--steps`` steps under ``torch.cuda.set_sync_debug_mode("warn")`` and lists every synchronizing CUDA call
   with the line of this package (or torch) it came from: none should be inside a step;
2. times ``--steps`` steps back to back, alone on the GPU, as the loop runs them: per step the host's time getting
   the packs (``Trainer.steps``), the host's time in ``train_step`` (launching), and the GPU's time from the step's
   first kernel to the next step's (CUDA events). A host time in ``train_step`` near the GPU's means the host sets
   the pace and every host millisecond between steps is a GPU millisecond lost;
3. times ``train_step``'s parts (zero_grad, forward + backward, clipping, each optimiser): the host's time with the
   GPU idle when the part starts (so that a launch never waits for a full launch queue), and, in other steps, the
   GPU's time with the part launched while the GPU sleeps (so that it is its kernels' own, not a wait for the host);
4. with ``--profile N``: N steps under torch.profiler, the ops with the most host time and the launches per step.

    python benchmarks/step_syncs.py --configfile config/config.yaml config/examples/smollm2-quality.yaml \\
        --store results/store.zarr --target results/target --out syncs
"""

from __future__ import annotations

import argparse
import collections
import statistics
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

from recipe_study import merged_train_config

from dflash_pipeline.train import Trainer, TrainConfig, accumulate_gradients


def sync_sites(trainer: Trainer, batches, steps: int) -> collections.Counter:
    """Synchronizing CUDA calls in ``steps`` steps (packs and train_step), by the innermost frame of ours/torch's."""
    sites = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        ours = [f for f in frames if "dflash_pipeline" in f.filename] or frames
        sites[f"{ours[-1].filename.split('/')[-1]}:{ours[-1].lineno} ({ours[-1].line}) <- "
              f"{frames[-1].filename.split('/')[-1]}:{frames[-1].lineno}"] += 1

    torch.cuda.synchronize()
    shown = warnings.showwarning
    warnings.showwarning = record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            for _ in range(steps):
                trainer.train_step(next(batches))
            torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = shown
    return sites


def timed(trainer: Trainer, batches, steps: int) -> dict:
    """Medians over ``steps`` steps: host ms getting the packs, host ms in train_step, GPU ms per step."""
    host_data, host_step, marks = [], [], []
    torch.cuda.synchronize()
    for _ in range(steps):
        began = time.perf_counter()
        packs = next(batches)
        got = time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append(event)
        trainer.train_step(packs)
        host_data.append(got - began)
        host_step.append(time.perf_counter() - got)
    torch.cuda.synchronize()
    gpu = [a.elapsed_time(b) / 1000 for a, b in zip(marks, marks[1:])]
    return {"host packs ms": 1e3 * statistics.median(host_data), "host train_step ms": 1e3 * statistics.median(host_step),
            "GPU step ms": 1e3 * statistics.median(gpu), "host packs / GPU step %": 100 * sum(host_data[1:]) / sum(gpu)}


SLEEP_CYCLES = 400_000_000  # ~0.2 s of an H200's clock: longer than the host takes to launch a part (a part of more
# than the launch queue's ~1,000 kernels makes the host wait for the sleep: its host time is taken without one)


def phases(trainer: Trainer, batches, steps: int) -> dict:
    """train_step's parts (its own calls, in its order) -> per part, medians of the host's ms and the GPU's ms."""
    names = ["zero_grad", "forward + backward", "clip_grad_norm_", *[type(o).__name__ for o in trainer.optimizers]]
    host, gpu = {n: [] for n in names}, {n: [] for n in names}
    for index in range(2 * steps):
        packs = next(batches)
        total = sum(p.weights.sum().double() for p in packs)
        parts = [lambda: [o.zero_grad(set_to_none=True) for o in trainer.optimizers],
                 lambda: accumulate_gradients(trainer.drafter, packs, total, trainer.amp, trainer.cfg.soft_labels),
                 lambda: torch.nn.utils.clip_grad_norm_(trainer.params, trainer.cfg.grad_clip),
                 *[o.step for o in trainer.optimizers]]
        for name, part in zip(names, parts):
            torch.cuda.synchronize()
            if index % 2 == 0:  # the host's time: the GPU runs the kernels as they come
                began = time.perf_counter()
                part()
                host[name].append(time.perf_counter() - began)
                continue
            torch.cuda._sleep(SLEEP_CYCLES)  # the GPU's time: the part queued behind a sleep, then run alone
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            part()
            end.record()
            torch.cuda.synchronize()
            gpu[name].append(start.elapsed_time(end) / 1000)
        for scheduler in trainer.schedulers:
            scheduler.step()
    return {n: (1e3 * statistics.median(host[n]), 1e3 * statistics.median(gpu[n])) for n in names}


def host_profile(trainer: Trainer, batches, steps: int, rows: int = 30) -> list[str]:
    """The host's time per op over ``steps`` steps (torch.profiler; its own overhead included): a markdown table
    of the ops with the most self CPU time, and the kernel launches per step (CUDA runtime/driver calls)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            trainer.train_step(next(batches))
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    launches = sum(e.count for e in events if e.key.startswith(("cudaLaunch", "cuLaunch")))
    lines = [f"{launches / steps:.0f} kernel launches per step; self CPU {total / 1e3 / steps:.1f} ms per step", "",
             "| op | calls per step | self CPU ms per step | CPU ms per step (with children) |", "|---|---|---|---|"]
    lines += [f"| {e.key[:80]} | {e.count / steps:.1f} | {e.self_cpu_time_total / 1e3 / steps:.2f} | "
              f"{e.cpu_time_total / 1e3 / steps:.2f} |" for e in events[:rows]]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configfile", nargs="+", required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--profile", type=int, default=5, help="steps under torch.profiler (0: none)")
    args = parser.parse_args()
    cfg = dict(merged_train_config(args.configfile)["train"], gpus=1, snapshots=[], checkpoint_every=10**9)
    args.out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(TrainConfig(**cfg), args.store, args.target, tempfile.mkdtemp())
    trainer.preloaded.wait()
    batches = trainer.sampler.batches(0)
    trainer.drafter.train()
    lines = [f"# step_syncs: {args.store}, config {' '.join(args.configfile)}, tokens_per_batch "
             f"{cfg['tokens_per_batch']}, optimizer {cfg['optimizer']}", ""]
    warm = trainer.steps(0, batches[: 5 + args.steps], trainer.rule)
    began = time.perf_counter()
    for _ in range(5):  # compilation, caches
        trainer.train_step(next(warm))
    torch.cuda.synchronize()
    lines += [f"first 5 steps (compilation): {time.perf_counter() - began:.1f} s", ""]
    sites = sync_sites(trainer, warm, args.steps)
    lines += [f"## synchronizing CUDA calls in {args.steps} steps", ""]
    lines += [f"- {count} x {site}" for site, count in sites.most_common()] or ["- none"]
    lines += ["", "## per step, medians", "", "| host packs ms | host train_step ms | GPU step ms | "
              "host packs / GPU step % |", "|---|---|---|---|"]
    start = 5 + args.steps
    steps = trainer.steps(0, batches[start : start + args.steps + 5], trainer.rule)
    for _ in range(5):
        trainer.train_step(next(steps))
    lines.append("| " + " | ".join(f"{v:.2f}" for v in timed(trainer, steps, args.steps).values()) + " |")
    print(lines[-1], flush=True)
    start += args.steps + 5
    parts = min(20, args.steps)
    lines += ["", f"## train_step's parts, medians of {parts} steps each", "", "| part | host ms | GPU ms |",
              "|---|---|---|"]
    for name, (host_ms, gpu_ms) in phases(trainer, trainer.steps(0, batches[start : start + 2 * parts], trainer.rule),
                                          parts).items():
        lines.append(f"| {name} | {host_ms:.2f} | {gpu_ms:.2f} |")
    start += 2 * parts
    if args.profile:
        lines += ["", f"## the host's time per op, {args.profile} steps", ""]
        lines += host_profile(trainer, trainer.steps(0, batches[start : start + args.profile], trainer.rule),
                              args.profile)
    (args.out / "step_syncs.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
