"""Speculative decoding on hybrid Gated-DeltaNet targets (tiny random qwen3_5 / qwen3_next, fp32, CPU).

The Gated-DeltaNet conv and recurrent states cannot be cropped; ``TargetSession.rollback`` restores them
and recomputes them over the committed prefix. Lossless means: the speculative output equals plain greedy
decoding token for token, for every number of accepted drafts 0..B-1 (drafts with a mismatch injected at
each block slot in turn), for the oracle (tau = B) and the always-wrong (tau = 1) proposers, and for a
random DFlash drafter run through ``evaluate.evaluate``.
"""

from __future__ import annotations

import pytest
import torch

from dflash_pipeline.drafter import DFlashDrafter, resolve_mask_token_id
from dflash_pipeline.evaluate import autoregressive, evaluate
from dflash_pipeline.speculative import Proposer, TargetSession, speculative_generate
from dflash_pipeline.target import has_linear_attention, load_target

B = 16
CYCLE = B * (B + 1) // 2  # tokens committed by B steps accepting 0, 1, ..., B-1 drafts
MAX_NEW = 1 + CYCLE  # the prefill's token, then one full cycle of accepted lengths
QUESTIONS = ["What is the capital of France?", "List three fruits."]
LAYER_IDS = [0, 3, 6]  # GDN, full attention, GDN


def chat_prompts(tokenizer) -> list[list[int]]:
    prompts = []
    for question in QUESTIONS:
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts


class Scripted(Proposer):
    """Proposes the target's greedy continuation ``reference``, with the drafts at the block slots
    ``wrong(step)`` (1-based; slot B does not exist) made wrong. Keeps the features it is given, in order."""

    layer_ids = LAYER_IDS

    def __init__(self, reference: list[int], prompt_length: int, wrong):
        self.reference, self.prompt_length, self.wrong, self.block_size = reference, prompt_length, wrong, B

    def start(self, prompt_ids):
        self.step, self.features = 0, []

    def propose(self, tokens, features, *, temperature=0.0, generator=None):
        self.features.append(features)
        done = len(tokens) - self.prompt_length
        drafts = [self.reference[i] if i < len(self.reference) else 3 for i in range(done, done + B - 1)]
        for slot in self.wrong(self.step):
            if slot < B:
                drafts[slot - 1] = (drafts[slot - 1] + 1) % 49152
        self.step += 1
        return torch.tensor(drafts), None


@pytest.fixture(scope="module", params=["qwen3_5_text_dir", "qwen3_5_vl_dir", "qwen3_next_dir"])
def hybrid(request, smollm2_tokenizer):
    model = load_target(str(request.getfixturevalue(request.param)))
    assert has_linear_attention(model)
    prompts = chat_prompts(smollm2_tokenizer)
    references = [autoregressive(model, ids, MAX_NEW)["tokens"] for ids in prompts]
    assert all(len(ref) == MAX_NEW for ref in references)  # no EOS: every step below is a full block
    return request.param, model, prompts, references


def test_every_accepted_length_is_lossless_and_context_features_are_exact(hybrid):
    name, model, prompts, references = hybrid
    for ids, ref in zip(prompts, references):
        proposer = Scripted(ref, len(ids), lambda step: {step % B + 1})  # a = 0, 1, ..., B-1
        g = speculative_generate(model, proposer, ids, max_new_tokens=MAX_NEW)
        assert g.tokens == ref, name
        assert g.accepted == list(range(B)) and g.committed == [a + 1 for a in range(B)], name
        # the drafter's context: the features of exactly the committed positions, each once, in order (up
        # to the last step's anchor: the last step's features are never asked for), equal to those of one
        # forward over the whole sequence
        context = torch.cat(proposer.features)
        session = TargetSession(model, LAYER_IDS)
        try:
            _, expected = session.forward(ids + ref[:-1])
        finally:
            session.close()
        assert context.shape == (len(ids) + CYCLE - B, len(LAYER_IDS) * 64)
        torch.testing.assert_close(context, expected[: len(context)], atol=1e-4, rtol=1e-4)


def test_oracle_and_always_wrong_proposers(hybrid):
    name, model, prompts, references = hybrid
    ids, ref = prompts[0], references[0]
    g = speculative_generate(model, Scripted(ref, len(ids), lambda step: ()), ids, max_new_tokens=MAX_NEW)
    assert g.tokens == ref and g.accepted[:-1] == [B - 1] * 8 and g.committed == [B] * 8 + [CYCLE - 8 * B], name
    short = 25
    g = speculative_generate(model, Scripted(ref, len(ids), lambda step: range(1, B)), ids, max_new_tokens=short)
    assert g.tokens == ref[:short] and g.tau == 1.0 and set(g.accepted) == {0}, name


def test_rollback_restores_and_recomputes_the_linear_attention_states(qwen3_5_vl_dir):
    model = load_target(str(qwen3_5_vl_dir))
    ids = torch.randint(0, 49152, (30,), generator=torch.Generator().manual_seed(0)).tolist()
    session, reference = TargetSession(model, LAYER_IDS), TargetSession(model, LAYER_IDS)
    try:
        assert session.hybrid and sorted(session._mixers) == [0, 1, 2, 4, 5, 6]
        session.forward(ids[:14], last_only=True)
        with pytest.raises(ValueError, match="only inside its latest forward"):
            session.rollback(13)  # a last_only forward (a prefill) is not undoable
        logits, _ = session.forward(ids[14:30])
        for length in (29, 21, 15, 14):  # rolling back further and further inside the same forward
            session.rollback(length)
            assert session.length == length
        with pytest.raises(ValueError, match="only inside its latest forward"):
            session.rollback(13)
        reference.forward(ids[:14], last_only=True)
        cache, expected = session.cache, reference.cache
        for index in session._mixers:  # back to exactly the state before the verify forward
            for name in ("conv_states", "recurrent_states"):
                assert torch.equal(getattr(cache.layers[index], name)[0], getattr(expected.layers[index], name)[0])
        session.forward(ids[14:30])
        session.rollback(20)  # keep 6 of the 16 positions: the states equal those of the kept tokens run alone
        reference.forward(ids[14:20])
        for index in session._mixers:
            for name in ("conv_states", "recurrent_states"):
                torch.testing.assert_close(getattr(cache.layers[index], name)[0],
                                           getattr(expected.layers[index], name)[0], atol=1e-5, rtol=1e-5)
        again, _ = session.forward(ids[20:30])  # and the logits after the rollback are the verify's
        torch.testing.assert_close(again, logits[6:], atol=1e-4, rtol=1e-4)
    finally:
        session.close()
        reference.close()


def test_random_dflash_drafter_through_evaluate_is_lossless(qwen3_5_vl_dir, smollm2_tokenizer):
    model = load_target(str(qwen3_5_vl_dir))
    torch.manual_seed(0)
    drafter = DFlashDrafter.from_target_config(
        model.config, mask_token_id=resolve_mask_token_id(smollm2_tokenizer, 49152), num_layers=1,
        embed_tokens=model.get_input_embeddings(), lm_head=model.get_output_embeddings())
    prompts = [{"id": index, "prompt_ids": ids} for index, ids in enumerate(chat_prompts(smollm2_tokenizer))]
    result = evaluate(model, drafter, prompts, max_new_tokens=24, warmup=False)
    assert result["lossless"] is True and all(row["matches_ar"] for row in result["rows"])
    assert result["verify_steps"] >= 2 and result["tokens_per_s"]["speculative"] > 0
    # transformers refuses assisted (prompt-lookup) generation on stateful models: reported as absent
    assert result["tokens_per_s"]["prompt_lookup"] is None and result["prompt_lookup_tau_pooled"] is None
    assert "stateful" in result["prompt_lookup_skipped"]


def test_sliding_window_drafter_is_lossless_on_the_hybrid_target(qwen3_5_vl_dir, smollm2_tokenizer):
    """A drafter of the published 27B drafter's layer pattern ([sliding x 2, full] here) with a 4-token window, far
    shorter than the prompts and the 40 new tokens: speculative output = plain greedy, token for token."""
    model = load_target(str(qwen3_5_vl_dir))
    torch.manual_seed(0)
    drafter = DFlashDrafter.from_target_config(
        model.config, mask_token_id=resolve_mask_token_id(smollm2_tokenizer, 49152), num_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], sliding_window=4,
        embed_tokens=model.get_input_embeddings(), lm_head=model.get_output_embeddings())
    prompts = [{"id": index, "prompt_ids": ids} for index, ids in enumerate(chat_prompts(smollm2_tokenizer))]
    result = evaluate(model, drafter, prompts, max_new_tokens=40, warmup=False)
    assert result["lossless"] is True and all(row["matches_ar"] for row in result["rows"])
    assert result["verify_steps"] >= 2
