"""The speculative decoding engine (src/dflash_pipeline/speculative.py).

Greedy: on the real SmolLM2-135M-Instruct target (fp32, CPU) the speculative output must equal
``generate(do_sample=False)`` token for token, with a random DFlash drafter, an oracle drafter, drafters
that inject mismatches, and an always-wrong drafter, including EOS and the length limit falling inside a
block. Sampling: the lossless acceptance rule, checked against exact target distributions.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from dflash_pipeline.drafter import DFlashDrafter, resolve_mask_token_id
from dflash_pipeline.speculative import (
    DFlashProposer,
    Proposer,
    TargetSession,
    greedy_accept,
    sampling_accept,
    speculative_generate,
)

QUESTIONS = [  # greedy answers ending in EOS after 12, 8, 11, 11, 23 tokens; the other 5 reach the limit
    "What is 2+2?", "What is the capital of France?", "Translate 'cat' to French.", "What is 10 times 3?",
    "Name a color.", "Say hello.", "Is water wet? Answer yes or no.", "List three fruits.",
    "What is the opposite of hot?", "Who wrote Hamlet?",
]
MAX_NEW = 24  # with B=16: 1 token from the prefill, then 16 + 7 -> the limit falls inside the second block


# ---- proposers for tests ----
class ScriptedProposer(Proposer):
    """Proposes the target's known greedy continuation ``reference`` (an oracle), with the drafts at the
    block slots ``wrong(step)`` (1-based) replaced by a wrong token; past the reference: token ``fill``."""

    def __init__(self, reference: list[int], prompt_length: int, block_size: int, wrong=lambda step: (), fill=3):
        self.reference, self.prompt_length, self.block_size = reference, prompt_length, block_size
        self.wrong, self.fill, self.step = wrong, fill, 0

    def start(self, prompt_ids):
        self.step = 0

    def propose(self, tokens, features, *, temperature=0.0, generator=None):
        done = len(tokens) - self.prompt_length
        drafts = [self.reference[i] if i < len(self.reference) else self.fill
                  for i in range(done, done + self.block_size - 1)]
        for slot in self.wrong(self.step):
            drafts[slot - 1] = (drafts[slot - 1] + 1) % 49152
        self.step += 1
        return torch.tensor(drafts), None


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    from dflash_pipeline.target import load_target, load_tokenizer

    model, tokenizer = load_target(str(smollm2_dir)), load_tokenizer(str(smollm2_dir))
    prompts = []
    for question in QUESTIONS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    references = []
    for ids in prompts:
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=MAX_NEW)
        references.append(out[0, len(ids):].tolist())
    return model, tokenizer, prompts, references


def test_scripted_drafters_are_lossless_with_eos_and_limit_inside_blocks(smollm2):
    model, _, prompts, references = smollm2
    B = 16
    assert any(ref[-1] == 2 and len(ref) < MAX_NEW for ref in references)  # some stop on EOS ...
    assert any(len(ref) == MAX_NEW and 2 not in ref for ref in references)  # ... some on the limit
    patterns = {
        "oracle": lambda step: (),
        "mismatches at slots 3, 1, 7, 15, ...": lambda step: ((3, 1, 7, 15)[step % 4], 12),
    }
    seen = {"eos_cut": 0, "limit_cut": 0}
    for name, wrong in patterns.items():
        for ids, ref in zip(prompts, references):
            g = speculative_generate(model, ScriptedProposer(ref, len(ids), B, wrong), ids, max_new_tokens=MAX_NEW)
            assert g.tokens == ref, name
            assert sum(g.committed) == len(ref) - 1 and len(g.accepted) == len(g.committed)
            for step, (a, c) in enumerate(zip(g.accepted[:-1], g.committed[:-1])):  # every step but the last
                first_wrong = min(wrong(step), default=B)
                assert a == first_wrong - 1 and c == a + 1, (name, step)
            last_a, last_c = g.accepted[-1], g.committed[-1]
            if name == "oracle":  # tau = B exactly until EOS or the limit
                assert g.committed[:-1] == [B] * (len(g.committed) - 1) and last_c <= B
            if last_c < last_a + 1:  # the step was cut inside the block
                seen["eos_cut" if g.stopped_by == "eos" else "limit_cut"] += 1
    assert all(seen.values()), seen  # EOS as an accepted draft inside a block, the limit inside a block


def test_always_wrong_drafter_gives_tau_one(smollm2):
    model, _, prompts, references = smollm2
    for ids, ref in list(zip(prompts, references))[2:4]:  # 11-token answers ending in EOS
        g = speculative_generate(model, ScriptedProposer(ref, len(ids), 16, lambda step: range(1, 16)), ids,
                                 max_new_tokens=MAX_NEW)
        assert g.tokens == ref and g.tau == 1.0 and set(g.accepted) == {0}
        assert g.stopped_by == "eos" and g.committed == [1] * 10  # EOS came as a bonus token


def test_random_dflash_drafter_is_lossless(smollm2):
    model, tokenizer, prompts, references = smollm2
    torch.manual_seed(0)
    drafter = DFlashDrafter.from_target_config(
        model.config, mask_token_id=resolve_mask_token_id(tokenizer, 49152), num_layers=1,
        embed_tokens=model.get_input_embeddings(), lm_head=model.get_output_embeddings())
    proposer, max_new = DFlashProposer(drafter), 9  # the references' first 9 tokens (one ends in EOS at 8)
    stops = set()
    for ids, ref in zip(prompts, references):
        g = speculative_generate(model, proposer, ids, max_new_tokens=max_new)
        expected = ref[:max_new]
        assert g.tokens == expected and sum(g.committed) == len(expected) - 1
        stops.add(g.stopped_by)
    assert stops == {"eos", "length"}


# ---- a tiny random target: capture, rollback, sampling ----
V = 8


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, eos_token_id=None, bos_token_id=None, pad_token_id=None,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # spread but prefix-dependent distributions (entropy ~1.8 nats)
    drafter = DFlashDrafter.from_target_config(config, mask_token_id=V - 1, num_layers=1, block_size=4,
                                               target_layer_ids=[0, 2], head_dim=8,
                                               embed_tokens=model.get_input_embeddings(), lm_head=model.lm_head)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    return model, drafter.eval()


def test_capture_and_rollback(tiny):
    model, _ = tiny
    ids = torch.randint(0, V, (1, 12))
    hidden = model(ids, output_hidden_states=True).hidden_states
    hooks_before = len(model.model.layers[0]._forward_hooks)
    session = TargetSession(model, [0, 2])
    try:
        _, prefix = session.forward(ids[0, :7].tolist(), last_only=True)
        logits, block = session.forward(ids[0, 7:].tolist())
        assert session.length == 12 and logits.shape == (5, V)
        features = torch.cat([prefix, block])
        expected = torch.cat([hidden[1][0], hidden[3][0]], dim=-1)  # id x = hidden_states[x + 1]
        torch.testing.assert_close(features, expected, atol=1e-5, rtol=1e-5)
        session.rollback(9)
        assert session.length == 9
        logits2, _ = session.forward(ids[0, 9:].tolist())  # recomputing after the crop gives the same logits
        torch.testing.assert_close(logits2, logits[2:], atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError):
            session.rollback(20)
    finally:
        session.close()
    assert len(model.model.layers[0]._forward_hooks) == hooks_before  # close() removed the capture hooks


def test_greedy_accept():
    logits = torch.eye(6)[[1, 2, 3, 4]] * 5  # target argmax per slot: 1, 2, 3, 4
    assert greedy_accept(logits, torch.tensor([1, 2, 3])) == (3, 4)
    assert greedy_accept(logits, torch.tensor([1, 5, 3])) == (1, 2)
    assert greedy_accept(logits, torch.tensor([0, 2, 3])) == (0, 1)


def _tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


@pytest.mark.parametrize("with_q", [True, False])
def test_sampling_rule_reproduces_target_distribution(with_q):
    """A target whose next-token distribution does not depend on the prefix: the first committed token
    follows p_1 and, after an accepted first draft, the second follows p_2, whatever q proposes."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5], [0.0, 2.0, 1.0, 0.0, -2.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    p = torch.softmax(logits, -1)
    q = torch.softmax(torch.tensor([[0.0, 0.0, 3.0, 0.0, 0.0], [3.0, 0.0, 0.0, 0.0, 0.0]]), -1)
    first, second, n = torch.zeros(5), torch.zeros(5), 6000
    for _ in range(n):
        drafts = torch.multinomial(q, 1, generator=gen)[:, 0] if with_q else torch.tensor([2, 0])
        a, nxt = sampling_accept(logits, drafts, q if with_q else None, 1.0, gen)
        first[int(drafts[0]) if a >= 1 else nxt] += 1
        if a >= 1:
            second[int(drafts[1]) if a >= 2 else nxt] += 1
    assert _tv(first, p[0]) < 0.025 and _tv(second, p[1]) < 0.035
    assert _tv(first, q[0] if with_q else torch.eye(5)[2]) > 0.3  # blind acceptance would be caught


def test_speculative_sampling_matches_target_distribution(tiny):
    """End to end with a DFlash drafter: the marginals of generated tokens 2 and 3 match the exact ones."""
    model, drafter = tiny
    prompt = [1, 5, 2]
    with torch.no_grad():  # exact marginals of tokens 1..3 of plain sampling at T=1, by enumeration
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
        two = torch.tensor([prompt + [a] for a in range(V)])
        p2 = torch.softmax(model(two).logits[:, -1], -1)  # [t1, t2]
        three = torch.tensor([prompt + [a, b] for a in range(V) for b in range(V)])
        p3 = torch.softmax(model(three).logits[:, -1], -1).view(V, V, V)
    joint12 = p1[:, None] * p2
    marg2, marg3 = joint12.sum(0), (joint12[..., None] * p3).sum((0, 1))
    proposer, gen = DFlashProposer(drafter), torch.Generator().manual_seed(1)
    counts2, counts3, accepted, n = torch.zeros(V), torch.zeros(V), [], 500
    for _ in range(n):
        g = speculative_generate(model, proposer, prompt, max_new_tokens=3, temperature=1.0, generator=gen,
                                 eos_ids=set())
        assert len(g.tokens) == 3
        counts2[g.tokens[1]] += 1
        counts3[g.tokens[2]] += 1
        accepted += g.accepted
    assert 0.3 < sum(accepted) / len(accepted) < 2.5  # partial acceptance: the rule really was exercised
    # sampling noise at n=500 is ~0.05; accepting drafts blindly gives ~0.37, resampling a rejected slot
    # from p instead of norm(max(p - q, 0)) ~0.16 / 0.12 (measured with this seed)
    assert _tv(counts2, marg2) < 0.1 and _tv(counts3, marg3) < 0.1, (_tv(counts2, marg2), _tv(counts3, marg3))


def test_dflash_proposer_feeds_context_incrementally(tiny):
    """The drafts of the cached proposer equal a fresh drafter run over the whole context at every step."""
    model, drafter = tiny

    class Checking(DFlashProposer):
        def propose(self, tokens, features, **kw):
            drafts, _ = super().propose(tokens, features, **kw)
            full = TargetSession(model, self.layer_ids)
            try:
                _, all_features = full.forward(tokens[:-1])
            finally:
                full.close()
            block = torch.tensor([[tokens[-1]] + [drafter.mask_token_id] * 3])
            assert torch.equal(drafter.draft(all_features[None], block, len(tokens) - 1)[0], drafts)
            return drafts, None

    g = speculative_generate(model, Checking(drafter), [1, 5, 2, 6], max_new_tokens=12, eos_ids=set())
    assert len(g.tokens) == 12
