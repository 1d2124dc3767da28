"""One training step's forward + backward: one pass per sequence (the trainer before packing) vs packed passes.

    python benchmarks/train_step_speed.py                      # CPU, fp32: 8 sequences of ~128 tokens, 8 anchors
    python benchmarks/train_step_speed.py --device cuda        # bf16 autocast, FlexAttention: the H200 shape of
                                                               # benchmarks/RESULTS.md (20 x ~410 tokens, 512 anchors)

A SmolLM2-shaped drafter (D 576, 5 layers, 9 heads x 64, 3 KV heads, FFN 1536, vocab 49152, B 16) with
random weights (or the target's embedding and LM head with ``--target DIR``), random features, response
masks and anchors drawn as in training. Both variants run the trainer's own code: ``accumulate_gradients``
with every sequence a pack alone (``pack_elements=0``: the per-sequence loop) and with the default caps.
Prints seconds per step (median of ``--repeats``, alternating) and the ratio; on CPU also the process's CPU
seconds (with OMP_NUM_THREADS=1, less disturbed by other work on shared cores than wall time).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from transformers import LlamaConfig

from dflash_pipeline.drafter import DFlashDrafter, load_target_embeddings
from dflash_pipeline.losses import default_gamma
from dflash_pipeline.train import TrainConfig, accumulate_gradients, micro_batches, prepare_sequence

SMOLLM2 = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
                      max_position_embeddings=8192, tie_word_embeddings=True)


def drafter_of_smollm2_shape(target: str | None, device, dtype) -> DFlashDrafter:
    if target:
        embed, lm_head = load_target_embeddings(target, dtype=dtype)
    else:
        weight = torch.randn(SMOLLM2.vocab_size, SMOLLM2.hidden_size, dtype=dtype) * 0.02
        embed = nn.Embedding(*weight.shape, _weight=weight, _freeze=True)
        lm_head = nn.Linear(SMOLLM2.hidden_size, SMOLLM2.vocab_size, bias=False)
        lm_head.weight = embed.weight
    torch.manual_seed(0)
    drafter = DFlashDrafter.from_target_config(SMOLLM2, mask_token_id=2, num_layers=5, block_size=16,
                                               embed_tokens=embed, lm_head=lm_head)
    return drafter.to(device=device, dtype=dtype).train()


def sequences(args, cfg: TrainConfig, device, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    K, D = 5, SMOLLM2.hidden_size
    out = []
    for i in range(args.sequences):
        T = int(args.length * (0.75 + 0.5 * torch.rand((), generator=g)))
        prompt = int(T * 0.3)  # a prompt without loss, then the response
        sample = (i, torch.randint(0, SMOLLM2.vocab_size, (T,), generator=g),
                  torch.cat([torch.zeros(prompt, dtype=torch.uint8), torch.ones(T - prompt, dtype=torch.uint8)]),
                  torch.randn(T, K, D, generator=g))
        out.append(prepare_sequence(sample, cfg, 2, default_gamma(cfg.block_size), (0, i), device, cfg.max_anchors))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sequences", type=int, help="sequences per step (cpu 8, cuda 20)")
    parser.add_argument("--length", type=int, help="mean tokens per sequence (cpu 128, cuda 410)")
    parser.add_argument("--max-anchors", type=int, help="anchors per sequence at most (cpu 8, cuda 512)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--target", help="a target checkpoint directory: its embedding and LM head")
    args = parser.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    args.sequences = args.sequences or (20 if cuda else 8)
    args.length = args.length or (410 if cuda else 128)
    args.max_anchors = args.max_anchors or (512 if cuda else 8)
    drafter = drafter_of_smollm2_shape(args.target, device, torch.bfloat16 if cuda else torch.float32)
    cfg = TrainConfig(block_size=16, max_anchors=args.max_anchors)
    seqs = sequences(args, cfg, device)
    total_weight = sum(s["weights"].sum().double() for s in seqs)
    packed = len(micro_batches(seqs, drafter.config.hidden_size))
    tokens = sum(s["context"].shape[1] for s in seqs)
    slots = sum(s["blocks"].numel() for s in seqs)
    print(f"{device}, threads {torch.get_num_threads()}: {len(seqs)} sequences, {tokens} tokens, {slots} block slots;"
          f" packed into {packed} pass(es)")

    def step(pack_elements=None):
        kwargs = {} if pack_elements is None else {"pack_elements": pack_elements}
        drafter.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        start, cpu = time.perf_counter(), time.process_time()
        loss = accumulate_gradients(drafter, seqs, total_weight, cuda, **kwargs)
        float(loss)  # waits for the step
        return time.perf_counter() - start, time.process_time() - cpu

    step(0), step()  # warm-up (and FlexAttention's compilation on CUDA)
    loop, pack = [], []
    for _ in range(args.repeats):
        loop.append(step(0))
        pack.append(step())
    (loop_s, loop_cpu), (pack_s, pack_cpu) = ([statistics.median(t) for t in zip(*runs)] for runs in (loop, pack))
    print(f"per-sequence loop: {loop_s:.3f} s/step ({tokens / loop_s:.0f} tokens/s); "
          f"packed: {pack_s:.3f} s/step ({tokens / pack_s:.0f} tokens/s); speed-up {loop_s / pack_s:.2f}x")
    for seed in (1, 2):  # other lengths, as every training step has: the first call pays any recompilation
        other = sequences(args, cfg, device, seed)
        weight = sum(s["weights"].sum().double() for s in other)
        drafter.zero_grad(set_to_none=True)
        start = time.perf_counter()
        float(accumulate_gradients(drafter, other, weight, cuda))
        print(f"packed, new lengths (seed {seed}): {time.perf_counter() - start:.3f} s/step first call")
    if cuda:
        print(f"peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB")
    if not cuda:  # CPU seconds of this process: less sensitive to other processes on shared cores
        print(f"process CPU time: loop {loop_cpu:.3f} s, packed {pack_cpu:.3f} s; ratio {loop_cpu / pack_cpu:.2f}x")


if __name__ == "__main__":
    main()
