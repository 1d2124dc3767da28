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
``--profile``: the compiled packed step's top operators by device time (torch.profiler), to see where a step goes.
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
from dflash_pipeline.train import accumulate_gradients

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sequences", type=int, help="sequences per step (cpu 8, cuda 20)")
    parser.add_argument("--length", type=int, help="mean tokens per sequence (cpu 128, cuda 410)")
    parser.add_argument("--max-anchors", type=int, help="anchors per sequence at most (cpu 8, cuda 512)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--target", help="a target checkpoint directory: its embedding and LM head")
    parser.add_argument("--chunk-rows", type=int, nargs="*", default=[], help="other LM-head loss chunk sizes")
    parser.add_argument("--profile", action="store_true", help="print the packed step's top operators")
    parser.add_argument("--flex-kernel-options", default='{"BLOCK_M": 64, "BLOCK_N": 64}',
                        help="JSON: FlexAttention kernel_options of the last CUDA variant")
    args = parser.parse_args()
    device = torch.device(args.device)
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
