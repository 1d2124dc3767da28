"""Our drafter against z-lab's reference implementation, the ``dflash`` package (PyPI, MIT; installed with --no-deps),
on the published Qwen3.6-27B drafter's architecture at reduced width: the same heads ratio (query heads x head_dim
below the hidden size, 4 query heads per KV head), FFN ratio and layer_types [sliding x 4, full], a window short
enough to bind on the contexts below. fp32 on the CPU.

- Our export loads strictly into ``dflash.DFlashDraftModel`` (``from_pretrained`` and ``load_state_dict(strict=True)``)
  and both compute the same drafts' hidden states, through our inference and training paths.
- The reference's ``dflash_generate`` and our ``speculative_generate`` give the same tokens and acceptance lengths on
  a tiny target (a vocabulary of 4, so that a random drafter's drafts are accepted often and in varied lengths).
- The training masks (dense and FlexAttention) equal the reference's own inference mask, block by block.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_pipeline.drafter.masks import dense_attention_mask, flex_block_mask
from dflash_pipeline.drafter import DFlashDrafter, save_dflash
from dflash_pipeline.speculative import DFlashProposer, speculative_generate

dflash = pytest.importorskip("dflash.model", reason="the reference: pip install --no-deps dflash")

LAYER_TYPES = ["sliding_attention"] * 4 + ["full_attention"]  # the published 27B drafter's
# 27B: D 5120, 32 x 128 query heads (4096), 8 KV heads, FFN 17408 = 3.4 D. Here: D 160, 8 x 16 (128), 2 KV, FFN 544.
D, HEADS, KV, HEAD_DIM, FFN, B = 160, 8, 2, 16, 544, 16


def target_config(vocab: int, layers: int = 8) -> Qwen3Config:
    return Qwen3Config(hidden_size=D, vocab_size=vocab, intermediate_size=320, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=40, rope_theta=1e7,
                       tie_word_embeddings=False, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def drafter_of_27b_shape(config: Qwen3Config, window: int, mask_token_id: int, embed=None, lm_head=None,
                         seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    drafter = DFlashDrafter.from_target_config(
        config, mask_token_id=mask_token_id, num_layers=5, block_size=B, target_layer_ids=[1, 3, 5],
        head_dim=HEAD_DIM, num_attention_heads=HEADS, num_key_value_heads=KV, intermediate_size=FFN,
        layer_types=LAYER_TYPES, sliding_window=window,
        embed_tokens=embed or nn.Embedding(config.vocab_size, D), lm_head=lm_head or nn.Linear(D, config.vocab_size,
                                                                                              bias=False))
    with torch.no_grad():  # weights far from their init, so that attention patterns matter
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return drafter.eval()


def reference_of(drafter: DFlashDrafter, directory) -> nn.Module:
    """Our export loaded into the reference's class: from_pretrained with no missing, unexpected or mismatched
    tensors, and the same tensors again through load_state_dict(strict=True)."""
    from safetensors.torch import load_file

    save_dflash(drafter, directory)
    model, info = dflash.DFlashDraftModel.from_pretrained(directory, output_loading_info=True, dtype=torch.float32)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    model.load_state_dict(load_file(str(directory / "model.safetensors")), strict=True)
    assert model.target_layer_ids == [1, 3, 5] and model.block_size == B
    assert model.mask_token_id == drafter.mask_token_id
    return model.eval()


@pytest.mark.parametrize("window", [5, 24])  # shorter than the block (16), and longer: the published 2048 is
def test_export_loads_strictly_into_the_reference_and_computes_the_same(tmp_path, window):
    config = target_config(vocab=64)
    drafter = drafter_of_27b_shape(config, window, mask_token_id=63)
    reference = reference_of(drafter, tmp_path / "drafter")
    assert len(list(same_hidden_states(drafter, reference, T=50, anchors=[0, 1, 7, 23, 40, 49, 50]))) == 7


def same_hidden_states(ours: DFlashDrafter, theirs: nn.Module, T: int, anchors: list[int], vocab: int = 64,
                       train_tolerance: float = 1e-5):
    """Blocks anchored at ``anchors`` over T random context features (the last anchor T: the whole context): our
    inference path, our training path (every block in one pass, over the whole context) and the reference compute
    the same hidden states. Yields (anchor, block tokens, ours, theirs) per anchor."""
    B = ours.block_size
    g = torch.Generator().manual_seed(1)
    features = torch.randn(1, T, 3 * D, generator=g)
    block_tokens = torch.randint(0, vocab - 1, (1, B), generator=g)
    block_tokens[:, 1:] = ours.mask_token_id
    with torch.no_grad():
        trained = ours.forward_blocks(features, torch.tensor(anchors[:-1]), block_tokens.repeat(len(anchors) - 1, 1),
                                      attn_impl="sdpa")
        for i, C in enumerate(anchors):
            h = ours.forward_block(features[:, :C], block_tokens)
            ref_h = theirs(position_ids=torch.arange(C + B)[None], noise_embedding=ours.embed(block_tokens),
                           target_hidden=features[:, :C])
            assert (h - ref_h).abs().max().item() <= 1e-5, C
            if C < T:
                assert (trained[i] - ref_h[0]).abs().max().item() <= train_tolerance, C
            yield C, block_tokens, features[:, :C], h, ref_h


@pytest.fixture(scope="module")
def tiny_target():
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(target_config(vocab=4)).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # prefix-dependent but not flat next-token distributions
    return model


def test_dflash_generate_and_our_loop_agree(tmp_path, tiny_target, monkeypatch):
    """The same weights in both loops (their draft cache is a transformers DynamicCache with sliding-window layers,
    ours a ContextCache with the window in the mask): the same tokens, and the same tokens committed per verify step,
    over a generation several windows long. Within ``max_new_tokens`` of the end the reference drafts shorter blocks
    (``min(B, max_length - start)`` slots: its full-attention layer then sees fewer mask slots and drafts otherwise),
    where ours drafts a whole block and cuts what it commits: the steps compared are those whose whole block fits.
    The reference's acceptance lengths come with its timings, which it reads after ``torch.cuda.synchronize``: on
    the CPU its clock is the plain one."""
    import time

    monkeypatch.setattr(dflash, "_cuda_time", time.perf_counter)
    model = tiny_target
    drafter = drafter_of_27b_shape(model.config, window=6, mask_token_id=3, embed=model.get_input_embeddings(),
                                   lm_head=model.lm_head, seed=1)
    assert_loops_agree(model, reference_of(drafter, tmp_path / "drafter"), DFlashProposer(drafter), max_new=60,
                       min_blocks=15)


def assert_loops_agree(model, reference, proposer, max_new: int, min_blocks: int):
    """``dflash_generate`` with the reference model and ``speculative_generate`` with our proposer, on two prompts:
    the same tokens; the same tokens committed per verify step while the whole block fits."""
    B = proposer.block_size
    g = torch.Generator().manual_seed(2)
    compared = []
    for prompt_length in (5, 11):
        prompt = torch.randint(0, 3, (1, prompt_length), generator=g)
        theirs = dflash.dflash_generate(reference, model, prompt, max_new_tokens=max_new, stop_token_ids=None,
                                        return_stats=True)
        ours = speculative_generate(model, proposer, prompt[0].tolist(), max_new_tokens=max_new, eos_ids=set())
        assert ours.tokens == theirs.output_ids[0, prompt_length:].tolist()
        whole_blocks, start = 0, prompt_length
        while whole_blocks < len(ours.committed) and start + B <= prompt_length + max_new:
            start, whole_blocks = start + ours.committed[whole_blocks], whole_blocks + 1
        assert ours.committed[:whole_blocks] == theirs.acceptance_lengths[:whole_blocks]
        assert whole_blocks >= min_blocks
        compared += ours.committed[:whole_blocks]
    assert len(set(compared)) >= 3 and max(compared) >= 3  # drafts accepted, in varied lengths


def reference_block_mask(a: int, B: int, layer_type: str, window: int) -> torch.Tensor:
    """The reference's own inference mask of a block anchored at ``a``: queries = the B slots, keys = [context
    0..a-1 ; the block] (``dflash.model._attention_mask``, as its attention builds it)."""
    sliding = layer_type == "sliding_attention"
    q, k = torch.zeros(1, 1, B, 1), torch.zeros(1, 1, a + B, 1)
    return dflash._attention_mask(q, k, is_causal=sliding, sliding_window=window if sliding else None)[0, 0]


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
@pytest.mark.parametrize("window", [5, 24])
def test_training_masks_equal_the_reference_mask_block_by_block(layer_type, window):
    """Our training masks over a packed batch (dense, and the FlexAttention BlockMask's mask_mod, whose tiles
    test_drafter checks against create_block_mask) hold, for each block, the reference's inference mask over its
    own sequence's context and its own slots, and nothing else."""
    g = torch.Generator().manual_seed(4)
    lengths = [300, 45, 170]
    anchors = [torch.randperm(T, generator=g)[:12].sort().values for T in lengths]
    starts = torch.cat([torch.full((len(a),), sum(lengths[:s])) for s, a in enumerate(anchors)])
    anchors_all, T = torch.cat(anchors), sum(lengths)
    expected = torch.zeros(len(anchors_all) * B, T + len(anchors_all) * B, dtype=torch.bool)
    for i, (a, start) in enumerate(zip(anchors_all.tolist(), starts.tolist())):
        mask = reference_block_mask(a, B, layer_type, window)
        expected[i * B : (i + 1) * B, start : start + a] = mask[:, :a]
        expected[i * B : (i + 1) * B, T + i * B : T + (i + 1) * B] = mask[:, a:]
    assert torch.equal(dense_attention_mask(anchors_all, T, B, layer_type, window, starts), expected)
    block_mask = flex_block_mask(anchors_all, T, B, layer_type, window, starts)
    q, kv = torch.arange(expected.shape[0])[:, None], torch.arange(expected.shape[1])[None, :]
    assert torch.equal(block_mask.mask_mod(None, None, q, kv), expected)
    assert expected.sum() > 0


# ---- DFlash2 (``dflash.DFlash2DraftModel``) ----
B2 = 8  # the published DFlash2 drafters' block
DFLASH2_ATTENTION = [  # (layer_types, is_causal): the published 27B drafter's, the DFlash rule, every layer causal
    (["sliding_attention"] * 5, False), (LAYER_TYPES, None), (["full_attention", "sliding_attention"] * 2 +
                                                              ["full_attention"], True)]


def dflash2_drafter(config: Qwen3Config, layer_types, is_causal, window: int, mask_token_id: int, embed=None,
                    lm_head=None, seed: int = 0, block_size: int = B2) -> DFlashDrafter:
    """The 27B shape at reduced width as a DFlash2 drafter (group 16 of D 160: 10 groups; rank 24, top-8), every
    weight moved far from its init (the convolutions from the identity, the successor codebook from zero), and logits
    scaled and soft-capped."""
    torch.manual_seed(seed)
    drafter = DFlashDrafter.from_target_config(
        config, mask_token_id=mask_token_id, num_layers=5, block_size=block_size, target_layer_ids=[1, 3, 5],
        head_dim=HEAD_DIM, num_attention_heads=HEADS, num_key_value_heads=KV, intermediate_size=FFN,
        layer_types=layer_types, sliding_window=window, architecture="dflash2", is_causal=is_causal,
        conv_kernel_size=2, conv_group_size=16, selector_rank=24, selector_top_k=min(8, config.vocab_size),
        output_multiplier=1.5, final_logit_softcapping=30.0,
        embed_tokens=embed or nn.Embedding(config.vocab_size, D),
        lm_head=lm_head or nn.Linear(D, config.vocab_size, bias=False))
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return drafter.eval()


def dflash2_reference_of(drafter: DFlashDrafter, directory) -> nn.Module:
    """Our export in ``dflash.DFlash2DraftModel``: from_pretrained with nothing missing, unexpected or mismatched, and
    load_state_dict(strict=True) of the same file (its codebooks, stored without ``.weight``, under the module's
    names)."""
    from safetensors.torch import load_file

    save_dflash(drafter, directory)
    model, info = dflash.DFlash2DraftModel.from_pretrained(directory, output_loading_info=True, dtype=torch.float32)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    state = load_file(str(directory / "model.safetensors"))
    codebooks = {k for k in state if k.endswith("_codebook")}
    assert codebooks == {"candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook"}
    model.load_state_dict({k + ".weight" if k in codebooks else k: v for k, v in state.items()}, strict=True)
    assert model.block_size == drafter.block_size and model.target_layer_ids == [1, 3, 5]
    assert model.candidate_selector.top_k == drafter.config.selector_top_k
    return model.eval()


def assert_same_drafting(ours: DFlashDrafter, theirs: nn.Module, lm_head: nn.Module, vocab: int):
    """Hidden states (inference and training paths), logits, each slot's candidates and the selector's greedy path
    of both models on the same inputs, anchors across a context longer than the window. A packed pass sums in another
    order: its values (up to ~7) agree to ~3e-5 relative (exactly in float64)."""
    paths, backbone = [], []
    for C, blocks, context, h, ref_h in same_hidden_states(ours, theirs, T=40, anchors=[0, 3, 9, 22, 39, 40],
                                                           vocab=vocab, train_tolerance=1e-3):
        logits, ref_logits = ours.logits(h[:, 1:]), theirs.compute_logits(ref_h[:, 1:], lm_head)
        assert (logits - ref_logits).abs().max().item() <= 1e-4, C
        path, candidates, _ = ours.candidate_selector.walk(h[0, 1:], logits[0], blocks[0, 0])
        ref_path, ref_candidates, _ = theirs.propose(ref_h[:, 1:], blocks[:, 0], lm_head, 0.0)
        assert torch.equal(candidates.sort(-1).values, ref_candidates[0].sort(-1).values), C
        assert torch.equal(path, ref_path[0]), C
        paths.append(path)
        backbone.append(ours.draft(context, blocks)[0])
    assert not torch.equal(torch.stack(paths), torch.stack(backbone))  # the selector changes drafts: it is exercised


@pytest.mark.parametrize("layer_types, is_causal, block_size", [(*a, B2) for a in DFLASH2_ATTENTION]
                         + [(*DFLASH2_ATTENTION[0], 16)])
def test_dflash2_export_loads_strictly_into_the_reference_and_drafts_the_same(tmp_path, layer_types, is_causal,
                                                                              block_size):
    config = target_config(vocab=64)
    drafter = dflash2_drafter(config, layer_types, is_causal, window=5, mask_token_id=63, block_size=block_size)
    reference = dflash2_reference_of(drafter, tmp_path / "drafter")
    assert_same_drafting(drafter, reference, drafter.lm_head, 64)


def test_a_reference_built_dflash2_model_loads_into_ours_and_drafts_the_same(tmp_path):
    """``DFlash2DraftModel`` built from a published-style config.json (conv and selector keys in ``dflash_config``,
    ``is_causal`` false over sliding layers), random weights, ``save_pretrained``: our loader takes it strictly."""
    from dflash_pipeline.drafter import load_dflash

    torch.manual_seed(3)
    config = Qwen3Config(hidden_size=D, vocab_size=64, intermediate_size=FFN, num_hidden_layers=5,
                         num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HEAD_DIM, rope_theta=1e7,
                         layer_types=["sliding_attention"] * 5, sliding_window=5, use_sliding_window=True,
                         max_window_layers=5, tie_word_embeddings=False)
    config.architectures = ["DFlash2DraftModel"]
    config.is_causal = False
    config.num_target_layers = 8
    config.dflash_config = {"block_size": B2, "mask_token_id": 63, "target_layer_ids": [1, 3, 5],
                            "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 24, "selector_top_k": 8}
    reference = dflash.DFlash2DraftModel(config).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    reference.save_pretrained(tmp_path / "reference")
    embed, lm_head = nn.Embedding(64, D), nn.Linear(D, 64, bias=False)
    ours = load_dflash(tmp_path / "reference", embed, lm_head)
    assert ours.config.architecture == "dflash2" and ours.config.is_causal is False and ours.block_size == B2
    assert_same_drafting(ours, reference, lm_head, 64)


def test_dflash2_generate_and_our_loop_agree(tmp_path, tiny_target, monkeypatch):
    """The reference's ``dflash_generate`` with its DFlash2 model (the selector's greedy walk) and our loop with
    ``DFlash2Proposer``: the same tokens and the same tokens committed per verify step."""
    import time

    from dflash_pipeline.speculative import make_proposer

    monkeypatch.setattr(dflash, "_cuda_time", time.perf_counter)
    model = tiny_target
    drafter = dflash2_drafter(model.config, ["sliding_attention"] * 5, False, window=6, mask_token_id=3,
                              embed=model.get_input_embeddings(), lm_head=model.lm_head, seed=4)
    assert_loops_agree(model, dflash2_reference_of(drafter, tmp_path / "drafter"), make_proposer(drafter), max_new=48,
                       min_blocks=8)
