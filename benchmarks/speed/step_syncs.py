"""Where the host waits in a training step on the GPU (issue #21): the trainer's own steps, on the real store.

Builds the train job's ``Trainer`` from the merged config (one GPU, the store preloaded), compiles on 5 steps, then
0. checks the faster paths against the plain ones on the real data: one step of ``BatchedMuon`` against
   ``torch.optim.Muon`` from the same weights, momentum and gradients (update difference, host and GPU ms of each),
   and with ``train.compile_layers`` the compiled layer pass's loss and gradients against the eager pass's;
1. runs ``--steps`` steps under ``torch.cuda.set_sync_debug_mode("warn")`` and lists every synchronizing CUDA call
   with the line of this package (or torch) it came from: none should be inside a step;
2. times ``--steps`` steps back to back, alone on the GPU, as the loop runs them: per step the host's time getting
   the packs (``Trainer.steps``), the host's time in ``train_step`` (launching), and the GPU's time from the step's
   first kernel to the next step's (CUDA events). A host time in ``train_step`` near the GPU's means the host sets
   the pace and every host millisecond between steps is a GPU millisecond lost;
3. times ``train_step``'s parts (zero_grad, forward + backward, clipping, each optimiser): the host's time with the
   GPU idle when the part starts (so that a launch never waits for a full launch queue), and, in other steps, the
   GPU's time with the part launched while the GPU sleeps (so that it is its kernels' own, not a wait for the host);
4. with ``--profile N``: N steps under torch.profiler, the ops with the most host time and the launches per step;
5. with ``--stalls N``: the GPU's gaps between steps (``train.DataGaps``, as the train log counts them) over runs
   of N steps, each run under one variant (as is; torch's intra-op threads at 1; Python's cyclic GC off), the
   variants interleaved twice: per run the gaps' share and spread, the GC's collections, the new pinned and device
   memory blocks, and the host's times around the longest gaps (``--steps 0`` skips 1-3).

    python benchmarks/speed/step_syncs.py --configfile config/config.yaml config/examples/smollm2-quality.yaml \\
        --store results/store.zarr --target results/target --out syncs
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import statistics
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import torch

from dflash_pipeline.config import load_config
from dflash_pipeline.drafter import decoder_layer_pass
from dflash_pipeline.muon import BatchedMuon
from dflash_pipeline.train import DataGaps, Trainer, TrainConfig, accumulate_gradients, set_up_process


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


def part_ms(part, host: bool) -> float:
    """One run of ``part`` from an idle GPU: the host's ms (the GPU runs the kernels as they come), or the GPU's ms
    (the part queued behind a GPU sleep, then run alone)."""
    torch.cuda.synchronize()
    if host:
        began = time.perf_counter()
        part()
        return 1e3 * (time.perf_counter() - began)
    torch.cuda._sleep(SLEEP_CYCLES)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    part()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def phases(trainer: Trainer, batches, steps: int) -> dict:
    """train_step's parts (its own calls, in its order) -> per part, medians of the host's ms and the GPU's ms."""
    names = ["zero_grad", "forward + backward", "clip_grad_norm_", *[type(o).__name__ for o in trainer.optimizers]]
    host, gpu = {n: [] for n in names}, {n: [] for n in names}
    for index in range(2 * steps):
        packs = next(batches)
        total = sum(p.weights.sum().double() for p in packs)
        parts = [lambda: [o.zero_grad(set_to_none=True) for o in trainer.optimizers],
                 lambda: accumulate_gradients(trainer.drafter, packs, total, trainer.amp),
                 lambda: torch.nn.utils.clip_grad_norm_(trainer.params, trainer.cfg.grad_clip),
                 *[o.step for o in trainer.optimizers]]
        for name, part in zip(names, parts):  # even steps the host's times, odd ones the GPU's
            (gpu if index % 2 else host)[name].append(part_ms(part, host=index % 2 == 0))
        for scheduler in trainer.schedulers:
            scheduler.step()
    return {n: (statistics.median(host[n]), statistics.median(gpu[n])) for n in names}


def muon_against_torch(trainer: Trainer, packs, reps: int = 10) -> list[str]:
    """The trainer's Muon (BatchedMuon) against torch.optim.Muon, from the same weights, momentum and real
    gradients (one step's packs): each matrix's update difference, and the host's and GPU's ms of one step of
    each. The weights and the trainer's Muon state are put back after."""
    muon = trainer.optimizers[0]
    params = muon.param_groups[0]["params"]
    for optimizer in trainer.optimizers:
        optimizer.zero_grad(set_to_none=True)
    total = sum(p.weights.sum().double() for p in packs)
    accumulate_gradients(trainer.drafter, packs, total, trainer.amp)
    weights = [p.detach().clone() for p in params]
    momentum = [muon.state[p]["momentum_buffer"].clone() for p in params]
    settings = dict(muon.defaults, lr=muon.param_groups[0]["lr"])

    def fresh(cls):
        optimizer = cls(params, **settings)
        with torch.no_grad():
            for p, w, m in zip(params, weights, momentum):
                p.copy_(w)
                optimizer.state[p]["momentum_buffer"] = m.clone()
        return optimizer

    updates, times = {}, {}
    for cls in (torch.optim.Muon, BatchedMuon):
        optimizer = fresh(cls)
        optimizer.step()
        updates[cls.__name__] = [p.detach() - w for p, w in zip(params, weights)]
        runs = [part_ms(fresh(cls).step, host=i % 2 == 0) for i in range(2 * reps)]
        times[cls.__name__] = statistics.median(runs[0::2]), statistics.median(runs[1::2])
    with torch.no_grad():
        for p, w, m in zip(params, weights, momentum):
            p.copy_(w)
            muon.state[p]["momentum_buffer"].copy_(m)
    for optimizer in trainer.optimizers:
        optimizer.zero_grad(set_to_none=True)
    diffs = [float((a - b).norm() / b.norm()) for a, b in zip(updates["BatchedMuon"], updates["Muon"])]
    lines = [f"update difference, norm of (batched - torch) / norm of torch's, over {len(params)} matrices: "
             f"max {max(diffs):.2e}, median {statistics.median(diffs):.2e}", "",
             "| Muon step | host ms | GPU ms |", "|---|---|---|"]
    lines += [f"| {name} | {host:.2f} | {gpu:.2f} |" for name, (host, gpu) in times.items()]
    return lines


def compiled_layers_check(trainer: Trainer, batches, steps: int) -> list[str]:
    """With ``compile_layers``: the loss and gradients of ``steps`` steps' packs through the compiled layer pass
    against the eager one (the layers' pointwise parts compiled, as without compile_layers), same weights."""
    drafter, compiled = trainer.drafter, trainer.drafter.layer_pass
    lines = ["| step | loss compiled | loss eager | max over weights of norm(compiled - eager) / norm(eager) |",
             "|---|---|---|---|"]
    for step in range(steps):
        packs = next(batches)
        total = sum(p.weights.sum().double() for p in packs)
        results = []
        for layer_pass in (compiled, decoder_layer_pass):
            drafter.layer_pass = layer_pass
            drafter.zero_grad(set_to_none=True)
            loss = float(accumulate_gradients(drafter, packs, total, trainer.amp))
            results.append((loss, [p.grad.float().clone() for p in trainer.params]))
        (loss, grads), (eager_loss, eager_grads) = results
        worst = max(float((a - b).norm() / b.norm().clamp(min=1e-30)) for a, b in zip(grads, eager_grads))
        lines.append(f"| {step} | {loss / float(total):.6f} | {eager_loss / float(total):.6f} | {worst:.2e} |")
    drafter.layer_pass = compiled
    drafter.zero_grad(set_to_none=True)
    return lines


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


@contextlib.contextmanager
def torch_threads(count: int):
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@contextlib.contextmanager
def gc_off():
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


STALL_VARIANTS = {"as is": contextlib.nullcontext, "torch threads 1": lambda: torch_threads(1), "gc off": gc_off}


def stalls(trainer: Trainer, batches, steps: int, repeats: int = 2, long_s: float = 0.005) -> list[str]:
    """Runs of ``steps`` steps as the loop runs them (packs, then train_step), one per variant, ``repeats`` rounds:
    a markdown table of the GPU's gaps between steps and what may cause the long ones."""
    collected, began = [], 0.0  # (generation, seconds) of the GC's collections in the run; the current one's start

    def on_gc(phase, info):
        nonlocal began
        if phase == "start":
            began = time.perf_counter()
        else:
            collected.append((info["generation"], time.perf_counter() - began))

    lines = [f"| round | variant | GPU gaps % of the run | median gap ms | gaps over {1e3 * long_s:.0f} ms | ms in them "
             "| GC collections (gen 2) | GC ms | new pinned blocks | new device blocks | the three longest gaps: ms "
             "(host ms getting the packs before it; host ms in the train_step before) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    gc.callbacks.append(on_gc)
    try:
        for round_ in range(repeats):
            for name, variant in STALL_VARIANTS.items():
                gaps, packs_s, step_s = DataGaps(trainer.device), [], []
                collected.clear()
                torch.cuda.synchronize()
                pinned, device = (torch.cuda.host_memory_stats().get("num_host_alloc", 0),
                                  torch.cuda.memory_stats().get("num_device_alloc", 0))
                with variant():
                    began = time.perf_counter()
                    for _ in range(steps):
                        mark = time.perf_counter()
                        packs = next(batches)
                        gaps.data_ready()
                        got = time.perf_counter()
                        trainer.train_step(packs)
                        gaps.step_ends()
                        packs_s.append(got - mark)
                        step_s.append(time.perf_counter() - got)
                    torch.cuda.synchronize()
                    wall = time.perf_counter() - began
                total = gaps.read()
                long = [g for g in gaps.gaps if g > long_s]
                worst = sorted(range(len(gaps.gaps)), key=gaps.gaps.__getitem__)[-3:][::-1]  # gap i: before step i + 1
                lines.append(
                    f"| {round_} | {name} | {100 * total / wall:.2f} | {1e3 * statistics.median(gaps.gaps):.2f} | "
                    f"{len(long)} | {1e3 * sum(long):.1f} | {len(collected)} ({sum(g == 2 for g, _ in collected)}) | "
                    f"{1e3 * sum(s for _, s in collected):.1f} | "
                    f"{torch.cuda.host_memory_stats().get('num_host_alloc', 0) - pinned} | "
                    f"{torch.cuda.memory_stats().get('num_device_alloc', 0) - device} | "
                    + "; ".join(f"{1e3 * gaps.gaps[i]:.1f} ({1e3 * packs_s[i + 1]:.1f}; {1e3 * step_s[i]:.1f})"
                                for i in worst) + " |")
                print(lines[-1], flush=True)
    finally:
        gc.callbacks.remove(on_gc)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configfile", nargs="+", required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--target", required=True)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--profile", type=int, default=5, help="steps under torch.profiler (0: none)")
    parser.add_argument("--stalls", type=int, default=0, help="steps per run of the gaps' probe (0: none)")
    args = parser.parse_args()
    cfg = load_config(args.configfile, {"train": {"gpus": 1, "snapshots": [], "checkpoint_every": 10**9}})["train"]
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(cfg["threads"])  # as the train job's start_job
    train_config = TrainConfig(**cfg)
    trainer = Trainer(train_config, args.store, args.target, tempfile.mkdtemp(), placement=set_up_process(train_config))
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
    print(lines[-2], flush=True)
    checks = trainer.steps(0, batches[-4:], trainer.rule)
    if isinstance(trainer.optimizers[0], BatchedMuon):
        lines += ["## BatchedMuon against torch.optim.Muon, one step from the same state", ""]
        lines += muon_against_torch(trainer, next(checks)) + [""]
        print("\n".join(lines[-7:]), flush=True)
    if cfg.get("compile_layers"):
        lines += ["## the compiled layer pass against the eager one", ""]
        lines += compiled_layers_check(trainer, checks, 3) + [""]
        print("\n".join(lines[-7:]), flush=True)
    if args.stalls:
        runs = 2 * len(STALL_VARIANTS)
        cycled = (batches * (1 + (30 + runs * args.stalls) // len(batches)))[: 30 + runs * args.stalls]
        probe = trainer.steps(1, cycled, trainer.rule)
        for _ in range(30):  # the pinned and device memory pools grown to the shapes' usual range
            trainer.train_step(next(probe))
        lines += [f"## the GPU's gaps between steps, {args.stalls} steps per run", ""]
        lines += stalls(trainer, probe, args.stalls) + [""]
    start = 5 + args.steps
    if args.steps:
        sites = sync_sites(trainer, warm, args.steps)
        lines += [f"## synchronizing CUDA calls in {args.steps} steps", ""]
        lines += [f"- {count} x {site}" for site, count in sites.most_common()] or ["- none"]
        lines += ["", "## per step, medians", "", "| host packs ms | host train_step ms | GPU step ms | "
                  "host packs / GPU step % |", "|---|---|---|---|"]
        steps = trainer.steps(0, batches[start : start + args.steps + 5], trainer.rule)
        for _ in range(5):
            trainer.train_step(next(steps))
        lines.append("| " + " | ".join(f"{v:.2f}" for v in timed(trainer, steps, args.steps).values()) + " |")
        print(lines[-1], flush=True)
        start += args.steps + 5
        parts = min(20, args.steps)
        lines += ["", f"## train_step's parts, medians of {parts} steps each", "", "| part | host ms | GPU ms |",
                  "|---|---|---|"]
        for name, (host_ms, gpu_ms) in phases(trainer, trainer.steps(0, batches[start : start + 2 * parts],
                                                                     trainer.rule), parts).items():
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
