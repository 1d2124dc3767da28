"""Unit tests of the DFlash drafter (src/dflash_pipeline/drafter/) and its loss helpers (losses.py)."""

from __future__ import annotations

import collections

import json
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig, Qwen3Config

from dflash_pipeline.drafter.masks import dense_attention_mask, dense_sequence_masks, dflash_mask_mod, flex_block_mask
from dflash_pipeline.drafter import (
    ContextCache,
    DFlashDrafter,
    config_from_export_dict,
    default_target_layer_ids,
    dflash_config_from_target,
    export_config_dict,
    load_dflash,
    load_target_embeddings,
    save_dflash,
)
from dflash_pipeline.losses import (
    IGNORE,
    acceptance_proxy,
    chunked_lm_loss,
    default_gamma,
    make_block_token_ids,
    slot_weights,
)
from dflash_pipeline.train_data import AnchorRule, draw_anchors, eligible_counts, pack_layouts

D, V, K, B, WINDOW = 64, 128, 3, 8, 6
MASK_ID = V - 1


def tiny_drafter(layer_types=("full_attention", "sliding_attention"), seed=0) -> DFlashDrafter:
    torch.manual_seed(seed)
    target = Qwen3Config(hidden_size=D, vocab_size=V, intermediate_size=96, num_hidden_layers=6,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    drafter = DFlashDrafter.from_target_config(
        target, mask_token_id=MASK_ID, num_layers=len(layer_types), block_size=B, target_layer_ids=[1, 2, 3],
        head_dim=16, num_key_value_heads=2, layer_types=list(layer_types), sliding_window=WINDOW,
        embed_tokens=nn.Embedding(V, D), lm_head=nn.Linear(D, V, bias=False),
    )
    with torch.no_grad():  # weights far from their init, so that the comparisons below mean something
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return drafter.eval()


# ---- layer ids, mask token ----
def test_default_target_layer_ids():
    assert default_target_layer_ids(30) == [1, 8, 14, 20, 27]
    assert default_target_layer_ids(36) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(64) == [1, 16, 31, 46, 61]
    assert default_target_layer_ids(30, k=1) == [15]  # one layer: the middle one, as the reference
    assert default_target_layer_ids(30, k=2) == [1, 27]


def test_default_target_layer_ids_are_the_references():
    from dflash.model import build_target_layer_ids

    for layers in (4, 5, 12, 24, 30, 36, 48, 64, 80):
        for k in range(1, 7):
            assert default_target_layer_ids(layers, k) == build_target_layer_ids(layers, k), (layers, k)


# ---- the attention rule ----
def rule(anchors, T, B, layer_type, window):
    n = len(anchors)
    mask = torch.zeros(n * B, T + n * B, dtype=torch.bool)
    for i, a in enumerate(anchors):
        for k in range(B):
            for p in range(T):  # context position p, RoPE position p
                mask[i * B + k, p] = p < a and (layer_type == "full_attention" or (a + k) - p < window)
            for j in range(n):
                for m in range(B):  # slot m of block j, RoPE position anchors[j] + m
                    ok = j == i and (layer_type == "full_attention" or (m <= k and k - m < window))
                    mask[i * B + k, T + j * B + m] = ok
    return mask


@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention"])
def test_dense_mask_matches_rule(layer_type):
    g = torch.Generator().manual_seed(1)
    T = 23
    anchors = torch.cat([torch.tensor([0]), torch.randperm(T - 1, generator=g)[:5] + 1]).sort().values
    got = dense_attention_mask(anchors, T, B, layer_type, WINDOW)
    assert got.dtype == torch.bool and got.shape == (len(anchors) * B, T + len(anchors) * B)
    assert torch.equal(got, rule(anchors.tolist(), T, B, layer_type, WINDOW))


def packed_rule(sequences, B, layer_type, window):
    """The rule over sequences packed one after another (contexts, then blocks), with explicit sequence
    (document) ids: ``sequences`` = [(T_s, anchors_s)]; a query may attend to a context key only of its
    own sequence."""
    ctx = [(s, p) for s, (T, _) in enumerate(sequences) for p in range(T)]  # key -> (sequence id, position)
    blocks = [(s, a) for s, (_, anchors) in enumerate(sequences) for a in anchors]
    n, T = len(blocks), len(ctx)
    mask = torch.zeros(n * B, T + n * B, dtype=torch.bool)
    for i, (s, a) in enumerate(blocks):
        for k in range(B):
            for key, (s_key, p) in enumerate(ctx):
                mask[i * B + k, key] = s_key == s and p < a and (layer_type == "full_attention" or (a + k) - p < window)
            for m in range(B):  # only its own block
                mask[i * B + k, T + i * B + m] = layer_type == "full_attention" or (m <= k and k - m < window)
    return mask


def random_packed_sequences(g, lengths, max_anchors):
    """[(T, sorted anchors)] with a random number (1..max_anchors) of random anchors, position 0 possible."""
    out = []
    for T in lengths:
        count = int(torch.randint(1, max_anchors + 1, (1,), generator=g))
        out.append((T, torch.randperm(T, generator=g)[: min(count, T)].sort().values.tolist()))
    return out


def packed_arguments(sequences):
    """anchors, starts (key index where each block's sequence begins) and T of packed ``sequences``."""
    starts, offset = [], 0
    for T, anchors in sequences:
        starts += [offset] * len(anchors)
        offset += T
    return torch.tensor([a for _, anchors in sequences for a in anchors]), torch.tensor(starts), offset


@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention"])
def test_packed_dense_mask_matches_rule(layer_type):
    g = torch.Generator().manual_seed(2)
    sequences = random_packed_sequences(g, [23, 5, 17, 1], max_anchors=6)
    anchors, starts, T = packed_arguments(sequences)
    got = dense_attention_mask(anchors, T, B, layer_type, WINDOW, starts)  # the mask of FlexAttention's mask_mod
    expected = packed_rule(sequences, B, layer_type, WINDOW)
    assert torch.equal(got, expected)
    assert not got[: len(sequences[0][1]) * B, sequences[0][0] : T].any()  # sequence 0 sees no other context
    # the dense path's per-sequence masks, laid on the packed grid, are the same mask
    segments = dense_sequence_masks(anchors, [T for T, _ in sequences], [len(a) for _, a in sequences], B,
                                    layer_type, WINDOW)
    assembled = torch.zeros_like(got)
    for queries, context, mask in segments:
        n_ctx = context.stop - context.start
        assembled[queries, context] = mask[:, :n_ctx]
        assembled[queries, T + queries.start : T + queries.stop] = mask[:, n_ctx:]
    assert torch.equal(assembled, expected)


@pytest.mark.parametrize("layer_type", ["full_attention", "sliding_attention"])
def test_flex_block_mask_has_the_tiles_of_create_block_mask(layer_type):
    """The block mask built from key ranges = create_block_mask over the materialised mask: the same empty,
    partial and full 128 x 128 tiles (ragged edges included), the same mask_mod."""
    from torch.nn.attention.flex_attention import create_block_mask

    g = torch.Generator().manual_seed(3)
    sequences = random_packed_sequences(g, [300, 41, 200, 150, 7], max_anchors=20)
    sequences[0] = (1000, torch.randperm(1000, generator=g)[:40].sort().values.tolist())  # full tiles too
    anchors, starts, T = packed_arguments(sequences)
    ours = flex_block_mask(anchors, T, B, layer_type, WINDOW, starts)
    mod = dflash_mask_mod(anchors, T, B, layer_type, WINDOW, starts)
    theirs = create_block_mask(mod, None, None, len(anchors) * B, T + len(anchors) * B, device="cpu")
    assert ours.seq_lengths == theirs.seq_lengths and ours.BLOCK_SIZE == theirs.BLOCK_SIZE

    def tiles(num, idx):
        return [sorted(idx[0, 0, r, : num[0, 0, r]].tolist()) for r in range(num.shape[-1])]

    assert tiles(ours.kv_num_blocks, ours.kv_indices) == tiles(theirs.kv_num_blocks, theirs.kv_indices)
    assert tiles(ours.full_kv_num_blocks, ours.full_kv_indices) == tiles(theirs.full_kv_num_blocks,
                                                                         theirs.full_kv_indices)
    assert ours.kv_num_blocks.sum() > 0
    assert (ours.full_kv_num_blocks.sum() > 0) == (layer_type == "full_attention")  # no full tile in a window of 6


# ---- training path == inference path ----
@pytest.mark.parametrize("layer_types", [("full_attention", "full_attention"), ("full_attention", "sliding_attention")])
def test_training_blocks_equal_inference_blocks(layer_types):
    drafter = tiny_drafter(layer_types)
    T = 20
    features = torch.randn(1, T, K * D)
    anchors = torch.tensor([0, 3, 4, 11, 18, 19])  # anchor 0: empty context; late anchors: block past T
    blocks = torch.randint(0, V, (len(anchors), B))
    blocks[:, 1:] = MASK_ID
    with torch.no_grad():
        batched = drafter.forward_blocks(features, anchors, blocks, attn_impl="sdpa")
        assert batched.shape == (len(anchors), B, D)
        for i, a in enumerate(anchors.tolist()):
            single = drafter.forward_block(features[:, :a], blocks[i : i + 1], start_position=a)
            assert (batched[i] - single[0]).abs().max().item() <= 1e-5


def test_flex_attention_path_matches_dense():
    drafter = tiny_drafter()
    features = torch.randn(1, 17, K * D)
    anchors = torch.tensor([0, 2, 9, 15])
    blocks = torch.randint(0, V, (4, B))
    with torch.no_grad():  # on the CPU: torch's unfused reference flex path (it warns once per process)
        flex = drafter.forward_blocks(features, anchors, blocks, attn_impl="flex")
    with torch.no_grad():
        dense = drafter.forward_blocks(features, anchors, blocks, attn_impl="sdpa")
    assert (flex - dense).abs().max().item() <= 1e-5


def test_compiled_layer_pass_traces_to_the_eager_pass():
    """The whole-layer pass (compile_layers) through dynamo, flex attention inside, computes the eager pass: on the
    CPU with dynamo's eager backend (FlexAttention has neither a CPU backward nor an Inductor CPU kernel here), two
    pack shapes through one dynamic graph."""
    from torch._dynamo.utils import counters

    from dflash_pipeline.drafter import decoder_layer_pass

    torch._dynamo.reset()
    counters.clear()
    drafter = tiny_drafter()
    g = torch.Generator().manual_seed(5)
    runs = []
    for lengths in ([21, 6, 33], [14, 9]):
        sequences = random_packed_sequences(g, lengths, max_anchors=5)
        features = torch.randn(1, sum(lengths), K * D, generator=g)
        blocks = torch.randint(0, V, (sum(len(a) for _, a in sequences), B), generator=g)
        runs.append((features, torch.cat([torch.tensor(a) for _, a in sequences]), blocks,
                     dict(lengths=lengths, block_counts=[len(a) for _, a in sequences], attn_impl="flex")))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # CPU flex: the unfused reference path
        eager = [drafter.forward_blocks(f, a, b, **kw) for f, a, b, kw in runs]
        drafter.layer_pass = torch.compile(decoder_layer_pass, backend="eager", dynamic=True)
        traced = [drafter.forward_blocks(f, a, b, **kw) for f, a, b, kw in runs]
        drafter.set_flex_kernel_options({"BLOCK_M": 64, "BLOCK_N": 64})  # train.flex_kernel_options
        tiled = [drafter.forward_blocks(f, a, b, **kw) for f, a, b, kw in runs]
    for x, y in [*zip(traced, eager), *zip(tiled, eager)]:
        assert (x - y).abs().max().item() <= 1e-5 * y.abs().max().item()
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]  # traced whole, not eager


def test_context_cache_matches_full_context():
    drafter = tiny_drafter()
    features = torch.randn(1, 15, K * D)
    block = torch.tensor([[5] + [MASK_ID] * (B - 1)])
    cache = ContextCache()
    with torch.no_grad():
        for start, end in [(0, 4), (4, 5), (5, 11), (11, 15)]:
            incremental = drafter.forward_block(features[:, start:end], block, start_position=end, cache=cache)
            full = drafter.forward_block(features[:, :end], block, start_position=end)
            assert (incremental - full).abs().max().item() <= 1e-5
    drafts = drafter.draft(features, block)
    assert drafts.shape == (1, B - 1) and drafts.dtype == torch.long
    assert torch.equal(drafts, drafter.logits(full[:, 1:]).argmax(-1))


@pytest.mark.parametrize("impl", ["sdpa", "flex"])
def test_packed_forward_equals_one_call_per_sequence(impl):
    """Sequences of different lengths and anchor counts in one packed pass = one pass per sequence."""
    drafter = tiny_drafter()
    g = torch.Generator().manual_seed(4)
    sequences = random_packed_sequences(g, [21, 6, 33, 14], max_anchors=7)
    features = [torch.randn(1, T, K * D, generator=g) for T, _ in sequences]
    blocks = [torch.randint(0, V, (len(a), B), generator=g) for _, a in sequences]
    anchors = torch.cat([torch.tensor(a) for _, a in sequences])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # CPU flex: the unfused reference path (warned once)
        packed = drafter.forward_blocks(torch.cat(features, dim=1), anchors, torch.cat(blocks),
                                        lengths=[T for T, _ in sequences], block_counts=[len(a) for _, a in sequences],
                                        attn_impl=impl)
    with torch.no_grad():
        single = torch.cat([drafter.forward_blocks(f, torch.tensor(a), b, attn_impl="sdpa")
                            for f, (_, a), b in zip(features, sequences, blocks)])
    assert packed.shape == single.shape == (len(anchors), B, D)
    assert (packed - single).abs().max().item() <= 1e-5 * single.abs().max().item()
    with pytest.raises(ValueError, match="do not cover"):
        drafter.forward_blocks(torch.cat(features, dim=1), anchors, torch.cat(blocks), lengths=[T for T, _ in sequences],
                               block_counts=[len(a) for _, a in sequences][:-1])


def test_gradients_reach_only_trainable_weights():
    drafter = tiny_drafter().train()
    drafter.gradient_checkpointing = True
    out = drafter(torch.randn(1, 12, K * D), torch.tensor([1, 5]), torch.randint(0, V, (2, B)), attn_impl="sdpa")
    drafter.logits(out).logsumexp(-1).sum().backward()
    assert all(p.grad is not None for p in drafter.parameters())
    assert drafter.embed_tokens.weight.grad is None and drafter.lm_head.weight.grad is None


# ---- parameters, state dict, export ----
EXPECTED_LAYER_KEYS = {
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
    "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
}


def expected_keys(num_layers):
    keys = {f"layers.{i}.{k}" for i in range(num_layers) for k in EXPECTED_LAYER_KEYS}
    return keys | {"fc.weight", "hidden_norm.weight", "norm.weight"}


def test_target_modules_are_frozen_and_not_parameters():
    drafter = tiny_drafter()
    assert set(drafter.state_dict()) == expected_keys(2)
    assert {n for n, _ in drafter.named_parameters()} == expected_keys(2)
    assert not drafter.embed_tokens.weight.requires_grad and not drafter.lm_head.weight.requires_grad
    drafter.to(torch.float64)  # drafter dtype changes, the target's modules keep theirs
    assert drafter.fc.weight.dtype == torch.float64 and drafter.embed_tokens.weight.dtype == torch.float32
    with torch.no_grad():
        assert drafter.draft(torch.randn(1, 4, K * D), torch.tensor([[3] + [MASK_ID] * (B - 1)])).shape == (1, B - 1)


def test_save_and_load_roundtrip(tmp_path):
    drafter = tiny_drafter()
    save_dflash(drafter, tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    # mixed layer types: no global "causal" flag (vLLM would apply it to every layer)
    assert config["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [1, 2, 3], "use_swa": True,
                                       "swa_window_size": WINDOW}
    assert config["block_size"] == B and config["num_target_layers"] == 6
    assert config["layer_types"] == ["full_attention", "sliding_attention"] and config["sliding_window"] == WINDOW
    assert config["use_sliding_window"] is True and config["target_hidden_size"] == D
    assert config["draft_vocab_size"] == V and config["rope_scaling"] is None
    for key, value in dict(hidden_size=D, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, vocab_size=V).items():
        assert config[key] == value
    for key in ("rms_norm_eps", "rope_parameters", "rope_theta", "max_position_embeddings"):
        assert key in config
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == expected_keys(2)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors"]

    loaded = load_dflash(tmp_path / "ckpt", drafter.embed_tokens, drafter.lm_head).eval()
    features, anchors = torch.randn(1, 14, K * D), torch.tensor([0, 6, 13])
    blocks = torch.randint(0, V, (3, B))
    with torch.no_grad():
        assert torch.equal(drafter(features, anchors, blocks), loaded(features, anchors, blocks))


def test_config_reads_zlab_style_checkpoint_config():
    zlab = {"architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
            "model_type": "qwen3", "block_size": 16, "num_target_layers": 36, "hidden_size": 4096,
            "intermediate_size": 12288, "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000, "rope_scaling": None,
            "max_position_embeddings": 40960, "vocab_size": 151936, "torch_dtype": "bfloat16",
            "layer_types": ["full_attention"] * 5, "sliding_window": None, "use_sliding_window": False,
            "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}}
    c = config_from_export_dict(zlab)
    assert c.rope_parameters["rope_theta"] == 1e6 and c.block_size == 16 and c.mask_token_id == 151669
    assert c.target_layer_ids == [1, 9, 17, 25, 33] and c.num_target_layers == 36 and c.head_dim == 128
    assert config_from_export_dict(export_config_dict(c)).to_dict() == c.to_dict()


def test_config_from_large_targets():
    smol = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                       num_key_value_heads=3, vocab_size=49152, rms_norm_eps=1e-5, rope_theta=100000.0,
                       max_position_embeddings=8192, tie_word_embeddings=True)
    c = dflash_config_from_target(smol, mask_token_id=0)
    assert (c.head_dim, c.num_attention_heads, c.num_key_value_heads) == (64, 9, 3)
    assert c.target_layer_ids == [1, 8, 14, 20, 27] and c.num_target_layers == 30 and c.num_hidden_layers == 5
    assert c.rope_parameters["rope_theta"] == 100000.0 and c.block_size == 16
    big = Qwen3Config(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
                      num_key_value_heads=4, head_dim=256, vocab_size=248320)
    c = dflash_config_from_target(big, mask_token_id=1)
    assert (c.head_dim, c.num_attention_heads, c.num_key_value_heads) == (128, 40, 4)
    assert c.target_layer_ids == [1, 16, 31, 46, 61]


# ---- target embeddings ----
def test_load_target_embeddings(tmp_path):
    emb, head = torch.randn(V, D), torch.randn(V, D)
    (tmp_path / "untied").mkdir()
    save_file({"model.embed_tokens.weight": emb, "lm_head.weight": head, "model.norm.weight": torch.ones(D)},
              str(tmp_path / "untied" / "model.safetensors"))
    e, h = load_target_embeddings(tmp_path / "untied")
    assert torch.equal(e.weight, emb) and torch.equal(h.weight, head)
    assert not e.weight.requires_grad and not h.weight.requires_grad

    (tmp_path / "tied").mkdir()  # SmolLM2: no lm_head tensor
    save_file({"model.embed_tokens.weight": emb}, str(tmp_path / "tied" / "model.safetensors"))
    (tmp_path / "tied" / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    e, h = load_target_embeddings(tmp_path / "tied")
    assert h.weight is e.weight and torch.equal(h(torch.eye(D)[:1]), emb[:, 0][None])

    (tmp_path / "sharded").mkdir()  # VL layout, sharded
    save_file({"model.language_model.embed_tokens.weight": emb}, str(tmp_path / "sharded" / "a.safetensors"))
    save_file({"lm_head.weight": head}, str(tmp_path / "sharded" / "b.safetensors"))
    (tmp_path / "sharded" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.language_model.embed_tokens.weight": "a.safetensors", "lm_head.weight": "b.safetensors"}}))
    e, h = load_target_embeddings(tmp_path / "sharded", dtype=torch.bfloat16)
    assert e.weight.dtype == torch.bfloat16 and torch.equal(h.weight, head.to(torch.bfloat16))


# ---- loss helpers ----
def test_slot_weights_and_gamma():
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)
    assert default_gamma(4) == 2.0 and default_gamma(2) == 1.0 and default_gamma(12) == pytest.approx(17 / 3)
    w = slot_weights(16)
    assert w.shape == (16,) and w[0] == 0 and w[1] == 1
    assert torch.allclose(w[1:], torch.exp(-torch.arange(15.0) / 7.0))
    assert torch.allclose(slot_weights(4, gamma=2.0), torch.tensor([0.0, 1.0, 0.60653066, 0.36787944]))  # exp(-(k-1)/2)


def eligible_positions(loss_mask):
    return {p for p in range(len(loss_mask) - 1) if loss_mask[p] and loss_mask[p + 1]}


def test_draw_anchors_is_a_seeded_uniform_draw_per_sample_and_epoch():
    masks = [np.array([0, 0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1, 1, 0, 1] + [1] * 40 + [0, 1], dtype=bool),
             np.array([0] * 5 + [1] * 30, dtype=bool), np.array([0, 1, 0, 1, 0], dtype=bool)]
    lengths = np.array([len(m) for m in masks])
    starts = np.cumsum(lengths) - lengths
    mask, samples = np.concatenate(masks), np.array([7, 3, 11])
    assert eligible_counts(mask, lengths).tolist() == [len(eligible_positions(m)) for m in masks] == [46, 29, 0]

    def per_sample(anchors):
        return [set((anchors[(anchors >= s) & (anchors < s + n)] - s).tolist()) for s, n in zip(starts, lengths)]

    rule = AnchorRule(block_size=4, gamma=2.0, max_anchors=10)
    draws = [draw_anchors(mask, lengths, samples, rule, epoch) for epoch in (0, 1, 0)]
    for anchors in draws:
        assert np.all(np.diff(anchors) > 0)  # sorted, distinct
        first, second, third = per_sample(anchors)
        assert len(first) == len(second) == 10 and not third  # a sample's last token never anchors
        assert first <= eligible_positions(masks[0]) and second <= eligible_positions(masks[1])
    assert not np.array_equal(draws[0], draws[1]) and np.array_equal(draws[0], draws[2])  # anew each epoch
    # A sample's anchors depend on it alone, not on the batch it is in or its place there.
    alone = draw_anchors(masks[1], lengths[1:2], samples[1:2], rule, 0)
    assert set(alone.tolist()) == per_sample(draws[0])[1]
    assert per_sample(draw_anchors(mask, lengths, samples, AnchorRule(4, 2.0, 1000), 0))[:2] == [
        eligible_positions(m) for m in masks[:2]]
    # uniform: over many epochs every eligible position is drawn about equally often
    counts = collections.Counter()
    for epoch in range(400):
        counts.update(per_sample(draw_anchors(mask, lengths, samples, rule, epoch))[1])
    frequencies = np.array([counts[p] for p in sorted(eligible_positions(masks[1]))]) / 400
    assert abs(frequencies.mean() - 10 / 29) < 1e-9 and frequencies.min() > 0.25 and frequencies.max() < 0.45


def test_pack_layout_labels_weights_and_blocks():
    T = 12
    input_ids = np.arange(100, 100 + T)
    loss_mask = np.array([0, 0, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1], dtype=bool)
    rule = AnchorRule(block_size=4, gamma=2.0, max_anchors=100)
    (rows, layout), = pack_layouts(input_ids, loss_mask, np.array([T]), np.array([0]), rule, 0, hidden_size=8)
    assert rows == slice(0, T) and layout.anchors.tolist() == [2, 3, 4, 7, 8, 9, 10]  # 11 is the last token
    dense = np.full((7, 4), IGNORE)
    dense.reshape(-1)[layout.slots] = layout.labels
    assert dense[[0, 2, 5]].tolist() == [[IGNORE, 103, 104, 105],  # 6 is no response token
                                         [IGNORE, 105, IGNORE, 107], [IGNORE, 110, 111, IGNORE]]  # 12 = T: outside
    w = slot_weights(4, 2.0).numpy()
    assert np.allclose(layout.weights, w[layout.slots % 4])
    assert layout.anchor_tokens.tolist() == [102, 103, 104, 107, 108, 109, 110]
    blocks = make_block_token_ids(torch.from_numpy(input_ids), torch.tensor([2, 9]), 4, MASK_ID)
    assert blocks.tolist() == [[102, MASK_ID, MASK_ID, MASK_ID], [109, MASK_ID, MASK_ID, MASK_ID]]


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.data())
def test_pack_layouts_equal_a_plain_loop_over_anchors_and_slots(data):
    """pack_layouts (vectorised) against the definition, one anchor and one slot at a time: random samples, masks,
    anchor caps (all eligible positions taken, or drawn) and pack caps."""
    n = data.draw(st.integers(1, 6))
    lengths = np.array(data.draw(st.lists(st.integers(1, 40), min_size=n, max_size=n)))
    mask = np.array(data.draw(st.lists(st.booleans(), min_size=int(lengths.sum()), max_size=int(lengths.sum()))))
    B = data.draw(st.sampled_from([2, 4, 16]))
    rule = AnchorRule(B, 2.0, data.draw(st.sampled_from([1, 3, 1000])), seed=5)
    samples = np.array(data.draw(st.permutations(range(10, 10 + n))))
    ids = np.arange(1000, 1000 + lengths.sum())
    cap = data.draw(st.sampled_from([8 * 30, 2**25]))
    packs = pack_layouts(ids, mask, lengths, samples, rule, 1, hidden_size=8, pack_elements=cap)
    anchors = draw_anchors(mask, lengths, samples, rule, 1)
    starts = np.cumsum(lengths) - lengths
    w = slot_weights(B, 2.0).numpy()
    for rows, layout in packs:
        assert rows.start == starts[np.flatnonzero(samples == layout.samples[0])[0]]
        slots = []  # (slot, label, weight) of every slot with a loss
        for i, a in enumerate(a for a in anchors if rows.start <= a < rows.stop):
            end = next(s + l for s, l in zip(starts, lengths) if s <= a < s + l)  # its own sample's end
            assert layout.anchors[i] == a - next(s for s in starts[::-1] if s <= a)
            assert layout.anchor_tokens[i] == ids[a]
            slots += [(i * B + k, ids[a + k], w[k]) for k in range(1, B) if a + k < end and mask[a + k]]
        got = list(zip(layout.slots.tolist(), layout.labels.tolist(), layout.weights.tolist()))
        assert got == [(s, l, pytest.approx(float(x))) for s, l, x in slots]
        assert layout.weights.dtype == np.float32
    assert sum(len(layout.anchors) for _, layout in packs) == len(anchors)
    assert np.concatenate([layout.samples for _, layout in packs]).tolist() == samples.tolist()


def test_packs_stay_under_the_cap_and_cover_the_step():
    rng = np.random.default_rng(0)
    lengths = rng.integers(20, 60, size=9)
    mask = rng.random(lengths.sum()) < 0.8
    ids = rng.integers(0, V, size=lengths.sum())
    rule = AnchorRule(block_size=4, gamma=2.0, max_anchors=8)
    whole = pack_layouts(ids, mask, lengths, np.arange(9), rule, 0, hidden_size=8)
    split = pack_layouts(ids, mask, lengths, np.arange(9), rule, 0, hidden_size=8, pack_elements=8 * 150)
    assert len(whole) == 1 and len(split) > 3
    for rows, layout in split:
        assert (layout.lengths.sum() + 4 * layout.anchors.size) * 8 <= 8 * 150 or len(layout.lengths) == 1
    assert np.concatenate([layout.samples for _, layout in split]).tolist() == list(range(9))
    for key in ("anchors", "labels", "weights"):
        assert np.array_equal(np.concatenate([getattr(layout, key) for _, layout in split]), getattr(whole[0][1], key))


def test_chunked_loss_equals_full_cross_entropy():
    torch.manual_seed(0)
    N = 37
    hidden = torch.randn(N, D, requires_grad=True)
    weight = torch.randn(V, D, requires_grad=True)
    labels = torch.randint(0, V, (N,))
    labels[::5] = IGNORE
    weights = torch.rand(N)
    loss_sum, weight_sum, correct = chunked_lm_loss(hidden, weight, labels, weights, chunk_size=8)
    (loss_sum / weight_sum).backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None

    logits = hidden @ weight.T
    valid = labels != IGNORE
    ce = F.cross_entropy(logits, labels.clamp(min=0), reduction="none") * weights * valid
    ref = ce.sum() / (weights * valid).sum()
    ref.backward()
    assert torch.allclose(loss_sum / weight_sum, ref, atol=1e-5)
    assert torch.allclose(weight_sum, (weights * valid).sum())
    assert torch.allclose(grads[0], hidden.grad, atol=1e-6) and torch.allclose(grads[1], weight.grad, atol=1e-6)
    assert torch.equal(correct, (logits.argmax(-1) == labels) & valid)
    correct = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    assert acceptance_proxy(correct).tolist() == [3, 1, 5]
