"""The trainer tests' tiny target and store (tests/test_train.py, test_muon.py, test_compact_store.py,
test_train_snapshots.py, test_reliability.py).

The store: a tiny random-weight Llama target (real transformers model, saved as safetensors with a word-level
tokenizer) whose captured layers are computed by the extract module's ``LayerCapture``, over a synthetic language in
which every token determines its successor (a few fixed "phrases" of distinct tokens), so a drafter can learn to
draft whole blocks and the acceptance proxy has room to rise.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch

from dflash_pipeline.extract import LayerCapture
from dflash_pipeline.store import ShardWriter, merge_shards, store_codec
from dflash_pipeline.target import tokenizer_hashes

V, D, LAYERS, LAYER_IDS = 160, 64, 4, [0, 2]
PHRASE, NUM_PHRASES = 8, 2  # 16 distinct tokens in 2 cyclic phrases: token -> successor is a function

# A small drafter and a run long enough to learn the phrases (~240 steps of 2-3 sequences, ~15 s); the
# learning, kill/resume and export tests share one reference run of it.
BASE = dict(gpus=0, threads=1, epochs=12, optimizer="adamw", lr=1e-2, warmup_ratio=0.05, max_anchors=12,
            tokens_per_batch=160, block_size=8, num_layers=2, head_dim=16, val_fraction=0.15, seed=0, num_workers=0,
            checkpoint_every=20)


def make_tiny_target(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                         max_position_embeddings=512, initializer_range=0.3)
    LlamaForCausalLM(config).save_pretrained(path)
    vocab = {"<unk>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, V - 1)}}  # V-1 tokens: mask = row V-1
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<eos>").save_pretrained(path)
    return path


def synthetic_samples(n: int, seed: int):
    """(input_ids, loss_mask) pairs: a random prompt (no loss), then a response walking one phrase cyclically."""
    rng = np.random.default_rng(seed)
    phrases = np.random.default_rng(1234).permutation(np.arange(2, 2 + PHRASE * NUM_PHRASES)).reshape(NUM_PHRASES, -1)
    for _ in range(n):
        prompt = rng.integers(2, V - 1, size=rng.integers(4, 12))
        phrase, start, length = rng.integers(NUM_PHRASES), rng.integers(PHRASE), rng.integers(16, 72)
        response = phrases[phrase][(start + np.arange(length)) % PHRASE]
        ids = np.concatenate([prompt, response]).astype(np.int32)
        yield ids, np.concatenate([np.zeros(len(prompt)), np.ones(len(response))]).astype(np.uint8)


def make_store(tmp: Path, target: Path, num_samples: int = 60, num_shards: int = 2, codec=None,
               basis: Path | None = None, name: str = "store.zarr", transform=None) -> Path:
    """A merged store of ``num_samples`` synthetic samples, features from the tiny target's layers; float32 unless
    ``codec`` (``basis``: a compact codec's basis file) says otherwise; ``transform`` changes the features before
    they are written."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    capture = LayerCapture(model, LAYER_IDS)
    samples = list(synthetic_samples(num_samples, seed=0))
    shards, frames = [], []
    for s in range(num_shards):
        part = samples[s::num_shards]
        frame = pd.DataFrame({"id": [f"s{s}-{i}" for i in range(len(part))], "input_ids": [p[0] for p in part],
                              "loss_mask": [p[1] for p in part], "num_tokens": [len(p[0]) for p in part]})
        shard = tmp / f"{name}.shard_{s}"
        writer = ShardWriter(shard, num_tokens=int(frame["num_tokens"].sum()), num_layers=len(LAYER_IDS),
                             hidden_size=D, codec=codec or store_codec("float32", "float32"), chunk_tokens=64)
        for ids, _ in part:
            features = capture(torch.from_numpy(ids.astype(np.int64))[None])[0]
            writer.write(transform(features) if transform else features)
        writer.close(np.concatenate(frame["input_ids"].tolist()), np.concatenate(frame["loss_mask"].tolist()),
                     frame["num_tokens"].to_numpy(), list(frame["id"]),
                     {"shard": s, "layer_ids": LAYER_IDS, "hidden_size": D, "num_target_layers": LAYERS})
        shards.append(shard)
        frames.append(frame)
    tokenizer = AutoTokenizer.from_pretrained(target)
    manifest = {"target": str(target), "config_sha256": "test", **tokenizer_hashes(tokenizer)}
    merge_shards(shards, frames, tmp / name, manifest, basis)
    return tmp / name


def paths(tiny, out: Path) -> dict:
    return dict(store=str(tiny["store"]), target=str(tiny["target"]), drafter_dir=str(out / "drafter"),
                log_csv=str(out / "log.csv"), curves_png=str(out / "curves.png"), state_dir=str(out / "state"),
                init_dir=str(out / "drafter_init"), timing_json=str(out / "timing.json"))
