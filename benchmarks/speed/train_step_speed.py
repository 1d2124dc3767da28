"""One training step's forward + backward: one pass per sequence (the trainer before packing) vs packed passes.

    python benchmarks/speed/train_step_speed.py                # CPU, fp32: 8 sequences of ~128 tokens, 8 anchors
    python benchmarks/speed/train_step_speed.py --device cuda  # bf16 autocast, FlexAttention: the H200 shape of
                                                               # benchmarks/journal/2026-11-29.md (20 x ~410 tokens,
                                                               # 512 anchors)
    python benchmarks/speed/train_step_speed.py --device cuda --sequences 50 --length 330 --chunk-rows 4096 16384 --profile

``--chunk-rows N ...``: the packed step again with the LM-head loss in chunks of N rows (the trainer's
``LOSS_CHUNK_ROWS`` is the packed baseline; ``accumulate_gradients(chunk_rows=)``), checked against it (loss and
gradients) before it is timed. (The loss of sessions 1-3, checkpointed 1,024-row chunks, was timed against the fused
one up to commit 3d7b32d.)
``--profile``: the compiled packed step's top operators by device time (torch.profiler), to see where a step goes;
with ``--architectures``, each architecture's whole step's, and the time its kernels keep the GPU busy per step.
Also timed: the packed step of a copy of the drafter after ``compile_pointwise`` (the trainer's default on GPU), and on
CUDA of copies after ``compile_layers`` (``train.compile_layers``), without and with ``--flex-kernel-options``
(``train.flex_kernel_options``; default the forward tiles of 64 x 64 that ``flex_options_speed.py`` measured).

A SmolLM2-shaped drafter (D 576, 5 layers, 9 heads x 64, 3 KV heads, FFN 1536, vocab 49152, B 16) with
random weights (or the target's embedding and LM head with ``--target DIR``), random features, response
masks and anchors drawn as in training. Both variants run the trainer's own code: ``accumulate_gradients``
over ``pack_layouts``' packs, every sequence a pack alone (``pack_elements=0``: the per-sequence loop) and with
the default cap.
Prints seconds per step (median of ``--repeats``, alternating), the ratio to the loop and the process's CPU
seconds (on CPU with OMP_NUM_THREADS=1, less disturbed by other work on shared cores than wall time).

``--architectures dflash dflash2`` (issue #53: the step time and peak memory of each) instead times the trainer's
whole step (``Trainer.train_step`` in one process: ``accumulate_gradients``, gradient clipping, the optimizers of
``make_optimizers`` and their schedules) of each architecture on the same packs, one after the other, alone on the
device. Each drafter is built from the ``train`` section of ``--configfile`` (default the recipe
config/examples/smollm2-varied.yaml over config/config.yaml: Muon, and on CUDA ``compile_layers`` with its flex
kernel options; eager on the CPU), with benchmarks/overlays/dflash2.yaml merged last for dflash2, as
``build_drafter`` sets it up but with the SmolLM2 shape and random weights above. On CUDA a step is the recipe's
``tokens_per_batch`` (4,096: ``--sequences`` = 4096 // ``--length``) with its ``max_anchors``; on the CPU the small
shape above. ``--warmup`` steps (compilation) are not timed; each repeat times ``--steps-per-repeat`` steps back to
back (no host sync between them, as the trainer runs), the architectures alternated per repeat. Prints per
architecture the median seconds per step, tokens per second, CPU seconds per step, peak memory (CUDA:
``max_memory_allocated`` over its steps, reset before them, less what the other architectures' drafters and
optimizer states hold at rest: its peak alone on the device; — on the CPU) and trainable parameters, then
dflash2 / dflash. On one GPU:

    python benchmarks/speed/train_step_speed.py --device cuda --architectures dflash dflash2
    OMP_NUM_THREADS=1 python benchmarks/speed/train_step_speed.py --architectures dflash dflash2   # a CPU reading
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common.py
from common import drafter_of_smollm2_shape, step_packs  # noqa: E402
from dflash_pipeline.config import load_config
from dflash_pipeline.drafter import architecture_kwargs
from dflash_pipeline.train import (TrainConfig, accumulate_gradients, configure_for_training,
                                   make_optimizers)
from dflash_pipeline.train.step import make_schedulers

ROOT = Path(__file__).resolve().parents[2]
RECIPE = [ROOT / "config" / "config.yaml", ROOT / "config" / "examples" / "smollm2-varied.yaml"]
ARCHITECTURE_OVERLAYS = {"dflash": [], "dflash2": [ROOT / "benchmarks" / "overlays" / "dflash2.yaml"]}


class WholeStep:
    """One architecture's training step as the trainer takes it in one process (``Trainer.train_step``), its drafter
    set up as ``build_drafter`` sets one up (selector loss weight, gradient checkpointing, kernel options, compile
    mode on CUDA), but of the SmolLM2 shape with random weights (``drafter_of_smollm2_shape``)."""

    def __init__(self, cfg: TrainConfig, target: str | None, device: torch.device, total_steps: int):
        self.cfg, self.amp = cfg, device.type == "cuda"
        drafter = drafter_of_smollm2_shape(target, device, torch.bfloat16 if self.amp else torch.float32,
                                           architecture_kwargs(cfg))
        self.drafter = configure_for_training(drafter, cfg)
        self.params = [p for p in drafter.parameters() if p.requires_grad]
        self.optimizers = make_optimizers(cfg, drafter)
        self.schedulers = make_schedulers(self.optimizers, total_steps, cfg.warmup_ratio)

    def __call__(self, packs) -> torch.Tensor:
        """One optimizer step over ``packs`` -> the mean loss, on the device (no host sync)."""
        total_weight = sum(p.weights.sum().double() for p in packs)
        self.rest()
        loss_sum = accumulate_gradients(self.drafter, packs, total_weight, self.amp)
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.grad_clip)
        for optimizer, scheduler in zip(self.optimizers, self.schedulers):
            optimizer.step()
            scheduler.step()
        return loss_sum / total_weight

    def rest(self) -> None:
        """Gradients dropped: only the weights and the optimizer states stay on the device."""
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=True)


def compare_architectures(args, device: torch.device) -> None:
    """``--architectures``: the whole step of each on the same packs (the module's docstring)."""
    cuda = device.type == "cuda"
    configs = {name: TrainConfig(**load_config([*args.configfile, *ARCHITECTURE_OVERLAYS[name]])["train"])
               for name in args.architectures}
    recipe = next(iter(configs.values()))
    args.length = args.length or (410 if cuda else 128)
    args.sequences = args.sequences or (max(1, recipe.tokens_per_batch // args.length) if cuda else 8)
    args.max_anchors = args.max_anchors or (recipe.max_anchors if cuda else 8)
    per_repeat = args.steps_per_repeat or (5 if cuda else 1)
    packs = step_packs(args, device)
    tokens = sum(p.context.shape[1] for p in packs)
    compiled = "compile_layers" if recipe.compile_layers else "compile_pointwise"
    mode = f"{compiled}, kernel options {recipe.flex_kernel_options}" if cuda and recipe.compile else "eager"
    print(f"{device}, threads {torch.get_num_threads()}: {args.sequences} sequences, {tokens} tokens, "
          f"{sum(p.blocks.numel() for p in packs)} block slots in {len(packs)} pass(es); optimizer "
          f"{recipe.optimizer}, {mode}, {per_repeat} step(s) per repeat")

    def allocated() -> int:
        return torch.cuda.memory_allocated(device) if cuda else 0

    def synchronize() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    steps, resting = {}, {}  # resting: the bytes each architecture holds between steps (weights, optimizer states)
    for name, cfg in configs.items():
        before, start = allocated(), time.perf_counter()
        steps[name] = step = WholeStep(cfg, args.target, device, args.warmup + args.repeats * per_repeat)
        loss = [float(step(packs)) for _ in range(max(1, args.warmup))][-1]
        step.rest()
        synchronize()
        resting[name] = allocated() - before
        shape = {key: value for key, value in architecture_kwargs(cfg).items() if value is not None}
        if cfg.architecture == "dflash2":
            shape["selector_loss_weight"] = cfg.selector_loss_weight
        print(f"{name}: {shape}; built and {max(1, args.warmup)} warm-up step(s){' (compilation)' if cuda else ''} "
              f"in {time.perf_counter() - start:.1f} s, loss {loss:.4f}")
    from torch._dynamo.utils import counters  # graphs compiled: none should be while timed

    graphs = counters["stats"]["unique_graphs"]
    times = {name: [] for name in steps}
    peaks = dict.fromkeys(steps, 0)
    for _ in range(args.repeats):
        for name, step in steps.items():
            for each in steps.values():
                each.rest()
            synchronize()
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            start, cpu = time.perf_counter(), time.process_time()
            for _ in range(per_repeat):
                step(packs)
            synchronize()
            times[name].append(((time.perf_counter() - start) / per_repeat, (time.process_time() - cpu) / per_repeat))
            if cuda:
                others = sum(resting[other] for other in steps if other != name)
                peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated(device) - others)
    if cuda:
        print(f"graphs compiled during the timed steps: {counters['stats']['unique_graphs'] - graphs} (0: no "
              f"compilation timed)")
    rows = {}
    print(f"{'architecture':14s} {'s/step':>8s} {'tokens/s':>9s} {'CPU s':>8s} {'peak GiB':>9s} {'trainable':>11s}")
    for name, step in steps.items():
        seconds = statistics.median(t[0] for t in times[name])
        cpu = statistics.median(t[1] for t in times[name])
        trainable = sum(p.numel() for p in step.params)
        rows[name] = dict(seconds=seconds, cpu=cpu, peak=peaks[name] / 2**30, trainable=trainable)
        peak = f"{rows[name]['peak']:9.3f}" if cuda else f"{'—':>9s}"
        print(f"{name:14s} {seconds:8.4f} {tokens / seconds:9.0f} {cpu:8.4f} {peak} {trainable:11,d}")
    if {"dflash", "dflash2"} <= rows.keys():
        new, old = rows["dflash2"], rows["dflash"]
        memory = f"{new['peak'] / old['peak']:.3f}" if cuda else "—"
        print(f"dflash2 / dflash: s/step {new['seconds'] / old['seconds']:.3f}, CPU s {new['cpu'] / old['cpu']:.3f}, "
              f"peak memory {memory}, trainable parameters {new['trainable'] / old['trainable']:.3f}")
    if args.profile:
        profile_architectures(steps, packs, per_repeat, rows, cuda)


def profile_architectures(steps: dict, packs, per_repeat: int, rows: dict, cuda: bool) -> None:
    """``--architectures --profile``: per architecture, ``per_repeat`` steps under torch.profiler: the time its
    kernels keep the GPU busy per step (on the CPU: its operators' own time) beside the timed step, and the top
    operators by their own time (device time on CUDA; a Triton kernel is listed twice, as its launch and itself)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    for name, step in steps.items():
        for each in steps.values():
            each.rest()
        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
            for _ in range(per_repeat):
                step(packs)
            if cuda:
                torch.cuda.synchronize()
        if cuda:  # kernels and copies on the device
            busy = sum(e.device_time_total for e in prof.events() if e.device_type == DeviceType.CUDA)
        else:
            busy = sum(e.self_cpu_time_total for e in prof.events())
        busy /= per_repeat * 1e6
        events = prof.key_averages()
        print(f"{name}: {'kernels' if cuda else 'operators (own CPU time)'} {busy:.4f} s per step against "
              f"{rows[name]['seconds']:.4f} s timed ({busy / rows[name]['seconds']:.0%})")
        print(events.table(sort_by=key, row_limit=20, max_name_column_width=70))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sequences", type=int,
                        help="sequences per step (cpu 8, cuda 20; --architectures on cuda: tokens_per_batch // length)")
    parser.add_argument("--length", type=int, help="mean tokens per sequence (cpu 128, cuda 410)")
    parser.add_argument("--max-anchors", type=int, help="anchors per sequence at most (cpu 8, cuda 512)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--target", help="a target checkpoint directory: its embedding and LM head")
    parser.add_argument("--chunk-rows", type=int, nargs="*", default=[], help="other LM-head loss chunk sizes")
    parser.add_argument("--profile", action="store_true",
                        help="print the packed step's top operators (--architectures: each architecture's step's)")
    parser.add_argument("--flex-kernel-options", default='{"BLOCK_M": 64, "BLOCK_N": 64}',
                        help="JSON: FlexAttention kernel_options of the last CUDA variant")
    parser.add_argument("--architectures", nargs="+", choices=sorted(ARCHITECTURE_OVERLAYS),
                        help="time the trainer's whole step of each architecture instead (issue #53)")
    parser.add_argument("--configfile", nargs="+", default=[str(path) for path in RECIPE],
                        help="--architectures: the recipe whose train section builds and steps each drafter")
    parser.add_argument("--warmup", type=int, default=2, help="--architectures: untimed steps of each first")
    parser.add_argument("--steps-per-repeat", type=int,
                        help="--architectures: steps back to back per timed repeat (cpu 1, cuda 5)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.architectures:
        compare_architectures(args, device)
        return
    cuda = device.type == "cuda"
    args.sequences = args.sequences or (20 if cuda else 8)
    args.length = args.length or (410 if cuda else 128)
    args.max_anchors = args.max_anchors or (512 if cuda else 8)
    drafter = drafter_of_smollm2_shape(args.target, device, torch.bfloat16 if cuda else torch.float32)
    variants_packs = {"loop": step_packs(args, device, pack_elements=0), "packed": step_packs(args, device)}
    total_weight = sum(p.weights.sum().double() for p in variants_packs["packed"])
    tokens = sum(p.context.shape[1] for p in variants_packs["packed"])
    slots = sum(p.blocks.numel() for p in variants_packs["packed"])
    print(f"{device}, threads {torch.get_num_threads()}: {args.sequences} sequences, {tokens} tokens, {slots} block "
          f"slots; packed into {len(variants_packs['packed'])} pass(es)")

    compiled = copy.deepcopy(drafter)  # the same weights
    compiled.compile_pointwise()
    layered = {}  # CUDA: the whole-layer compile, then with FlexAttention's kernel options
    if cuda:
        for name, options in [("packed, compile_layers", None),
                              ("packed, compile_layers, kernel options", json.loads(args.flex_kernel_options))]:
            layered[name] = copy.deepcopy(drafter)
            layered[name].compile_layers()
            layered[name].set_flex_kernel_options(options)

    def step(model=drafter, packs="packed", **kwargs):
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        start, cpu = time.perf_counter(), time.process_time()
        total = float(accumulate_gradients(model, variants_packs[packs], total_weight, cuda, **kwargs))  # waits
        return time.perf_counter() - start, time.process_time() - cpu, total

    def gradients(model=drafter):
        return torch.cat([p.grad.flatten().float() for p in model.parameters() if p.grad is not None])

    variants = {"per-sequence loop": dict(packs="loop"), "packed": {},
                **{f"packed, loss chunks of {n} rows": dict(chunk_rows=n) for n in args.chunk_rows},
                "packed, compile_pointwise": dict(model=compiled),
                **{name: dict(model=model) for name, model in layered.items()}}
    reference_loss = step()[2]  # warm-up (and FlexAttention's compilation on CUDA); the packed baseline's result
    reference = gradients()
    for name, kwargs in variants.items():  # each checked against the packed baseline, then warmed up
        start = time.perf_counter()
        loss = step(**kwargs)[2]
        if "compile" in name:
            print(f"{name}: first step (compilation) {time.perf_counter() - start:.1f} s")
        grads = gradients(kwargs.get("model", drafter))
        print(f"{name}: loss {loss:.6g} vs {reference_loss:.6g} (relative {abs(loss - reference_loss) / abs(reference_loss):.1e}),"
              f" gradients max |diff| {(grads - reference).abs().max():.2e} of max |g| {reference.abs().max():.2e}")
    times = {name: [] for name in variants}
    for _ in range(args.repeats):  # alternating
        for name, kwargs in variants.items():
            times[name].append(step(**kwargs))
    base = statistics.median(t[0] for t in times["per-sequence loop"])
    print(f"{'variant':40s} {'s/step':>7s} {'tokens/s':>9s} {'x loop':>7s} {'CPU s':>7s}")
    for name, runs in times.items():
        seconds, cpu = statistics.median(t[0] for t in runs), statistics.median(t[1] for t in runs)
        print(f"{name:40s} {seconds:7.3f} {tokens / seconds:9.0f} {base / seconds:7.2f} {cpu:7.3f}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            step(compiled)
        key = "device_time_total" if cuda else "cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))
    for seed in (1, 2):  # other lengths, as every training step has: the first call pays any recompilation
        variants_packs["other"] = step_packs(args, device, seed)
        weight = sum(p.weights.sum().double() for p in variants_packs["other"])
        drafter.zero_grad(set_to_none=True)
        start = time.perf_counter()
        float(accumulate_gradients(drafter, variants_packs["other"], weight, cuda))
        print(f"packed, new lengths (seed {seed}): {time.perf_counter() - start:.3f} s/step first call")
    if cuda:
        print(f"peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
