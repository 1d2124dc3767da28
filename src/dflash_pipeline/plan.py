"""The capacity plan (issue #34): what a run will need before the GPUs start.

From the workflow config, the conversations (counted and a sample tokenised, or given as counts) and the target's
shape: conversations and tokens; bytes per token and store size per store setting; extraction GPU-hours; training
GPU-hours; training's peak GPU memory and host RAM; and whether the store fits preloaded on the GPUs, in RAM (the
page cache serves the streamed reads), on the node's disks, or none of them.

Every rate is a named ``Rate`` with the measurement it comes from; a target without a measured extraction rate gets
none (``--extract-rate`` gives one). Training time per optimiser step is a step measured at the drafter's shape
(``TRAIN_STEPS``, scaled by the tokens per step) where there is one, else ``drafter_step_flops`` of the rank's
sequences / (``TRAIN_MFU`` x ``GPU_PEAK``) + ``optimizer_seconds`` (the 27B-shape measurement scaled by the
drafter's parameter count; Muon's Newton-Schulz sharded over the ranks). ``TRAIN_MFU`` is the measured step's
utilisation by ``drafter_step_flops`` itself, which benchmarks/speed/arch_step_speed.py counts its FLOPs with: one count.
The peak memory estimate is calibrated on the same measured step (``LOSS_BYTES_PER_LOGIT``).
"""

from __future__ import annotations

import dataclasses
import math
import random
from pathlib import Path

GIB, TB = 2**30, 1e12


@dataclasses.dataclass(frozen=True)
class Rate:
    value: float
    source: str


GPU_PEAK = Rate(989e12, "H200 SXM dense bf16 peak (NVIDIA datasheet)")
GPU_MEMORY = Rate(141e9, "H200: 141 GB")
# The 27B-shape drafter's step on one H200 (issue #35, 2026-12-03; benchmarks/journal/2026-12-04_results.md, "The published 27B
# drafter's training step"; benchmarks/logs/arch_step_2026-12-03/arch_step_speed.md, tree "merged"): 4,096 context
# tokens in 3 sequences of 512 anchors, forward + backward 0.812 s, optimizer 0.354 s, peak 40.5 GiB.
TRAIN_MFU = Rate(0.45, "issue #35's 27B-shape step on one H200 (2026-12-03, arch_step_2026-12-03): forward + backward "
                       "0.812 s for 360.6 TFLOPs by plan.drafter_step_flops, 44.9 % of the bf16 peak")
OPTIMIZER_S = Rate(0.354, "the same step: clip + BatchedMuon + AdamW over the 1.73 B parameters, 0.354 s on one H200, "
                          "0.317 s of it Muon's Newton-Schulz, which the ranks share (muon.shard_assignment)")
NEWTON_SCHULZ_S = 0.317  # of OPTIMIZER_S
OPTIMIZER_PARAMS = 1.73e9  # the drafter OPTIMIZER_S was measured on
ALLGATHER = Rate(300e9, "the all-gather of the bf16 Muon updates at 300 GB/s (assumed, as benchmarks/"
                        "arch_step_speed.py: 0.089 s per rank and step at 8 ranks for the 27B shape)")
MEASURED_PEAK = Rate(40.5 * 2**30, "the same step's peak GPU memory (gradient checkpointing, 3 x 1,365 tokens x 512 "
                                   "anchors): 40.5 GiB (39.1 before the sharded Muon)")
# Bytes per logit of the loss's 4,096-row chunk at the peak: bf16 logits, their float32 copy, exp, one-hot label and
# gradient, the bf16 gradient (~22 B); fitted so that train_memory of the measured step is MEASURED_PEAK (21.0 B).
LOSS_BYTES_PER_LOGIT = 21.0
HOST_MEMORY = Rate(2048 * GIB, "DGX H200 node: 2 TB")
NODE_DISK = Rate(30.7e12, "DGX H200 node: 8 x 3.84 TB NVMe")
# Extraction tokens/s of one GPU, per target shape (model family, hidden size, layers) and store setting
# ("compact" stores write fewer bytes than fp8 and add one K*D x r product per token: taken as fp8's rate).
EXTRACT_RATES = {
    ("qwen3_5", 5120, 64): {
        "bfloat16": Rate(8541, "benchmarks/journal/2026-11-30_s07.md, 'Extraction with FLA kernels and early "
                               "flushing on one H200', run B: pipeline +fla, bf16, early flush"),
        "fp8_e4m3": Rate(10233, "the same run B: pipeline +fla, fp8, early flush"),
    },
    ("llama", 576, 30): {
        "bfloat16": Rate(54000, "benchmarks/journal/2026-11-30.md, 'The quality run on one H200': extract 52-56k "
                               "tok/s (bf16)"),
        "fp8_e4m3": Rate(57500, "the same section, the fp8 twin: 56-59k tok/s"),
    },
}
# Measured training steps at a drafter shape (target family, hidden size, layers): (seconds per optimiser step, tokens
# per step on one GPU). Where one exists the plan scales it by the tokens per step instead of the FLOPs model: a small
# drafter's step is bound by the host's launches, not by FLOPs (SmolLM2: the model says 0.02 s).
TRAIN_STEPS = {
    ("llama", 576, 30): (Rate(0.067, "benchmarks/journal/2026-12-02_s14.md: the SmolLM2 recipe's train job on one "
                                     "H200, 0.067 s per Muon step of 4,096 tokens"), 4096),
}
PRELOAD_SHARE = 0.5  # train_data.fits_in_memory: the store is preloaded when it takes under half the free memory


@dataclasses.dataclass(frozen=True)
class Workload:
    conversations: int
    tokens_per_conversation: float  # after truncation to tokenize.max_length
    response_share: float  # share of tokens that can anchor a block (a response token followed by one)
    source: str

    @property
    def tokens(self) -> int:
        return round(self.conversations * self.tokens_per_conversation)


@dataclasses.dataclass(frozen=True)
class StoreSetting:
    name: str
    stored: float  # bytes per token on disk before compression: features (+ scales), ids and loss mask
    preloaded: float  # bytes per token of the features as the trainer holds them (bf16 decoded, or fp8 as stored)
    rate: str  # the EXTRACT_RATES key it is extracted at


def load_config(configfiles: list[str], workflow_dir: str | Path | None = None) -> dict:
    """config/config.yaml of the workflow directory (default: this package's checkout) with ``configfiles`` (paths
    of config files) merged over it in order (as Snakemake's --configfile), defaults from config/schema.yaml."""
    from .config import SCHEMA
    from .config import load_config as merged_config

    root = Path(workflow_dir) if workflow_dir else SCHEMA.parents[1]
    for path in configfiles:
        if not Path(path).is_file():
            raise FileNotFoundError(f"--configfile {path}: not a config file (a YAML file of config keys, as "
                                    f"snakemake --configfile takes)")
    return merged_config([root / "config" / "config.yaml", *configfiles], schema=root / "config" / "schema.yaml")


def workload_from_file(source: str, config: dict, tokenizer, sample: int = 1000, seed: int = 0) -> Workload:
    """Count the conversations ``prepare`` keeps (and its ``max_conversations`` subset), tokenise a seeded sample of
    them as ``tokenize`` does (truncated to ``tokenize.max_length``) and measure tokens and anchor-eligible share."""
    import numpy as np

    from .prepare import read_conversations, select_subset
    from .tokenization import tokenize_conversation

    records, _ = read_conversations(source)
    records = select_subset(records, config["data"]["max_conversations"], config["data"]["seed"])
    picked = random.Random(seed).sample(records, min(sample, len(records)))
    tokens = eligible = 0
    for record in picked:
        ids, mask = tokenize_conversation(tokenizer, record["messages"])
        mask = mask[: config["tokenize"]["max_length"]].astype(bool)
        tokens += len(mask)
        eligible += int((mask[:-1] & mask[1:]).sum())
    return Workload(len(records), tokens / len(picked), eligible / max(tokens, 1),
                    f"{source}: {len(records):,} conversations, {len(picked):,} of them tokenised")


def store_settings(num_layers: int, hidden: int, compact_ranks: list[int]) -> list[StoreSetting]:
    """bf16, fp8 (a float32 scale per token and layer; held as stored, decoded per step) and compact stores of each
    rank (fp8 coefficients and a float32 scale per token; held as bf16 coefficients). 5 bytes per token of input_ids
    and loss_mask."""
    K, D, tokens = num_layers, hidden, 5
    settings = [StoreSetting("bf16", 2 * K * D + tokens, 2 * K * D, "bfloat16"),
                StoreSetting("fp8 e4m3", K * D + 4 * K + tokens, K * D + 4 * K, "fp8_e4m3")]
    settings += [StoreSetting(f"compact rank {r} (fp8)", r + 4 + tokens, 2 * r, "fp8_e4m3") for r in compact_ranks]
    return settings


def drafter_flops(drafter_config, tokens: float, anchors: float, num_features: int) -> dict[str, float]:
    """Model FLOPs of forward + backward of one sequence of ``tokens`` context tokens and ``anchors`` blocks, by part:
    matmuls only, backward 2x forward for the trained layers, 1x for ``fc`` (its input needs no gradient) and for
    the frozen LM head (only its input's gradient); ``attention``: scores and values over the keys each query sees,
    on average the context before a mid-sequence anchor (or the window) plus its block; the LM head on the B - 1
    predicted slots of every block. ``num_features``: fc's input width (K * D, or the compact rank). DFlash2: the
    convolutions' projections in ``layers`` (their taps are elementwise), and ``selector``: the hidden projection and
    the K bilinear scores of every predicted slot (its logits are the LM head's)."""
    c = drafter_config
    D, I, B, L = c.hidden_size, c.intermediate_size, c.block_size, c.num_hidden_layers
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    slots = anchors * B
    seen = [tokens / 2 if t == "full_attention" else min(tokens / 2, c.sliding_window) for t in c.layer_types]
    dflash2 = c.architecture == "dflash2"
    conv = 2 * D * 2 * c.conv_kernel_size * (D // c.conv_group_size) if dflash2 else 0
    return {"fc": 2 * 2 * tokens * num_features * D,
            "layers": 3 * L * (2 * tokens * D * 2 * kv + 2 * slots * (D * (2 * q + 2 * kv) + 3 * D * I + conv)),
            "attention": 3 * sum(2 * 2 * slots * q * (keys + B) for keys in seen),
            "lm_head": 2 * 2 * anchors * (B - 1) * D * c.vocab_size,
            "selector": 3 * 2 * anchors * (B - 1) * (D + c.selector_top_k) * c.selector_rank if dflash2 else 0}


def drafter_step_flops(drafter_config, tokens: float, anchors: float, num_features: int) -> float:
    """``drafter_flops``' parts together."""
    return sum(drafter_flops(drafter_config, tokens, anchors, num_features).values())


def drafter_parameters(drafter_config, num_features: int) -> int:
    """Trained parameters. DFlash2 adds per layer two convolutions (a base kernel 2 x K x D and a projection D ->
    2 K D / G) and the selector: two codebooks of vocabulary x r (~127 M for Qwen3.6's 248,320 tokens at r 256) and
    a D -> r projection."""
    c = drafter_config
    D, q, kv = c.hidden_size, c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    layer = D * (2 * q + 2 * kv) + 3 * D * c.intermediate_size + 2 * D + 2 * c.head_dim
    if c.architecture == "dflash2":
        layer += 2 * (2 * c.conv_kernel_size * D + D * 2 * c.conv_kernel_size * (D // c.conv_group_size))
    return c.num_hidden_layers * layer + num_features * D + 2 * D + selector_parameters(c)


def selector_parameters(drafter_config) -> int:
    """A DFlash2 selector's codebooks and hidden projection (0 for DFlash)."""
    c = drafter_config
    return 0 if c.architecture != "dflash2" else (2 * c.vocab_size + c.hidden_size) * c.selector_rank


def optimizer_seconds(parameters: float, ranks: int) -> float:
    """One rank's optimizer time per step: ``OPTIMIZER_S`` scaled by the parameters, its Newton-Schulz part divided
    among the ranks, plus the all-gather of the others' bf16 updates."""
    one = OPTIMIZER_S.value * parameters / OPTIMIZER_PARAMS
    sharded = one * NEWTON_SCHULZ_S / OPTIMIZER_S.value
    gather = 2 * parameters * (ranks - 1) / ranks / ALLGATHER.value
    return one - sharded + sharded / ranks + gather


def train_memory(drafter_config, train: dict, num_features: int, seq_tokens: float, anchors: float,
                 tied: bool) -> float:
    """Peak GPU bytes of one rank (an estimate; the trainer logs the measured peak): bf16 weights, gradients and Muon
    momenta (6 B per parameter); the target's frozen bf16 embedding and LM head; the activations of one packed pass
    of the rank's share of a step (bf16; per block slot and layer ~6 D + 4 I values, per context token and layer
    4 KV widths; only the layers' inputs with gradient checkpointing, plus one layer recomputed); the LM-head loss's
    4,096-row chunk (losses.LOSS_CHUNK_ROWS) at ``LOSS_BYTES_PER_LOGIT``, calibrated on ``MEASURED_PEAK``; a DFlash2
    selector's fp32 gradient accumulators of the loss (``_FusedLinearCrossEntropy``: its codebooks' and projection's,
    dense)."""
    from .losses import LOSS_CHUNK_ROWS

    c = drafter_config
    D, I, L = c.hidden_size, c.intermediate_size, c.num_hidden_layers
    kv = c.num_key_value_heads * c.head_dim
    sequences = max(1.0, train["tokens_per_batch"] / max(1, train["gpus"]) / seq_tokens)
    slots, ctx = sequences * anchors * c.block_size, sequences * seq_tokens
    per_layer = 2 * (slots * (6 * D + 4 * I) + ctx * 4 * kv)
    layers = (2 * (slots + ctx) * D * L + per_layer) if train["gradient_checkpointing"] else per_layer * L
    activations = layers + 2 * ctx * (num_features + D)
    embeddings = (1 if tied else 2) * 2 * c.vocab_size * D
    loss = LOSS_BYTES_PER_LOGIT * LOSS_CHUNK_ROWS * c.vocab_size
    return 6 * drafter_parameters(c, num_features) + embeddings + activations + loss + 4 * selector_parameters(c)


def host_memory(train: dict, target_text, tokens: int, step_bytes: float, preloaded: bool) -> float:
    """Host bytes of one training rank (an estimate): ~3 GiB for the process (torch, CUDA context); the target's
    embedding and LM head read on the host (bf16) before they move to the GPU; the store's token arrays (preloaded:
    int64 ids and bool mask, 9 B per token; streamed: the loss mask, 1 B); streamed, the loader workers (~1.5 GiB each)
    and the decoded steps in flight (num_workers x prefetch_factor + 2)."""
    heads = 1 if getattr(target_text, "tie_word_embeddings", False) else 2
    memory = 3 * GIB + heads * 2 * target_text.vocab_size * target_text.hidden_size
    if preloaded:
        return memory + 9 * tokens
    workers = train["num_workers"]
    return memory + tokens + workers * 1.5 * GIB + (workers * train["prefetch_factor"] + 2) * step_bytes


def make_plan(config: dict, workload: Workload, target_config, *, compact_ranks: list[int] | None = None,
              extract_rate: Rate | None = None, gpus: int = 8) -> dict:
    """Every figure of the plan (see the module docstring); ``format_plan`` prints it. ``compact_ranks``: the compact
    settings to plan (default: ``compact.default_rank``, 1/3 of K * D, and 1/5 of it: about 6x and 10x fewer bytes
    than bf16); ``gpus``: the GPUs extraction runs on at once."""
    from .store.compact import default_rank
    from .drafter import architecture_kwargs, dflash_config_from_target
    from .target import resolve_layer_ids, text_config

    text = text_config(target_config)
    layer_ids = resolve_layer_ids(config["extract"]["layer_ids"], config["extract"]["num_layers"],
                                  text.num_hidden_layers)
    K, D, train = len(layer_ids), text.hidden_size, config["train"]
    drafter = dflash_config_from_target(target_config, mask_token_id=0, target_layer_ids=layer_ids,
                                        **architecture_kwargs(train))
    ranks = compact_ranks if compact_ranks is not None else [default_rank(K, D), default_rank(K, D, 1 / 5)]
    shape = (text.model_type.removesuffix("_text"), D, text.num_hidden_layers)
    measured = EXTRACT_RATES.get(shape, {})
    measured_step = TRAIN_STEPS.get(shape) if drafter.architecture == "dflash" else None  # measured: DFlash steps
    tokens, per_conversation = workload.tokens, workload.tokens_per_conversation
    train_gpus = max(1, train["gpus"])
    eligible = workload.response_share * per_conversation
    anchors = min(train["max_anchors"], math.ceil(eligible))
    train_tokens = tokens * (1 - train["val_fraction"]) * train["epochs"]
    steps = math.ceil(train_tokens / train["tokens_per_batch"])
    if train["steps"] is not None:  # a fixed step count: its batches hold up to tokens_per_batch tokens each
        steps = train["steps"]
        train_tokens = steps * train["tokens_per_batch"]
    sequences = train["tokens_per_batch"] / train_gpus / per_conversation  # per rank and step
    stores = []
    for setting, features in zip(store_settings(K, D, ranks), [K * D, K * D, *ranks]):
        rate = extract_rate or measured.get(setting.rate)
        flops = sequences * drafter_step_flops(drafter, per_conversation, anchors, features)
        optimizer = optimizer_seconds(drafter_parameters(drafter, features), train_gpus)
        step_s = flops / (TRAIN_MFU.value * GPU_PEAK.value) + optimizer
        if measured_step is not None:
            step_s = measured_step[0].value * train["tokens_per_batch"] / train_gpus / measured_step[1]
        peak = train_memory(drafter, train, features, per_conversation, anchors,
                            bool(getattr(text, "tie_word_embeddings", False)))
        preloaded, stored = setting.preloaded * tokens, setting.stored * tokens
        preload = preloaded < PRELOAD_SHARE * GPU_MEMORY.value and preloaded + peak < GPU_MEMORY.value
        step_bytes = setting.preloaded * train["tokens_per_batch"] / train_gpus
        stores.append({
            "setting": setting.name, "bytes_per_token": setting.stored, "store_bytes": stored, "extract_rate": rate,
            "extract_gpu_h": tokens / rate.value / 3600 if rate else None,
            "extract_h": tokens / rate.value / 3600 / gpus if rate else None,
            "step_s": step_s, "optimizer_share": None if measured_step else optimizer / step_s,
            "step_rate": measured_step[0] if measured_step else None, "train_h": steps * step_s / 3600,
            "train_gpu_h": steps * step_s * train_gpus / 3600, "peak_gpu_bytes": peak, "preloaded_bytes": preloaded,
            "host_bytes_per_rank": host_memory(train, text, tokens, step_bytes, preload),
            "fits": ("preloaded on each GPU" if preload
                     else "in RAM (streamed from the page cache)" if stored < 0.8 * HOST_MEMORY.value
                     else "streamed from the node's disks" if stored < NODE_DISK.value
                     else "on no disk of one node: object storage or several nodes"),
        })
    return {"workload": workload, "tokens": tokens, "layers": K, "hidden": D, "drafter": drafter, "anchors": anchors,
            "train_tokens": train_tokens, "steps": steps, "gpus": gpus, "train_gpus": train_gpus, "stores": stores}


def format_plan(plan: dict) -> str:
    """The plan as Markdown: a few lines of totals, one table row per store setting, the sources of every rate."""
    w, train_gpus = plan["workload"], plan["train_gpus"]
    lines = ["# Capacity plan", "",
             f"- conversations: {w.conversations:,} ({w.source}); {w.tokens_per_conversation:,.0f} tokens per "
             f"conversation, {w.response_share:.0%} of them can anchor a block",
             f"- tokens: {plan['tokens']:,}; features: {plan['layers']} layers x {plan['hidden']:,}",
             f"- training: {plan['steps']:,} steps, {plan['train_tokens'] / 1e9:.3g} B trained tokens, "
             f"{plan['anchors']} anchors per conversation, {train_gpus} GPU(s); extraction on {plan['gpus']} GPU(s)",
             _drafter_line(plan["drafter"], plan["layers"] * plan["hidden"]),
             "", "| store | B/token | store TB | extract GPU-h | extract h | train s/step (optimizer) | train GPU-h | "
             "train h | peak GPU GiB | host RAM GiB per rank | fits |", "|" + "---|" * 11]
    for s in plan["stores"]:
        extract = f"{s['extract_gpu_h']:,.3g} | {s['extract_h']:,.3g}" if s["extract_rate"] else "not measured | –"
        share = "measured" if s["optimizer_share"] is None else f"{s['optimizer_share']:.0%}"
        lines.append(f"| {s['setting']} | {s['bytes_per_token']:,.0f} | {s['store_bytes'] / TB:,.3g} | {extract} | "
                     f"{s['step_s']:.3g} ({share}) | {s['train_gpu_h']:,.3g} | {s['train_h']:,.3g} | "
                     f"{s['peak_gpu_bytes'] / GIB:,.1f} | {s['host_bytes_per_rank'] / GIB:,.1f} | {s['fits']} |")
    lines += ["", "Sources and assumptions:"]
    rates = {s[key] for s in plan["stores"] for key in ("extract_rate", "step_rate") if s[key]}
    for rate in [*sorted(rates, key=lambda r: r.value), GPU_PEAK, TRAIN_MFU, OPTIMIZER_S, ALLGATHER, MEASURED_PEAK,
                 GPU_MEMORY, HOST_MEMORY, NODE_DISK]:
        value = f"{rate.value:,.0f}" if 1 <= rate.value < 1e6 else f"{rate.value:.3g}"
        lines.append(f"- {value}: {rate.source}")
    lines.append("- compact stores are extracted at the fp8 store's rate (fewer bytes written; the encode adds one "
                 "K*D x r product per token); store sizes are before compression")
    return "\n".join(lines) + "\n"


def _drafter_line(drafter, num_features: int) -> str:
    parameters = drafter_parameters(drafter, num_features)
    line = f"- drafter: {drafter.architecture}, {parameters / 1e6:,.0f} M trained parameters"
    if drafter.architecture == "dflash2":
        line += f" ({selector_parameters(drafter) / 1e6:,.0f} M of them the selector's codebooks and projection)"
    return line


def plan_rows(plan: dict) -> list[dict]:
    """The plan's table, one row per store setting with the workload's totals (the report's TSV)."""
    w = plan["workload"]
    return [{"store": s["setting"], "conversations": w.conversations, "tokens": plan["tokens"],
             "bytes_per_token": s["bytes_per_token"], "store_TB": s["store_bytes"] / TB,
             "extract_GPU_hours": s["extract_gpu_h"], "train_steps": plan["steps"], "train_s_per_step": s["step_s"],
             "train_GPU_hours": s["train_gpu_h"], "peak_GPU_GiB": s["peak_gpu_bytes"] / GIB,
             "host_RAM_GiB_per_rank": s["host_bytes_per_rank"] / GIB, "fits": s["fits"]} for s in plan["stores"]]


def run_plan(conversations: str, target: str, config: dict, out_md: str, out_tsv: str) -> dict:
    """The ``plan`` job: the prepared conversations (a tokenised sample) and the target's config -> the plan as
    Markdown and as a TSV, each atomically."""
    import pandas as pd
    from transformers import AutoConfig

    from .atomic import atomic_path
    from .target import _gguf_args, load_tokenizer

    location, extra = _gguf_args(target)
    target_config = AutoConfig.from_pretrained(location, trust_remote_code=config["target"]["trust_remote_code"],
                                               **extra)
    workload = workload_from_file(conversations, config, load_tokenizer(target))
    plan = make_plan(config, workload, target_config, gpus=config["gpu"]["count"] or 1)
    with atomic_path(out_md) as tmp:
        Path(tmp).write_text(format_plan(plan))
    with atomic_path(out_tsv) as tmp:
        pd.DataFrame(plan_rows(plan)).to_csv(tmp, sep="\t", index=False, float_format="%.4g")
    return plan
