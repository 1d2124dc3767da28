"""The training step of the published Qwen3.6-27B drafter's shape on one GPU, one source tree against another (issue #35).

The drafter of ``config/examples/qwen3.6-27b.yaml`` (D 5120, 5 layers [sliding x 4, full], window 2048, 32 x 128
query heads, 8 KV heads, FFN 17408, K = 5 target layers, B = 16, vocab 248,320; 1.73 B trainable parameters) with
random weights, fed synthetic bf16 features and response masks, its packs made by the trainer's own
``pack_layouts``; the trainer's step: ``accumulate_gradients`` (bf16 autocast, ``compile_pointwise``, gradient
checkpointing as the example) then gradient clipping and the optimizers of ``make_optimizers`` (BatchedMuon on the
matrices, AdamW on the norms). For each ``--tokens`` (context tokens per GPU step; sequences of ``--length`` tokens
on average, up to ``--max-anchors`` anchors each): forward + backward seconds, optimizer seconds, tokens/s, model
FLOPs utilisation (forward + backward model FLOPs over ``--peak-tflops``; recomputation not counted) and peak memory.

Then, from the same tree, the optimizer's share of a step at ``--example-tokens`` per GPU (the example's 32,768 per
global batch over 8 GPUs = 4,096), on one GPU and by arithmetic for ``--ranks`` data-parallel ranks: the
optimizer's time less its Newton-Schulz part (every rank still does it), plus the Newton-Schulz time of the
busiest rank's share of the matrices (the tree's ``muon.shard_assignment``, measured on this GPU; a tree without it
repeats all of it on every rank), plus an all-gather of the bf16 updates at ``--allgather-gbps`` (an assumption, not
measured: one GPU here). And the example's batch by the formula of its TODO: the tokens per GPU at which that
optimizer time is 15 % of the step.

Each ``--tree NAME=SRC`` (a ``dflash_pipeline`` source directory, e.g. ``git archive main src | tar x -C /tmp/main``)
runs in its own process with ``PYTHONPATH=SRC``, one after the other, alone on the GPU:

    python benchmarks/speed/arch_step_speed.py --tree main=/tmp/main/src --tree arch=src
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time

OPTIMIZER_SHARE_GOAL = 0.15  # the optimizer under 15 % of the step
LAYER_TYPES = ["sliding_attention"] * 4 + ["full_attention"]
# the drafter's shape: the example's, or a tiny one that checks this script on the CPU (--smoke)
SHAPES = {"27b": dict(hidden=5120, vocab=248320, ffn=17408, heads=32, kv=8, head_dim=128, window=2048, mask=248070),
          "smoke": dict(hidden=128, vocab=1024, ffn=256, heads=4, kv=1, head_dim=16, window=64, mask=1000)}


def build(shape: dict, device):
    """The drafter (gradient checkpointing; its pointwise parts compiled on CUDA, as the trainer does) and its
    optimizers."""
    import torch
    from torch import nn
    from transformers import Qwen3Config

    from dflash_pipeline.drafter import DFlashDrafter
    from dflash_pipeline.train import TrainConfig, make_optimizers

    target = Qwen3Config(hidden_size=shape["hidden"], vocab_size=shape["vocab"], intermediate_size=shape["ffn"],
                         num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
                         rms_norm_eps=1e-6, max_position_embeddings=262144, rope_theta=1e7, tie_word_embeddings=False)
    with torch.device(device):
        embed = nn.Embedding(target.vocab_size, target.hidden_size, dtype=torch.bfloat16)
        lm_head = nn.Linear(target.hidden_size, target.vocab_size, bias=False, dtype=torch.bfloat16)
        torch.manual_seed(0)
        drafter = DFlashDrafter.from_target_config(
            target, mask_token_id=shape["mask"], num_layers=5, block_size=16,
            target_layer_ids=[1, 16, 31, 46, 61], head_dim=shape["head_dim"], num_attention_heads=shape["heads"],
            num_key_value_heads=shape["kv"], layer_types=LAYER_TYPES, sliding_window=shape["window"],
            embed_tokens=embed, lm_head=lm_head)
    drafter.gradient_checkpointing = True
    if device.type == "cuda":
        drafter.compile_pointwise()
    return drafter.train(), make_optimizers(TrainConfig(), drafter)


def step_packs(drafter, tokens: int, args, seed: int, device):
    """One GPU step of about ``tokens`` context tokens: sequences (a prompt without loss, a response) and their
    packs, as the trainer makes them."""
    import numpy as np
    import torch

    from dflash_pipeline.losses import default_gamma
    from dflash_pipeline.train_data import AnchorRule, Pack, pack_layouts

    D, V = drafter.config.hidden_size, drafter.config.vocab_size
    g = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(min(tokens - sum(lengths), max(64, args.length * g.uniform(0.75, 1.25)))))
    ids = g.integers(0, V, sum(lengths))
    mask = np.concatenate([np.r_[np.zeros(int(T * 0.2)), np.ones(T - int(T * 0.2))] for T in lengths]).astype(bool)
    rule = AnchorRule(16, default_gamma(16), args.max_anchors)
    features = torch.randn(sum(lengths), 5, D, generator=torch.Generator().manual_seed(seed)).to(device, torch.bfloat16)
    return [Pack.to_device(layout, features[rows], 5, drafter.mask_token_id, 16, device)
            for rows, layout in pack_layouts(ids, mask, np.array(lengths), np.arange(len(lengths)), rule, seed, D)]


def model_flops(config, packs) -> float:
    """Forward + backward model FLOPs of a step: the library's count of each sequence (``plan.drafter_step_flops``),
    the one ``dflash-pipeline plan`` divides by the utilisation measured here."""
    from dflash_pipeline.plan import drafter_step_flops

    return sum(drafter_step_flops(config, tokens, blocks, 5 * config.hidden_size)
               for pack in packs for tokens, blocks in zip(pack.lengths, pack.block_counts))


def timed(fn, device) -> float:
    import torch

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda device: None)
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def newton_schulz_seconds(matrices, owned, group, device, repeats: int) -> float:
    """Median time of the Newton-Schulz iterations of ``matrices[i]`` for i in ``owned``, batched by shape as
    BatchedMuon batches them."""
    import torch

    from dflash_pipeline.muon import newton_schulz

    by_shape: dict = {}
    for i in owned:
        by_shape.setdefault(tuple(matrices[i].shape), []).append(i)
    stacks = [torch.stack([matrices[i] for i in members]) for members in by_shape.values()]

    def run():
        for stack in stacks:
            newton_schulz(stack, group["ns_coefficients"], group["ns_steps"], group["eps"])

    run()
    return statistics.median(timed(run, device) for _ in range(repeats))


def worker(args) -> dict:
    import torch

    import dflash_pipeline.muon as muon
    from dflash_pipeline.train import accumulate_gradients

    device = torch.device("cpu" if args.smoke else "cuda")
    cuda = device.type == "cuda"
    began = time.perf_counter()
    drafter, optimizers = build(SHAPES["smoke" if args.smoke else "27b"], device)
    params = [p for p in drafter.parameters() if p.requires_grad]
    result = {"build_s": time.perf_counter() - began, "parameters": sum(p.numel() for p in params), "rows": []}
    for tokens in args.tokens:
        packs = step_packs(drafter, tokens, args, seed=tokens, device=device)
        weight = sum(p.weights.sum().double() for p in packs)
        flops = model_flops(drafter.config, packs)

        def forward_backward():
            for optimizer in optimizers:
                optimizer.zero_grad(set_to_none=True)
            accumulate_gradients(drafter, packs, weight, cuda)

        def optimizer_step():
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            for optimizer in optimizers:
                optimizer.step()

        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(args.warmup):  # compilation, allocator
            forward_backward()
            optimizer_step()
        fb, opt = [], []
        for _ in range(args.repeats):
            fb.append(timed(forward_backward, device))
            opt.append(timed(optimizer_step, device))
        fb_s, opt_s = statistics.median(fb), statistics.median(opt)
        result["rows"].append({
            "tokens": sum(p.context.shape[1] for p in packs), "blocks": sum(p.anchors.numel() for p in packs),
            "packs": len(packs), "fb_s": fb_s, "opt_s": opt_s, "step_s": fb_s + opt_s,
            "tokens_per_s": sum(p.context.shape[1] for p in packs) / (fb_s + opt_s),
            "fb_tokens_per_s": sum(p.context.shape[1] for p in packs) / fb_s,
            "mfu_fb": flops / fb_s / (args.peak_tflops * 1e12),
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else 0.0})
    muon_optimizer = next(o for o in optimizers if isinstance(o, muon.BatchedMuon))
    group = muon_optimizer.param_groups[0]
    matrices = [torch.randn(p.shape, device=device) for p in group["params"]]  # the values do not change the cost
    shapes = [tuple(m.shape) for m in matrices]
    everything = list(range(len(matrices)))
    result["ns_all_s"] = newton_schulz_seconds(matrices, everything, group, device, args.repeats)
    sharded = hasattr(muon, "shard_assignment")
    owners = muon.shard_assignment(shapes, args.ranks) if sharded else [0] * len(shapes)
    shares = [[i for i in everything if owners[i] == r] for r in range(args.ranks)]
    result["sharded"] = sharded
    result["ns_busiest_rank_s"] = max(newton_schulz_seconds(matrices, share, group, device, args.repeats)
                                      for share in shares if share)
    result["allgather_bytes"] = args.ranks * max(sum(math.prod(shapes[i]) for i in s) for s in shares) * 2 if sharded else 0
    return result


def report(name: str, result: dict, args) -> list[str]:
    rows = result["rows"]
    lines = [f"### {name}: {result['parameters'] / 1e9:.2f} B trainable parameters, built in {result['build_s']:.0f} s", "",
             "| tokens | blocks | packs | fwd+bwd s | optimizer s | step s | tokens/s | fwd+bwd MFU | optimizer share | peak GiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['blocks']} | {r['packs']} | {r['fb_s']:.3f} | {r['opt_s']:.3f} | "
                     f"{r['step_s']:.3f} | {r['tokens_per_s']:.0f} | {100 * r['mfu_fb']:.1f} % | "
                     f"{100 * r['opt_s'] / r['step_s']:.1f} % | {r['peak_gib']:.1f} |")
    opt_1 = statistics.median(r["opt_s"] for r in rows)
    rest = max(0.0, opt_1 - result["ns_all_s"])
    allgather = result["allgather_bytes"] * (args.ranks - 1) / args.ranks / (args.allgather_gbps * 1e9)
    opt_n = rest + result["ns_busiest_rank_s"] + allgather
    closest = min(rows, key=lambda r: abs(r["tokens"] - args.example_tokens))  # its fwd+bwd rate, at that size
    fb_rate = closest["fb_tokens_per_s"]
    fb_example = args.example_tokens / fb_rate
    need = opt_n * (1 - OPTIMIZER_SHARE_GOAL) / OPTIMIZER_SHARE_GOAL * fb_rate
    batch = args.ranks * math.ceil(need / 4096) * 4096
    lines += ["", f"- optimizer (clip + BatchedMuon + AdamW) {opt_1:.3f} s per step on one GPU, of it Newton-Schulz "
                  f"{result['ns_all_s']:.3f} s; the rest {rest:.3f} s",
              f"- {args.ranks} ranks ({'sharded: busiest rank' if result['sharded'] else 'not sharded: every rank all'}) "
              f"Newton-Schulz {result['ns_busiest_rank_s']:.3f} s + all-gather of "
              f"{result['allgather_bytes'] / 2**30:.2f} GiB at an assumed {args.allgather_gbps:.0f} GB/s {allgather:.3f} s "
              f"-> optimizer {opt_n:.3f} s per step",
              f"- at the example's {args.example_tokens} tokens per GPU (fwd+bwd {fb_example:.3f} s at "
              f"{fb_rate:.0f} tokens/s): optimizer share {100 * opt_1 / (opt_1 + fb_example):.1f} % on one GPU, "
              f"{100 * opt_n / (opt_n + fb_example):.1f} % per rank with {args.ranks} ranks",
              f"- the example's batch by its formula (optimizer <= {100 * OPTIMIZER_SHARE_GOAL:.0f} % of the step on "
              f"{args.ranks} ranks): >= {need:.0f} tokens per GPU -> tokens_per_batch {batch}", ""]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", metavar="NAME=SRC", help="a source tree to measure (repeatable)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[4096, 8192], help="context tokens per GPU step")
    parser.add_argument("--length", type=int, default=1536, help="mean tokens per sequence")
    parser.add_argument("--max-anchors", type=int, default=512)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 dense peak (H200 SXM: 989)")
    parser.add_argument("--example-tokens", type=int, default=4096, help="the example's tokens per GPU step")
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--allgather-gbps", type=float, default=300.0,
                        help="assumed all-gather bus bandwidth between the ranks' GPUs (NVLink)")
    parser.add_argument("--smoke", action="store_true", help="a tiny drafter on the CPU: checks this script")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print("RESULT " + json.dumps(worker(args)), flush=True)
        return
    forwarded = ["--tokens", *map(str, args.tokens)] + [
        f"--{name.replace('_', '-')}={getattr(args, name)}" for name in (
            "length", "max_anchors", "warmup", "repeats", "peak_tflops", "example_tokens", "ranks", "allgather_gbps")]
    forwarded += ["--smoke"] if args.smoke else []
    for tree in args.tree or [f"current={os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}/src"]:
        name, src = tree.split("=", 1)
        path = os.pathsep.join(filter(None, [os.path.abspath(src), os.environ.get("PYTHONPATH")]))  # the tree first
        env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "8")}
        out = subprocess.run([sys.executable, __file__, "--worker", *forwarded], env=env, capture_output=True, text=True)
        line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
        if out.returncode or line is None:
            print(f"### {name}: failed (exit {out.returncode})\n{out.stderr[-3000:]}", flush=True)
            continue
        print("\n".join(report(name, json.loads(line[len("RESULT "):]), args)), flush=True)


if __name__ == "__main__":
    main()
