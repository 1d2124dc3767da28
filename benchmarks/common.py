"""What the benchmarks share. They run as scripts (``python benchmarks/speed/<name>.py``) and import this as
``common`` after putting ``benchmarks/`` on ``sys.path``. Everything else they need comes from the library's public
surface, its config loader included (``dflash_pipeline.config.load_config``); ``tests/test_benchmarks.py`` checks
that none of them imports a private name, patches the library or imports another benchmark."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig

from dflash_pipeline.drafter import DFlashDrafter, load_target_embeddings
from dflash_pipeline.losses import acceptance_proxy, default_gamma, make_block_token_ids
from dflash_pipeline.train_data import PACK_ELEMENTS, AnchorRule, Pack, pack_layouts


class Report:
    """Lines printed and appended to a report file (if any) as they come, so that a killed run keeps what it had."""

    def __init__(self, path: str | Path | None):
        self.path = Path(path) if path else None
        if self.path:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text("")

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        if self.path:
            with open(self.path, "a", encoding="utf-8") as handle:
                handle.write(line + "\n")


def read_timing(run_dir: str | Path) -> dict:
    """The train job's ``timing.json`` under ``run_dir`` (results/train/timing.json of a workflow run, or the file
    ``train(timing_json=...)`` wrote)."""
    path = Path(run_dir)
    for candidate in (path, path / "timing.json", path / "results" / "train" / "timing.json"):
        if candidate.is_file():
            return json.loads(candidate.read_text())
    raise FileNotFoundError(f"no timing.json in {run_dir}")


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two answers differ (a length difference counts); None if identical."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


# ---- a Qwen3.5-27B-shaped hybrid target (random weights) ----
def add_hybrid_shape_arguments(parser) -> None:
    """The model-shape options of ``hybrid_config`` (defaults: Qwen3.5-27B)."""
    shape = parser.add_argument_group("model shape (defaults: Qwen3.5-27B)")
    shape.add_argument("--layers", type=int, default=64)
    shape.add_argument("--hidden", type=int, default=5120)
    shape.add_argument("--intermediate", type=int, default=17408)
    shape.add_argument("--vocab", type=int, default=248320)
    shape.add_argument("--heads", type=int, default=24)
    shape.add_argument("--kv-heads", type=int, default=4)
    shape.add_argument("--head-dim", type=int, default=256)
    shape.add_argument("--linear-k-heads", type=int, default=16)
    shape.add_argument("--linear-v-heads", type=int, default=48)
    shape.add_argument("--linear-k-dim", type=int, default=128)
    shape.add_argument("--linear-v-dim", type=int, default=128)
    shape.add_argument("--conv", type=int, default=4)
    shape.add_argument("--max-length", type=int, default=2048, help="longest sample (tokens)")


def hybrid_config(args):
    """The ``Qwen3_5TextConfig`` of the model shape in ``args`` (``add_hybrid_shape_arguments``)."""
    from transformers import Qwen3_5TextConfig

    rotary = int(args.head_dim * 0.25) // 2  # frequencies of the 25 % rotary part, split over (t, h, w)
    first = -(-rotary // 3)
    section = [first, (rotary - first + 1) // 2, (rotary - first) // 2]  # 27B: [11, 11, 10]
    return Qwen3_5TextConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        layer_types=[("linear_attention", "linear_attention", "linear_attention", "full_attention")[i % 4]
                     for i in range(args.layers)],
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.head_dim,
        linear_conv_kernel_dim=args.conv, linear_key_head_dim=args.linear_k_dim,
        linear_value_head_dim=args.linear_v_dim, linear_num_key_heads=args.linear_k_heads,
        linear_num_value_heads=args.linear_v_heads, max_position_embeddings=max(32768, args.max_length),
        initializer_range=0.02, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                         "mrope_interleaved": True, "mrope_section": section},
    )


# ---- teacher-forced acceptance of fixed responses (recipe_study.py, teacher_forced_tau.py) ----
@torch.no_grad()
def teacher_forced_matches(drafter, features: torch.Tensor, ids: torch.Tensor, prompt_len: int,
                           chunk: int = 256) -> list[int]:
    """Leading drafts equal to the response for a block anchored at each response position but the last, all in a
    few ``forward_blocks`` passes: ``ids`` [T] = prompt + a fixed response, ``features`` [1, T, K*D] their target
    features (as speculative decoding captures them, ``TargetSession``)."""
    T, B = ids.shape[0], drafter.block_size
    matches = []
    for start in range(prompt_len, T - 1, chunk):
        anchors = torch.arange(start, min(start + chunk, T - 1), device=ids.device)
        blocks = make_block_token_ids(ids, anchors, B, drafter.mask_token_id)
        hidden = drafter.forward_blocks(features, anchors, blocks, attn_impl="sdpa")  # the exact dense mask
        drafts = drafter.logits(hidden).argmax(-1)[:, 1:]
        positions = anchors[:, None] + torch.arange(1, B, device=ids.device)
        correct = (drafts == ids[positions.clamp(max=T - 1)]) & (positions < T)
        matches += (acceptance_proxy(correct) - 1).tolist()
    return matches


def replayed_tau(matches: list[int]) -> tuple[int, int]:
    """(committed tokens, verify steps) of the greedy speculative loop replayed over ``teacher_forced_matches``
    (index 0 = the first response token, the prefill's, which no verify step commits, as ``Generation.tau``): a
    block that matches k drafts commits k + 1 tokens and the next anchor is k + 1 further. Greedy decoding is
    lossless, so this is the tau speculative decoding measures, up to numerics (incremental vs one-pass features)."""
    position, steps = 0, 0
    while position < len(matches):
        position += matches[position] + 1
        steps += 1
    return len(matches), steps


# The SmolLM2-shaped drafter and a training step of random data (train_step_speed.py, flex_options_speed.py).
SMOLLM2 = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
                      max_position_embeddings=8192, tie_word_embeddings=True)


def drafter_of_smollm2_shape(target: str | None, device, dtype, architecture: dict | None = None) -> DFlashDrafter:
    """``architecture``: the drafter-shaping train keys (``architecture_kwargs`` of a ``TrainConfig``); None: a
    DFlash drafter of 5 layers, B 16. The same seed, so the same random weights, for every call."""
    torch.manual_seed(0)
    if target:
        embed, lm_head = load_target_embeddings(target, dtype=dtype)
    else:
        weight = torch.randn(SMOLLM2.vocab_size, SMOLLM2.hidden_size, dtype=dtype) * 0.02
        embed = nn.Embedding(*weight.shape, _weight=weight, _freeze=True)
        lm_head = nn.Linear(SMOLLM2.hidden_size, SMOLLM2.vocab_size, bias=False)
        lm_head.weight = embed.weight
    torch.manual_seed(0)
    drafter = DFlashDrafter.from_target_config(SMOLLM2, mask_token_id=2, embed_tokens=embed, lm_head=lm_head,
                                               **(architecture or dict(num_layers=5, block_size=16)))
    return drafter.to(device=device, dtype=dtype).train()


def step_packs(args, device, seed: int = 0, pack_elements: int = PACK_ELEMENTS) -> list[Pack]:
    """One step of ``args.sequences`` random samples (a prompt without loss, then a response), their anchors and
    packs made as in training (``pack_layouts``); ``pack_elements=0``: every sequence a pass alone."""
    g = torch.Generator().manual_seed(seed)
    K, D = 5, SMOLLM2.hidden_size
    lengths = [int(args.length * (0.75 + 0.5 * torch.rand((), generator=g))) for _ in range(args.sequences)]
    ids = torch.randint(0, SMOLLM2.vocab_size, (sum(lengths),), generator=g).numpy()
    mask = torch.cat([torch.cat([torch.zeros(int(T * 0.3)), torch.ones(T - int(T * 0.3))]) for T in lengths])
    features = torch.randn(sum(lengths), K, D, generator=g)
    rule = AnchorRule(16, default_gamma(16), args.max_anchors)
    return [Pack.to_device(layout, features[rows], K, 2, 16, device)
            for rows, layout in pack_layouts(ids, mask.bool().numpy(), lengths, range(len(lengths)), rule, seed, D,
                                             pack_elements)]
