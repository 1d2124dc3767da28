"""Hybrid Gated-DeltaNet targets (Qwen3.5/3.6, Qwen3-Next): text-only loading, capture and extraction.

"Relative error" below is per captured layer: max |a - b| over tokens and channels divided by max |b|.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import dflash_pipeline.target as target_module
from dflash_pipeline.extract import LayerCapture, extract_shard
from dflash_pipeline.store import HiddenStateStore, merge_shards, store_codec
from dflash_pipeline.target import (
    decoder_layers,
    has_linear_attention,
    load_target,
    load_tokenizer,
    num_hidden_layers,
    text_config,
    warn_slow_linear_attention,
)
from dflash_pipeline.tokenization import read_tokenized, tokenize_shard
from hybrid_fixtures import FULL_ATTENTION_LAYERS, NUM_LAYERS
from workflow_helpers import example_config

ROOT = Path(__file__).resolve().parents[1]
# GDN layers 0, 2, 5, 6 and full-attention layer 3. Not the last layer: output_hidden_states[L] is the
# final-normed output, not the raw output of decoder layer L-1.
LAYER_IDS = [0, 2, 3, 5, 6]
LENGTHS = [23, 70, 131, 150, 150]  # across the GDN chunk size (64); the longest row has no padding


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max over layers of max|a-b| / max|b|, for features [..., K, D]."""
    dims = tuple(d for d in range(a.dim()) if d != a.dim() - 2)
    return ((a - b).abs().amax(dims) / b.abs().amax(dims)).max().item()


def random_ids(lengths, seed=0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 49152, (n,), generator=generator) for n in lengths]


class RecordingSafeOpen:
    """``safe_open`` that records every tensor name read."""

    def __init__(self):
        self.read = []

    def __call__(self, *args, **kwargs):
        recorder, handle = self, safe_open(*args, **kwargs)

        class Handle:
            def __enter__(self):
                handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def keys(self):
                return handle.keys()

            def get_tensor(self, name):
                recorder.read.append(name)
                return handle.get_tensor(name)

        return Handle()


def test_vl_checkpoint_loads_text_only_and_equals_the_full_model(qwen3_5_vl_dir, monkeypatch):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    with safe_open(str(qwen3_5_vl_dir / "model.safetensors"), "pt") as handle:
        stored = list(handle.keys())
    assert any(k.startswith("model.visual.") for k in stored) and any(k.startswith("mtp.") for k in stored)
    recorder = RecordingSafeOpen()
    monkeypatch.setattr(target_module, "safe_open", recorder)
    model = load_target(str(qwen3_5_vl_dir), dtype="float32")
    assert type(model) is Qwen3_5ForCausalLM and model.name_or_path == str(qwen3_5_vl_dir)
    assert recorder.read and not [k for k in recorder.read if "visual" in k or k.startswith("mtp.")]
    assert sorted(recorder.read) == sorted(k for k in stored if k.startswith(("model.language_model.", "lm_head.")))
    assert not [name for name, _ in model.named_parameters() if "visual" in name]
    assert not model.training and not any(p.requires_grad for p in model.parameters())

    full = Qwen3_5ForConditionalGeneration.from_pretrained(qwen3_5_vl_dir, dtype=torch.float32).eval()
    ids = random_ids([97])[0][None]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, full(ids).logits, rtol=1e-6, atol=1e-6)
    assert num_hidden_layers(str(qwen3_5_vl_dir)) == NUM_LAYERS == len(decoder_layers(model))
    assert len(decoder_layers(full)) == NUM_LAYERS and text_config(full.config).model_type == "qwen3_5_text"


def test_text_only_loader_equals_transformers_own_loading_in_bf16(qwen3_5_vl_dir):
    """Same parameters, buffers and dtypes as transformers' AutoModelForCausalLM on the same checkpoint."""
    from transformers import AutoModelForCausalLM

    ours = load_target(str(qwen3_5_vl_dir), dtype="bfloat16")
    theirs = AutoModelForCausalLM.from_pretrained(qwen3_5_vl_dir, dtype=torch.bfloat16)
    a = {**dict(ours.named_parameters()), **dict(ours.named_buffers())}
    b = {**dict(theirs.named_parameters()), **dict(theirs.named_buffers())}
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def test_text_layout_and_qwen3_next_load_through_load_target(qwen3_5_text_dir, qwen3_next_dir):
    from transformers import Qwen3_5ForCausalLM, Qwen3NextForCausalLM

    for directory, cls in [(qwen3_5_text_dir, Qwen3_5ForCausalLM), (qwen3_next_dir, Qwen3NextForCausalLM)]:
        model = load_target(str(directory))
        assert type(model) is cls and has_linear_attention(model)
        reference = cls.from_pretrained(directory, dtype=torch.float32).eval()
        ids = random_ids([40])[0][None]
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=0)
        layers = decoder_layers(model)
        assert num_hidden_layers(str(directory)) == len(layers) == NUM_LAYERS
        assert [i for i, layer in enumerate(layers) if hasattr(layer, "self_attn")] == FULL_ATTENTION_LAYERS


def _rewrite(source: Path, out: Path, edit_tensors=None, edit_config=None) -> Path:
    shutil.copytree(source, out)
    file = out / "model.safetensors"
    with safe_open(str(file), "pt") as handle:
        tensors, metadata = {k: handle.get_tensor(k) for k in handle.keys()}, handle.metadata()
    if edit_tensors:
        edit_tensors(tensors)
    save_file(tensors, str(file), metadata=metadata)
    if edit_config:
        config = json.loads((out / "config.json").read_text())
        edit_config(config)
        (out / "config.json").write_text(json.dumps(config))
    return out


def test_mismatched_vl_checkpoint_is_a_clear_error_and_a_tied_head_loads(qwen3_5_vl_dir, tmp_path):
    extra = _rewrite(qwen3_5_vl_dir, tmp_path / "extra",
                     lambda t: t.__setitem__("model.language_model.extra.weight", torch.zeros(2)))
    with pytest.raises(ValueError, match=r"unexpected \['model.language_model.extra.weight'\]"):
        load_target(str(extra))
    missing = _rewrite(qwen3_5_vl_dir, tmp_path / "missing",
                       lambda t: t.pop("model.language_model.layers.3.self_attn.q_proj.weight"))
    with pytest.raises(ValueError, match=r"missing \['model.layers.3.self_attn.q_proj.weight'\]"):
        load_target(str(missing))

    def tie(config):
        config["tie_word_embeddings"] = config["text_config"]["tie_word_embeddings"] = True

    tied = _rewrite(qwen3_5_vl_dir, tmp_path / "tied", lambda t: t.pop("lm_head.weight"), tie)
    model = load_target(str(tied))
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("fixture", ["qwen3_5_vl_dir", "qwen3_next_dir"])
def test_bucketed_right_padded_capture_equals_single_runs_and_hidden_states(fixture, request):
    model = load_target(str(request.getfixturevalue(fixture)))
    layers = decoder_layers(model)
    assert {hasattr(layers[i], "linear_attn") for i in LAYER_IDS} == {True, False}  # GDN and full attention
    capture = LayerCapture(model, LAYER_IDS)
    samples = random_ids(LENGTHS)
    width = max(LENGTHS)
    ids = torch.zeros((len(samples), width), dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    for row, sample in enumerate(samples):
        ids[row, : len(sample)], mask[row, : len(sample)] = sample, 1
    batched = capture(ids, mask)
    assert batched.shape == (len(samples), width, len(LAYER_IDS), 64)
    for row, sample in enumerate(samples):
        alone = capture(sample[None])[0]
        assert relative_error(batched[row, : len(sample)], alone) <= 1e-5
        with torch.no_grad():
            hidden = model(sample[None], output_hidden_states=True).hidden_states
        reference = torch.stack([hidden[x + 1][0] for x in LAYER_IDS], dim=1)
        assert relative_error(alone, reference) <= 1e-5

    # Same shapes, other rows and pad contents changed: a row's real-token features do not move at all.
    row, length = 1, LENGTHS[1]
    others = torch.randint(0, 49152, ids.shape, generator=torch.Generator().manual_seed(7))
    others[row, :length] = ids[row, :length]
    assert torch.equal(capture(others, mask)[row, :length], batched[row, :length])

    # The check is not vacuous: the GDN state carries token 0 to the last position (GDN-only layers 0 and 2).
    changed = samples[-1].clone()
    changed[0] = (changed[0] + 1) % 49152
    moved = relative_error(capture(changed[None])[0, -1:, :2], capture(samples[-1][None])[0, -1:, :2])
    assert moved > 1e-3


def _conversations(path: Path) -> Path:
    words = "the quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing".split()
    with open(path, "w") as handle:
        for i in range(10):
            reply = " ".join(words[(i + j) % len(words)] for j in range(6 + 9 * i))
            messages = [{"role": "user", "content": f"Question {i}: say something."},
                        {"role": "assistant", "content": reply}]
            handle.write(json.dumps({"id": f"c{i}", "messages": messages}) + "\n")
    return path


def test_extract_shard_on_the_hybrid_target_passes_the_merge_checks(qwen3_5_vl_dir, tmp_path):
    tokenizer = load_tokenizer(str(qwen3_5_vl_dir))
    tokenize_shard(_conversations(tmp_path / "conversations.jsonl"), tokenizer, shard=0, num_shards=1,
                   max_length=128, out_parquet=tmp_path / "tok.parquet", out_counts=tmp_path / "counts.tsv")
    frame = read_tokenized(tmp_path / "tok.parquet")
    lengths = frame["num_tokens"].to_numpy()
    assert len(frame) == 10 and len(set(lengths)) > 3
    model = load_target(str(qwen3_5_vl_dir))
    meta = extract_shard(tmp_path / "tok.parquet", model, tmp_path / "shard.zarr", layer_ids=LAYER_IDS,
                         codec=store_codec("float32", "float32"), tokens_per_batch=300, chunk_tokens=64, compression="zstd",
                         attrs={"shard": 0, "num_target_layers": NUM_LAYERS, "target_dtype": "float32"})
    assert meta["layer_ids"] == LAYER_IDS and meta["num_tokens"] == int(lengths.sum())
    summary = merge_shards([tmp_path / "shard.zarr"], [frame], tmp_path / "store.zarr", {"target": "qwen3_5"})
    assert summary["num_samples"] == 10 and summary["hidden_size"] == 64
    store = HiddenStateStore(tmp_path / "store.zarr")
    capture = LayerCapture(model, LAYER_IDS)
    for i in (0, 4, 9):
        input_ids, _, features = store[i]
        assert relative_error(features, capture(input_ids[None])[0]) <= 1e-5
    assert np.array_equal(store.lengths, lengths)


def test_slow_path_warning_is_one_line(qwen3_5_text_dir, smollm2_dir, caplog):
    caplog.set_level(logging.WARNING, logger="dflash_pipeline.target")
    model = load_target(str(qwen3_5_text_dir))
    ours = [r for r in caplog.records if r.name == "dflash_pipeline.target"]
    assert len(ours) == 1
    assert "PyTorch path" in ours[0].getMessage() and "flash-linear-attention" in ours[0].getMessage()
    with torch.no_grad():
        model(random_ids([70])[0][None])
    assert len([r for r in caplog.records if r.name == "dflash_pipeline.target"]) == 1

    caplog.clear()
    load_target(str(smollm2_dir))  # no Gated-DeltaNet layers: no warning
    assert not [r for r in caplog.records if r.name == "dflash_pipeline.target"]


def test_slow_path_messages(qwen3_5_text_dir, monkeypatch):
    model = load_target(str(qwen3_5_text_dir))
    monkeypatch.setattr(target_module, "_fla_importable", lambda: False)
    assert "not installed" in warn_slow_linear_attention(model, "cuda")
    assert "need a GPU" in warn_slow_linear_attention(model, "cpu")
    monkeypatch.setattr(target_module, "_fla_importable", lambda: True)
    assert warn_slow_linear_attention(model, "cuda:0") is None
    assert "need a GPU" in warn_slow_linear_attention(model, "cpu")


def test_qwen3_6_27b_example_config_validates():
    config = example_config("qwen3.6-27b.yaml")
    assert config["target"]["dtype"] == "bfloat16" and config["extract"]["layer_ids"] == [1, 16, 31, 46, 61]
    assert config["extract"]["store_dtype"] == "bfloat16" and config["tokenize"]["max_length"] == 3072
    assert config["gpu"]["count"] == 8 and config["train"]["gpus"] == 8
    train = config["train"]
    assert (train["num_layers"], train["head_dim"], train["num_attention_heads"], train["num_key_value_heads"]) == (
        5, 128, 32, 8)
    assert train["layer_types"] == ["sliding_attention"] * 4 + ["full_attention"] and train["sliding_window"] == 2048
    assert train["mask_token_id"] == 248070 and train["block_size"] == 16
    # Every key is commented: each key line is preceded by a comment line.
    lines = (ROOT / "config" / "examples" / "qwen3.6-27b.yaml").read_text().splitlines()
    for index, line in enumerate(lines):
        if line.startswith("  ") and ":" in line and not line.lstrip().startswith("#"):
            assert lines[index - 1].lstrip().startswith("#"), line


def test_random_weights_from_config_alone(qwen3_5_vl_dir, tmp_path):
    """``target.random_weights_seed``: only config.json is read (a directory without weights loads); the same seed
    gives the same model, another seed another one; the multimodal config builds its text model."""
    from dflash_pipeline.target import load_target

    bare = tmp_path / "config_only"
    bare.mkdir()
    shutil.copy(qwen3_5_vl_dir / "config.json", bare / "config.json")
    first, again = (load_target(str(bare), random_weights_seed=0) for _ in range(2))
    other = load_target(str(bare), random_weights_seed=1)
    real = load_target(str(qwen3_5_vl_dir))
    assert type(first).__name__ == type(real).__name__ == "Qwen3_5ForCausalLM"
    a, b, c, r = (m.state_dict() for m in (first, again, other, real))
    assert a.keys() == r.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a) and any(not torch.equal(a[k], r[k]) for k in a)
    with pytest.raises(FileNotFoundError):
        load_target(str(bare))  # without the seed the weights are required
