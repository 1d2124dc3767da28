"""The drafter's FlexAttention alone, forward + backward, under other kernel options and mask tiles (issue #36).

On the GPU FlexAttention is 46 % of the SmolLM2 drafter's training step (journal, session 21): 45.5 K block-slot
queries (9 heads x 64) against their sequence's context and their own block. This times that call alone, on the
shapes of one training step of random data (``train_step_speed.py``'s step: ``pack_layouts`` over response masks,
up to ``--max-anchors`` anchors per sequence), with the library's own mask (``flex_block_mask``) and queries, keys and
values of the drafter's layout ([1, heads, n*B, hd] against [1, kv heads, T + n*B, hd], bf16). Each variant is
compiled as the library compiles FlexAttention (``torch.compile(flex_attention)``), with its ``kernel_options``, the
mask's ``tile`` or a compile ``mode``; its output and the gradients of q, k and v are checked against the default's
first, then timed: the median of ``--repeats`` CUDA-event timings of forward + backward, the variants interleaved.
A variant the kernel refuses (a tile it cannot take) is reported and skipped.

    python benchmarks/speed/flex_options_speed.py                            # the default variants, on the GPU
    python benchmarks/speed/flex_options_speed.py --variants '[{"name": "m64", "kernel_options": {"BLOCK_M": 64}}]'
    python benchmarks/speed/flex_options_speed.py --device cpu --sequences 2 --length 64 --max-anchors 4 --repeats 1
        # the CPU: forward only with the default options (FlexAttention has no backward there), checks the script
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import flex_attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for common.py
from common import SMOLLM2, step_packs  # noqa: E402
from dflash_pipeline.drafter import flex_block_mask

VARIANTS = [
    {"name": "default"},
    {"name": "forward tiles 64 x 64", "kernel_options": {"BLOCK_M": 64, "BLOCK_N": 64}},
    {"name": "forward tiles 128 x 128", "kernel_options": {"BLOCK_M": 128, "BLOCK_N": 128}},
    {"name": "forward 4 warps, 3 stages", "kernel_options": {"num_warps": 4, "num_stages": 3}},
    {"name": "backward tiles 64", "kernel_options": {"BLOCK_M1": 64, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 64}},
    {"name": "mask tile 64", "tile": 64},
    {"name": "max-autotune", "mode": "max-autotune-no-cudagraphs"},
]


def attention_inputs(args, device, dtype):
    """The first pack of one step: q [1, H, n*B, hd], k and v [1, Hkv, T + n*B, hd] (random), its anchors, context
    length and each block's sequence start, as ``DFlashDrafter.forward_blocks`` hands them to the mask."""
    pack = step_packs(args, device)[0]
    n, B = pack.blocks.shape
    T = pack.context.shape[1]
    heads, kv_heads = SMOLLM2.num_attention_heads, SMOLLM2.num_key_value_heads
    hd = SMOLLM2.hidden_size // heads
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(1, heads, n * B, hd, device=device, dtype=dtype, generator=g)
    k, v = (torch.randn(1, kv_heads, T + n * B, hd, device=device, dtype=dtype, generator=g) for _ in range(2))
    sizes = torch.tensor(pack.lengths, device=device)
    starts = (sizes.cumsum(0) - sizes).repeat_interleave(torch.tensor(pack.block_counts, device=device))
    return q, k, v, pack.anchors, T, B, starts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--sequences", type=int, default=10, help="sequences in the step (the recipe: ~10 x 410)")
    parser.add_argument("--length", type=int, default=410, help="mean tokens per sequence")
    parser.add_argument("--max-anchors", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--variants", help="a JSON list of {name, kernel_options, tile, mode} (default: VARIANTS)")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    q, k, v, anchors, T, B, starts = attention_inputs(args, device, torch.bfloat16 if cuda else torch.float32)
    variants = json.loads(args.variants) if args.variants else VARIANTS if cuda else VARIANTS[:1]
    print(f"{device}: q {tuple(q.shape)}, k/v {tuple(k.shape)}, {anchors.numel()} blocks over {T} context tokens")

    masks = {tile: flex_block_mask(anchors, T, B, "full_attention", None, starts, tile=tile)
             for tile in {variant.get("tile", 128) for variant in variants}}
    grad_out = torch.randn_like(q)
    compiled = {variant["name"]: torch.compile(flex_attention, mode=variant.get("mode")) for variant in variants}

    def run(variant, backward: bool):
        """One forward (+ backward) of a variant: (output, gradients of q, k, v)."""
        mask = masks[variant.get("tile", 128)]
        leaves = [t.detach().requires_grad_(backward) for t in (q, k, v)]
        out = compiled[variant["name"]](*leaves, block_mask=mask, scale=q.shape[-1] ** -0.5, enable_gqa=True,
                                        kernel_options=variant.get("kernel_options"))
        if backward:
            out.backward(grad_out)
        return out.detach(), [t.grad for t in leaves] if backward else []

    reference, usable = None, []
    for variant in variants:
        start = time.perf_counter()
        try:
            out, grads = run(variant, cuda)
        except Exception as error:  # a tile or option the kernel cannot take
            print(f"{variant['name']}: refused ({type(error).__name__}: {str(error).splitlines()[0][:160]})")
            continue
        compile_s = time.perf_counter() - start
        reference = reference or (out, grads)
        diffs = [float((a.float() - b.float()).abs().max() / b.float().abs().max())
                 for a, b in zip([out, *grads], [reference[0], *reference[1]])]
        print(f"{variant['name']}: first call {compile_s:.1f} s; max |diff| / max |default|: output {diffs[0]:.1e}"
              + "".join(f", d{name} {d:.1e}" for name, d in zip("qkv", diffs[1:])))
        usable.append(variant)
    times = {variant["name"]: [] for variant in usable}
    for _ in range(args.repeats):  # interleaved
        for variant in usable:
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                run(variant, True)
                end.record()
                end.synchronize()
                times[variant["name"]].append(begin.elapsed_time(end))
            else:
                start = time.perf_counter()
                run(variant, False)
                times[variant["name"]].append((time.perf_counter() - start) * 1e3)
    base = statistics.median(times[usable[0]["name"]])
    print(f"{'variant':28s} {'ms':>8s} {'x ' + usable[0]['name']:>12s}")
    for name, runs in times.items():
        ms = statistics.median(runs)
        print(f"{name:28s} {ms:8.2f} {base / ms:12.2f}")


if __name__ == "__main__":
    main()
