"""DFlash2 drafters (drafter/dflash2.py): the identity start, the selector's training term and its gradients, the
teacher-forced predecessors of a pack, a training step, and the selector's walk in the speculative loop (lossless:
greedy on the real SmolLM2 target, sampling against exact target distributions). Parity with the reference
``dflash`` package is in test_reference_parity.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config

from dflash_pipeline.drafter import DFlashDrafter, dflash_config_from_target, resolve_mask_token_id
from dflash_pipeline.losses import selector_targets
from dflash_pipeline.losses import LogitsTransform, SelectorLoss, chunked_lm_loss
from dflash_pipeline.speculative import DFlash2Proposer, DFlashProposer, make_proposer, speculative_generate
from dflash_pipeline.train.step import packed_forward, selector_loss
from dflash_pipeline.train_data import Pack

V, D = 40, 64


def target_config() -> Qwen3Config:
    return Qwen3Config(hidden_size=D, vocab_size=V, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, tie_word_embeddings=False)


def dflash2(seed: int = 0, block_size: int = 8, **kwargs) -> DFlashDrafter:
    torch.manual_seed(seed)
    return DFlashDrafter.from_target_config(
        target_config(), mask_token_id=V - 1, num_layers=2, block_size=block_size, head_dim=16,
        target_layer_ids=[1, 3, 5],
        architecture="dflash2",
        selector_rank=12, selector_top_k=6, embed_tokens=nn.Embedding(V, D), lm_head=nn.Linear(D, V, bias=False),
        **{"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5, **kwargs})


def test_a_fresh_dflash2_drafter_drafts_as_its_dflash_backbone():
    """Identity convolutions and a zero successor codebook: the same hidden states as a DFlash drafter with the same
    layers, and the walk is the argmax."""
    drafter = dflash2(seed=1)
    backbone = DFlashDrafter(dflash_config_from_target(target_config(), mask_token_id=V - 1, num_layers=2,
                                                       block_size=8, head_dim=16, sliding_window=5,
                                                       target_layer_ids=[1, 3, 5],
                                                       layer_types=["sliding_attention", "full_attention"]),
                             drafter.embed_tokens, drafter.lm_head)
    missing, unexpected = backbone.load_state_dict(drafter.state_dict(), strict=False)
    assert not missing and unexpected and all("conv" in k or "selector" in k for k in unexpected)
    features, block = torch.randn(1, 20, 3 * D), torch.tensor([[5] + [V - 1] * 7])
    with torch.no_grad():
        h = drafter.forward_block(features, block)
        assert torch.equal(h, backbone.forward_block(features, block))
        path, _, _ = drafter.candidate_selector.walk(h[0, 1:], drafter.logits(h[0, 1:]), 5)
    assert torch.equal(path, backbone.draft(features, block)[0])


def test_selector_targets_put_the_gold_token_in_place_of_the_lowest():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, 2.0, 1.0], [9.0, 1.0, 2.0, 3.0, 4.0, 0.0]])
    candidates, index, covered = selector_targets(logits, torch.tensor([3, 5]), top_k=3)
    assert candidates.tolist() == [[1, 2, 3], [0, 4, 5]] and index.tolist() == [2, 2]
    assert covered.tolist() == [True, False]


def reference_loss(hidden, weight, labels, weights, transform, term: SelectorLoss):
    """The same objective with plain autograd over the whole [N, V] logits."""
    logits, _ = transform(hidden @ weight.T)
    loss = (F.cross_entropy(logits, labels, reduction="none") * weights).sum()
    candidates, index, _ = selector_targets(logits.detach(), labels, term.selector.top_k)
    scores = logits.gather(1, candidates) + term.selector.transition(hidden, term.predecessors, candidates)
    return loss + (F.cross_entropy(scores, index, reduction="none") * term.weights).sum()


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_the_chunked_loss_and_its_gradients_equal_autograd(softcap):
    """Loss, and gradients to the hidden states and every selector weight, over chunks smaller than the rows, with
    the logits scaled and soft-capped, rows whose gold is outside the top-K, and rows without a selector term."""
    drafter = dflash2(seed=2)
    with torch.no_grad():
        drafter.candidate_selector.successor_codebook.normal_(std=0.5)  # a transition term that matters
    selector, weight = drafter.candidate_selector, drafter.lm_head.weight.detach()
    g = torch.Generator().manual_seed(3)
    N = 23
    hidden = torch.randn(N, D, generator=g)
    labels = torch.randint(0, V, (N,), generator=g)
    weights = torch.rand(N, generator=g)
    term = SelectorLoss(selector, torch.randint(0, V, (N,), generator=g), torch.rand(N, generator=g) * (
        torch.arange(N) % 4 != 0))
    transform = LogitsTransform(1.7, softcap)
    ours_h = hidden.clone().requires_grad_(True)
    loss, _, _ = chunked_lm_loss(ours_h, weight, labels, weights, chunk_size=5, predict=False, transform=transform,
                                 selector_loss=term)
    loss.backward()
    ours = [ours_h.grad] + [p.grad.clone() for p in selector.parameters()]
    selector.zero_grad()
    ref_h = hidden.clone().requires_grad_(True)
    expected = reference_loss(ref_h, weight, labels, weights, transform, term)
    expected.backward()
    theirs = [ref_h.grad] + [p.grad for p in selector.parameters()]
    assert torch.allclose(loss, expected, rtol=1e-5)
    for a, b in zip(ours, theirs):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    missing = ~selector_targets(transform(hidden @ weight.T)[0], labels, selector.top_k)[2]
    assert missing.any() and (~missing).any()


def test_the_selector_term_is_teacher_forced_on_the_gold_token_before():
    """Slot 1's predecessor is the anchor token, slot k's the label of slot k-1; a slot after a slot without a label
    has no selector term (its predecessor is no label of the pack)."""
    drafter = dflash2()
    drafter.selector_loss_weight = 0.5
    B = 8
    blocks = torch.tensor([[11] + [V - 1] * 7, [21] + [V - 1] * 7])
    slots = torch.tensor([1, 2, 3, 9, 10, 12, 13])  # block 1: slot 11 has no label
    labels = torch.tensor([12, 13, 14, 22, 23, 25, 26])
    weights = torch.full((7,), 2.0)
    pack = Pack(context=torch.zeros(1, 1, 3 * D), anchors=torch.tensor([0, 0]), blocks=blocks, slots=slots,
                labels=labels, weights=weights, lengths=[1], block_counts=[2])
    term = selector_loss(drafter, pack)
    assert term.predecessors[[0, 1, 2, 3, 4]].tolist() == [11, 12, 13, 21, 22]
    assert term.weights.tolist() == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]
    assert slots.view(-1).max() < 2 * B
    drafter.selector_loss_weight = 0.0
    assert selector_loss(drafter, pack) is None


def random_pack(B: int, g: torch.Generator) -> Pack:
    """A pack of two sequences (30 and 20 tokens), 7 blocks, every slot inside its sequence labelled."""
    lengths = [30, 20]
    anchors = torch.tensor([0, 6, 13, 21, 0, 5, 11])
    tokens = [torch.randint(0, V - 1, (n,), generator=g) for n in lengths]
    owner = [0] * 4 + [1] * 3
    blocks = torch.full((7, B), V - 1)
    blocks[:, 0] = torch.stack([tokens[s][a] for s, a in zip(owner, anchors.tolist())])
    positions = anchors[:, None] + torch.arange(B)
    valid = positions < torch.tensor([lengths[s] for s in owner])[:, None]
    valid[:, 0] = False
    slots = valid.flatten().nonzero()[:, 0]
    labels = torch.stack([tokens[owner[i // B]][positions.flatten()[i]] for i in slots.tolist()])
    return Pack(context=torch.randn(1, sum(lengths), 3 * D, generator=g), anchors=anchors, blocks=blocks,
                slots=slots, labels=labels, weights=torch.ones(len(slots)), lengths=lengths,
                block_counts=[4, 3])


@pytest.mark.parametrize("B", [8, 16])
def test_a_training_step_reaches_every_dflash2_weight_and_learns(B):
    """packed_forward on a pack of two sequences: every weight gets a gradient in the first steps (the successor
    codebook first, the rest once it is non-zero), and a few AdamW steps lower the loss."""
    drafter = dflash2(seed=4, block_size=B, output_multiplier=1.3, final_logit_softcapping=20.0).train()
    pack = random_pack(B, torch.Generator().manual_seed(5))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    losses, touched = [], set()
    for _ in range(12):
        optimizer.zero_grad()
        loss, weight, _ = packed_forward(drafter, pack, amp=False, train=True)
        (loss / weight).backward()
        touched |= {name for name, p in drafter.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
        optimizer.step()
        losses.append(loss.item() / weight.item())
    assert touched == {name for name, _ in drafter.named_parameters()}
    assert losses[-1] < 0.8 * losses[0], losses


def test_the_validation_proxy_of_a_dflash2_drafter_is_its_walks():
    """Validation's correct slots of a DFlash2 drafter are the selector's teacher-forced choices: their leading run in
    each block is the number of leading drafts of the selector's own walk that equal the data. The data: each block's
    walk with slot i % 7 + 1 changed (block 6: none), so that the leading runs are 1, 2, ..., 6 and 7."""
    from dflash_pipeline.losses import acceptance_proxy

    drafter = dflash2(seed=8).eval()
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    pack = random_pack(8, torch.Generator().manual_seed(9))
    pack.slots = torch.cat([torch.arange(1, 8) + 8 * i for i in range(7)])  # every slot labelled
    pack.weights = torch.ones(len(pack.slots))
    with torch.no_grad():
        hidden = drafter.forward_blocks(pack.context, pack.anchors, pack.blocks, lengths=pack.lengths,
                                        block_counts=pack.block_counts)
        paths = torch.stack([drafter.candidate_selector.walk(hidden[i, 1:], drafter.logits(hidden[i, 1:]),
                                                             pack.blocks[i, 0])[0] for i in range(7)])
        data = paths.clone()
        for i in range(6):
            data[i, i + 1] = (data[i, i + 1] + 1) % (V - 1)
        pack.labels = data.flatten()
        _, _, correct = packed_forward(drafter, pack, amp=False, train=False)
    assert (acceptance_proxy(correct) - 1).tolist() == [1, 2, 3, 4, 5, 6, 7]
    backbone = drafter.logits(hidden[:, 1:]).argmax(-1)
    assert not torch.equal(backbone, paths)  # the walk is not the argmax: the proxy is the selector's


# ---- the walk in the speculative loop ----
QUESTIONS = ["What is 2+2?", "Name a color.", "List three fruits."]


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    from dflash_pipeline.target import load_target, load_tokenizer

    model, tokenizer = load_target(str(smollm2_dir)), load_tokenizer(str(smollm2_dir))
    prompts = [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                       add_generation_prompt=True), add_special_tokens=False)[
        "input_ids"] for q in QUESTIONS]
    return model, tokenizer, prompts


def test_a_random_dflash2_drafter_is_lossless_on_smollm2(smollm2):
    """The selector's greedy walk, on a drafter far from its start (so that the walk is not the argmax), gives the
    target's own greedy tokens."""
    model, tokenizer, prompts = smollm2
    torch.manual_seed(0)
    drafter = DFlashDrafter.from_target_config(
        model.config, mask_token_id=resolve_mask_token_id(tokenizer, 49152), num_layers=1, block_size=8,
        architecture="dflash2", selector_rank=16, embed_tokens=model.get_input_embeddings(),
        lm_head=model.get_output_embeddings())
    with torch.no_grad():
        drafter.candidate_selector.successor_codebook.normal_(std=1.0)
    proposer = make_proposer(drafter)
    assert isinstance(proposer, DFlash2Proposer)
    for ids in prompts:
        expected = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                  do_sample=False, max_new_tokens=12)[0, len(ids):].tolist()
        assert speculative_generate(model, proposer, ids, max_new_tokens=12).tokens == expected


@pytest.fixture(scope="module")
def tiny():
    """A Llama target of 8 tokens with spread, prefix-dependent distributions and a DFlash2 drafter whose top-4
    candidates leave half of the vocabulary out of q."""
    torch.manual_seed(0)
    vocab = 8
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, eos_token_id=None,
                         bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)
    drafter = DFlashDrafter.from_target_config(config, mask_token_id=vocab - 1, num_layers=1, block_size=4,
                                               target_layer_ids=[0, 2], head_dim=8, architecture="dflash2",
                                               conv_group_size=8, selector_rank=4, selector_top_k=4,
                                               embed_tokens=model.get_input_embeddings(), lm_head=model.lm_head)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return model, drafter.eval()


def test_sampled_walks_return_their_distribution_over_the_vocabulary(tiny):
    model, drafter = tiny
    proposer = DFlash2Proposer(drafter)
    proposer.start([1, 5, 2])
    features = torch.randn(2, 2 * 32)  # positions 0..1: the anchor (2) is not in the context yet
    drafts, q = proposer.propose([1, 5, 2], features, temperature=0.7, generator=torch.Generator().manual_seed(0))
    assert q.shape == (3, 8) and torch.allclose(q.sum(-1), torch.ones(3))
    assert ((q > 0).sum(-1) <= 4).all() and (q[torch.arange(3), drafts] > 0).all()


def test_speculative_sampling_with_the_walk_matches_the_target_distribution(tiny):
    """The marginals of generated tokens 2 and 3 match the exact ones of plain sampling at T = 1."""
    model, drafter = tiny
    vocab, prompt = 8, [1, 5, 2]
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
        p2 = torch.softmax(model(torch.tensor([prompt + [a] for a in range(vocab)])).logits[:, -1], -1)
        three = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
        p3 = torch.softmax(model(three).logits[:, -1], -1).view(vocab, vocab, vocab)
    joint12 = p1[:, None] * p2
    marg2, marg3 = joint12.sum(0), (joint12[..., None] * p3).sum((0, 1))
    proposer, gen = DFlash2Proposer(drafter), torch.Generator().manual_seed(1)
    counts2, counts3, accepted, n = torch.zeros(vocab), torch.zeros(vocab), [], 500
    for _ in range(n):
        g = speculative_generate(model, proposer, prompt, max_new_tokens=3, temperature=1.0, generator=gen,
                                 eos_ids=set())
        counts2[g.tokens[1]] += 1
        counts3[g.tokens[2]] += 1
        accepted += g.accepted
    assert 0.3 < sum(accepted) / len(accepted) < 2.5
    tv = [0.5 * (c / c.sum() - m).abs().sum().item() for c, m in ((counts2, marg2), (counts3, marg3))]
    assert max(tv) < 0.1, tv


def test_backbone_drafts_of_a_dflash2_drafter_are_the_argmax(tiny):
    """``DFlashProposer`` over a DFlash2 drafter drafts the backbone's argmax: the "backbone drafts" evaluation."""
    model, drafter = tiny
    features = torch.randn(2, 2 * 32)  # positions 0..1: the anchor (2) is not in the context yet
    backbone, walk = DFlashProposer(drafter), DFlash2Proposer(drafter)
    for proposer in (backbone, walk):
        proposer.start([1, 5, 2])
    drafts, _ = backbone.propose([1, 5, 2], features)
    logits = walk.block_logits([1, 5, 2], features)
    assert torch.equal(drafts, logits.argmax(-1))


def test_dflash2_keys_need_the_dflash2_architecture():
    with pytest.raises(ValueError, match="architecture to dflash2"):
        dflash_config_from_target(target_config(), mask_token_id=1, selector_rank=8)
    with pytest.raises(ValueError, match="conv_group_size 48 does not divide"):
        dflash_config_from_target(target_config(), mask_token_id=1, architecture="dflash2", conv_group_size=48)
    with pytest.raises(ValueError, match="is_causal"):
        dflash_config_from_target(target_config(), mask_token_id=1, is_causal=True)  # over full layers
    config = dflash_config_from_target(target_config(), mask_token_id=1, architecture="dflash2", block_size=8)
    assert (config.conv_kernel_size, config.conv_group_size, config.selector_rank, config.selector_top_k) == (
        2, 16, 256, 16)
    assert np.isclose(config.output_multiplier, 1.0) and config.final_logit_softcapping is None


def test_evaluate_records_backbone_drafts_beside_the_selectors(tiny):
    """``evaluate.backbone_drafts``: the same DFlash2 drafter decoded a second time with its backbone's argmax drafts;
    result.json's ``backbone_drafts`` holds their tau. A DFlash drafter has no second run."""
    from dflash_pipeline.evaluate import evaluate_rows, summarize

    model, drafter = tiny
    prompts = [{"id": i, "prompt_ids": ids} for i, ids in enumerate([[1, 5, 2], [3, 3, 6, 1], [0, 4]])]
    rows = evaluate_rows(model, drafter, prompts, max_new_tokens=20, baselines=False, warmup=False,
                         backbone_drafts=True)
    result = summarize(rows, block_size=4, max_new_tokens=20)
    for row, prompt in zip(rows, prompts):
        walk = speculative_generate(model, DFlash2Proposer(drafter), prompt["prompt_ids"], max_new_tokens=20)
        argmax = speculative_generate(model, DFlashProposer(drafter), prompt["prompt_ids"], max_new_tokens=20)
        assert (row["committed"], row["backbone_committed"]) == (walk.committed, argmax.committed)
        assert row["output_ids"] == argmax.tokens  # greedy: both lossless
    assert set(result["backbone_drafts"]) == {"tau_mean", "tau_pooled", "tokens_per_s", "tau_loop_aware_mean",
                                              "tau_loop_aware_pooled"}
    assert [r["committed"] for r in rows] != [r["backbone_committed"] for r in rows]  # two different runs
    plain = DFlashDrafter.from_target_config(model.config, mask_token_id=7, num_layers=1, block_size=4,
                                             target_layer_ids=[0, 2], head_dim=8,
                                             embed_tokens=model.get_input_embeddings(), lm_head=model.lm_head)
    rows = evaluate_rows(model, plain, prompts[:1], max_new_tokens=8, baselines=False, warmup=False,
                         backbone_drafts=True)
    assert "backbone_committed" not in rows[0] and "backbone_drafts" not in summarize(rows, block_size=4,
                                                                                      max_new_tokens=8)


@pytest.mark.parametrize("overlays", [
    ["config/examples/smollm2-quality.yaml", "benchmarks/smoke/gpu_smoke.yaml", "benchmarks/smoke/gpu_smoke_dflash2.yaml"],
    ["config/examples/smollm2-varied.yaml", "benchmarks/overlays/stage2_from_stored_answers.yaml",
     "benchmarks/overlays/stage2_from_stored_answers_5ep.yaml", "benchmarks/overlays/dflash2.yaml"]])
def test_the_dflash2_overlays_build_a_dflash2_drafter(overlays):
    """The GPU smoke overlay and the comparison arm validate over their recipes and shape a DFlash2 drafter for
    SmolLM2 (D 576: 36 groups of 16 channels)."""
    from dflash_pipeline.drafter import architecture_kwargs
    from dflash_pipeline.plan import load_config
    from workflow_helpers import REPO

    config = load_config([str(REPO / path) for path in overlays], str(REPO))
    smollm2 = LlamaConfig(hidden_size=576, vocab_size=49152, intermediate_size=1536, num_hidden_layers=30,
                          num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    drafter = dflash_config_from_target(smollm2, mask_token_id=16, **architecture_kwargs(config["train"]))
    assert drafter.architecture == "dflash2" and config["evaluate"]["backbone_drafts"]
    assert (drafter.conv_kernel_size, drafter.conv_group_size, drafter.selector_rank, drafter.selector_top_k) == (
        2, 16, 256, 16)


def test_the_flex_path_and_the_compiled_layer_pass_compute_the_dense_pass():
    """The training path on FlexAttention (bidirectional sliding layers: is_causal false) and each layer's pass through
    dynamo whole (train.compile_layers; dynamo's eager backend on the CPU), the convolutions inside, over packs of two
    shapes: the dense pass's hidden states, one graph, no graph break."""
    import warnings

    from torch._dynamo.utils import counters

    from dflash_pipeline.drafter import decoder_layer_pass

    drafter = dflash2(seed=6, is_causal=False)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # convolutions away from the identity
    torch._dynamo.reset()
    counters.clear()
    g = torch.Generator().manual_seed(7)
    runs = []
    for lengths, anchors in (([21, 12], [[0, 4, 13, 20], [2, 7]]), ([17], [[1, 5, 9]])):
        blocks = torch.randint(0, V - 1, (sum(map(len, anchors)), 8), generator=g)
        blocks[:, 1:] = V - 1
        runs.append((torch.randn(1, sum(lengths), 3 * D, generator=g), torch.tensor(sum(anchors, [])), blocks,
                     dict(lengths=lengths, block_counts=[len(a) for a in anchors])))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # CPU flex: the unfused reference path
        dense = [drafter.forward_blocks(f, a, b, attn_impl="sdpa", **kw) for f, a, b, kw in runs]
        flex = [drafter.forward_blocks(f, a, b, attn_impl="flex", **kw) for f, a, b, kw in runs]
        drafter.layer_pass = torch.compile(decoder_layer_pass, backend="eager", dynamic=True)
        traced = [drafter.forward_blocks(f, a, b, attn_impl="flex", **kw) for f, a, b, kw in runs]
    for x, y in [*zip(flex, dense), *zip(traced, dense)]:
        assert (x - y).abs().max().item() <= 1e-5 * y.abs().max().item()
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]
